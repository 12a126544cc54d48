"""Tiered tables: every tier is visible to the table's views, admission and eviction."""

from __future__ import annotations

import numpy as np
import pytest

from tensorkv.embedding import EmbeddingTable
from tensorkv.embedding.chain.specs import DRAM, PMEM, SSDHash, StorageOption
from tensorkv.embedding.filters import CounterFilter
from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.errors import ConfigError, NonFiniteGradientError, ShapeError

from .test_exactness import assert_same, full_export

DIM = 4


def rb(optimizer: str = "adagrad") -> int:
    n = {"sgd": 0, "adagrad": 1, "adam": 2}[optimizer]
    return RecordLayout(DIM, num_slots=n).record_bytes


def pair(tmp_path, *, rows0: int = 32, optimizer: str = "adagrad", storage="DRAM_SSDHASH",
         policy="lru", **kw):
    ref = EmbeddingTable(DIM, optimizer=optimizer, seed=1, **kw)
    t = EmbeddingTable(DIM, optimizer=optimizer, seed=1, storage=storage,
                             storage_path=str(tmp_path / "t"),
                             storage_size=[rows0 * rb(optimizer)], cache_strategy=policy, **kw)
    return ref, t


def steps(tables, n_steps=40, batch=20, n_ids=600, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n_steps):
        keys = rng.choice(n_ids, batch, replace=False).astype(np.int64)
        g = rng.standard_normal((batch, tables[0].dim)).astype(np.float32)
        for t in tables:
            t.lookup(keys)
            t.apply_gradients(keys, g)


def test_views_see_every_tier(tmp_path):
    ref, t = pair(tmp_path)
    with t:
        steps([ref, t])
        st = t.stats()
        assert st["tiers"][0]["rows"] <= 32 < len(t)
        assert len(t) == len(ref) == st["rows"]
        keys = t.keys()
        assert keys.size == np.unique(keys).size == len(ref)  # no double counting
        np.testing.assert_array_equal(np.sort(keys), np.sort(ref.keys()))
        probe = np.arange(-5, 700, dtype=np.int64)
        np.testing.assert_array_equal(t.contains(probe), ref.contains(probe))
        np.testing.assert_array_equal(t.frequency(probe), ref.frequency(probe))
        np.testing.assert_array_equal(t.version(probe), ref.version(probe))
        np.testing.assert_array_equal(t[probe], ref[probe])  # insert=False reads lower tiers
        assert 5 in t and -5 not in t
        out = np.empty((probe.size, DIM), np.float32)
        assert t.lookup(probe, insert=False, out=out) is out
        np.testing.assert_array_equal(out, ref.lookup(probe, insert=False))
        assert_same(ref, t)


def test_remove_reaches_every_tier(tmp_path):
    ref, t = pair(tmp_path)
    with t:
        steps([ref, t])
        victims = ref.keys()[::3]
        assert t.remove(victims) == ref.remove(victims) == victims.size
        assert not t.contains(victims).any()
        assert t.mutation_seq == ref.mutation_seq
        assert_same(ref, t)
        assert t.remove(victims) == 0


def test_upsert_keeps_slots_of_a_lower_tier_row(tmp_path):
    ref, t = pair(tmp_path)
    with t:
        steps([ref, t])
        lower = np.setdiff1d(t.keys(), t.arena.keys())[:10]
        assert lower.size == 10
        vals = np.ones((10, DIM), np.float32)
        ref.upsert(lower, vals)
        t.upsert(lower, vals)
        assert_same(ref, t)


@pytest.mark.parametrize("eviction", [
    {"steps_to_live": 5, "every_n_steps": 3},
    {"l2_threshold": 0.06, "every_n_steps": 4},
    {"max_rows": 150, "policy": "lfu", "every_n_steps": 5},
    {"max_rows": 150, "policy": "lru", "every_n_steps": 5},
    {"steps_to_live": 12, "l2_threshold": 0.05, "max_rows": 200, "every_n_steps": 2},
])
def test_eviction_same_keys_as_dram(tmp_path, eviction):
    ref, t = pair(tmp_path, eviction=eviction)
    with t:
        steps([ref, t], n_steps=30)
        assert ref.stats()["evictions"] > 0
        assert t.stats()["evictions"] == ref.stats()["evictions"]
        assert_same(ref, t)
        assert ref.evict() == t.evict()
        assert_same(ref, t)
        gone = np.setdiff1d(np.arange(600), ref.keys())
        assert not t.contains(gone).any()  # TTL/L2/max_rows removed them from every tier


