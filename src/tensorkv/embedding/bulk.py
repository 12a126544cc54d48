"""BulkImport: a table's new content built from rows at known positions (a restore's fast path).

Returned by :meth:`EmbeddingTable.bulk_import
<tensorkv.embedding.table.EmbeddingTable.bulk_import>`: rows are copied into a new
:class:`~tensorkv.embedding.arena.RowArena`, which replaces the table's rows on commit. See
docs/internals.md ("Bulk loads and page hints").
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from tensorkv.embedding.arena import RowArena
from tensorkv.embedding.chunks import ChunkArrays, nonfinite_rows
from tensorkv.errors import CapacityError, ConfigError, ShapeError
from tensorkv.pages import FreshPages


class BulkTarget(Protocol):
    """What a :class:`BulkImport` needs of the table it builds rows for (an EmbeddingTable)."""

    @property
    def arena(self) -> RowArena:
        """Tier 0: the arena whose settings the new one copies."""

    @property
    def mutation_seq(self) -> int:
        """The table's change counter."""

    def as_keys(self, keys: Any) -> np.ndarray:
        """Keys as the table stores them."""

    def check_chunk(self, chunk: Any, what: str = ...) -> ChunkArrays:
        """A chunk's arrays checked against the table."""

    def keep_finite(self, keys: np.ndarray, bad: np.ndarray, what: str) -> np.ndarray | None:
        """Rows to keep under the table's ``nan_policy``."""

    def adopt_rows(self, arena: RowArena, seq: int, skipped: int = 0) -> None:
        """Replace every row of the table with those of ``arena``."""


