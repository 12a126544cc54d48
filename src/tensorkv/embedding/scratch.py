"""Per-thread scratch arrays reused across a table's updates (no allocation per batch).

:class:`Scratch` holds them (docs/internals.md, "Concurrency").
"""

from __future__ import annotations

import threading

import numpy as np

from tensorkv.embedding.chunks import nonfinite_rows
from tensorkv.kernels import arena as ak


class Scratch(threading.local):
    """Per-thread scratch arrays for :meth:`EmbeddingTable.apply_gradients`.

    The summed-gradient buffers are reused across calls; each thread has its own set.
    """

    def __init__(self) -> None:
        self.n = -1
        self.dim = -1

    def dedup_buffers(self, n: int, dim: int) -> tuple[np.ndarray, ...]:
        """Buffers ``(uniq, sums, bad, table, pos)`` for summing ``n`` gradient rows of ``dim``."""
        if n > self.n or dim != self.dim:
            cap = max(n, 1024)
            self.uniq = np.empty(cap, np.int64)
            self.sums = np.empty((cap, dim), np.float32)
            self.bad = np.empty(cap, np.bool_)
            self.tab = np.empty((ak.dedup_table_size(cap), 2), np.int64)
            self.pos = np.empty(cap, np.int64)
            self.n, self.dim = cap, dim
        size = ak.dedup_table_size(n)
        return (self.uniq[:n], self.sums[:n], self.bad[:n], self.tab[:size], self.pos[:n])

    def summed(self, keys: np.ndarray, grads: np.ndarray, rows: np.ndarray | None,
               unique: bool, row_key: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Distinct keys, their summed gradients, NaN/Inf flags and rows (IndexedSlices).

        Returns ``(uniq, sums, bad, urows)``; ``urows`` are the distinct keys' arena rows when
        ``rows`` (every key's row, all present) were given, else None. ``unique``: the keys
        are distinct already, nothing is summed. ``row_key``: the arena's key of each row.
        The sums are views of this thread's buffers, valid until its next call.
        """
        if unique:
            sums = np.ascontiguousarray(grads, np.float32)
            return keys, sums, nonfinite_rows(sums), rows
        uniq, sums, bad, tab, pos = self.dedup_buffers(keys.shape[0], grads.shape[1])
        if rows is None:
            u = ak.dedup_sum(keys, grads, uniq, sums, bad, tab, pos)  # pure: no lock needed
            return uniq[:u], sums[:u], bad[:u], None
        first = self.row_slots(row_key.shape[0])
        u = ak.dedup_rows(rows, grads, uniq, sums, bad, first, pos)
        urows = uniq[:u].copy()
        return row_key[urows], sums[:u], bad[:u], urows

    def row_slots(self, capacity: int) -> np.ndarray:
        """An ``int64[>= capacity]`` array of ``-1``: the row map of ``dedup_rows``.

        The kernel leaves it all ``-1`` again, so it is reused as it is.
        """
        first = getattr(self, "first", None)
        if first is None or first.shape[0] < capacity:
            first = self.first = np.full(max(capacity, 1024), -1, np.int64)
        return first


__all__ = ["Scratch"]
