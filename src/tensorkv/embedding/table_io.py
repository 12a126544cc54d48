"""Export, import and metadata of an embedding table: :class:`TableIO`, a base of the table.

:class:`~tensorkv.embedding.table.EmbeddingTable` inherits :meth:`TableIO.export`,
:meth:`TableIO.export_into`, :meth:`TableIO.import_` and :meth:`TableIO.bulk_import` (split
out to keep ``table.py`` small). How checkpoints store a table: docs/format.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Self, cast

import numpy as np

from tensorkv.embedding.arena import RowArena
from tensorkv.embedding.backend import RowBackend
from tensorkv.embedding.chunks import (
    ChunkArrays,
    ExportChunk,
    check_chunk,
    is_single_chunk,
    nonfinite_rows,
)
from tensorkv.embedding.rows import Place
from tensorkv.embedding.snapshot import LiveSnapshot, TableSnapshot
from tensorkv.embedding.tiers.base import check_chunk_rows
from tensorkv.errors import ConfigError, NonFiniteValueError, UnsupportedOperationError

if TYPE_CHECKING:
    from tensorkv.embedding.bulk import BulkImport

#: Version of the dict :meth:`TableIO.state_dict_meta` returns.
META_FORMAT = 1


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (numpy integers included, bools not)."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


class TableIO:
    """Export, import and metadata methods of :class:`EmbeddingTable` (which sets the state)."""

    dim: int
    dtype: str
    num_slots: int
    growth: bool
    seed: int
    nan_policy: str
    capacity_limit: int | None
    optimizer: Any
    initializer: Any
    admission: Any
    eviction: Any
    _rows: RowBackend
    _lock: Any
    _meta_lock: threading.Lock
    _default: np.ndarray | None
    _step: int
    _mseq: int
    _stats: dict[str, int]
    _frozen_by: int | None = None  # the thread inside freeze()

    @property
    def mutation_seq(self) -> int:
        """Counter bumped by every mutating call; rows remember the value of their last change."""
        return self._mseq

    @property
    def arena(self) -> RowArena:  # pragma: no cover - defined by the table
        """Tier 0 (see :attr:`EmbeddingTable.arena`)."""
        raise NotImplementedError

    def as_keys(self, keys: Any) -> np.ndarray:  # pragma: no cover - defined by the table
        """Keys as the table stores them (see :meth:`EmbeddingTable.as_keys`)."""
        raise NotImplementedError

    def _check_room(self, keys: np.ndarray) -> None:  # pragma: no cover - defined by the table
        raise NotImplementedError

    def export(self, chunk_rows: int = 65536, since: int | None = None) -> Iterator[ExportChunk]:
        """Yield the rows (keys, values, slots, freq, version, seq) in chunks, tier 0 first.

        Parameters
        ----------
        chunk_rows
            Most rows per chunk.
        since
            Only rows changed after this :attr:`mutation_seq` (incremental checkpoints).

        Each chunk is copied under the shared lock; a writer running between chunks may make
        the export a mix of before/after states. For one state while other threads train,
        export :meth:`snapshot` instead (what ``tensorkv.save`` does).
        """
        return self._rows.export(check_chunk_rows(chunk_rows), since)

    # --- snapshots ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def freeze(self) -> Iterator[None]:
        """Hold every operation of this table off (and settle its background work) inside.

        Operations running when it is entered finish first; operations started meanwhile
        wait. Re-entering it on the thread that holds it does nothing. ``tensorkv.save``
        freezes every table it saves at once (in a fixed order) to take their snapshots at
        one moment; keep it short.
        """
        me = threading.get_ident()
        if getattr(self, "_frozen_by", None) == me:
            yield
            return
        with self._rows.frozen():
            self._frozen_by = me
            try:
                yield
            finally:
                self._frozen_by = None

    def snapshot(self) -> TableSnapshot:
        """One state of the table, to export while other threads go on using it.

        Takes :meth:`freeze` for as long as it copies tier 0's keys (10 bytes per row of
        tier 0); from then on every write first copies the rows the snapshot has not read yet
        (tier 0's rows, and the records of rows below tier 0), so the snapshot's
        :meth:`~tensorkv.embedding.snapshot.TableSnapshot.export` yields exactly the rows,
        slots, frequencies and versions of that moment, and its ``meta`` the step, mutation
        sequence and optimizer state. One snapshot per table at a time; release it (or use it
        as a context manager) to stop the copying. docs/format.md ("What a tag is a snapshot
        of") has the details and the memory it uses.

        Raises
        ------
        SnapshotInProgressError
            The table has a snapshot open already.

        Examples
        --------
        >>> import numpy as np
        >>> from tensorkv import EmbeddingTable
        >>> t = EmbeddingTable(4, seed=1)
        >>> _ = t.lookup(np.arange(3))
        >>> with t.snapshot() as snap:
        ...     _ = t.lookup(np.arange(3, 10))      # changes after the snapshot
        ...     rows = list(snap.export())
        >>> sum(len(ch.keys) for ch in rows), len(t)
        (3, 10)
        """
        with self.freeze():
            snap: TableSnapshot | None = self._rows.open_snapshot(self.state_dict_meta())
            return LiveSnapshot(self) if snap is None else snap


    @property
    def exports_in_place(self) -> bool:
        """Whether :meth:`export_into` gathers every row straight from a host row arena."""
        return self._rows.exports_in_place

    def export_into(self, place: Place, chunk_rows: int = 65536,
                    since: int | None = None) -> Iterator[int]:
        """Export rows straight into buffers the caller chooses (no intermediate chunk copy).

        Parameters
        ----------
        place
            Called once per chunk (the rows one :meth:`export` chunk would hold) as
            ``place(keys, fields)``: ``keys`` are the chunk's keys (int64) and ``fields`` the
            ``(dtype, row shape)`` of keys, values, slots, freq and version. It returns groups
            ``(index, outs)``: ``index`` (int64) selects rows of the chunk by position in
            ``keys`` and ``outs`` are five C-contiguous arrays of ``len(index)`` rows with those
            dtypes and row shapes, which are filled with the selected rows' keys, values,
            slots, freq and version.
        chunk_rows
            Most rows per chunk.
        since
            Only rows changed after this :attr:`mutation_seq` (incremental checkpoints).

        Yields
        ------
        int
            The number of rows in the chunk, once its groups are filled.

        Notes
        -----
        Rows of a host tier 0 are gathered into ``outs`` under the shared lock, the same
        snapshot semantics as :meth:`export`; rows on a device or below tier 0 are copied
        from :meth:`export`'s chunks.
        """
        return self._rows.export_into(place, check_chunk_rows(chunk_rows), since)

    def check_chunk(self, chunk: Any, what: str = "import_") -> ChunkArrays:
        """Check an imported chunk against this table; returns its arrays (see ``import_``).

        Raises
        ------
        ShapeError
            A chunk that does not fit the table (wrong dim, slots of another optimizer,
            mismatched lengths, not a chunk at all).
        """
        a = self.arena
        return check_chunk(chunk, dim=self.dim, slot_width=a.slot_width,
                           storage_dtype=a.np_dtype, optimizer=self.optimizer.name,
                           as_keys=self.as_keys, what=what)

    def keep_finite(self, keys: np.ndarray, bad: np.ndarray, what: str,
                    unchanged: str = "nothing was written") -> np.ndarray | None:
        """Apply :attr:`nan_policy` to the rows ``bad`` flags (see :func:`nonfinite_rows`).

        Returns None when every row is finite, else (``"skip"``) the mask of rows to keep;
        the caller counts the others in ``stats()["nonfinite_skipped"]``.

        Raises
        ------
        NonFiniteValueError
            Under ``nan_policy="raise"``, naming the first bad key and how many rows.
        """
        if not bad.any():
            return None
        pos = np.flatnonzero(bad)
        if self.nan_policy == "raise":
            raise NonFiniteValueError(
                f"{what}: {pos.size} of {bad.size} rows hold NaN or Inf (first: key "
                f"{int(keys[pos[0]])}, row {int(pos[0])}); {unchanged}. Replace them (e.g. "
                "np.nan_to_num) or create the table with nan_policy='skip' to skip such rows"
            )
        return ~bad

    def import_(self, chunks: Iterable[Any]) -> int:
        """Upsert exported rows exactly (values, slots, freq, version); returns rows written.

        ``chunks`` is an iterable of :class:`ExportChunk` or tuples
        ``(keys, values, slots, freq, version[, seq])``. Each chunk is checked before it is
        applied; a bad chunk raises :class:`ShapeError` and leaves the table as it was after
        the previous chunk. Rows whose values or slots hold NaN or Inf follow
        :attr:`nan_policy`: ``"raise"`` refuses their chunk with
        :class:`~tensorkv.errors.NonFiniteValueError`, ``"skip"`` leaves them out (not
        counted in the result; counted in ``stats()["nonfinite_skipped"]``).
        """
        total = 0
        if is_single_chunk(chunks):
            chunks = [chunks]
        for ch in chunks:
            keys, values, slots, freq, version = self.check_chunk(ch)
            keep = self.keep_finite(
                keys, nonfinite_rows(values, slots, self.arena.np_dtype), "import_",
                "this chunk was not written (chunks before it were)")
            n_skip = 0
            if keep is not None:
                n_skip = keys.shape[0] - int(keep.sum())
                keys, values, slots = keys[keep], values[keep], slots[keep]
                freq, version = freq[keep], version[keep]
            with self._rows.op:
                self._rows.begin_write(self, "import_", keys, values, slots, freq, version)
                self._rows.promote(keys)
                a = self.arena
                with self._lock.write():
                    if not self.growth:
                        self._check_room(keys)
                    rows, _ = a.insert(keys)
                    a.scatter(rows, values)
                    if self.num_slots:
                        a.scatter_slots(rows, slots)
                    self._mseq += 1
                    a.set_fields(rows, freq, version, self._mseq)
                    self._stats["nonfinite_skipped"] += n_skip
                self._rows.after(keys, protect=False)
            total += keys.shape[0]
        return total

    @property
    def rows_in_checkpoint(self) -> bool:
        """Whether a checkpoint carries this table's rows (False: they live elsewhere).

        A Redis-resident table with ``table_store_mode`` 1 or 2 keeps its rows in Redis (or
        dump files): :meth:`export` yields none, and loading a checkpoint into the table
        restores its settings and step but leaves its rows alone.
        """
        return self._rows.rows_in_checkpoint

    def check_restore_meta(self, meta: dict[str, Any]) -> None:
        """Refuse to load a tag's table metadata that needs rows this table has lost.

        Called by ``tensorkv.load`` before anything changes: a tag of a Redis-resident table
        saved with ``table_store_mode=2`` holds no rows, so it loads only into a table whose
        Redis rows are those of the save (the same epoch); else ``TableLostError``.
        """
        self._rows.check_restore(meta)

    @property
    def can_bulk_import(self) -> bool:
        """Whether :meth:`bulk_import` serves this table (rows all in a host row arena)."""
        return self.exports_in_place

    def bulk_import(self, positions: int) -> BulkImport:
        """Start building this table's new content from rows at known positions.

        The fast path of a restore: every row is copied once, straight to its final place in
        a new row arena, and the hash index is built in bulk. The table itself is untouched
        until :meth:`BulkImport.commit`, which replaces all its rows (values, slots, freq,
        version) with the imported ones; a :class:`BulkImport` dropped without a commit
        leaves it as it was.

        Parameters
        ----------
        positions
            Row positions to reserve: the rows to be imported, counting duplicates and rows
            left out later (positions nobody fills become free rows).

        Returns
        -------
        BulkImport
            ``put`` rows at positions (from several threads at once, disjoint ranges), then
            ``index`` those ranges in order (one thread), ``remove`` keys between ranges,
            and ``commit``.

        Raises
        ------
        UnsupportedOperationError
            When :attr:`can_bulk_import` is false (use :meth:`import_`); a ``TypeError``.
        """
        from tensorkv.embedding.bulk import BulkImport

        if not self.can_bulk_import:
            raise UnsupportedOperationError(
                "this table keeps rows below tier 0 or on a device, which bulk_import cannot "
                "build; use import_"
            )
        if not is_int(positions) or positions < 0:
            raise ConfigError(f"positions={positions!r} must be a non-negative integer")
        return BulkImport(self, int(positions))

    def adopt_rows(self, arena: RowArena, seq: int, skipped: int = 0) -> None:
        """Replace every row with those of ``arena`` (one mutation); for :class:`BulkImport`.

        ``seq`` is the change sequence the new rows carry; if the table changed since it was
        read, the rows are stamped with the new one. ``skipped``: rows left out for NaN/Inf.
        """
        with self._lock.write():
            self._stats["nonfinite_skipped"] += skipped
            self._mseq += 1
            if self._mseq != seq:  # the table changed while the rows were copied
                arena.seq[: arena.high_water] = self._mseq
            removed = len(self._rows.arena)
            self._rows.arena = arena
            self._stats["removed"] += removed

    def state_dict_meta(self) -> dict[str, Any]:
        """JSON-serialisable description, enough for :meth:`from_meta` to rebuild an empty twin."""
        meta = {
            "format": META_FORMAT,
            "dim": self.dim,
            "dtype": self.dtype,
            "initializer": self.initializer.config(),
            "optimizer": {"config": self.optimizer.config(), "state": self.optimizer.state()},
            "seed": self.seed,
            "step": self._step,
            "mutation_seq": self._mseq,
            "admission": None if self.admission is None else self.admission.config(),
            "eviction": None if self.eviction is None else self.eviction.config(),
            "default_value": None if self._default is None else self._default.tolist(),
            "nan_policy": self.nan_policy,
            "capacity": self.capacity_limit,
            "growth": self.growth,
        }
        self._rows.add_meta(meta)
        return meta

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Self:
        """Build an empty DRAM table from :meth:`state_dict_meta` (step, optimizer state too)."""
        if not isinstance(meta, dict) or "dim" not in meta:
            raise ConfigError("from_meta needs the dict returned by state_dict_meta()")
        if meta.get("format", META_FORMAT) > META_FORMAT:
            raise ConfigError(
                f"table meta format {meta['format']} is newer than this tensorkv "
                f"({META_FORMAT}); upgrade tensorkv"
            )
        opt = meta.get("optimizer") or {}
        table = cast(Any, cls)(
            meta["dim"], dtype=meta.get("dtype", "float32"), initializer=meta.get("initializer"),
            optimizer=opt.get("config"), admission=meta.get("admission"),
            eviction=meta.get("eviction"), capacity=meta.get("capacity"), seed=meta.get("seed", 0),
            default_value=meta.get("default_value"), nan_policy=meta.get("nan_policy", "raise"),
            growth=meta.get("growth", True),
        )
        if opt.get("state") is not None:
            table.optimizer.load_state(opt["state"])
        table._step = int(meta.get("step", 0))
        table._mseq = int(meta.get("mutation_seq", 0))
        return table


__all__ = ["META_FORMAT", "TableIO", "is_int"]
