"""prefetch(next_keys): rows move up in the background; results stay bit-identical."""

from __future__ import annotations

import numpy as np
import pytest

from tensorkv.embedding import EmbeddingTable
from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.errors import ShapeError, StoreClosedError, TableError

from .test_exactness import assert_same

DIM = 8
TIER0 = 48


def make(tmp_path, storage: str, policy: str = "lru", optimizer: str = "adagrad",
         tier1_rows: int | None = None, **kw) -> EmbeddingTable:
    rb = RecordLayout(DIM, num_slots=1 if optimizer == "adagrad" else 2).record_bytes
    sizes = [TIER0 * rb] + ([tier1_rows * rb] if tier1_rows else [])
    return EmbeddingTable(DIM, optimizer=optimizer, seed=4, storage=storage,
                                storage_path=str(tmp_path / "t"), storage_size=sizes,
                                cache_strategy=policy, **kw)


def finish_prefetch(table: EmbeddingTable) -> None:
    """Wait until the prefetch in flight has run, so the next operation finds its rows.

    Without it, a loaded machine may schedule the background thread only after the next
    operation has already cancelled the job, and a test would see no row moved ahead.
    """
    chain = getattr(table._rows, "chain", None)
    job = getattr(chain, "_prefetch", None)
    if job is not None:
        assert job.done.wait(60), "the prefetch job did not finish within 60 s"


