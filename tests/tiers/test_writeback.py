"""The shared write-back pool: sizing, ordering, pending reads, errors never lost."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tensorkv.embedding import EmbeddingTable
from tensorkv.embedding.chain import writeback
from tensorkv.embedding.chain.specs import DRAM, KV, StorageOption
from tensorkv.embedding.chain.writeback import WriteQueue
from tensorkv.errors import ConfigError, WriteBackError

from .test_chain import DIM, pair, rb, steps
from .test_exactness import assert_same


@pytest.fixture
def fresh_pool():
    writeback.shutdown()
    yield
    writeback.shutdown()


def test_pool_is_shared_and_sized_by_env(monkeypatch, fresh_pool, tmp_path):
    monkeypatch.setenv("TENSORKV_EVICTION_THREADS", "3")
    assert writeback.pool_threads() == 0  # created lazily
    a = pair(tmp_path / "a")[1]
    b = pair(tmp_path / "b")[1]
    with a, b:
        steps([a, b], n_steps=5)
        assert writeback.pool() is writeback.pool()
        assert writeback.pool_threads() == 3
        a.flush()
        b.flush()
        assert a._rows.chain.queue.completed > 0 and b._rows.chain.queue.completed > 0


def test_pool_default_is_one_thread(monkeypatch, fresh_pool):
    monkeypatch.delenv("TENSORKV_EVICTION_THREADS", raising=False)
    writeback.pool()
    assert writeback.pool_threads() == 1


def test_bad_thread_count(monkeypatch, fresh_pool):
    monkeypatch.setenv("TENSORKV_EVICTION_THREADS", "0")
    with pytest.raises(ConfigError, match="TENSORKV_EVICTION_THREADS"):
        writeback.pool()


def test_queue_runs_in_order_and_flush_waits():
    q = WriteQueue("q")
    out: list[int] = []
    gate = threading.Event()
    q.submit(gate.wait)
    for i in range(20):
        q.submit(lambda i=i: out.append(i))
    assert q.pending == 21
    gate.set()
    q.flush()
    assert out == list(range(20)) and q.pending == 0


def test_queue_error_is_raised_once_then_retried():
    q = WriteQueue("q")
    calls: list[int] = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk full")

    q.submit(flaky)
    with pytest.raises(WriteBackError, match="disk full"):
        q.flush()
    q.check()  # raised once only
    q.flush()  # retries the failed job
    assert len(calls) == 2 and q.pending == 0


def test_reads_use_pending_rows_while_writes_are_blocked(tmp_path):
    ref, t = pair(tmp_path, rows0=16)
    tier = t._rows.chain.lowers[0][0]
    gate = threading.Event()
    real_put = tier.put_rows

    def slow_put(keys, source):  # the real tier, held back until the gate opens
        gate.wait()
        real_put(keys, source)

    tier.put_rows = slow_put
    with t:
        try:
            steps([ref, t], n_steps=25, n_ids=120)  # keys come back while their writes wait
            assert t._rows.chain.pending
            assert len(tier) == 0  # nothing landed: every promotion came from pending rows
            assert t._rows.chain.counters["tier1"]["promotions"] > 0
        finally:
            gate.set()
        assert_same(ref, t)


def test_failed_background_write_is_reported_and_rows_kept(tmp_path):
    p = tmp_path / "db"
    opt = StorageOption(tiers=[DRAM(8 * rb()),
                               KV(f"lmdb://{p}", map_size=65536, max_map_size=65536)])
    ref = EmbeddingTable(DIM, optimizer="adagrad", seed=1)
    t = EmbeddingTable(DIM, optimizer="adagrad", seed=1, storage=opt)
    keys = np.arange(4000, dtype=np.int64)
    ref_vals = ref.lookup(keys)
    with pytest.raises(WriteBackError, match="StoreFull|full"):
        for i in range(0, 4000, 100):
            np.testing.assert_array_equal(t.lookup(keys[i:i + 100]), ref_vals[i:i + 100])
        t.flush()
    # the rows that did not land are still readable from the pending buffer, bit-identical
    pending = np.concatenate([pb.keys[pb.live] for pb in t._rows.chain.pending])
    assert pending.size > 0
    found, recs = t._rows.chain.read(pending)
    assert found.all()
    np.testing.assert_array_equal(t._rows.layout.unpack(recs).values, ref_vals[pending])
    with pytest.raises(WriteBackError):
        t.close()


def test_tables_on_threads_with_a_wide_pool(monkeypatch, fresh_pool, tmp_path):
    """Several tables trained from their own threads share a 3-thread pool; all stay exact."""
    monkeypatch.setenv("TENSORKV_EVICTION_THREADS", "3")
    pairs = [pair(tmp_path / f"p{i}", rows0=12, policy="lfu" if i % 2 else "lru")
             for i in range(3)]
    errors: list[BaseException] = []

    def work(i):
        try:
            steps(list(pairs[i]), n_steps=40, n_ids=200, seed=i)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for ref, t in pairs:
        with t:
            assert_same(ref, t)


def test_pending_memory_is_bounded(tmp_path):
    ref = EmbeddingTable(DIM, optimizer="adagrad", seed=1)
    t = EmbeddingTable(DIM, optimizer="adagrad", seed=1, storage="DRAM_SSDHASH",
                             storage_path=str(tmp_path / "t"), storage_size=[8 * rb()],
                             max_pending_bytes=1)
    rng = np.random.default_rng(0)
    with t:
        for _ in range(30):
            keys = rng.choice(300, 20, replace=False)
            for x in (ref, t):
                x.lookup(keys)
            assert len(t._rows.chain.pending) <= 2  # the caller waited for the writer
        assert_same(ref, t)
