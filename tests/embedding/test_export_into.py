"""``EmbeddingTable.export_into`` fills the caller's buffers with exactly what ``export`` gives.

On a DRAM table (rows gathered straight from the arena) and on a DRAM_SSDHASH table (tier 0
gathered, the lower tier's chunks copied), whole and since a change sequence; each group of
rows lands in the buffers ``place`` hands out.
"""

from __future__ import annotations

import numpy as np
import pytest

import tensorkv


def rows_of(chunks):
    parts = [tuple(np.asarray(x) for x in tuple(ch)[:5]) for ch in chunks]
    if not parts:
        return None
    out = [np.concatenate([p[i] for p in parts]) for i in range(5)]
    order = np.argsort(out[0], kind="stable")
    return [a[order] for a in out]


def exported_into(table, **kw):
    got = []

    def place(keys, fields):
        half = keys.size // 2  # two groups: the second half first, so the index matters
        groups = []
        for idx in (np.arange(half, keys.size), np.arange(half)):
            outs = [np.empty((idx.size, *shape), dtype) for dtype, shape in fields]
            got.append(outs)
            groups.append((idx, outs))
        return groups

    counts = list(table.export_into(place, chunk_rows=64, **kw))
    rows = rows_of(got)
    assert sum(counts) == (0 if rows is None else rows[0].size)
    return rows


@pytest.mark.parametrize("storage", ["DRAM", "DRAM_SSDHASH"])
def test_export_into_equals_export(storage, tmp_path):
    kw = {} if storage == "DRAM" else {
        "storage": storage, "storage_path": str(tmp_path / "t"), "storage_size": [4096]}
    t = tensorkv.EmbeddingTable(4, optimizer="adagrad", seed=3, **kw)
    keys = np.arange(500, dtype=np.int64)
    t.lookup(keys)
    t.apply_gradients(keys, np.ones((500, 4), np.float32))
    seq = t.mutation_seq
    t.apply_gradients(keys[:50], np.ones((50, 4), np.float32))
    for since in (None, seq):
        want = rows_of(t.export(chunk_rows=64, since=since))
        got = exported_into(t, since=since)
        assert want is not None and got is not None and want[0].size == (
            500 if since is None else 50)
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(a, b)
    t.close()