def batches(n_steps: int, seed: int = 0, n_ids: int = 1500, batch: int = 40):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        ids = rng.choice(n_ids, size=batch, replace=False)
        out.append(np.concatenate([ids, ids[:batch // 4]]).astype(np.int64))  # duplicates
    return out


def pipelined(tables, bs, seed: int = 1) -> None:
    """lookup i, prefetch i + 1, apply i; lookups compared at every step."""
    rng = np.random.default_rng(seed)
    for i, keys in enumerate(bs):
        grads = rng.standard_normal((keys.size, DIM)).astype(np.float32)
        outs = [t.lookup(keys) for t in tables]
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])
        if i + 1 < len(bs):
            for t in tables:
                t.prefetch(bs[i + 1])
                if i % 2:  # half the steps race the job, half find its rows in place
                    finish_prefetch(t)
        for t in tables:
            t.apply_gradients(keys, grads)


CHAINS = [
    ("DRAM_SSDHASH", "lru", "adagrad", None),
    ("DRAM_SSDHASH", "lfu", "adam", None),
    ("DRAM_PMEM_SSDHASH", "lru", "adagrad", 200),  # cascades into tier 2
    ("DRAM_LEVELDB", "lfu", "adagrad", None),  # copies deleted in the background
    ("HBM_SSDHASH", "lru", "adagrad", None),  # device rows (cpu device here)
]


@pytest.mark.parametrize(("storage", "policy", "optimizer", "tier1_rows"), CHAINS)
def test_prefetch_pipeline_bit_identical(tmp_path, storage, policy, optimizer, tier1_rows):
    """A prefetching loop trains exactly like the DRAM-only table and moves rows ahead."""
    ref = EmbeddingTable(DIM, optimizer=optimizer, seed=4)
    kw = {"device": "cpu"} if storage.startswith("HBM") else {}
    with make(tmp_path, storage, policy, optimizer, tier1_rows, **kw) as t:
        pipelined([ref, t], batches(80))
        st = t.stats()
        assert st["tiers"][0]["prefetched"] > 0
        assert st["tiers"][0]["rows"] <= TIER0
        if tier1_rows:
            assert st["tiers"][2]["rows"] > 0
        assert_same(ref, t)


def test_prefetch_keeps_hit_counts(tmp_path):
    """Prefetched keys still count as tier-0 misses: the same counters as without prefetch."""
    bs = batches(60, seed=3)
    plain = make(tmp_path / "a", "DRAM_SSDHASH")
    pre = make(tmp_path / "b", "DRAM_SSDHASH")
    with plain, pre:
        rng = np.random.default_rng(0)
        for i, keys in enumerate(bs):
            grads = rng.standard_normal((keys.size, DIM)).astype(np.float32)
            plain.lookup(keys)
            plain.apply_gradients(keys, grads)
            pre.lookup(keys)
            if i + 1 < len(bs):
                pre.prefetch(bs[i + 1])
                if i % 2:
                    finish_prefetch(pre)
            pre.apply_gradients(keys, grads)
        a, b = plain.stats()["tiers"][0], pre.stats()["tiers"][0]
        assert (a["hits"], a["misses"]) == (b["hits"], b["misses"])
        assert a["prefetched"] == 0 < b["prefetched"]
        assert_same(plain, pre)


@pytest.mark.parametrize("storage", ["DRAM_SSDHASH", "DRAM_LMDB"])
def test_operations_after_a_prefetch_stay_exact(tmp_path, storage):
    """Anything may follow a prefetch (other batches, reads, removal, eviction, export)."""
    ev = {"steps_to_live": 6}
    ref = EmbeddingTable(DIM, optimizer="adagrad", seed=4, eviction=ev)
    rng = np.random.default_rng(11)
    with make(tmp_path, storage, eviction=ev) as t:
        for step in range(90):
            keys = rng.choice(1200, size=30, replace=False).astype(np.int64)
            nxt = rng.choice(1200, size=30, replace=False).astype(np.int64)
            other = rng.choice(1200, size=5).astype(np.int64)
            grads = rng.standard_normal((keys.size, DIM)).astype(np.float32)
            kind = step % 9
            results = []
            for tab in (ref, t):
                tab.lookup(keys)
                tab.prefetch(nxt)
                if step % 2:
                    finish_prefetch(tab)
                if kind == 0:  # a different batch than announced
                    results.append(tab.lookup(other))
                elif kind == 1:  # reads of announced keys
                    results.append((tab.contains(nxt), tab.frequency(nxt), tab.version(nxt)))
                elif kind == 2:
                    results.append((len(tab), np.sort(tab.keys())))
                elif kind == 3:  # announced keys removed before their lookup
                    results.append(tab.remove(nxt[:7]))
                elif kind == 4:
                    results.append(tab.evict())
                elif kind == 5:  # announced keys rewritten
                    tab.upsert(nxt[3:6], np.full((3, DIM), 0.5, np.float32))
                elif kind == 6:  # announced twice, the second time other keys
                    tab.prefetch(keys)
                elif kind == 7:
                    results.append(sum(c.keys.size for c in tab.export(chunk_rows=100)))
                tab.apply_gradients(keys, grads)
            if results:
                a, b = results
                for x, y in zip(a if isinstance(a, tuple) else (a,),
                                b if isinstance(b, tuple) else (b,), strict=True):
                    np.testing.assert_array_equal(x, y)
        assert t.stats()["tiers"][0]["prefetched"] > 0
        assert_same(ref, t)


def test_prefetch_of_resident_or_unknown_keys_moves_nothing(tmp_path):
    with make(tmp_path, "DRAM_SSDHASH") as t:
        keys = np.arange(20, dtype=np.int64)
        t.lookup(keys)
        t.prefetch(keys)  # all in tier 0
        t.prefetch(np.arange(10_000, 10_050))  # nowhere yet
        t.prefetch([])
        assert t.lookup(np.arange(10_000, 10_003)).shape == (3, DIM)
        assert t.stats()["tiers"][0]["prefetched"] == 0
        assert len(t) == 23


def test_prefetch_bad_keys(tmp_path):
    ref = EmbeddingTable(DIM)
    with make(tmp_path, "DRAM_SSDHASH") as t:
        t.lookup(np.arange(100))
        for tab in (ref, t):
            with pytest.raises(ShapeError, match="dtype float64"):
                tab.prefetch(np.array([1.5, 2.5]))
            with pytest.raises(ShapeError, match="1-D"):
                tab.prefetch(np.zeros((2, 2), np.int64))
        assert len(t) == 100  # nothing moved, nothing lost


def test_failed_prefetch_raises_at_the_next_operation(tmp_path):
    """A prefetch that cannot read its tier reports it, naming the cause, on the next call."""
    t = make(tmp_path, "DRAM_SSDHASH")
    t.lookup(np.arange(200))
    t.wait_writes()
    t._rows.chain.lowers[0][0].close()  # the tier goes away underneath the table
    t.prefetch(np.arange(200))
    t._rows.chain._prefetch.done.wait()  # the job ran (a lookup right away may cancel it unrun)
    with pytest.raises(TableError, match="prefetching rows from the lower tiers failed") as e:
        t.lookup(np.arange(200))
    assert isinstance(e.value.__cause__, StoreClosedError)


def test_dram_only_prefetch_is_a_no_op():
    t = EmbeddingTable(DIM)
    t.prefetch(np.arange(5))
    assert len(t) == 0


def test_guarded_sink_copies_only_under_its_guard(tmp_path, monkeypatch):
    """A prefetch's copies (SSDHASH reads go through ``write_many``) hold tier 0's guard."""
    import threading

    import tensorkv.embedding.tiers.base as base
    from tensorkv.embedding.arena import RowArena
    from tensorkv.embedding.chain.prefetch import GuardedSink
    from tensorkv.embedding.tiers.ssdhash import SSDHashTier

    guard = threading.RLock()
    real = base.kr.records_to_rows
    held: list[bool] = []

    def checked(*args):
        held.append(guard._is_owned())
        real(*args)

    monkeypatch.setattr(base.kr, "records_to_rows", checked)
    lay = RecordLayout(DIM, num_slots=1)
    keys = np.arange(200, dtype=np.int64)
    recs = lay.pack(keys, np.full((200, DIM), 0.5, np.float32))
    with SSDHashTier(tmp_path / "s", lay, segment_bytes=8192) as tier:  # several segments
        tier.put(keys, recs)
        arena = RowArena(DIM, lay.slot_width)
        found = tier.read_into(keys, lambda f: arena.insert(keys[f])[0],
                               GuardedSink(arena, lay, guard))
    assert found.all() and held and all(held)
    assert np.array_equal(arena.values[arena.find(keys)], np.full((200, DIM), 0.5, np.float32))
