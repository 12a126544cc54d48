"""The block writer: queued batches on a helper thread, reused record buffers, errors."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

import tensorkv
from tensorkv.checkpoint import writer
from tensorkv.errors import StoreFullError
from tensorkv.stores.memory import MemoryStore

from .helpers import assert_tables_equal, make_table


class SlowStore(MemoryStore):
    """A memory store whose writes take a while and are counted (and may fail)."""

    def __init__(self, delay: float = 0.002, fail_after: int | None = None) -> None:
        super().__init__()
        self.delay = delay
        self.fail_after = fail_after
        self.writes = 0
        self.threads: set[str] = set()

    def _write(self, ops, *, atomic):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)  # the caller goes on filling buffers meanwhile
        self.writes += 1
        if self.fail_after is not None and self.writes > self.fail_after:
            raise StoreFullError(28, "the slow store is full")
        super()._write(ops, atomic=atomic)


@pytest.fixture
def small_batches(monkeypatch):
    """Many small batches and a short queue, so buffers are recycled during one save."""
    monkeypatch.setattr(writer, "WRITE_BATCH_BYTES", 4096)
    monkeypatch.setattr(writer, "QUEUE_BYTES", 32 * 1024)
    monkeypatch.setattr(writer, "KEEP_BYTES", 64 * 1024)


def test_buffers_are_reused_only_after_their_batch_is_written(small_batches):
    t = make_table(20000, 8)
    store = SlowStore()
    d = {"emb": t, "w": np.arange(30000.0)}
    tensorkv.save(d, store, "a", block_rows=32, chunk_bytes=4096)
    assert store.writes > 100 and any("ckpt-write" in n for n in store.threads)
    got = tensorkv.load(None, store, "a")  # every block verified by its checksums
    assert_tables_equal(t, got["emb"])
    assert np.array_equal(got["w"], d["w"])
    t.apply_gradients(t.keys()[:3000], np.ones((3000, 8), np.float32), step=9)
    tensorkv.save(d, store, "b", block_rows=32, incremental=True)  # kept buffers reused
    assert_tables_equal(t, tensorkv.load(None, store, "b")["emb"])
    assert tensorkv.checkpoint.check(store, verify=True).ok


def test_store_error_in_the_writer_thread_fails_the_save(small_batches):
    t = make_table(5000, 8)
    store = SlowStore(fail_after=5)
    with pytest.raises(StoreFullError, match="slow store is full"):
        tensorkv.save({"emb": t}, store, "a", block_rows=32)
    assert tensorkv.list_tags(store) == []
    store.fail_after = None
    # the store refused the cleanup too: what the save wrote is reported, as a dead save's
    rep = tensorkv.checkpoint.check(store)
    assert not rep.ok and rep.orphan_keys and rep.orphan_bytes > 0
    assert [p["owner"] for p in rep.pending] == ["dead"]
    removed = tensorkv.checkpoint.gc(store)  # no grace needed: its owner is known to be gone
    assert removed.removed_keys == len(rep.orphan_keys)
    assert removed.removed_bytes == rep.orphan_bytes
    rep = tensorkv.checkpoint.check(store)
    assert rep.ok and not rep.pending, rep.as_dict()
    tensorkv.save({"emb": t}, store, "a", block_rows=32)
    assert_tables_equal(t, tensorkv.load(None, store, "a")["emb"])


def test_buffers_are_kept_with_the_table_and_go_with_it():
    gc.collect()  # tables of earlier tests in this worker, kept alive only by cycles, go now
    t = make_table(3000, 8)
    tensorkv.save({"emb": t}, MemoryStore(), "a", block_rows=64)
    kept = writer._KEPT.get(t)
    assert kept and sum(b.nbytes for b in kept) <= writer.KEEP_BYTES
    w = writer.BlockWriter(MemoryStore(), b"p/", None, None, owner=t)
    assert writer._KEPT.get(t) is None and w._pool is not None  # handed to the writer
    w.flush()
    assert writer._KEPT.get(t)  # and back
    n = len(writer._KEPT)
    del t, w
    gc.collect()
    assert len(writer._KEPT) == n - 1


def test_keep_trims_to_the_newest_buffers(monkeypatch):
    monkeypatch.setattr(writer, "KEEP_BYTES", 250)
    owner = make_table(10, 4)
    bufs = [np.empty(100, np.uint8) for _ in range(4)]
    writer._keep(owner, bufs)
    assert [id(b) for b in writer._KEPT[owner]] == [id(bufs[2]), id(bufs[3])]
    writer._keep(None, bufs)  # no owner: nothing kept, no error
    writer._keep({}, bufs)  # not weak-referenceable: nothing kept, no error
    assert writer._take_kept({}) == []


def test_kept_buffers_stay_within_one_budget(monkeypatch):
    monkeypatch.setattr(writer, "KEEP_BYTES", 250)
    owners = [make_table(10, 4) for _ in range(3)]
    for o in owners:
        writer._keep(o, [np.empty(100, np.uint8)])
    kept = [o for o in owners if writer._KEPT.get(o)]
    assert kept == owners[1:]  # the most recent two fit in 250 bytes
    writer._keep(owners[0], [np.empty(200, np.uint8)])
    assert [o for o in owners if writer._KEPT.get(o)] == [owners[0]]
    for o in owners:
        writer._take_kept(o)
