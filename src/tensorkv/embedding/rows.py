"""The row backend of a table whose rows are all in one arena: :class:`ArenaBackend`.

Every hook of :class:`~tensorkv.embedding.backend.RowBackend` is trivial here (a DRAM or HBM
table); the tier chain's and the Redis table's backends build on it. See docs/tiers.md
("Tier chains").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tensorkv.embedding.arena import RowArena
from tensorkv.embedding.backend import RowBackend
from tensorkv.embedding.chunks import ExportChunk, Place, gather_into, place_chunks
from tensorkv.embedding.filters import Eviction
from tensorkv.embedding.locks import RWLock
from tensorkv.embedding.snapshot import RowsSnapshot, Tier0Snapshot
from tensorkv.errors import SnapshotInProgressError
from tensorkv.kernels import arena as ak

_NO_KEYS = np.empty(0, np.int64)
#: Lookups of more keys are not remembered by :meth:`ArenaBackend.note_lookup` (a copy each).
HINT_MAX_KEYS = 1 << 20

class ArenaBackend(RowBackend):
    """A table's rows, all in one arena (a DRAM table).

    Parameters
    ----------
    arena
        Tier 0: every row of the table.

    Attributes
    ----------
    arena
        Tier 0, where every read and update happens.
    lock
        The table's readers-writer lock (:class:`~tensorkv.embedding.locks.RWLock`).
    op
        A context manager entered around each whole operation (a no-op here: operations of
        a DRAM table run concurrently under :attr:`lock`).
    parallel, split
        How the optimizer kernel runs (``TableOptimizer.apply`` arguments; defaults here).
    """

    #: Whether rows may live below tier 0.
    tiered = False

    def __init__(self, arena: RowArena) -> None:
        self.arena = arena
        self.lock: Any = RWLock()
        self.op: Any = contextlib.nullcontext()
        self.parallel: bool | None = None
        self.split: Any = None
        self._last: tuple[np.ndarray, np.ndarray, int] | None = None

    # --- around one batch operation ------------------------------------------------------------
    def begin_write(self, table: Any, what: str, *args: Any) -> None:
        """The table starts ``what``, a call that may change rows, with its checked ``args``.

        Called inside :attr:`op`, before anything changes. A backend that must not write
        (a read-only Redis table) raises here; one whose writes can fail after the table's
        logic ran puts ``table``'s step back then (:mod:`tensorkv.embedding.redis.rows`).
        Nothing to do here.
        """

    def promote_lookup(self, keys: np.ndarray) -> np.ndarray | None:
        """Make a lookup's keys resident; returns every key's tier-0 row if known (else None)."""
        return None

    def promote_update(self, keys: np.ndarray) -> np.ndarray | None:
        """Make an update's keys resident; returns their tier-0 rows if all are present."""
        return None

    def promote(self, keys: np.ndarray) -> None:
        """Make ``keys`` resident before an operation that inserts, removes or overwrites."""

    def note_lookup(self, keys: np.ndarray, rows: np.ndarray, moves: int) -> None:
        """Remember a lookup's rows (all present) for :meth:`known_rows` (untiered tables).

        ``moves``: the arena's :attr:`~tensorkv.embedding.arena.RowArena.moves` under the lock
        that found ``rows``. The keys are copied (the caller may reuse its array).
        """
        if self.tiered or keys.shape[0] > HINT_MAX_KEYS:
            self._last = None
            return
        self._last = (keys.copy(), rows, moves)

    def known_rows(self, keys: np.ndarray) -> np.ndarray | None:
        """Rows of ``keys`` if the last lookup had these very keys and no row moved since.

        Call it under the table's lock. An update of the batch just looked up (the PyTorch
        modules' backward) then skips probing the index again.
        """
        last = self._last
        if last is None or last[2] != self.arena.moves or last[0].shape != keys.shape \
                or not np.array_equal(last[0], keys):
            return None
        return last[1]

    def holding_meta(self) -> contextlib.AbstractContextManager[None]:
        """Context of a batch whose metadata writes :meth:`meta_write` may hold."""
        return contextlib.nullcontext()

    def meta_write(self, kernel: Callable[..., Any], *args: Any) -> None:
        """Run a batch's metadata kernel (frequency counts, versions): at once, here."""
        kernel(*args)

    def run_held_meta(self) -> None:
        """Run the metadata writes held so far (before rules that read them)."""

    def after_batch(self, keys: np.ndarray) -> None:
        """After a lookup or update of ``keys``: move tier 0's excess down."""

    def after(self, keys: np.ndarray, protect: bool = True) -> None:
        """After an upsert or import of ``keys``: move tier 0's excess down.

        ``protect``: never move ``keys`` themselves.
        """

    def start_prefetch(self, keys: np.ndarray) -> None:
        """Start moving the next batch's non-resident rows up (nothing to move here)."""

    # --- rows below tier 0 ---------------------------------------------------------------------
    def read_lower(self, keys: np.ndarray) -> tuple[np.ndarray, Any]:
        """``(found, fields)`` of keys below tier 0; ``fields`` has ``freq`` and ``version``."""
        return np.zeros(keys.shape[0], np.bool_), None

    def lower_len(self) -> int:
        """Rows below tier 0."""
        return 0

    def lower_keys(self) -> np.ndarray:
        """Keys below tier 0."""
        return _NO_KEYS

    def export_lower(self, chunk_rows: int, since: int) -> Iterator[ExportChunk]:
        """Chunks of the rows below tier 0 changed after ``since``."""
        return iter(())

    def evict_keys(self, eviction: Eviction, step: int) -> np.ndarray:
        """Keys ``eviction`` removes at ``step`` (every tier)."""
        a = self.arena
        return a.row_key[eviction.select(a, step)].copy()

    def remove_lower(self, keys: np.ndarray) -> int:
        """Delete keys below tier 0; returns how many were there."""
        return 0

    def clear_lower(self) -> None:
        """Drop every row below tier 0 (tier 0 has just been cleared)."""

    # --- export ----------------------------------------------------------------------------------
    @property
    def exports_in_place(self) -> bool:
        """Whether :meth:`export_into` gathers every row straight from a host arena."""
        return not self.tiered and not self.arena.on_device

    def _tier0_chunks(self, chunk_rows: int, since: int | None,
                      take: Callable[[RowArena, np.ndarray], Any]) -> Iterator[Any]:
        """Yield ``take(arena, rows)`` for chunks of tier 0's live rows changed after ``since``.

        ``take`` runs under the shared lock (one chunk at a time; a writer between chunks may
        make the whole a mix of before/after states); chunks with no live row are skipped.
        """
        s = -1 if since is None else int(since)
        with self.lock.read():
            hw = self.arena.high_water
            rows_all = ak.live_rows(self.arena.live, self.arena.seq, 0, hw, s)
        for start in range(0, rows_all.shape[0], chunk_rows):
            rows = rows_all[start:start + chunk_rows]
            with self.lock.read():
                a = self.arena
                rows = rows[a.live[rows].view(np.bool_)]
                if rows.size == 0:
                    continue
                got = take(a, rows)
            yield got

    def export(self, chunk_rows: int, since: int | None) -> Iterator[ExportChunk]:
        """Chunks of every row changed after ``since`` (None: all), tier 0 first."""

        def take(a: RowArena, rows: np.ndarray) -> ExportChunk:
            return ExportChunk(a.row_key[rows], a.gather(rows).view(a.np_dtype),
                               a.gather_slots(rows), a.freq[rows], a.version[rows], a.seq[rows])

        yield from self._tier0_chunks(chunk_rows, since, take)
        yield from self.export_lower(chunk_rows, -1 if since is None else int(since))

    def export_into(self, place: Place, chunk_rows: int, since: int | None) -> Iterator[int]:
        """:meth:`export` into buffers from ``place``; yields each chunk's row count.

        Rows of a host tier 0 are gathered straight into the buffers; rows on a device or
        below tier 0 are copied from exported chunks.
        """
        if self.arena.on_device:
            yield from place_chunks(place, self.export(chunk_rows, since))
            return

        def take(a: RowArena, rows: np.ndarray) -> int:
            return gather_into(place, a.row_key[rows], a, rows)

        yield from self._tier0_chunks(chunk_rows, since, take)
        yield from place_chunks(place, self.export_lower(chunk_rows,
                                                         -1 if since is None else int(since)))

    # --- snapshots -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """No operation runs inside (it waits for those running and holds new ones off)."""
        with self.op, self.lock.write():
            self.quiesce()
            yield

    def quiesce(self) -> None:
        """Settle background work that changes rows (inside :meth:`frozen`; none here)."""

    def open_snapshot(self, meta: dict[str, Any]) -> RowsSnapshot | None:
        """The snapshot of the rows now (inside :meth:`frozen`); None: this backend has none.

        A subclass that brings its own ``export`` returns None unless it implements this
        too: the table then falls back to a :class:`~tensorkv.embedding.snapshot.LiveSnapshot`.
        """
        if type(self).export is not ArenaBackend.export or \
                type(self).export_into is not ArenaBackend.export_into:
            return None
        a = self.arena
        if a.snap is not None:
            raise SnapshotInProgressError(
                "this table has a snapshot open already (a save still writing it); release it "
                "first, or wait for the save (SaveHandle.result())")
        t0 = Tier0Snapshot(a)
        a.snap = t0
        return RowsSnapshot(meta, t0, in_place=self.exports_in_place)

    # --- lifecycle -----------------------------------------------------------------------------
    def sync(self) -> None:
        """Land every background write."""

    def wait_writes(self) -> None:
        """Block until every background write has landed."""

    def flush(self) -> None:
        """Land background writes and make the lower tiers durable."""

    def close(self) -> None:
        """Flush and release the lower tiers."""

    @property
    def device(self) -> Any:
        """The torch device of tier 0's rows."""
        return "cpu"

    def add_stats(self, stats: dict[str, Any]) -> None:
        """Add per-tier figures to the table's :meth:`stats` (none here)."""

    def spill_locations(self) -> list[str]:
        """Where the lower tiers keep rows (absolute paths or URLs); none here."""
        return []

    def add_meta(self, meta: dict[str, Any]) -> None:
        """Add the storage description to the table's metadata (none here)."""


__all__ = ["ArenaBackend", "Place", "place_chunks"]
