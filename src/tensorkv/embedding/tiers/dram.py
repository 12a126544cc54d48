"""DRAM as a lower tier: records in host memory below an HBM tier 0 (``HBM_DRAM*`` chains).

:class:`DRAMTier` keeps fixed-size records in one numpy array indexed by a width-1
:class:`~tensorkv.embedding.arena.RowArena`. Not persistent. Tier 0 above it:
:class:`~tensorkv.embedding.tiers.hbm_arena.HBMArena`. See docs/tiers.md ("HBM tier 0").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from tensorkv.embedding.arena import RowArena
from tensorkv.embedding.tiers.base import (
    LowerTier,
    RecordLayout,
    as_keys,
    check_chunk_rows,
    score_word,
)


class DRAMTier(LowerTier):
    """Host memory as a lower tier (below an HBM tier 0): records in one numpy array.

    The index is a :class:`RowArena` of width 1 (its hash index, free list and key column);
    records live in a ``uint8[capacity, record_bytes]`` array beside it. Not persistent.

    Parameters
    ----------
    layout
        Record layout.
    """

    kind = "dram"
    persistent = False

    def __init__(self, layout: RecordLayout) -> None:
        super().__init__(layout)
        self._idx = RowArena(1, 0)
        self._rec = layout.empty(self._idx.capacity)
        self._counters = {"reads": 0, "writes": 0, "deletes": 0}

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:  # noqa: D102
        keys, records = self._check_put(keys, records)
        with self._lock:
            self._check_open()
            rows, _ = self._idx.insert(keys)
            if self._rec.shape[0] < self._idx.capacity:
                self._rec.resize((self._idx.capacity, self.record_bytes), refcheck=False)
            self._rec[rows] = records  # numpy assignment: a later duplicate wins
            self._counters["writes"] += int(keys.size)

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # noqa: D102
        keys = as_keys(keys)
        with self._lock:
            self._check_open()
            rows = self._idx.find(keys)
            found = rows >= 0
            out = self.layout.empty(keys.size)
            out[found] = self._rec[rows[found]]
            self._counters["reads"] += int(keys.size)
        return found, out

    def delete(self, keys: np.ndarray) -> int:  # noqa: D102
        keys = as_keys(keys)
        with self._lock:
            self._check_open()
            n = int((self._idx.remove(keys) >= 0).sum())
            self._counters["deletes"] += n
        return n

    def contains(self, keys: np.ndarray) -> np.ndarray:  # noqa: D102
        keys = as_keys(keys)
        with self._lock:
            self._check_open()
            return self._idx.find(keys) >= 0

    def keys(self) -> np.ndarray:  # noqa: D102
        with self._lock:
            self._check_open()
            return self._idx.keys()

    def __len__(self) -> int:
        return len(self._idx)

    def flush(self) -> None:  # noqa: D102
        self._check_open()

    def _close(self) -> None:
        self._rec = self.layout.empty(0)
        self._idx = RowArena(1, 0)

    def stats(self) -> dict[str, Any]:  # noqa: D102
        with self._lock:
            return {"kind": self.kind, "rows": len(self._idx),
                    "bytes": int(self._rec.nbytes + self._idx.nbytes), "compactions": 0,
                    **self._counters}

    def check(self) -> list[str]:  # noqa: D102
        with self._lock:
            keys = self._idx.keys()
            rows = self._idx.find(keys)
            bad = self.layout.record_keys(self._rec[rows]) != keys
            return [f"row of key {int(k)} holds another key" for k in keys[bad][:10]]

    def scores(self, field: str) -> tuple[np.ndarray, np.ndarray]:  # noqa: D102
        word = score_word(field)
        with self._lock:
            self._check_open()
            keys = self._idx.keys()
            rows = self._idx.find(keys)
            col = self._rec[rows, 8 * word:8 * word + 8]  # one cache line per row, not the record
        return keys, col.view(np.int64)[:, 0]

    def scan(self, chunk_rows: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:  # noqa: D102
        chunk_rows = check_chunk_rows(chunk_rows)
        with self._lock:
            self._check_open()
            keys = self._idx.keys()
        for s in range(0, keys.size, chunk_rows):
            with self._lock:  # rows removed since the listing are skipped
                self._check_open()
                ck = keys[s:s + chunk_rows]
                rows = self._idx.find(ck)
                ok = rows >= 0
                recs = self._rec[rows[ok]]
            if recs.shape[0]:
                yield (ck if ok.all() else ck[ok]), recs


__all__ = ["DRAMTier"]
