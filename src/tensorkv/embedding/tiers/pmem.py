"""PMEM tier: a memory-mapped file of fixed-size record slots (a DAX mount in production).

:class:`PMEMTier` indexes slots in memory, reuses freed slots, writes puts copy-on-write and
recovers by write sequence and checksum. File layout and crash rules: docs/tiers.md ("PMEM").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import struct
from typing import Any

import numpy as np

from tensorkv import config
from tensorkv.embedding.tiers.base import IndexedTier, RecordLayout, as_keys, score_word
from tensorkv.embedding.tiers.ssdhash_files import fsync_dir
from tensorkv.errors import (
    CapacityError,
    CorruptRecordError,
    ShapeError,
    StoreLockedError,
    StorePathError,
)
from tensorkv.kernels import ssdhash as K

MAGIC = b"TKVPMEM1"
HEADER_BYTES = 4096
_LOW32 = np.uint64(0xFFFFFFFF)


class PMEMTier(IndexedTier):
    """Fixed record slots in one memory-mapped file, with free-list reuse.

    Parameters
    ----------
    path
        The slot file (e.g. ``/mnt/pmem0/emb.tier`` on a DAX mount, or a ``/dev/shm`` path).
        Reopening it restores the rows.
    layout
        Record layout; must match the one the file was created with.
    capacity
        Initial slots (rows) of a new file; it doubles when full.
    max_bytes
        Largest size the file may grow to (bytes or ``"64GiB"``; None: no limit). A put that
        would need more raises :class:`~tensorkv.errors.CapacityError` and writes nothing.
    overwrite
        Empty an existing tier file first (refused for a file that is not a PMEM tier).
    """

    kind = "pmem"
    persistent = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        layout: RecordLayout,
        *,
        capacity: int = 4096,
        max_bytes: int | str | None = None,
        overwrite: bool = False,
    ) -> None:
        super().__init__(layout)
        self.path = os.path.abspath(os.fspath(path))
        self.words = self.record_bytes // 8 + 2  # record, write seq, trailer
        self.slot_bytes = self.words * 8
        self.max_bytes = (
            None if max_bytes is None else config.parse_size(max_bytes, what="max_bytes")
        )
        self._counters = {"reads": 0, "writes": 0, "deletes": 0, "grows": 0, "dropped_slots": 0}
        parent = os.path.dirname(self.path)
        if not os.path.isdir(parent):
            raise StorePathError(f"PMEM tier directory {parent!r} does not exist; create it first")
        if os.path.isdir(self.path):
            raise StorePathError(f"PMEM tier path {self.path!r} is a directory; give a file path")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise StoreLockedError(
                f"PMEM tier file {self.path!r} is open elsewhere; close it first"
            ) from None
        try:
            if overwrite and os.pread(self._fd, 8, 0) not in (b"", MAGIC):
                raise StorePathError(f"{self.path!r} is not a tensorkv PMEM tier file; "
                                     "overwrite only empties a tier file: give a new path")
            if overwrite:
                os.ftruncate(self._fd, 0)
            self._load(max(int(capacity), 16))
        except BaseException:
            os.close(self._fd)
            raise

    def __repr__(self) -> str:
        return f"<PMEMTier {self.path!r}>"

    # ----------------------------------------------------------------- file
    def _header(self) -> bytes:
        meta = json.dumps({"format": "tensorkv-pmem", "version": 1, "layout": self.layout.to_dict(),
                           "slot_bytes": self.slot_bytes}).encode()  # fmt: skip
        h = MAGIC + struct.pack("<Q", len(meta)) + meta
        return h + b"\0" * (HEADER_BYTES - len(h))

    # the mapping and its uint64 view; None while remapping and once closed
    _mm: Any
    _arr: Any

    def _map(self, capacity: int) -> None:
        self._mm = mmap.mmap(self._fd, HEADER_BYTES + capacity * self.slot_bytes)
        self._arr = np.frombuffer(self._mm, np.uint64, count=capacity * self.words,
                                  offset=HEADER_BYTES).reshape(capacity, self.words)  # fmt: skip
        self.capacity = capacity

    def _load(self, capacity: int) -> None:
        size = os.fstat(self._fd).st_size
        if size == 0:
            self._check_size(capacity)
            os.pwrite(self._fd, self._header(), 0)
            os.ftruncate(self._fd, HEADER_BYTES + capacity * self.slot_bytes)
            os.fsync(self._fd)
            fsync_dir(os.path.dirname(self.path))  # the new file's entry
            self._map(capacity)
            self.index = K.HashIndex(capacity)
            self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)
            self._nfree = capacity
            self._seq = 1
            return
        head = os.pread(self._fd, HEADER_BYTES, 0)
        if head[:8] != MAGIC:
            raise StorePathError(f"{self.path!r} is not a tensorkv PMEM tier file (bad magic)")
        (hlen,) = struct.unpack("<Q", head[8:16])
        meta = json.loads(head[16 : 16 + hlen])
        stored = RecordLayout.from_dict(meta["layout"])
        if stored != self.layout:
            raise ShapeError(
                f"PMEM tier {self.path!r} stores records of {stored}; it was opened with "
                f"{self.layout}; open it with the same dim, dtype and slots"
            )
        cap = (size - HEADER_BYTES) // self.slot_bytes
        if cap < 1:
            raise CorruptRecordError(f"{self.path!r} is shorter than one slot")
        self._map(cap)
        arr = self._arr
        trailer = arr[:, -1]
        used = np.flatnonzero((trailer & _LOW32) == K.FLAG_PUT)
        keys = np.ascontiguousarray(arr[used, 0]).view(np.int64)
        bad = np.zeros(used.size, np.uint8)
        K.verify_rows(arr, used, keys, bad, 0)
        ok = bad == 0
        seqs = arr[used, -2].view(np.int64)
        order = np.lexsort((seqs, keys))
        order = order[ok[order]]
        k_sorted = keys[order]
        last = np.ones(order.size, bool)
        last[:-1] = k_sorted[1:] != k_sorted[:-1]
        win = order[last]
        drop = np.setdiff1d(np.arange(used.size), win)
        if drop.size:
            arr[used[drop], -1] = 0
            self._counters["dropped_slots"] += int(drop.size)
        self.index = K.HashIndex.from_items(keys[win], used[win])
        free_mask = np.ones(cap, bool)
        free_mask[used[win]] = False
        self._free = np.empty(cap, np.int64)
        fr = np.flatnonzero(free_mask)[::-1]
        self._nfree = fr.size
        self._free[: fr.size] = fr
        self._seq = int(seqs.max()) + 1 if seqs.size else 1

    def _check_size(self, capacity: int) -> None:
        need = HEADER_BYTES + capacity * self.slot_bytes
        if self.max_bytes is not None and need > self.max_bytes:
            raise CapacityError(
                f"PMEM tier {self.path!r} needs {need} bytes for {capacity} slots but max_bytes="
                f"{self.max_bytes}; raise max_bytes or evict rows"
            )

    def _grow(self, need: int) -> None:
        old = self.capacity
        cap = max(2 * old, old + need - self._nfree)
        self._check_size(cap)
        self._mm.flush()
        os.ftruncate(self._fd, HEADER_BYTES + cap * self.slot_bytes)
        self._arr = None
        self._mm = None
        self._map(cap)
        free = np.empty(cap, np.int64)
        free[: self._nfree] = self._free[: self._nfree]
        new = np.arange(cap - 1, old - 1, -1, dtype=np.int64)
        free[self._nfree : self._nfree + new.size] = new
        self._free = free
        self._nfree += new.size
        self._counters["grows"] += 1

    # ----------------------------------------------------------------- writes
    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Store one record per key (copy-on-write into free slots); later duplicates win."""
        keys, records = self._check_put(keys, records)
        if keys.size == 0:
            return
        with self._lock:
            self._check_open()
            keep = K.last_occurrence(keys)
            if not keep.all():
                keys, records = keys[keep], records[keep]
            m = keys.size
            if m > self._nfree:
                self._grow(m)
            w = self.record_bytes // 8
            tmp = np.empty((m, w + 1), np.uint64)
            tmp[:, :w] = records.view(np.uint64)
            tmp[:, w] = np.arange(self._seq, self._seq + m, dtype=np.int64).view(np.uint64)
            stored = np.empty((m, self.words), np.uint64)
            K.seal(tmp, K.FLAG_PUT, stored, 0)
            slots = self._free[self._nfree - m : self._nfree][::-1].copy()
            self._nfree -= m
            K.scatter(self._arr, slots, stored)
            self._seq += m
            old = self.index.upsert(keys, slots)
            self._release(old[old >= 0])
            self._counters["writes"] += m

    def _release(self, slots: np.ndarray) -> None:
        if slots.size:
            self._arr[slots, -1] = 0
            self._free[self._nfree : self._nfree + slots.size] = slots
            self._nfree += slots.size

    def delete(self, keys: np.ndarray) -> int:
        """Free the keys' slots; return how many were present."""
        keys = as_keys(keys)
        with self._lock:
            self._check_open()
            if keys.size == 0:
                return 0
            old = self.index.remove(keys)
            gone = old[old >= 0]
            self._release(gone)
            self._counters["deletes"] += int(gone.size)
            return int(gone.size)

    def flush(self) -> None:
        """Msync the mapping."""
        with self._lock:
            self._check_open()
            self._mm.flush()

    # ----------------------------------------------------------------- reads
    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(found, records)``; absent rows are zero."""
        keys = as_keys(keys)
        out = np.zeros((keys.size, self.record_bytes // 8), np.uint64)
        with self._lock:
            self._check_open()
            slots = self.index.lookup(keys)
            found = slots >= 0
            pos = np.flatnonzero(found)
            K.gather(self._arr, slots[pos], out, pos)
            self._counters["reads"] += keys.size
        return found, out.view(np.uint8)

    def scores(self, field: str) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, values)`` of one header field, read from the mapping without whole records."""
        word = score_word(field)
        with self._lock:
            self._check_open()
            keys, slots = self.index.items()
            return keys, self._arr[slots, word].view(np.int64)

    # ----------------------------------------------------------------- checks
    def check(self) -> list[str]:
        """Verify every indexed slot (key, flags, checksum) and the used-slot count."""
        problems: list[str] = []
        with self._lock:
            self._check_open()
            keys, slots = self.index.items()
            bad = np.zeros(keys.size, np.uint8)
            K.verify_rows(self._arr, slots, keys, bad, 0)
            for code, what in ((1, "key mismatch"), (2, "slot marked free"), (3, "bad checksum")):
                hit = np.flatnonzero(bad == code)
                if hit.size:
                    problems.append(
                        f"{self.path}: {hit.size} slots with {what} (keys {keys[hit[:5]].tolist()})"
                    )
            used = int(((self._arr[:, -1] & _LOW32) == K.FLAG_PUT).sum())
            if used != keys.size:
                problems.append(
                    f"{self.path}: {used} slots marked used but {keys.size} rows indexed"
                )
            if self._nfree != self.capacity - keys.size:
                problems.append(
                    f"free list holds {self._nfree}, expected {self.capacity - keys.size}"
                )
        return problems

    def stats(self) -> dict[str, Any]:
        """Counters and sizes."""
        with self._lock:
            self._check_open()
            return {
                "kind": self.kind,
                "path": self.path,
                "rows": len(self.index),
                "bytes": HEADER_BYTES + self.capacity * self.slot_bytes,
                "capacity": self.capacity,
                "free_slots": self._nfree,
                "record_bytes": self.record_bytes,
                "compactions": 0,
                **self._counters,
            }

    def _close(self) -> None:
        try:
            self._mm.flush()
        finally:
            mm, self._mm, self._arr = self._mm, None, None
            with contextlib.suppress(BufferError):  # arrays may still view it; GC closes it
                mm.close()
            fcntl.flock(self._fd, fcntl.LOCK_UN)  # the mapping holds a dup of the descriptor
            os.close(self._fd)
