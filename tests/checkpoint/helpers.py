"""Helpers shared by the checkpoint tests."""

from __future__ import annotations

import numpy as np

from tensorkv.embedding.table import EmbeddingTable


def make_table(n: int = 5000, dim: int = 8, optimizer: str = "adagrad", seed: int = 0,
               start: int = 0) -> EmbeddingTable:
    """A table with ``n`` rows, a few trained, so values, slots, freq and version all vary."""
    t = EmbeddingTable(dim, optimizer=optimizer, seed=seed)
    keys = (np.arange(start, start + n, dtype=np.int64) * 7919) ^ 0x5DEECE66D
    t.lookup(keys)
    rng = np.random.default_rng(seed)
    hot = keys[: max(1, n // 3)]
    t.apply_gradients(hot, rng.standard_normal((len(hot), dim)).astype(np.float32), step=3)
    t.lookup(keys[: n // 5])
    return t


def rows_of(table: EmbeddingTable) -> tuple[np.ndarray, ...]:
    """(keys, values, slots, freq, version) sorted by key."""
    parts = list(table.export(chunk_rows=1 << 30))
    if not parts:
        return (np.empty(0, np.int64),)
    ch = parts[0]
    order = np.argsort(ch.keys)
    return tuple(np.asarray(a)[order] for a in (ch.keys, ch.values, ch.slots, ch.freq, ch.version))


def assert_tables_equal(a: EmbeddingTable, b: EmbeddingTable) -> None:
    """Bit-identical rows (keys, values, slots, freq, version)."""
    ra, rb = rows_of(a), rows_of(b)
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb, strict=True):
        assert x.shape == y.shape
        assert x.tobytes() == y.tobytes()