class BulkImport:
    """A new row arena for a table, filled from rows at known positions.

    Made by :meth:`EmbeddingTable.bulk_import`. The arrays are allocated lazily (the pages
    are touched by the rows copied into them), positions ``0 .. positions-1`` are filled by
    :meth:`put` and mapped by :meth:`index`, and :meth:`commit` swaps the arena into the
    table. Until then nothing the table holds changes.

    Threads: :meth:`put` may run on several threads at once for disjoint position ranges, and
    alongside :meth:`index` / :meth:`remove`, which run on one thread in the order the rows
    must be applied (a later duplicate key wins, a removal removes what was indexed before).
    The numpy copies and numba kernels release the GIL.

    Pages: the arena's arrays (and the index) are filled through a
    :class:`~tensorkv.pages.FreshPages` (:attr:`pages`): base pages, populated a range at a
    time; :meth:`commit` releases them.
    """

    def __init__(self, table: BulkTarget, positions: int) -> None:
        self.table = table
        self.positions = positions
        a = RowArena.for_bulk_load(table.arena, positions)
        self._arena = a
        self._index_ready = False
        self._seq = table.mutation_seq + 1  # the rows' change sequence: one mutation
        self._done = False
        #: The page policy of the arena's new arrays.
        self.pages = FreshPages()
        self.pages.track(*a.row_arrays)
        #: Keys indexed so far that were indexed before (their later row won).
        self.duplicates = 0
        # (start, stop) position ranges left empty by rows skipped for NaN/Inf
        self._holes: list[tuple[int, int]] = []

    @property
    def skipped(self) -> int:
        """Rows left out so far for NaN/Inf values or slots (``nan_policy="skip"``)."""
        return sum(b - a for a, b in self._holes)

    def _check(self, start: int, chunk: Any) -> ChunkArrays:
        arrays = self.table.check_chunk(chunk, what="bulk import")
        m = arrays.keys.shape[0]
        if start < 0 or start + m > self.positions:
            raise ShapeError(
                f"rows {start}..{start + m} lie outside the {self.positions} positions reserved"
            )
        return arrays

    def put(self, start: int, chunk: Any) -> int:
        """Copy one chunk's rows to positions ``start ..`` (not yet indexed); returns its rows.

        ``chunk`` is an :class:`~tensorkv.embedding.chunks.ExportChunk` or a tuple ``(keys,
        values, slots, freq, version)``; values in the table's storage dtype are copied bit
        for bit, other float values are rounded to it. Raises :class:`ShapeError` for a chunk
        that does not fit the table (nothing is written then). Rows holding NaN or Inf follow
        the table's ``nan_policy``: ``"raise"`` raises
        :class:`~tensorkv.errors.NonFiniteValueError` (nothing written), ``"skip"`` leaves
        them out (their positions stay empty; :attr:`skipped` counts them).
        """
        keys, values, slots, freq, version = self._check(start, chunk)
        a = self._arena
        m = keys.shape[0]
        keep = self.table.keep_finite(keys, nonfinite_rows(values, slots, a.np_dtype),
                                       "bulk import")
        if keep is not None:  # the kept rows first, in order; the rest of the range stays empty
            keys, values, slots = keys[keep], values[keep], slots[keep]
            freq, version = freq[keep], version[keep]
            self._holes.append((start + keys.shape[0], start + m))
        stop = start + keys.shape[0]
        a.row_key[start:stop] = keys
        self.pages.prepare(a.values[start:stop], a.slots[start:stop])
        if values.dtype == a.np_dtype:
            a.values[start:stop] = values.view(a.values.dtype)
        else:
            a.values[start:stop] = a.to_raw(values)
        if a.slot_width:
            a.slots[start:stop] = slots
        a.freq[start:stop] = freq
        a.version[start:stop] = version
        a.seq[start:stop] = self._seq
        return m

    def _ready_index(self) -> None:
        if self._index_ready:
            return
        a = self._arena
        # an empty index, on pages of the same policy as the rows
        index = np.empty((a.index_size(), 2), np.int64)
        self.pages.track(index)
        self.pages.prepare(index)
        a.set_index(index)
        self._index_ready = True

    def index(self, start: int, stop: int) -> int:
        """Map the keys of positions ``start .. stop-1`` (put before) to their rows.

        A key indexed before moves to its new row (a later duplicate wins). Returns how many
        keys were already present (also added up in :attr:`duplicates`).
        """
        if not 0 <= start <= stop <= self.positions:
            raise ShapeError(f"rows {start}..{stop} lie outside the {self.positions} positions")
        self._ready_index()
        dups = 0
        for lo, hi in self._filled(start, stop):
            dups += self._arena.index_rows(lo, hi)
        self.duplicates += dups
        return dups

    def _filled(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``[start, stop)`` less the empty ranges of skipped rows (one range per chunk)."""
        out: list[tuple[int, int]] = []
        lo = start
        for a, b in sorted(h for h in self._holes if h[0] < stop and h[1] > start):
            if a > lo:
                out.append((lo, a))
            lo = max(lo, b)
        if lo < stop:
            out.append((lo, stop))
        return out

    def remove(self, keys: Any) -> int:
        """Remove keys indexed so far; returns how many were present."""
        k = self.table.as_keys(keys)
        self._ready_index()
        return int((self._arena.remove(k) >= 0).sum())

    def __len__(self) -> int:
        return len(self._arena)

    def commit(self) -> None:
        """Replace every row of the table with the imported rows (one mutation).

        Raises
        ------
        CapacityError
            When the table may not grow (``growth=False``) and more rows were imported than
            its capacity; the table is unchanged.
        """
        if self._done:
            raise ConfigError("this bulk import was committed already")
        self._ready_index()
        a = self._arena
        if not a.growth and a.max_rows is not None and len(a) > a.max_rows:
            raise CapacityError(
                f"the import holds {len(a)} rows but the table may hold at most capacity="
                f"{a.max_rows} (growth=False); build it with a larger capacity"
            )
        a.finish_bulk_load()
        self.pages.release()  # huge pages again for what the table touches from now on
        self.table.adopt_rows(a, self._seq, self.skipped)
        self._done = True


__all__ = ["BulkImport", "BulkTarget"]