def test_admission_filter_across_tiers(tmp_path):
    ref, t = pair(tmp_path, admission=CounterFilter(min_count=2).config())
    with t:
        steps([ref, t], n_steps=40, n_ids=200)
        assert t.stats()["admissions_rejected"] == ref.stats()["admissions_rejected"] > 0
        assert_same(ref, t)


def test_export_since_and_import(tmp_path):
    ref, t = pair(tmp_path)
    with t:
        steps([ref, t], n_steps=20)
        s = t.mutation_seq
        assert s == ref.mutation_seq
        steps([ref, t], n_steps=5, seed=9)
        inc_t = full_export_since(t, s)
        inc_r = full_export_since(ref, s)
        for f in inc_r:
            np.testing.assert_array_equal(inc_t[f], inc_r[f])
        # tiered -> DRAM and DRAM -> tiered
        back = EmbeddingTable(DIM, optimizer="adagrad", seed=1)
        back.import_(t.export(chunk_rows=50))
        t2 = EmbeddingTable(DIM, optimizer="adagrad", seed=1, storage="DRAM_SSDHASH",
                                  storage_path=str(tmp_path / "t2"), storage_size=[20 * rb()])
        with t2:
            assert t2.import_(ref.export(chunk_rows=64)) == len(ref)
            assert t2.stats()["tiers"][0]["rows"] <= 20
            for other in (back, t2):
                ea, eb = full_export(ref), full_export(other)
                for f in ("keys", "values", "slots", "freq", "version"):
                    np.testing.assert_array_equal(ea[f], eb[f])


def full_export_since(table, since):
    chunks = list(table.export(chunk_rows=64, since=since))
    keys = np.concatenate([c.keys for c in chunks])
    order = np.argsort(keys)
    return {f: np.concatenate([getattr(c, f) for c in chunks])[order]
            for f in ("keys", "values", "slots", "freq", "version", "seq")}


def test_batch_larger_than_tier0_is_served_then_trimmed(tmp_path):
    ref, t = pair(tmp_path, rows0=8)
    with t:
        keys = np.arange(50, dtype=np.int64)
        np.testing.assert_array_equal(t.lookup(keys), ref.lookup(keys))
        assert t.stats()["tiers"][0]["rows"] == 50  # the whole batch stays while it runs
        np.testing.assert_array_equal(t.lookup(np.arange(100, 104)),
                                      ref.lookup(np.arange(100, 104)))
        assert t.stats()["tiers"][0]["rows"] == 8
        assert len(t) == len(ref) == 54
        assert_same(ref, t)


def test_stats_per_tier(tmp_path):
    opt = StorageOption(tiers=[DRAM(16 * rb()), PMEM(str(tmp_path / "p.tier"), 64 * rb()),
                               SSDHash(str(tmp_path / "ssd"), segment_bytes=8192)])
    ref = EmbeddingTable(DIM, optimizer="adagrad", seed=1)
    with EmbeddingTable(DIM, optimizer="adagrad", seed=1, storage=opt) as t:
        steps([ref, t], n_steps=60)
        st = t.stats()
        assert [x["tier"] for x in st["tiers"]] == [0, 1, 2]
        assert [x["kind"] for x in st["tiers"]] == ["DRAM", "pmem", "ssdhash"]
        for x in st["tiers"]:
            for k in ("rows", "bytes", "hits", "misses", "promotions", "evictions",
                      "compactions"):
                assert k in x or k == "compactions" and x["tier"] == 0, (k, x)
        assert st["tiers"][0]["hits"] > 0 and st["tiers"][0]["misses"] > 0
        assert st["tiers"][1]["promotions"] > 0 and st["tiers"][1]["evictions"] > 0
        assert st["tiers"][2]["rows"] > 0 and st["tiers"][2]["promotions"] > 0
        assert st["tiers"][1]["rows"] <= 64
        assert sum(x["rows"] for x in st["tiers"]) == len(ref)
        assert_same(ref, t)


def test_clear_and_reuse(tmp_path):
    ref, t = pair(tmp_path)
    with t:
        steps([ref, t], n_steps=10)
        t.clear()
        ref.clear()
        assert len(t) == 0 and t.keys().size == 0
        steps([ref, t], n_steps=10, seed=4)
        assert_same(ref, t)


