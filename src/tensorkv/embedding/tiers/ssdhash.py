"""SSDHASH: an append-only, hash-indexed record store on local disk (the SSD tier).

:class:`SSDHashTier` appends records to segment files, maps keys to them with an in-memory
index, reads rows from memory-mapped segments, compacts the deadest segments and reopens from
an index snapshot plus a replay. Design, durability and crash guarantees: docs/tiers.md
("SSDHASH"); the on-disk pieces are in :mod:`tensorkv.embedding.tiers.ssdhash_files`.

Size: one class; its write, read, compaction and recovery paths share locks and segment state.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
from typing import Any

import numpy as np

from tensorkv import config, pages
from tensorkv.embedding.tiers import ssdhash_files as sf
from tensorkv.embedding.tiers.base import IndexedTier, RecordLayout, RowSink, RowSource, as_keys
from tensorkv.embedding.tiers.ssdhash_files import REC_BITS, REC_MASK, SEG_HEADER, Segment
from tensorkv.errors import (
    ConfigError,
    CorruptRecordError,
    ShapeError,
    StoreError,
    StoreFullError,
    StoreLockedError,
    StorePathError,
)
from tensorkv.kernels import ssdhash as K

DEFAULT_SEGMENT_BYTES = 256 * 1024 * 1024
DEFAULT_BUFFER_BYTES = 4 * 1024 * 1024
DEFAULT_SNAPSHOT_MIN_BYTES = 64 * 1024 * 1024
DEFAULT_COMPACTION_THRESHOLD = 0.5
COMPACTION_CHUNK_ROWS = 16384  # records copied per hold of the state lock
COMPACTION_STEP_FACTOR = 4  # synchronous compaction scans up to this many records per write
DEFAULT_MAX_FREE_SEGMENTS = 4


class SSDHashTier(IndexedTier):
    """Append-only segment files plus an in-memory hash index.

    Parameters
    ----------
    path
        Directory of the tier (created if missing). Reopening it restores the rows.
    layout
        Record layout; must match the layout the directory was created with.
    segment_bytes
        Size at which the head segment is sealed and a new one started (bytes or ``"256MiB"``).
    buffer_bytes
        Write buffer; puts smaller than this are coalesced into one ``write`` call.
    compaction_threshold
        Share of dead records among all stored records that starts a compaction. It frees the
        deadest sealed segments (copying their live records) until the share is below the
        threshold again; segments with no live record are freed whenever there are any. Space
        on disk stays under ``1 / (1 - threshold)`` times the live records (2x at 0.5), and
        compacting the deadest segments first copies few live records per freed byte.
    async_compaction
        Compact on a background thread (default: ``TENSORKV_SSDHASH_ASYNC_COMPACTION``).
    snapshot_min_bytes
        ``flush`` writes a new index snapshot once this many bytes (and at least the
        snapshot's own size) were appended since the last one; ``close`` always does.
    max_free_segments
        Compacted segment files kept (renamed ``free-*.dat``) to become new segments: writing
        over cached pages is cheaper than growing the page cache. Deleted on close.
    repair
        Open a directory whose snapshot is damaged by replaying every segment, and truncate a
        damaged segment instead of refusing to open. Rows deleted before the last compaction
        may come back.
    overwrite
        Delete the tier files already in ``path`` and start empty (refused for a directory
        holding other files).
    """

    kind = "ssdhash"
    persistent = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        layout: RecordLayout,
        *,
        segment_bytes: int | str = DEFAULT_SEGMENT_BYTES,
        buffer_bytes: int | str = DEFAULT_BUFFER_BYTES,
        compaction_threshold: float = DEFAULT_COMPACTION_THRESHOLD,
        async_compaction: bool | None = None,
        snapshot_min_bytes: int | str = DEFAULT_SNAPSHOT_MIN_BYTES,
        max_free_segments: int = DEFAULT_MAX_FREE_SEGMENTS,
        repair: bool = False,
        overwrite: bool = False,
    ) -> None:
        super().__init__(layout)
        self.path = os.path.abspath(os.fspath(path))
        self.words = self.record_bytes // 8 + 1  # stored record in uint64 words
        self.stored_bytes = self.words * 8
        seg_bytes = config.parse_size(segment_bytes, what="segment_bytes")
        self.segment_rows = (seg_bytes - SEG_HEADER) // self.stored_bytes
        if self.segment_rows < 1:
            raise ConfigError(
                f"segment_bytes={segment_bytes!r} holds no {self.stored_bytes}-byte record; "
                f"use at least {SEG_HEADER + self.stored_bytes} bytes (default 256MiB)"
            )
        self.segment_rows = min(self.segment_rows, REC_MASK)
        buf_bytes = config.parse_size(buffer_bytes, what="buffer_bytes")
        self.buffer_rows = max(1, buf_bytes // self.stored_bytes)
        if not 0.0 < float(compaction_threshold) <= 1.0:
            raise ConfigError(
                f"compaction_threshold={compaction_threshold!r} must be in (0, 1], e.g. 0.5"
            )
        self.compaction_threshold = float(compaction_threshold)
        self.async_compaction = (
            config.ssdhash_async_compaction()
            if async_compaction is None
            else bool(async_compaction)
        )
        self.snapshot_min_bytes = config.parse_size(snapshot_min_bytes, what="snapshot_min_bytes")
        self._buf = np.empty((self.buffer_rows, self.words), np.uint64)
        self._buf_n = 0
        self._segs: dict[int, Segment] = {}
        self._counters = dict.fromkeys(
            (
                "reads", "writes", "deletes", "compactions", "compacted_records",
                "snapshots", "replayed_records", "truncated_records", "write_calls", "fsyncs",
                "reused_segments",
            ),
            0,
        )  # fmt: skip
        self._since_snapshot = 0  # bytes appended since the last snapshot
        self._dirty = False
        self._lock_fd: int | None = None
        # Writers (put, delete, flush, compaction, close) hold ``_wlock`` and ``_lock``;
        # readers only ``_lock``. A writer lets go of ``_lock`` during file I/O (``_io``), so
        # reads are not stalled by a write or an fsync: the rows being written are not yet
        # indexed, and rows past ``written`` are served from the unchanged buffer meanwhile.
        self._wlock = threading.RLock()
        self._writers = 0
        self._retired: list[Segment] = []  # compacted, deleted by the next snapshot
        self._retired_bytes = 0
        self._free: list[Segment] = []  # files of retired segments kept for reuse
        self._free_seq = 0
        self._compacting: Segment | None = None  # the segment synchronous compaction is at
        self._compact_pos = 0
        if isinstance(max_free_segments, bool) or not isinstance(max_free_segments, int) or \
                max_free_segments < 0:
            raise ConfigError(
                f"max_free_segments={max_free_segments!r} must be a non-negative int (0: "
                "delete compacted segment files at once)"
            )
        self.max_free_segments = max_free_segments
        self._scratch_buf = np.empty((0, self.words), np.uint64)
        self._open(repair, overwrite)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._compaction_error: BaseException | None = None
        if self.async_compaction:
            self._thread = threading.Thread(
                target=self._compaction_loop, name=f"ssdhash-compaction:{self.path}", daemon=True
            )
            self._thread.start()
            self._wake.set()

    def __repr__(self) -> str:
        return (
            f"<SSDHashTier {self.path!r} rows={len(self.index) if hasattr(self, 'index') else 0}>"
        )

    # ================================================================= open / recovery
    def _open(self, repair: bool, overwrite: bool = False) -> None:
        try:
            sf.make_dirs(self.path)
        except OSError as exc:
            raise StorePathError(f"cannot create SSDHASH directory {self.path!r}: {exc}") from exc
        if not os.path.isdir(self.path):
            raise StorePathError(f"SSDHASH path {self.path!r} is not a directory")
        self._lock_fd = os.open(
            os.path.join(self.path, sf.LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644
        )
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise StoreLockedError(
                f"SSDHASH directory {self.path!r} is open in another tier (this or another "
                "process); close it first"
            ) from None
        try:
            if overwrite:
                sf.wipe(self.path)
            self._load(repair)
        except BaseException:
            self._release_files()
            raise

    def _load(self, repair: bool) -> None:
        meta_path = os.path.join(self.path, sf.META_NAME)
        seg_ids = sf.list_segments(self.path)
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                meta = json.load(f)
            if meta.get("format") != sf.FORMAT_NAME:
                raise StorePathError(f"{self.path!r} holds {meta.get('format')!r}, not SSDHASH")
            if meta.get("version") != sf.FORMAT_VERSION:
                raise StorePathError(
                    f"SSDHASH directory {self.path!r} has format version {meta.get('version')!r}"
                    f"; this tensorkv reads version {sf.FORMAT_VERSION}. A tier is a table's "
                    "spill space: open it with overwrite=True (or delete the directory) and "
                    "restore the table from a checkpoint"
                )
            stored = RecordLayout.from_dict(meta["layout"])
            if stored != self.layout:
                raise ShapeError(
                    f"SSDHASH directory {self.path!r} stores records of {stored}; it was opened "
                    f"with {self.layout}; open it with the same dim, dtype and slots"
                )
        elif seg_ids:
            raise StorePathError(f"{self.path!r} has segments but no {sf.META_NAME}; not a tier")
        else:
            meta = {"format": sf.FORMAT_NAME, "version": sf.FORMAT_VERSION,
                    "layout": self.layout.to_dict(), "stored_bytes": self.stored_bytes}  # fmt: skip
            sf.atomic_write(meta_path, [json.dumps(meta, indent=1).encode()])

        for p in sf.list_free(self.path):  # reusable files left by a crash: start afresh
            os.unlink(p)
        covered_seg, covered_rows, next_id = 0, 0, 1
        snap_path = os.path.join(self.path, sf.SNAP_NAME)
        keys = locs = np.empty(0, np.int64)
        if os.path.exists(snap_path):
            try:
                header, keys, locs = sf.read_snapshot(snap_path)
                covered_seg = int(header["covered_seg"])
                covered_rows = int(header["covered_rows"])
                next_id = int(header["next_seg_id"])
            except (CorruptRecordError, ValueError, KeyError) as exc:
                if not repair:
                    raise CorruptRecordError(
                        f"{snap_path}: {exc}; reopen with repair=True to rebuild the index from "
                        "the segments (rows deleted before the last compaction may return)"
                    ) from exc
                keys = locs = np.empty(0, np.int64)
        self.index = K.HashIndex.from_items(keys, locs)
        for sid in seg_ids:
            p = os.path.join(self.path, sf.seg_name(sid))
            self._segs[sid] = Segment(sid, p)
        missing = np.setdiff1d(np.unique(locs >> REC_BITS), np.asarray(seg_ids, np.int64))
        if missing.size:
            raise CorruptRecordError(
                f"{snap_path} references segment(s) {missing[:8].tolist()} missing from "
                f"{self.path!r}; restore them or reopen with repair=True"
            )
        last = seg_ids[-1] if seg_ids else None
        for sid in seg_ids:
            seg = self._segs[sid]
            size = os.path.getsize(seg.path)
            if size < SEG_HEADER:
                if sid != last and not repair:
                    raise CorruptRecordError(f"{seg.path}: segment shorter than its header")
                with open(seg.path, "wb") as f:
                    f.write(sf.segment_header(sid, self.record_bytes, self.stored_bytes))
                size = SEG_HEADER
            with open(seg.path, "rb") as f:
                sf.check_segment_header(f.read(SEG_HEADER), sid, self.record_bytes, seg.path)
            n = (size - SEG_HEADER) // self.stored_bytes
            seg.rows = seg.written = n
            if sid < covered_seg:
                continue
            start = covered_rows if sid == covered_seg else 0
            arr = seg.mapped(self.words, n)
            good = int(K.first_invalid(arr, min(start, n), n, sid)) if n else 0
            if good < n or size != SEG_HEADER + n * self.stored_bytes:
                if sid != last and not repair:
                    raise CorruptRecordError(
                        f"{seg.path}: record {good} of {n} fails its checksum in a sealed "
                        "segment; reopen with repair=True to truncate it there"
                    )
                tail = arr[good:n, -1]
                self._counters["truncated_records"] += int(np.count_nonzero(tail))
                del tail
                seg.unmap()
                del arr
                os.truncate(seg.path, SEG_HEADER + good * self.stored_bytes)
                seg.rows = seg.written = n = good
                arr = seg.mapped(self.words, n)
            if start < n:
                block = arr[start:n]
                rkeys = np.ascontiguousarray(block[:, 0]).view(np.int64)
                tomb = (block[:, -1] & np.uint64(0xFFFFFFFF)) == K.FLAG_TOMB
                rlocs = (np.int64(sid) << REC_BITS) | np.arange(start, n, dtype=np.int64)
                self.index.apply(rkeys, rlocs, tomb)
                self._counters["replayed_records"] += n - start
                self._since_snapshot += (n - start) * self.stored_bytes
        self._recount_live()
        self._next_id = max([next_id, covered_seg + 1] + [s + 1 for s in seg_ids])
        if last is not None and self._segs[last].rows < self.segment_rows:
            self._activate(self._segs[last])
        else:
            self._new_segment()
        self._dirty = self._since_snapshot > 0

    def _recount_live(self) -> None:
        _, locs = self.index.items()
        ids, counts = np.unique(locs >> REC_BITS, return_counts=True)
        for seg in self._segs.values():
            seg.live = 0
        for sid, c in zip(ids.tolist(), counts.tolist(), strict=True):
            self._segs[sid].live = c

    def _activate(self, seg: Segment) -> None:
        seg.fd = os.open(seg.path, os.O_WRONLY)
        seg.unmap()
        # Preallocate (sparse) so the head is mapped once; the tail past ``written`` holds
        # zeros or records of a reused file's earlier life, which fail the seeded checksum,
        # so a reopen finds the end by validation.
        os.ftruncate(seg.fd, SEG_HEADER + self.segment_rows * self.stored_bytes)
        seg.mapped(self.words, self.segment_rows)  # written rows are mapped as they land
        self._active = seg

    def _new_segment(self) -> None:
        """Start the next head segment (a reused free file where one is kept).

        The file work (header write, fsync, rename, directory fsync) runs with the state lock
        released (``_io``): the new segment is registered only afterwards, and no reader looks
        at it or at the free file before then.
        """
        sid = self._next_id
        self._next_id += 1
        p = os.path.join(self.path, sf.seg_name(sid))
        header = sf.segment_header(sid, self.record_bytes, self.stored_bytes)
        reused = self._free.pop() if self._free else None
        with self._io():
            # A reused compacted segment's file has its pages cached (and mapped), so writing
            # over them costs no new page-cache memory; its new header is durable before the
            # file takes its segment name.
            fd = os.open(reused.path, os.O_WRONLY) if reused is not None else \
                os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                sf.pwrite_all(fd, header, 0)
                if reused is not None:
                    os.fsync(fd)
            finally:
                os.close(fd)
            seg = Segment(sid, p)
            if reused is not None:
                os.rename(reused.path, p)
                seg.mm, seg.arr = reused.mm, reused.arr
            sf.fsync_dir(self.path)
        if reused is not None:
            self._counters["reused_segments"] += 1
        self._segs[sid] = seg
        if seg.arr is not None and seg.arr.shape[0] >= self.segment_rows:
            seg.fd = os.open(seg.path, os.O_WRONLY)  # already full size and mapped
            self._active = seg
        else:
            self._activate(seg)

    # ================================================================= writing
    @contextlib.contextmanager
    def _writing(self) -> Any:
        """Hold the writer lock and the state lock (see ``_io``)."""
        with self._wlock, self._lock:
            self._writers += 1
            try:
                yield
            finally:
                self._writers -= 1

    @contextlib.contextmanager
    def _io(self) -> Any:
        """Release the state lock around a system call, inside one ``_writing`` section."""
        if self._writers != 1:  # opening, closing or nested: keep the lock
            yield
            return
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def _write_buffer(self) -> None:
        if self._buf_n:
            seg = self._active
            with self._io():  # readers still see these rows in the buffer
                self._write_rows(seg, self._buf[: self._buf_n])
            seg.written += self._buf_n
            self._buf_n = 0

    def _write_rows(self, seg: Segment, stored: np.ndarray) -> None:
        """Write sealed records at ``seg.written`` and map their pages (no state lock held).

        Their writeback to disk starts at once (:func:`tensorkv.pages.start_writeback`):
        the fsync that seals a full segment then waits for its last pages only, not for the
        whole segment while the write-back thread stalls and tier 0's pending rows pile up.
        """
        offset = self._offset(seg.written)
        fd = seg.write_fd
        sf.pwrite_all(fd, stored, offset)
        seg.populate(seg.written, seg.written + stored.shape[0], self.words)
        pages.start_writeback(fd, offset, stored.nbytes)
        self._counters["write_calls"] += 1

    def _roll(self) -> None:
        self._write_buffer()
        seg = self._active
        fd = seg.write_fd
        os.ftruncate(fd, self._offset(seg.written))  # drop the preallocated tail
        with self._io():
            os.fsync(fd)
        os.close(fd)
        seg.fd = None  # the mapping stays: the segment is full, its size has not changed
        self._counters["fsyncs"] += 1
        self._new_segment()

    def _offset(self, row: int) -> int:
        return SEG_HEADER + row * self.stored_bytes

    def _append(self, stored: np.ndarray, flags: int, sealed_by: int | None = None) -> np.ndarray:
        """Seal and append records (uint64[m, words]); return their locations.

        The trailer column is written here: each record is sealed with the id of the segment
        it lands in, outside the state lock (writers are serialised by ``_wlock`` and no
        reader looks at unindexed rows). Records already sealed for segment ``sealed_by``
        (compaction copies) are only re-keyed to their new segment.
        """
        m = stored.shape[0]
        locs = np.empty(m, np.int64)
        i = 0
        while i < m:
            seg = self._active
            room = self.segment_rows - seg.rows
            if room == 0:
                self._roll()
                continue
            take = min(room, m - i)
            locs[i : i + take] = (np.int64(seg.seg_id) << REC_BITS) | np.arange(
                seg.rows, seg.rows + take, dtype=np.int64
            )
            chunk = stored[i : i + take]
            with self._io():
                if sealed_by is None:
                    K.seal_inplace(chunk, flags, seg.seg_id)
                else:
                    K.reseed(chunk, sealed_by, seg.seg_id)
            if self._buf_n + take <= self.buffer_rows:
                self._buf[self._buf_n : self._buf_n + take] = chunk
                self._buf_n += take
            else:
                self._write_buffer()
                if take >= self.buffer_rows:
                    with self._io():  # rows not indexed yet: no reader looks at them
                        self._write_rows(seg, chunk)
                    seg.written += take
                else:
                    self._buf[:take] = chunk
                    self._buf_n = take
            seg.rows += take
            i += take
        self._since_snapshot += m * self.stored_bytes
        self._dirty = True
        return locs

    def _scratch(self, n: int) -> np.ndarray:
        """A reusable ``uint64[n, words]`` buffer (writers only, under ``_wlock``)."""
        if self._scratch_buf.shape[0] < n:
            self._scratch_buf = np.empty((max(n, 2 * self._scratch_buf.shape[0]), self.words),
                                         np.uint64)
        return self._scratch_buf[:n]

    def _account(self, old: np.ndarray, new_locs: np.ndarray | None) -> None:
        """Update live counts after the index moved keys from ``old`` to ``new_locs``."""
        for locs, sign in ((old[old >= 0], -1), (new_locs, 1)):
            if locs is None or locs.size == 0:
                continue
            sids = locs >> REC_BITS
            lo = int(sids.min())
            counts = np.bincount(sids - lo)
            for i in np.flatnonzero(counts).tolist():
                self._segs[lo + i].live += sign * int(counts[i])

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Store one record per key; later duplicates in the batch win."""
        keys, records = self._check_put(keys, records)
        if keys.shape[0] == 0:
            return
        with self._wlock:
            stored = self._scratch(keys.shape[0])
            stored[:, :-1] = records.view(np.uint64)
            self._put_stored(keys, stored)

    def put_rows(self, keys: np.ndarray, source: RowSource) -> None:
        """Store tier-0 rows, packed straight into the write path (one copy, no buffer)."""
        keys = as_keys(keys)
        if keys.shape[0] == 0:
            return
        with self._wlock:
            self._check_open()
            stored = self._scratch(keys.shape[0])
            source.pack(stored.view(np.uint8))
            self._put_stored(keys, stored)

    def _put_stored(self, keys: np.ndarray, stored: np.ndarray) -> None:
        n = keys.shape[0]
        with self._writing():
            self._check_open()
            try:
                locs = self._append(stored, K.FLAG_PUT)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise StoreFullError(
                        f"no space left for SSDHASH {self.path!r}: {exc}; free disk space. Rows "
                        "of this put written before the error may reappear after reopening"
                    ) from exc
                raise
            old = self.index.upsert(keys, locs)
            self._account(old, locs)
            self._counters["writes"] += n
            self._after_write(n)

    def delete(self, keys: np.ndarray) -> int:
        """Remove keys (tombstones are appended so deletes survive reopening)."""
        return self._remove(keys, tombstones=True)

    def discard(self, keys: np.ndarray) -> int:
        """Remove keys from the index without appending tombstones; return how many were here.

        Cheaper than :meth:`delete` (no write), for scratch use such as an embedding table's
        spill tier: the records become dead (compaction reclaims them), but a key whose last
        put was appended after the latest index snapshot comes back after a reopen.
        """
        return self._remove(keys, tombstones=False)

    def _remove(self, keys: np.ndarray, *, tombstones: bool) -> int:
        keys = as_keys(keys)
        with self._writing():
            self._check_open()
            if keys.size == 0:
                return 0
            keys = keys[K.last_occurrence(keys)]
            keys = keys[self.index.lookup(keys) >= 0]
            n = keys.size
            if n == 0:
                return 0
            if tombstones:
                stored = self._scratch(n)
                stored[:] = 0
                stored[:, 0] = keys.view(np.uint64)
                self._append(stored, K.FLAG_TOMB)
            old = self.index.remove(keys)
            self._account(old, None)
            self._counters["deletes"] += n
            self._after_write(n)
            return n

    def flush(self) -> None:
        """Write the buffer and fsync the head segment (and maybe snapshot the index)."""
        with self._writing():
            self._check_open()
            self._flush(force_snapshot=False)

    def _flush(self, force_snapshot: bool) -> None:
        self._write_buffer()
        with self._io():
            os.fsync(self._active.write_fd)
        self._counters["fsyncs"] += 1
        limit = max(self.snapshot_min_bytes, 16 * len(self.index))
        if force_snapshot or self._since_snapshot >= limit:
            self._snapshot()

    def _snapshot(self) -> None:
        """Write an index snapshot covering everything written so far (buffer must be empty)."""
        assert self._buf_n == 0
        keys, locs = self.index.items()
        header = {
            "covered_seg": self._active.seg_id,
            "covered_rows": self._active.written,
            "next_seg_id": self._next_id,
            "rows": int(keys.size),
            "layout": self.layout.to_dict(),
        }
        with self._io():  # the copies above are the snapshot; writers are excluded
            sf.write_snapshot(os.path.join(self.path, sf.SNAP_NAME), header, keys, locs)
            # compacted segments are referenced by no durable snapshot any more: keep a few
            # files (and their mapped, cached pages) for new segments, delete the rest
            for seg in self._retired:
                if len(self._free) < self.max_free_segments and seg.mm is not None:
                    self._free_seq += 1
                    free = os.path.join(self.path, sf.free_name(self._free_seq))
                    os.rename(seg.path, free)
                    seg.path = free
                    self._free.append(seg)
                else:
                    seg.unmap()
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(seg.path)
            if self._retired:
                sf.fsync_dir(self.path)
        self._retired, self._retired_bytes = [], 0
        self._since_snapshot = 0
        self._dirty = False
        self._counters["snapshots"] += 1

    # ================================================================= reading
    def _gather(self, locs: np.ndarray, out: np.ndarray, pos: np.ndarray) -> None:
        """Copy records at ``locs`` into ``out[pos]`` (uint64 words), grouped by segment."""
        if locs.size == 0:
            return
        sids = locs >> REC_BITS
        lo = int(sids.min())
        order, starts = K.group_by(sids - lo, int(sids.max()) - lo + 1)
        rows_all = locs & REC_MASK
        for g in np.flatnonzero(np.diff(starts)).tolist():
            sel = order[starts[g] : starts[g + 1]]
            seg = self._segs[lo + g]
            rows = rows_all[sel]
            arr = seg.mapped(self.words, seg.written)
            if seg is self._active and self._buf_n:
                K.gather_tail(arr, seg.written, self._buf, rows, out, pos[sel])
            else:
                K.gather(arr, rows, out, pos[sel])

    takes_on_read = True

    def read_into(self, keys: np.ndarray, alloc: Any, sink: RowSink,
                  take: bool = False) -> np.ndarray:
        """Copy stored records of ``keys`` from the mapped segments straight into tier-0 rows.

        See :meth:`LowerTier.read_into`; no intermediate record buffer is made. ``take``
        also drops the rows from the index like :meth:`discard`, under the same hold of the
        state lock (readers never wait for writers' I/O; compaction, which may run between
        its lock holds, re-checks the index before repointing a key).
        """
        keys = as_keys(keys)
        with self._lock:
            self._check_open()
            # taking: the lookup removes the keys at once (one probe each); they are put
            # back if the copy fails, so the tier keeps its rows
            locs = self.index.take(keys) if take else self.index.lookup(keys)
            found = locs >= 0
            if found.any():
                locs = locs[found]
                try:
                    rows = alloc(found)
                    order = np.argsort(locs)  # read the files front to back
                    self._copy_to_rows(locs[order], rows[order], sink)
                except BaseException:
                    if take:
                        self.index.upsert(keys[found], locs)
                    raise
                if take:
                    self._account(locs, None)
                    self._counters["deletes"] += int(locs.size)
                    if self.async_compaction and self._candidates():
                        self._wake.set()  # synchronous compaction runs on the next write
            self._counters["reads"] += keys.size
        return found

    def _copy_to_rows(self, locs: np.ndarray, rows: np.ndarray, sink: RowSink) -> None:
        """Copy the records at ``locs`` (sorted) into tier-0 ``rows`` through ``sink``.

        One :meth:`RowSink.write_many` call over every segment the records are in.
        """
        sids = locs >> REC_BITS
        rows_all = locs & REC_MASK
        cuts = [0, *(np.flatnonzero(np.diff(sids)) + 1).tolist(), locs.size]
        pieces = []
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            seg = self._segs[int(sids[lo])]
            src, dst = rows_all[lo:hi], rows[lo:hi]
            if seg is self._active and self._buf_n:
                tail = src >= seg.written
                if tail.any():
                    pieces.append((self._buf[: self._buf_n].view(np.uint8),
                                   src[tail] - seg.written, dst[tail]))
                    src, dst = src[~tail], dst[~tail]
            if src.size:
                pieces.append((seg.mapped(self.words, seg.written).view(np.uint8), src, dst))
        sink.write_many(pieces)

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(found, records)``; absent rows are zero."""
        keys = as_keys(keys)
        n = keys.size
        out = np.zeros((n, self.record_bytes // 8), np.uint64)
        with self._lock:
            self._check_open()
            locs = self.index.lookup(keys)
            found = locs >= 0
            pos = np.flatnonzero(found)
            self._gather(locs[pos], out, pos)
            self._counters["reads"] += n
        return found, out.view(np.uint8)


    # ================================================================= compaction
    def _candidates(self) -> list[Segment]:
        """Segments to compact now, deadest first (see ``compaction_threshold``)."""
        active = self._active
        sealed = [s for s in self._segs.values() if s is not active and s.rows > 0]
        out = [s for s in sealed if s.live == 0]
        total = sum(s.rows for s in self._segs.values())
        dead = sum(s.dead for s in self._segs.values())
        for s in out:
            total -= s.rows
            dead -= s.rows
        limit = self.compaction_threshold
        if dead < limit * total:
            return out
        rest = sorted((s for s in sealed if s.live > 0 and s.dead > 0),
                      key=lambda s: s.dead / s.rows, reverse=True)
        for s in rest:
            out.append(s)
            total -= s.dead
            dead -= s.dead
            if dead < limit * total:
                break
        return out

    def _after_write(self, written: int) -> None:
        if self.async_compaction:
            if self._compaction_error is not None:
                err, self._compaction_error = self._compaction_error, None
                raise StoreError(
                    f"background compaction of {self.path!r} failed: {err!r}; the tier's data is "
                    "intact (old segments are kept until their copies are durable); fix the cause "
                    "(e.g. free disk space) and reopen it"
                ) from err
            if self._candidates():
                self._wake.set()
        else:
            self._compact_step(max(COMPACTION_STEP_FACTOR * written, COMPACTION_CHUNK_ROWS))

    def _compact_step(self, budget: int) -> None:
        """Do at most about ``budget`` records' worth of compaction (whole chunks).

        Synchronous compaction runs in steps after each write, so a writer never stalls for
        a whole segment: the segment being compacted keeps its place (the index points at
        either copy of a record, both readable) until its last chunk is copied.
        """
        while budget > 0:
            seg = self._compacting
            if seg is None or self._segs.get(seg.seg_id) is not seg:
                victims = self._candidates()
                if not victims:
                    self._compacting = None
                    return
                seg = self._compacting = victims[0]
                self._compact_pos = 0
            lo = self._compact_pos
            hi = seg.written if seg.live == 0 else min(seg.written, lo + COMPACTION_CHUNK_ROWS)
            if seg.live:
                self._copy_range(seg, lo, hi)
            budget -= max(hi - lo, 1) if seg.live else 1
            self._compact_pos = hi
            if hi >= seg.written or seg.live == 0:
                self._compacting = None
                self._retire([seg])

    def _copy_live(self, seg: Segment) -> None:
        """Append the live records of ``seg`` to the head and point the index at them.

        Works in chunks of ``COMPACTION_CHUNK_ROWS`` records and lets readers in between
        chunks: after each chunk the index points at either copy, and both are readable.
        """
        if self._segs.get(seg.seg_id) is not seg:  # already retired by another compaction
            return
        n = seg.written
        for lo in range(0, n, COMPACTION_CHUNK_ROWS):
            if seg.live == 0:
                break
            self._copy_range(seg, lo, min(n, lo + COMPACTION_CHUNK_ROWS))

    def _copy_range(self, seg: Segment, lo: int, hi: int) -> None:
        """Copy the live records among records ``[lo, hi)`` of ``seg`` to the head."""
        arr = seg.mapped(self.words, seg.written)
        rkeys = np.ascontiguousarray(arr[lo:hi, 0]).view(np.int64)
        here = (np.int64(seg.seg_id) << REC_BITS) | np.arange(lo, hi, dtype=np.int64)
        live = np.flatnonzero(self.index.lookup(rkeys) == here)
        if live.size:
            copies = arr[lo + live]
            # re-keyed for their new segment; lets readers in during the write
            locs = self._append(copies, K.FLAG_PUT, sealed_by=seg.seg_id)
            # a reader may have taken (read_into) some of these keys meanwhile: repoint
            # only keys still at their old place; the other copies are dead on arrival
            moved = self.index.repoint(rkeys[live], here[live], locs)
            self._account(here[live][moved], locs[moved])
            self._counters["compacted_records"] += int(moved.sum())
        with self._io():  # a reader waiting for the lock goes first
            pass

    def _retire(self, victims: list[Segment]) -> None:
        """Drop compacted segments; their files go with the next index snapshot.

        The index no longer points into ``victims`` (their live records were copied), so no
        read touches them. Until a snapshot that does not reference them is durable, a crash
        reopens from the older snapshot, which may, so the files stay until then. A snapshot
        is forced once the retired files pass :meth:`_retired_limit` bytes, which spreads the
        snapshot and fsync cost over several compactions.
        """
        for seg in victims:
            if self._segs.get(seg.seg_id) is not seg:
                continue
            self._segs.pop(seg.seg_id)  # its mapping is kept for reuse (see _snapshot)
            self._retired.append(seg)
            self._retired_bytes += SEG_HEADER + seg.rows * self.stored_bytes
        self._counters["compactions"] += 1
        if self._retired_bytes >= self._retired_limit():
            self._flush(force_snapshot=True)

    def _retired_limit(self) -> int:
        """Bytes of compacted segment files kept until the next snapshot frees them.

        One segment, or four times the snapshot's size (16 bytes a row) when that is more:
        the files are free for reuse soon, while snapshots stay a small share of the I/O.
        """
        return max(self.segment_rows * self.stored_bytes, 64 * len(self.index))

    def _compact(self, victims: list[Segment]) -> None:
        if self._compacting is not None and self._compacting not in victims:
            victims = [self._compacting, *victims]  # finish the one compacted in steps
        self._compacting = None
        for seg in victims:
            self._copy_live(seg)
        self._retire(victims)

    def compact(self) -> int:
        """Compact every candidate segment now; return how many segments were removed."""
        with self._writing():
            self._check_open()
            victims = self._candidates()
            if victims or self._compacting is not None:
                self._compact(victims)
            if self._retired:  # reclaim the space now
                self._flush(force_snapshot=True)
            return len(victims)

    def _compaction_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                with self._writing():
                    if self._closed:
                        return
                    victims = self._candidates()
                done = []
                for seg in victims:  # copy one segment per lock hold; writers interleave
                    with self._writing():
                        if self._closed or self._stop.is_set():
                            return
                        self._copy_live(seg)
                        done.append(seg)
                if done:
                    with self._writing():
                        if self._closed:
                            return
                        self._retire(done)
            except BaseException as exc:  # surfaced on the next write
                self._compaction_error = exc
                return

    # ================================================================= checks & stats
    def check(self) -> list[str]:
        """Verify every live index entry against its record (key, flags, checksum)."""
        problems: list[str] = []
        with self._lock:
            self._check_open()
            keys, locs = self.index.items()
            sids = locs >> REC_BITS
            for sid in np.unique(sids).tolist():
                seg = self._segs.get(sid)
                sel = np.flatnonzero(sids == sid)
                if seg is None:
                    problems.append(f"{sel.size} rows point at missing segment {sid}")
                    continue
                rows = locs[sel] & REC_MASK
                if int(rows.max()) >= seg.rows:
                    problems.append(f"{seg.path}: rows point past the end ({seg.rows} records)")
                    continue
                bad = np.zeros(sel.size, np.uint8)
                in_file = rows < seg.written
                arr = seg.mapped(self.words, seg.written)
                if in_file.any():
                    b = np.zeros(int(in_file.sum()), np.uint8)
                    K.verify_rows(arr, rows[in_file], keys[sel][in_file], b, sid)
                    bad[in_file] = b
                if (~in_file).any():
                    b = np.zeros(int((~in_file).sum()), np.uint8)
                    K.verify_rows(self._buf, rows[~in_file] - seg.written, keys[sel][~in_file], b,
                                  sid)
                    bad[~in_file] = b
                for code, what in (
                    (1, "key mismatch"),
                    (2, "not a put record"),
                    (3, "bad checksum"),
                ):
                    hit = np.flatnonzero(bad == code)
                    if hit.size:
                        ex = keys[sel][hit[:5]].tolist()
                        problems.append(f"{seg.path}: {hit.size} records with {what} (keys {ex})")
                if seg.live != sel.size:
                    problems.append(f"{seg.path}: live count {seg.live} but index has {sel.size}")
                size = os.path.getsize(seg.path)
                rows = self.segment_rows if seg is self._active else seg.written
                if size != self._offset(rows):
                    problems.append(f"{seg.path}: size {size} does not match {seg.written} records")
        return problems

    def stats(self) -> dict[str, Any]:
        """Counters and sizes (rows, bytes on disk, dead records, segments, compactions...)."""
        with self._lock:
            self._check_open()
            segs = list(self._segs.values())
            disk = sum(SEG_HEADER + s.rows * self.stored_bytes for s in segs)
            return {
                "kind": self.kind,
                "path": self.path,
                "rows": len(self.index),
                "bytes": disk,
                "live_bytes": len(self.index) * self.stored_bytes,
                "dead_records": sum(s.dead for s in segs),
                "segments": len(segs),
                "retired_segments": len(self._retired),
                "free_segments": len(self._free),
                "record_bytes": self.record_bytes,
                "index_bytes": self.index.nbytes,
                "buffered_rows": self._buf_n,
                "async_compaction": self.async_compaction,
                **self._counters,
            }

    # ================================================================= lifecycle
    def close(self) -> None:
        """Flush and release the tier; closing twice is harmless."""
        with self._wlock:  # writers first, as everywhere: then the state lock
            super().close()

    def _close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            if self._thread is not threading.current_thread():
                self._lock.release()  # let the compaction thread finish its step
                self._wlock.release()
                try:
                    self._thread.join()
                finally:
                    self._wlock.acquire()
                    self._lock.acquire()
            self._thread = None
        try:
            if self._dirty or self._buf_n or self._retired:
                self._flush(force_snapshot=True)
        finally:
            self._release_files()

    def _release_files(self) -> None:
        for seg in self._segs.values():
            if seg.fd is not None:
                os.close(seg.fd)
                seg.fd = None
            seg.unmap()
        for seg in self._free + self._retired:
            seg.unmap()
        for seg in self._free:  # reusable only while open
            with contextlib.suppress(FileNotFoundError):
                os.unlink(seg.path)
        self._free = []
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
