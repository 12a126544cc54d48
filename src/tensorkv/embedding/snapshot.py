"""Table snapshots: one state of a table, exported while the table goes on changing.

A snapshot is taken in a short barrier (no operation of the table runs, background work is
settled; see :meth:`~tensorkv.embedding.table_io.TableIO.freeze`) and then read at leisure.
What keeps it one state is copy-before-write at each storage level, designed once:

- tier 0 (:class:`Tier0Snapshot`): the barrier records which rows hold data and their keys;
  every :class:`~tensorkv.embedding.arena.RowArena` method that writes a row first copies
  that row for the snapshot if the snapshot has not read it yet (:meth:`Tier0Snapshot.
  preserve`), and the exporter reads the other rows in place;
- lower tiers (:class:`tensorkv.embedding.chain.guard.LowerSnapshot`): every change the tier
  chain makes below tier 0 first marks its keys settled and keeps the record they had, if the
  exporter has not read it yet; the exporter skips settled keys.

:class:`TableSnapshot` is the interface savers code against (``meta``, ``export``,
``export_into``, ``keys``, ``release``); :class:`LiveSnapshot` wraps a table that cannot be
snapshotted (its export reads it as it changes). docs/format.md ("What a tag is a snapshot
of") describes the guarantee.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tensorkv.embedding.chunks import ExportChunk, Place, gather_into, place_chunks
from tensorkv.kernels import snapshot as sk


class KeySet:
    """A growable set of int64 keys (an open-addressing table over an array of keys).

    About 16 bytes per key (8 for the key, 4 per slot at a load of at most one half).
    """

    def __init__(self, keys: np.ndarray | None = None) -> None:
        self._tab = np.full(16, -1, np.int32)
        self._store = np.empty(8, np.int64)
        self.n = 0
        if keys is not None and keys.size:
            self.add(keys)

    def _room(self, more: int) -> None:
        need = self.n + more
        if need > self._store.shape[0]:
            self._store = np.resize(self._store, max(need, 2 * self._store.shape[0]))
        if 2 * need > self._tab.shape[0]:
            size = self._tab.shape[0]
            while 2 * need > size:
                size *= 2
            if size > 1 << 31:
                raise MemoryError(f"a key set of {need} keys is too large")
            self._tab = np.full(size, -1, np.int32)
            sk.set_rehash(self._store, self.n, self._tab)

    def add(self, keys: np.ndarray) -> np.ndarray:
        """Add ``keys``; returns ``bool[n]``: which of them were new (first occurrences)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        new = np.zeros(keys.shape[0], np.bool_)
        if keys.shape[0]:
            self._room(keys.shape[0])
            self.n = int(sk.set_add(self._tab, self._store, self.n, keys, new))
        return new

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """``bool[n]``: which keys are in the set."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        out = np.zeros(keys.shape[0], np.bool_)
        if keys.shape[0] and self.n:
            sk.set_has(self._tab, self._store, keys, out)
        return out

    def __len__(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return int(self._tab.nbytes + self._store.nbytes)


def chunk_bytes(ch: ExportChunk) -> int:
    """Bytes of the arrays of an export chunk."""
    return int(sum(np.asarray(a).nbytes for a in ch))


def split_chunk(ch: ExportChunk, chunk_rows: int) -> Iterator[ExportChunk]:
    """``ch`` in pieces of at most ``chunk_rows`` rows."""
    n = len(ch.keys)
    if n <= chunk_rows:
        yield ch
        return
    for lo in range(0, n, chunk_rows):
        yield ExportChunk(*(np.asarray(a)[lo:lo + chunk_rows] for a in ch))


def since_filter(ch: ExportChunk, since: int | None) -> ExportChunk | None:
    """The rows of ``ch`` changed after ``since`` (None: all); None when no row is left."""
    if since is not None:
        keep = np.asarray(ch.seq) > since
        if not keep.all():
            ch = ExportChunk(*(np.asarray(a)[keep] for a in ch))
    return ch if len(ch.keys) else None


class Tier0Snapshot:
    """Tier 0's rows at a snapshot: the rows that hold data, their keys, copies of changed rows.

    Made in the barrier (O(rows of tier 0): the keys are copied; 10 bytes per row in all) and
    attached to the arena as ``arena.snap``; from then on every arena method that writes
    rows calls :meth:`preserve` first. A row is *captured* once: by the exporter reading it
    or by :meth:`preserve` copying it before a write, whichever comes first. The exporter
    claims a chunk of rows (marking them *in flight*), copies them while holding only the
    arena's ``resize_guard`` (the arrays cannot move), then marks them captured
    (:meth:`claim`, :meth:`done`); a write of an in-flight row waits for that copy. So the
    table's lock is never held for an export: lookups run on, and only a write of a row
    being copied waits, for one chunk's copy at most.

    Parameters
    ----------
    arena
        Tier 0.
    held_rows, held_keys
        Rows that hold data without a key in the index (a tier chain's rows on their way
        down, or fetched ahead), and their keys.
    """

    def __init__(self, arena: Any, held_rows: np.ndarray | None = None,
                 held_keys: np.ndarray | None = None) -> None:
        hw = arena.high_water
        self.arena = arena
        # the arrays of the table's previous snapshot, if large enough: warm memory (a fresh
        # 80 MB of keys for 10M rows costs a page fault per 4 KiB, ~0.1 s on a VM)
        spare, arena.snap_spare = getattr(arena, "snap_spare", None), None
        if spare is not None and spare[0].shape[0] >= hw:
            self._bufs = spare
            self.keys, self.member, self.captured = (b[:hw] for b in spare)
            np.copyto(self.keys, arena.row_key[:hw])
            np.copyto(self.member, arena.live[:hw])
            self.captured[:] = 0
        else:  # room for a quarter more rows: a training table grows between snapshots
            cap = max(hw + hw // 4, 1024)
            self._bufs = (np.empty(cap, np.int64), np.empty(cap, np.uint8),
                          np.zeros(cap, np.uint8))
            self.keys, self.member, self.captured = (b[:hw] for b in self._bufs)
            np.copyto(self.keys, arena.row_key[:hw])
            np.copyto(self.member, arena.live[:hw])
        if held_rows is not None and held_rows.size:
            self.member[held_rows] = 1
            self.keys[held_rows] = held_keys
        # captured: 0: not yet, 1: captured, 2: in flight
        self.rows = int(np.count_nonzero(self.member))
        self.lock = threading.Lock()
        self.copied = threading.Condition(self.lock)  # in-flight rows became captured
        self.busy = 0  # rows in flight
        self.saved: list[ExportChunk] = []
        self.saved_bytes = 0
        self.saved_rows = 0
        self.peak_bytes = 0
        self.open = True

    @property
    def nbytes(self) -> int:
        """Bytes held now: the key copy, the two row maps and the rows copied before writes."""
        return int(self.keys.nbytes + self.member.nbytes + self.captured.nbytes
                   + self.saved_bytes)

    def member_keys(self) -> np.ndarray:
        """Keys of the rows that held data at the snapshot."""
        return self.keys[self.member.view(np.bool_)]

    # --- the writers' side --------------------------------------------------------------------
    def preserve(self, rows: np.ndarray) -> None:
        """Copy the rows about to be written that the snapshot still needs (a no-op after end).

        Called by the arena (under whatever lock the write holds); thread-safe.
        """
        if not self.open:
            return
        rows = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
        with self.lock:
            while self.open and self.busy and sk.count_marked(rows, self.captured, 2):
                self.copied.wait()  # the exporter is copying some of them
            if not self.open or rows.shape[0] == 0:
                return
            out = np.empty(rows.shape[0], np.int64)
            m = int(sk.claim_rows(rows, self.member, self.captured, out, 1))
            if m:
                self._save(out[:m])

    def preserve_from(self, start: int) -> None:
        """Copy every member row from ``start`` on not captured yet (the rows will go)."""
        if not self.open:
            return
        with self.lock:
            while self.open and self.busy:
                self.copied.wait()
            if not self.open:
                return
            rows = np.flatnonzero(self.member[start:] & (self.captured[start:] == 0)) + start
            if rows.size:
                self.captured[rows] = 1
                self._save(rows.astype(np.int64))

    def _save(self, rows: np.ndarray) -> None:
        values, slots, freq, version, seq = self.arena.copy_rows(rows)
        ch = ExportChunk(self.keys[rows], values, slots, freq, version, seq)
        self.saved.append(ch)
        self.saved_rows += int(rows.size)
        self.saved_bytes += chunk_bytes(ch)
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    # --- the exporter's side ------------------------------------------------------------------
    def claim(self, rows: np.ndarray) -> np.ndarray:
        """Of ``rows``, those not captured yet, now in flight: copy them, then :meth:`done`."""
        out = np.empty(rows.shape[0], np.int64)
        with self.lock:
            if not self.open:
                raise RuntimeError("the snapshot was released")
            m = int(sk.claim_rows(rows, self.member, self.captured, out, 2))
            self.busy += m
        return out[:m]

    def done(self, rows: np.ndarray) -> None:
        """The exporter has copied ``rows`` (claimed by :meth:`claim`): writes may go on."""
        with self.lock:
            self.captured[rows] = 1
            self.busy -= int(rows.size)
            self.copied.notify_all()

    def candidates(self, since: int | None) -> np.ndarray:
        """Member rows the exporter may still read: all of them, or those changed after ``since``.

        With ``since``, call holding the arena's ``resize_guard`` (reads the rows' change
        sequence); a row changed meanwhile was copied aside with its earlier sequence.
        """
        if since is None:
            return np.flatnonzero(self.member).astype(np.int64)
        with self.lock:
            return sk.members_since(self.member, self.captured, self.arena.seq, int(since))

    def take_saved(self) -> list[ExportChunk]:
        """The rows copied before writes so far (handed over once)."""
        with self.lock:
            out, self.saved = self.saved, []
            self.saved_bytes = 0
        return out

    def close(self) -> None:
        """Stop preserving (the exporter is done with tier 0, or the snapshot is released)."""
        with self.lock:
            self.open = False
            self.copied.notify_all()
        if getattr(self.arena, "snap", None) is self:
            self.arena.snap = None

    def recycle(self) -> None:
        """Give the arrays to the arena for its next snapshot (this one is done with them)."""
        bufs, self._bufs = self._bufs, None
        if bufs is not None:
            self.arena.snap_spare = bufs


class TableSnapshot(ABC):
    """One state of a table, read while the table goes on changing: what a save writes.

    Obtained from :meth:`EmbeddingTable.snapshot` (or a table's ``snapshot()``). Holds memory
    until released: use it as a context manager, or call :meth:`release`.

    Attributes
    ----------
    meta
        ``state_dict_meta()`` of the table at the snapshot (step, mutation sequence,
        optimizer state, settings).
    isolated
        True: every export yields the rows as they were at the snapshot, whatever other
        threads do. False (:class:`LiveSnapshot`): rows are read while they change.
    """

    meta: dict[str, Any]
    isolated: bool = True
    #: Whether :meth:`export_into` copies rows straight from a host arena (one copy).
    exports_in_place: bool = False

    @property
    def mutation_seq(self) -> int:
        """The table's mutation sequence at the snapshot."""
        return int(self.meta.get("mutation_seq", 0))

    @property
    def step(self) -> int:
        """The table's step at the snapshot."""
        return int(self.meta.get("step", 0))

    @abstractmethod
    def export(self, chunk_rows: int = 65536, since: int | None = None) -> Iterator[ExportChunk]:
        """Chunks of the rows at the snapshot (changed after ``since``, if given).

        One export per snapshot: it reads each row once (tier 0, then the rows written
        aside before writes, then the lower tiers).
        """

    def export_into(self, place: Place, chunk_rows: int = 65536,
                    since: int | None = None) -> Iterator[int]:
        """:meth:`export` into buffers ``place`` chooses (as ``EmbeddingTable.export_into``)."""
        return place_chunks(place, self.export(chunk_rows, since))

    @abstractmethod
    def keys(self) -> np.ndarray:
        """Every key of the snapshot (a tiered table's: once an export has run to its end)."""

    @abstractmethod
    def __len__(self) -> int:
        """Keys in the snapshot (a tiered table's: once an export has run to its end)."""

    @property
    def approx_rows(self) -> int:
        """Rows of the snapshot as known when it was taken (for progress bars)."""
        return 0

    def stats(self) -> dict[str, int]:
        """``bytes`` held now, ``peak_bytes``, ``preserved_rows`` (copied before writes)."""
        return {"bytes": 0, "peak_bytes": 0, "preserved_rows": 0}

    @abstractmethod
    def release(self) -> None:
        """Give the snapshot's memory back and stop copying rows for it (idempotent)."""

    def __enter__(self) -> TableSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LiveSnapshot(TableSnapshot):
    """A table that offers no snapshot: its metadata now, its rows read as they change.

    Saves of such tables (a Redis-resident table, a table object of another library) are as
    consistent as the table's own ``export`` (``isolated`` is False).
    """

    isolated = False

    def __init__(self, table: Any) -> None:
        self.table = table
        self.meta = table.state_dict_meta()
        self.exports_in_place = bool(getattr(table, "exports_in_place", False)) and \
            hasattr(table, "export_into")

    def export(self, chunk_rows: int = 65536, since: int | None = None) -> Iterator[ExportChunk]:
        """The table's own export."""
        if since is None:
            return iter(self.table.export(chunk_rows=chunk_rows))
        return iter(self.table.export(chunk_rows=chunk_rows, since=since))

    def export_into(self, place: Place, chunk_rows: int = 65536,
                    since: int | None = None) -> Iterator[int]:
        """The table's own ``export_into`` where it has one."""
        if self.exports_in_place:
            return iter(self.table.export_into(place, chunk_rows=chunk_rows, since=since))
        return super().export_into(place, chunk_rows, since)

    def keys(self) -> np.ndarray:
        """The table's keys now."""
        return np.asarray(self.table.keys(), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.table)

    @property
    def approx_rows(self) -> int:  # noqa: D102
        return len(self.table)

    def release(self) -> None:
        """Nothing held."""


class RowsSnapshot(TableSnapshot):
    """The snapshot of a table whose rows live in a row arena and, optionally, a tier chain.

    Made by :meth:`~tensorkv.embedding.rows.ArenaBackend.open_snapshot` inside the table's
    barrier.

    Parameters
    ----------
    meta
        The table's ``state_dict_meta()`` at the snapshot.
    tier0
        Tier 0's part (attached to the arena already).
    lower
        The lower tiers' part (``chunks(chunk_rows, since)``, ``keys()``, ``__len__``,
        ``release()``, ``nbytes``), or None.
    in_place
        Whether :meth:`export_into` gathers tier-0 rows straight into the buffers (a host
        arena).
    """

    def __init__(self, meta: dict[str, Any], tier0: Tier0Snapshot, lower: Any = None,
                 in_place: bool = False) -> None:
        self.meta = meta
        self.tier0 = tier0
        self.lower = lower
        self.exports_in_place = bool(in_place)
        self._exported = False
        self._released = False
        self._recycled = False
        self._lock = threading.Lock()

    def _start(self) -> None:
        with self._lock:
            if self._released:
                raise RuntimeError("this snapshot was released; take a new one")
            if self._exported:
                raise RuntimeError("a snapshot is exported once; take a new one")
            self._exported = True

    # --- tier 0 ---------------------------------------------------------------------------------
    def _tier0(self, chunk_rows: int, since: int | None,
               take: Callable[[Any, np.ndarray], Any]) -> Iterator[Any]:
        """``take(arena, rows)`` of tier 0's member rows, a chunk at a time (see ``claim``)."""
        t0 = self.tier0
        a = t0.arena
        if since is None:
            cand = t0.candidates(None)
        else:
            with a.resize_guard:
                cand = t0.candidates(since)
        s = -1 if since is None else int(since)
        for start in range(0, cand.shape[0], chunk_rows):
            rows = t0.claim(cand[start:start + chunk_rows])
            try:
                with a.resize_guard:  # the arrays stay put while the rows are copied
                    sel = rows if since is None or not rows.size else rows[a.seq[rows] > s]
                    got = take(a, sel) if sel.size else None
            finally:
                t0.done(rows)
            if got is not None:
                yield got

    def _saved(self, chunk_rows: int, since: int | None,
               final: bool = False) -> Iterator[ExportChunk]:
        """The rows tier 0 copied before writes (all of them once ``final``)."""
        if final:
            self.tier0.close()
        for ch in self.tier0.take_saved():
            ch2 = since_filter(ch, since)
            if ch2 is not None:
                yield from split_chunk(ch2, chunk_rows)

    def export(self, chunk_rows: int = 65536, since: int | None = None) -> Iterator[ExportChunk]:
        """Tier 0's rows, the rows copied before writes, then the lower tiers' rows."""
        self._start()

        def take(a: Any, rows: np.ndarray) -> ExportChunk:
            return ExportChunk(self.tier0.keys[rows], *a.copy_rows(rows))

        try:
            for ch in self._tier0(chunk_rows, since, take):
                yield ch
                yield from self._saved(chunk_rows, since)
            yield from self._saved(chunk_rows, since, final=True)
            if self.lower is not None:
                yield from self.lower.chunks(chunk_rows, since)
        finally:
            self._end()

    def export_into(self, place: Place, chunk_rows: int = 65536,
                    since: int | None = None) -> Iterator[int]:
        """:meth:`export` with tier 0's rows gathered straight into ``place``'s buffers."""
        if not self.exports_in_place:
            yield from super().export_into(place, chunk_rows, since)
            return
        self._start()
        keys_s = self.tier0.keys

        def take(a: Any, rows: np.ndarray) -> int:
            return gather_into(place, keys_s[rows], a, rows)

        try:
            for n in self._tier0(chunk_rows, since, take):
                yield n
                yield from place_chunks(place, self._saved(chunk_rows, since))
            yield from place_chunks(place, self._saved(chunk_rows, since, final=True))
            if self.lower is not None:
                yield from place_chunks(place, self.lower.chunks(chunk_rows, since))
        finally:
            self._end()

    # --- whole-snapshot facts -----------------------------------------------------------------
    def keys(self) -> np.ndarray:
        """Every key at the snapshot (tier 0's, then the lower tiers' read by the export)."""
        top = self.tier0.member_keys()
        if self.lower is None:
            return top
        return np.concatenate([top, self.lower.keys()])

    def __len__(self) -> int:
        return self.tier0.rows + (0 if self.lower is None else len(self.lower))

    @property
    def approx_rows(self) -> int:  # noqa: D102
        return self.tier0.rows + (0 if self.lower is None else self.lower.approx_rows)

    def stats(self) -> dict[str, int]:  # noqa: D102
        low = self.lower
        return {
            "bytes": self.tier0.nbytes + (0 if low is None else low.nbytes),
            "peak_bytes": self.tier0.peak_bytes + (0 if low is None else low.peak_bytes),
            "preserved_rows": self.tier0.saved_rows + (0 if low is None else low.saved_rows),
        }

    def reset_after_fork(self) -> None:
        """In a forked child: new locks (the parent's threads that held them are gone)."""
        self._lock = threading.Lock()
        self.tier0._bufs = None  # never handed back in a child
        self.tier0.lock = threading.Lock()
        self.tier0.copied = threading.Condition(self.tier0.lock)
        self.tier0.busy = 0

    def _end(self) -> None:
        """Stop copying rows for this snapshot (its keys stay readable until release)."""
        with self._lock:
            self._released = True
        self.tier0.close()
        self.tier0.take_saved()
        if self.lower is not None:
            self.lower.release()

    def release(self) -> None:
        """Stop copying rows for this snapshot and drop what it holds (idempotent).

        Tier 0's row arrays go back to the table for its next snapshot (warm memory).
        """
        self._end()
        with self._lock:
            recycle, self._recycled = not self._recycled, True
        if recycle:
            self.tier0.recycle()


__all__ = ["KeySet", "LiveSnapshot", "RowsSnapshot", "TableSnapshot", "Tier0Snapshot",
           "chunk_bytes", "since_filter", "split_chunk"]