def test_dram_storage_is_a_plain_table(tmp_path):
    ref = EmbeddingTable(DIM, optimizer="adam", seed=1)
    t = EmbeddingTable(DIM, optimizer="adam", seed=1, storage="DRAM")
    steps([ref, t], n_steps=5)
    assert_same(ref, t)
    assert len(t.stats()["tiers"]) == 1


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"storage": "DRAM_FLOPPY", "storage_path": "/x"}, "unknown storage_type"),
    ({"storage": "DRAM_REDIS"}, "needs storage_path"),
    ({"storage": 3}, "must be a storage type name"),
    ({"storage_path": "/x"}, "need storage="),
    ({"storage": "HBM_SSDHASH", "storage_path": "/x", "device": "floppy"}, "torch device"),
    ({"storage": "DRAM_SSDHASH", "storage_path": "/x", "growth": False, "capacity": 5},
     "growth=False"),
    ({"storage": StorageOption("DRAM"), "storage_size": [5]}, "inside the StorageOption"),
    ({"storage": "DRAM_SSDHASH", "storage_path": "/x", "cache_strategy": "fifo"},
     "cache_strategy"),
    ({"storage": "DRAM", "max_pending_bytes": 0}, "max_pending_bytes"),
    ({"storage": "DRAM", "max_pending_bytes": "lots"}, "max_pending_bytes"),
])
def test_bad_storage_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EmbeddingTable(DIM, **kwargs)


def test_bad_input_leaves_state_intact(tmp_path):
    ref, t = pair(tmp_path)
    with t:
        steps([ref, t], n_steps=10)
        lower = np.setdiff1d(t.keys(), t.arena.keys())[:5]
        with pytest.raises(ShapeError):
            t.apply_gradients(lower, np.zeros((4, DIM), np.float32))  # wrong shape
        with pytest.raises(NonFiniteGradientError):
            t.apply_gradients(lower, np.full((5, DIM), np.nan, np.float32))
        assert_same(ref, t)


def test_storage_path_with_old_rows_is_refused(tmp_path):
    ref, t = pair(tmp_path)
    with t:
        steps([ref, t], n_steps=5)
    with pytest.raises(ConfigError, match="already holds"):
        pair(tmp_path)
    pair(tmp_path / "fresh")[1].close()


def test_ssdhash_discard_drops_rows_without_tombstones(tmp_path):
    from tensorkv.embedding.tiers.ssdhash import SSDHashTier
    from tensorkv.testing.tiers import make_records

    lay = RecordLayout(DIM, num_slots=1)
    keys = np.arange(100, dtype=np.int64)
    with SSDHashTier(str(tmp_path / "s"), lay) as tier:
        tier.put(keys, make_records(lay, keys))
        before = tier.stats()["bytes"]
        assert tier.discard(np.array([3, 4, 4, 500])) == 2
        assert tier.stats()["bytes"] == before  # nothing appended
        assert len(tier) == 98 and not tier.contains(np.array([3, 4])).any()
        assert tier.discard(np.empty(0, np.int64)) == 0
        assert tier.check() == []


