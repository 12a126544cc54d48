"""Checkpoints of tiered (DRAM_SSDHASH) tables, and the row gather that builds their blocks."""

from __future__ import annotations

import numpy as np
import pytest

import tensorkv
from tensorkv.checkpoint import tables
from tensorkv.checkpoint.gather import gather_rows, rows_contiguous
from tensorkv.embedding.table import EmbeddingTable
from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.stores.memory import MemoryStore

DIM = 8


def _tiered(path, rows0: int) -> EmbeddingTable:
    rb = RecordLayout(DIM, "float32", 1).record_bytes
    return EmbeddingTable(DIM, optimizer="adagrad", seed=0, storage="DRAM_SSDHASH",
                          storage_path=str(path), storage_size=[rows0 * rb],
                          cache_strategy="lru")


def _all_rows(table) -> list[np.ndarray]:
    """(keys, values, slots, freq, version) of every tier, sorted by key."""
    parts = list(table.export(chunk_rows=1 << 30))
    cols = [np.concatenate([np.asarray(p[i]) for p in parts]) for i in range(5)]
    order = np.argsort(cols[0])
    return [c[order] for c in cols]


def _same(a, b) -> None:
    ra, rb_ = _all_rows(a), _all_rows(b)
    assert len(ra[0]) == len(a) == len(b)
    for x, y in zip(ra, rb_, strict=True):
        assert x.tobytes() == y.tobytes()


def test_ssdhash_table_round_trip_into_a_tiered_table(tmp_path):
    src = _tiered(tmp_path / "src", 300)
    dst = _tiered(tmp_path / "dst", 300)
    with src, dst:
        rng = np.random.default_rng(0)
        keys = rng.choice(10**9, 5000, replace=False).astype(np.int64)
        src.lookup(keys)
        src.apply_gradients(keys[:2000], rng.standard_normal((2000, DIM)).astype(np.float32),
                            step=4)
        src.wait_writes()
        assert src.stats()["tier0_rows"] < len(src) == 5000  # most rows on SSD
        assert not tables._gathers_in_place(src)  # its rows come through export's chunks
        store = MemoryStore()
        d = {"emb": src, "w": np.arange(10.0)}
        tensorkv.save(d, store, "a", block_rows=128)
        tensorkv.load({"emb": dst}, store, "a")
        dst.wait_writes()
        assert dst.stats()["tier0_rows"] < len(dst) == 5000  # streamed into the lower tier
        _same(src, dst)
        # an incremental save of the tiered table, restored into a DRAM table
        src.apply_gradients(keys[-100:], np.ones((100, DIM), np.float32), step=5)
        src.remove(keys[:10])
        tensorkv.save(d, store, "b", incremental=True, block_rows=128)
        info = tensorkv.checkpoint.tag_manifest(store, "b")["tables"]["emb"]["shards"]["0"]
        assert (info["rows"], info["removed"], info["added"]) == (100, 10, 0)
        _same(src, tensorkv.load(None, store, "b")["emb"])


def test_gathers_in_place_for_plain_tables():
    assert tables._gathers_in_place(EmbeddingTable(4))
    assert not tables._gathers_in_place(object())


@pytest.mark.parametrize("make", [
    lambda b, r: b[:, 32:288].view(np.float32),  # a field of a record buffer: strided rows
    lambda b, r: b[:, 0:8].view(np.int64)[:, 0],  # a strided column
    lambda b, r: b[:, 1:9].view(np.int64)[:, 0],  # unaligned
    lambda b, r: b[:, 3:259].view(np.float32),  # unaligned rows
    lambda b, r: b[:, 5:12],  # 7-byte rows
    lambda b, r: r.standard_normal((1000, 3, 5)),  # C-contiguous, 3-d
    lambda b, r: r.standard_normal((1000, 6))[:, ::2],  # rows not contiguous: np.take
    lambda b, r: r.standard_normal(1000).astype(np.float16),  # a dtype numba lacks
    lambda b, r: r.standard_normal((1000, 4, 2))[:, :, :1],
    lambda b, r: (r.standard_normal((1000, 2)) > 0),
])
def test_gather_rows_matches_fancy_indexing(make):
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 255, (1000, 544), dtype=np.uint8)
    src = make(buf, rng)
    idx = rng.integers(0, 1000, 300)
    out = np.empty((300, *src.shape[1:]), src.dtype)
    gather_rows(src, idx, out)
    assert out.tobytes() == src[idx].tobytes()
    gather_rows(src, idx[:0], out[:0])  # nothing to gather


def test_rows_contiguous():
    a = np.zeros((10, 4, 3))
    assert rows_contiguous(a) and rows_contiguous(a[::2]) and rows_contiguous(a[:, 0, 0])
    assert not rows_contiguous(a[:, ::2]) and not rows_contiguous(a[:, :, :1])
    assert rows_contiguous(a[:, :1, :])  # a size-1 axis has no stride to honour
