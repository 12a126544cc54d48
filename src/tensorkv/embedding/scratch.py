"""Per-thread scratch arrays reused across a table's updates (no allocation per batch).

:class:`Scratch` holds them (docs/internals.md, "Concurrency").
"""

from __future__ import annotations

import threading

import numpy as np

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

    def row_slots(self, capacity: int) -> np.ndarray:
        """An ``int64[>= capacity]`` array of ``-1``: the row map of ``dedup_rows``.

        The kernel leaves it all ``-1`` again, so it is reused as it is.
        """
        first = getattr(self, "first", None)
        if first is None or first.shape[0] < capacity:
            first = self.first = np.full(max(capacity, 1024), -1, np.int64)
        return first


__all__ = ["Scratch"]