def test_closed_table_refuses(tmp_path):
    from tensorkv.errors import StoreClosedError

    ref, t = pair(tmp_path)
    steps([ref, t], n_steps=3)
    t.close()
    t.close()  # twice is harmless
    with pytest.raises(StoreClosedError, match="closed"):
        t.lookup([1, 2])
    with pytest.raises(StoreClosedError, match="closed"):
        len(t)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_bulk_load_spread_rows_are_packed_on_flush(tmp_path, monkeypatch, policy):
    """A bulk load outpaces the writer and tier 0 holds many rows for it; flush() packs the
    live rows densely again and gives the memory held for the writes back, and training
    goes on (growing tier 0 again) bit-identical to the DRAM table."""
    import threading

    from tensorkv.embedding.chain import tierchain as tiered

    monkeypatch.setattr(tiered, "SPARE_ROWS_MIN", 16)
    ref, t = pair(tmp_path, rows0=40, policy=policy)
    tier = t._rows.chain.lowers[0][0]
    gate = threading.Event()
    real = tier.put_rows

    def held_back(keys, source):
        gate.wait()
        real(keys, source)

    tier.put_rows = held_back
    with t:
        rng = np.random.default_rng(5)
        keys = np.arange(3000, dtype=np.int64)
        chunk = (keys, rng.standard_normal((3000, DIM)).astype(np.float32),
                 rng.random((3000, DIM)).astype(np.float32), rng.integers(0, 9, 3000),
                 rng.integers(0, 9, 3000))
        for i in range(0, 3000, 300):
            part = tuple(np.ascontiguousarray(a[i:i + 300]) for a in chunk)
            ref.import_([part])
            t.import_([part])
        a = t.arena
        assert a.high_water > 10 * 40  # rows held for the writes in flight
        grown = a.capacity
        gate.set()
        t.flush()
        assert a.high_water == len(a) <= 40 + 300
        assert a.capacity == len(a) + max(len(a) // 2, 16) < grown  # memory given back
        assert_same(ref, t)
        steps([ref, t], n_steps=30, n_ids=3000)
        assert_same(ref, t)


@pytest.mark.parametrize("device", [None, "cpu"])
def test_arena_shrink_rows_keeps_rows_below_high_water(device):
    from tensorkv.embedding.arena import RowArena
    from tensorkv.embedding.tiers.hbm_arena import HBMArena

    a = RowArena(2, 2, capacity=16) if device is None else HBMArena(2, 2, capacity=16,
                                                                   device=device)
    keys = np.arange(100, 140, dtype=np.int64)
    rows, _ = a.insert(keys)
    vals = np.arange(80, dtype=np.float32).reshape(40, 2)
    a.scatter(rows, vals)
    a.scatter_slots(rows, -vals)
    a.freq[rows] = keys
    a.remove(keys[20:])
    assert a.capacity >= 40
    assert a.shrink_rows(4) == a.high_water == 40  # never below the rows ever used
    a.pack_rows()
    assert a.shrink_rows(25) == a.capacity == 25
    got = a.find(keys[:20])
    np.testing.assert_array_equal(a.gather(got), vals[:20])
    np.testing.assert_array_equal(a.gather_slots(got), -vals[:20])
    np.testing.assert_array_equal(a.freq[got], keys[:20])
    new, fresh = a.insert(np.arange(200, 230, dtype=np.int64))  # grows again
    assert fresh.all() and a.capacity >= 50 and len(a) == 50


def test_arena_pack_rows_moves_live_rows_down():
    from tensorkv.embedding.arena import RowArena

    a = RowArena(2, 2, capacity=16)
    keys = np.arange(100, 110, dtype=np.int64)
    rows, _ = a.insert(keys)
    a.values[rows] = np.arange(20, dtype=np.float32).reshape(10, 2)
    a.slots[rows] = -np.arange(20, dtype=np.float32).reshape(10, 2)
    a.freq[rows] = keys * 2
    before = {int(k): (a.values[r].copy(), a.slots[r].copy(), int(a.freq[r]))
              for k, r in zip(keys, rows, strict=True)}
    a.remove(keys[:6])
    src, dst = a.pack_rows()
    assert len(a) == a.high_water == 4 and src.size == dst.size == 4
    got = a.find(keys[6:])
    assert sorted(got.tolist()) == [0, 1, 2, 3]
    for k, r in zip(keys[6:].tolist(), got.tolist(), strict=True):
        v, s, f = before[k]
        np.testing.assert_array_equal(a.values[r], v)
        np.testing.assert_array_equal(a.slots[r], s)
        assert a.freq[r] == f and a.row_key[r] == k
    new, fresh = a.insert(np.array([7], np.int64))  # allocation continues after the packed rows
    assert fresh.all() and new[0] == 4


@pytest.mark.parametrize("sizes", [[0], [10], [None, 0], ["1KiB", 5]],
                         ids=["dram-0", "dram-10B", "ssd-0", "ssd-5B"])
def test_a_tier_size_under_one_row_is_refused_before_anything_opens(tmp_path, sizes):
    """A tier that could hold no row is an error, not a tier of one row."""
    with pytest.raises(ConfigError, match=r"tier size \d+ bytes holds no row: .* give at least"):
        EmbeddingTable(DIM, storage="DRAM_SSDHASH", storage_path=tmp_path / "spill",
                       storage_size=sizes)
    assert not (tmp_path / "spill").exists()
