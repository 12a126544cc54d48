"""The model the fault tests save: dense tensors and an EmbeddingTable, in three states.

:func:`stages` yields the states ``t0`` (saved in full), ``t1`` and ``t2`` (saved
incrementally on top); each state changes some table rows, adds and removes keys and changes
part of the dense tensors, so an incremental save writes blocks, added and removed key lists
and new dense chunks beside chunks shared with the parent. Everything depends only on the
code here, so the test process rebuilds the expected contents that the saving process wrote.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from tensorkv.embedding.table import EmbeddingTable
from tensorkv.testing.tablecheck import assert_bits_equal, assert_same_rows, table_rows

TAGS = ("t0", "t1", "t2")
SAVE_OPTIONS: dict[str, Any] = {"chunk_bytes": 4096, "block_rows": 256, "bucket_bits": 2}
"""Small chunks and blocks: a save writes dozens of records."""


def stages(rows: int = 3000) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(tag, model)`` for each state; the table object is the same, mutated between.

    A model is ``{"w": float32 [64, 256], "b": int64 [10], "emb": EmbeddingTable}``. Take
    what you need of one state (e.g. :func:`snapshot`) before asking for the next.
    """
    rng = np.random.default_rng(20240601)
    table = EmbeddingTable(8, optimizer="adagrad", seed=5)
    keys = np.arange(rows, dtype=np.int64) * 7919 + 11
    table.lookup(keys)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    for i, tag in enumerate(TAGS):
        hot = rng.choice(keys, size=rows // 4, replace=False)
        table.apply_gradients(hot, rng.standard_normal((hot.size, 8)).astype(np.float32),
                              step=10 * (i + 1))
        if i:
            fresh = np.arange(rows // 10, dtype=np.int64) * 104729 + 1_000_003 * i
            table.lookup(fresh)
            table.remove(rng.choice(keys, size=rows // 20, replace=False))
            keys = np.asarray(table.keys(), dtype=np.int64)
            w[16 * i : 16 * i + 8] += np.float32(i)  # a few dense chunks change
        model = {"w": w.copy(), "b": np.full(10, i, np.int64), "emb": table}
        yield tag, model


def snapshot(model: dict[str, Any]) -> dict[str, Any]:
    """A copy of what a model holds: dense arrays, and the table's rows (``table_rows``)."""
    return {k: (table_rows(v, chunk_rows=1 << 20) if k == "emb" else np.array(v))
            for k, v in model.items()}


def expected() -> dict[str, dict[str, Any]]:
    """``{tag: snapshot}`` of every state."""
    return {tag: snapshot(model) for tag, model in stages()}


def assert_loads_as(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Assert that a loaded model (``tensorkv.load(None, ...)``) equals a snapshot, bit for bit.

    Compares the dense arrays and every table row field (keys, values, optimizer slots,
    frequency, version).
    """
    assert sorted(got) == sorted(want), f"{what}: variables {sorted(got)} != {sorted(want)}"
    for name, value in want.items():
        if name == "emb":
            assert_same_rows(table_rows(got[name], chunk_rows=1 << 20), value,
                             what=f"{what}: table", seq=False)
        else:
            assert_bits_equal(got[name], value, f"{what}: {name}")
