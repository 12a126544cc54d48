"""End to end: every chain the docs name gives the DRAM table's results, bit for bit.

DRAM over Redis, DRAM over PMEM, HBM over DRAM, and HBM over each KV store (LMDB, LevelDB,
RocksDB, Redis; and HBM over DRAM over LMDB, which cascades), with int keys and with string
keys. HBM runs on CUDA when there is one, else on CPU tensors. Tier 0 holds 16 rows, so
nearly every batch moves rows down and back up. A seeded sequence of lookups (which insert),
updates, reads without insertion, removals and exports runs on the chained table and on a
DRAM-only ``EmbeddingTable`` of the same configuration; every result is compared at once
(float bits), and the whole state (``len``, keys, every exported field: values, slots,
frequency, version, change seq) every 20 steps and at the end.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tensorkv.embedding import EmbeddingTable
from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.testing.tablecheck import (
    assert_bits_equal,
    assert_reads_equal,
    assert_same_rows,
    assert_same_table,
    table_rows,
)

DIM = 5
TIER0 = 16  # rows
TIER1 = 48  # rows of a middle tier (DRAM below HBM, when it is not the last tier)
STEPS = 80
N_IDS = 400
BATCH = (4, 25)  # keys per batch: some batches hold more distinct keys than tier 0


def _device() -> str:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a test dependency
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


# (storage type, middle tier bounded, optimizer, cache strategy)
CHAINS = [
    ("DRAM_REDIS", False, "adagrad", "lfu"),
    ("DRAM_PMEM", False, "adam", "lru"),
    ("HBM_DRAM", False, "adagrad", "lru"),
    ("HBM_LMDB", False, "adam", "lfu"),
    ("HBM_LEVELDB", False, "adagrad", "lru"),
    ("HBM_ROCKSDB", False, "ftrl", "lfu"),
    ("HBM_REDIS", False, "adam", "lru"),
    ("HBM_DRAM_LMDB", True, "adagrad", "lfu"),
]


def storage_path(name: str, tmp_path, redis_url: str | None) -> str | None:
    if name.endswith("_REDIS"):
        return redis_url
    if name.endswith("_PMEM"):
        return str(tmp_path / "rows.pmem")
    if name == "HBM_DRAM":
        return None
    return str(tmp_path / "tier")


@pytest.fixture
def redis_url(request) -> str | None:
    """An empty database on the session's redis-server, for the chains that need one."""
    if "REDIS" not in request.node.callspec.params["chain"][0]:
        return None
    server = request.getfixturevalue("redis_server")
    server.flushall()
    return f"redis://127.0.0.1:{server.port}/0"


def make_pair(chain: tuple[str, bool, str, str], tmp_path, redis_url) -> tuple[Any, Any]:
    name, bounded_middle, optimizer, policy = chain
    ref = EmbeddingTable(DIM, optimizer=optimizer, seed=13)
    rb = RecordLayout(DIM, num_slots=ref.num_slots).record_bytes
    sizes = [TIER0 * rb] + ([TIER1 * rb] if bounded_middle else [])
    kw: dict[str, Any] = {"device": _device()} if name.startswith("HBM") else {}
    table = EmbeddingTable(DIM, optimizer=optimizer, seed=13, storage=name,
                           storage_path=storage_path(name, tmp_path, redis_url),
                           storage_size=sizes, cache_strategy=policy, **kw)
    return table, ref


def keys_of(ids: np.ndarray, string_keys: bool) -> Any:
    return [f"user:{i}" for i in ids.tolist()] if string_keys else ids.astype(np.int64)


def run_sequence(t: Any, ref: Any, string_keys: bool, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for step in range(STEPS):
        where = f"step {step}"
        ids = rng.integers(0, N_IDS, int(rng.integers(*BATCH)))
        keys = keys_of(ids, string_keys)
        assert_bits_equal(t.lookup(keys), ref.lookup(keys), f"lookup at {where}")
        grads = rng.standard_normal((ids.size, DIM)).astype(np.float32)
        assert t.apply_gradients(keys, grads) == ref.apply_gradients(keys, grads), where
        if step % 4 == 1:  # reads that insert nothing, of present and absent keys
            other = keys_of(rng.integers(0, 2 * N_IDS, 12), string_keys)
            assert_bits_equal(t.lookup(other, insert=False), ref.lookup(other, insert=False),
                              f"lookup(insert=False) at {where}")
            hashed = ref.as_keys(other)
            assert_bits_equal(t.as_keys(other), hashed, "hashed keys")
            assert_reads_equal(t, ref, hashed)
        if step % 5 == 2:  # removals, some of keys without a row
            gone = keys_of(rng.integers(0, N_IDS + 50, 8), string_keys)
            assert t.remove(gone) == ref.remove(gone), f"remove at {where}"
        if step % 10 == 6:  # incremental and full exports
            since = int(rng.integers(0, ref.mutation_seq + 1))
            assert_same_rows(table_rows(t, 9, since), table_rows(ref, 9, since),
                             f"export(since={since}) at {where}")
            assert len(t) == len(ref), where
        if step % 20 == 19:
            assert_same_table(t, ref, stats=True)
    assert_same_table(t, ref, stats=True)


def check_exercised(t: Any, bounded_middle: bool) -> None:
    tiers = t.stats()["tiers"]
    assert len(t) > 10 * TIER0
    assert tiers[0]["evictions"] > 100 and tiers[1]["promotions"] > 50, tiers
    if bounded_middle:
        assert tiers[1]["evictions"] > 0 and tiers[2]["promotions"] > 0, tiers


@pytest.mark.parametrize("string_keys", [False, True], ids=["int", "str"])
@pytest.mark.parametrize("chain", CHAINS, ids=[c[0] for c in CHAINS])
def test_chain_matches_the_dram_table(tmp_path, redis_url, chain, string_keys):
    t, ref = make_pair(chain, tmp_path, redis_url)
    try:
        run_sequence(t, ref, string_keys)
        check_exercised(t, chain[1])
        t.flush()
        assert_same_table(t, ref, stats=True)  # after the lower tiers flushed
    finally:
        t.close()
