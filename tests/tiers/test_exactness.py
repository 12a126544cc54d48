"""Training through a tier chain is bit-identical to the DRAM-only table."""

from __future__ import annotations

import numpy as np
import pytest

from tensorkv.embedding import EmbeddingTable
from tensorkv.embedding.tiers.base import RecordLayout

STEPS = 200
BATCH = 50
N_IDS = 5000
TIER0_ROWS = 64


def full_export(table) -> dict[str, np.ndarray]:
    """Every row of ``table`` as arrays sorted by key."""
    chunks = list(table.export(chunk_rows=1000))
    if not chunks:
        return {}
    cat = {f: np.concatenate([getattr(c, f) for c in chunks]) for f in
           ("keys", "values", "slots", "freq", "version", "seq")}
    order = np.argsort(cat["keys"])
    return {f: v[order] for f, v in cat.items()}


def assert_same(a, b) -> None:
    ea, eb = full_export(a), full_export(b)
    assert ea.keys() == eb.keys()
    for f in ea:
        assert ea[f].dtype == eb[f].dtype, f
        assert np.array_equal(ea[f], eb[f]), f"field {f} differs"
    assert len(a) == len(b)


def chain(name: str, tmp_path, layout: RecordLayout, tier0_rows: int = TIER0_ROWS,
          tier1_rows: int | None = None):
    size0 = tier0_rows * layout.record_bytes
    sizes = [size0] if tier1_rows is None else [size0, tier1_rows * layout.record_bytes]
    path = str(tmp_path / "tier")
    return {"storage": name, "storage_path": path, "storage_size": sizes}


def train(tables, *, string_keys: bool, seed: int = 0, steps: int = STEPS, batch=BATCH,
          n_ids=N_IDS, dim=8) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.choice(n_ids, size=batch, replace=False)
        ids = np.concatenate([ids, ids[: batch // 5]])  # duplicates within the batch
        keys = [f"id{i}" for i in ids] if string_keys else ids.astype(np.int64)
        grads = rng.standard_normal((ids.size, dim)).astype(np.float32)
        outs = [t.lookup(keys) for t in tables]
        for o in outs[1:]:
            assert np.array_equal(o, outs[0])
        for t in tables:
            t.apply_gradients(keys, grads)


SSD_CHAINS = [("DRAM_SSDHASH", None), ("DRAM_PMEM_SSDHASH", 300)]
KV_CHAINS = [("DRAM_LEVELDB", None), ("DRAM_ROCKSDB", None), ("DRAM_LMDB", None)]
CASES = [
    # the SSDHASH chains run every combination, the KV chains int keys with each optimizer
    *[(n, r, o, s, p) for n, r in SSD_CHAINS for o in ("adagrad", "adam")
      for s in (False, True) for p in ("lru", "lfu")],
    *[(n, r, o, False, p) for n, r in KV_CHAINS for o, p in (("adagrad", "lru"), ("adam", "lfu"))],
]


@pytest.mark.parametrize(("name", "tier1_rows", "optimizer", "string_keys", "policy"), CASES)
def test_training_bit_identical(tmp_path, name, tier1_rows, optimizer, string_keys, policy):
    """200 steps of 50 distinct keys (+ duplicates) over 5,000 ids with tier 0 = 64 rows."""
    dim = 8
    ref = EmbeddingTable(dim, optimizer=optimizer, seed=3)
    num_slots = ref.num_slots
    lay = RecordLayout(dim, num_slots=num_slots)
    opts = chain(name, tmp_path, lay, tier1_rows=tier1_rows)
    with EmbeddingTable(dim, optimizer=optimizer, seed=3, cache_strategy=policy,
                              **opts) as t:
        train([ref, t], string_keys=string_keys, steps=STEPS)
        st = t.stats()
        assert st["tiers"][0]["rows"] <= TIER0_ROWS
        assert st["tiers"][0]["evictions"] > 0 and st["tiers"][1]["promotions"] > 0
        if tier1_rows is not None:
            assert st["tiers"][2]["rows"] > 0
        assert_same(ref, t)
        np.testing.assert_array_equal(np.sort(ref.keys()), np.sort(t.keys()))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["DRAM_SSDHASH", "DRAM_PMEM_SSDHASH"])
def test_16bit_rows_bit_identical(tmp_path, dtype, name):
    """16-bit value rows travel down and up as their exact bits."""
    dim = 8
    ref = EmbeddingTable(dim, optimizer="adagrad", seed=3, dtype=dtype,
                         eviction={"l2_threshold": 0.02, "every_n_steps": 9})
    lay = RecordLayout(dim, value_dtype=dtype, num_slots=1)
    opts = chain(name, tmp_path, lay, tier1_rows=300 if "PMEM" in name else None)
    with EmbeddingTable(dim, optimizer="adagrad", seed=3, dtype=dtype,
                              eviction={"l2_threshold": 0.02, "every_n_steps": 9},
                              **opts) as t:
        train([ref, t], string_keys=False, steps=60)
        assert t.stats()["tiers"][1]["promotions"] > 0
        assert ref.stats()["evictions"] == t.stats()["evictions"]
        ea, eb = full_export(ref), full_export(t)
        assert ea["values"].dtype == eb["values"].dtype == lay.dtype
        for f in ea:
            assert np.array_equal(ea[f].view(np.uint8), eb[f].view(np.uint8)), f


@pytest.mark.parametrize("name", ["DRAM_SSDHASH", "DRAM_LMDB"])
def test_operations_between_lookup_and_apply(tmp_path, name):
    """Operations between a lookup and the apply of the same batch keep results exact.

    The apply reuses the lookup's tier-0 rows when nothing moved in between; here other
    operations evict, remove, move or rewrite rows in between, and every variant must stay
    bit-identical to the DRAM-only table.
    """
    dim = 8
    ev = {"steps_to_live": 4}  # only on explicit evict() calls
    ref = EmbeddingTable(dim, optimizer="adagrad", seed=5, eviction=ev)
    lay = RecordLayout(dim, num_slots=1)
    with EmbeddingTable(dim, optimizer="adagrad", seed=5, cache_strategy="lru",
                              eviction=ev, **chain(name, tmp_path, lay)) as t:
        rng = np.random.default_rng(7)
        for step in range(60):
            keys = rng.choice(2000, size=40, replace=False).astype(np.int64)
            grads = rng.standard_normal((keys.size, dim)).astype(np.float32)
            other = rng.choice(2000, size=90, replace=False).astype(np.int64)
            kind = step % 4
            for tab in (ref, t):
                tab.lookup(keys)
                if kind == 0:  # rows (of the batch too) evicted in between
                    tab.evict()
                elif kind == 1:  # rows of the batch removed in between
                    tab.remove(keys[:10])
                elif kind == 2:  # another batch moves rows up and down in between
                    tab.lookup(other)
                elif kind == 3:  # some rows of the batch rewritten in between
                    tab.upsert(keys[5:8], np.ones((3, dim), np.float32))
                # kind 3 also passes an equal batch in a new array
                tab.apply_gradients(keys.copy() if kind == 3 else keys, grads)
        assert t.stats()["tiers"][1]["promotions"] > 0 and ref.stats()["evictions"] > 0
        assert_same(ref, t)
