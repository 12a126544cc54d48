"""On-disk pieces of the SSDHASH tier: segment files, the index snapshot and the tier metadata.

:class:`Segment` is one segment file (header, mapping, record counts);
:func:`write_snapshot` / :func:`read_snapshot` write and verify the index snapshot;
:func:`atomic_write`, :func:`fsync_dir` and :func:`make_dirs` are the durable file steps.
Directory layout, segment header, record trailer and snapshot format: docs/tiers.md
("SSDHASH").
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from tensorkv import pages
from tensorkv.errors import CorruptRecordError, StoreError, StorePathError

SEG_MAGIC = b"TKVSEG01"
SNAP_MAGIC = b"TKVSNAP1"
SEG_HEADER = 64
REC_BITS = 40  # a location packs (segment id << REC_BITS) | record index
REC_MASK = (1 << REC_BITS) - 1
META_NAME = "TIER.json"
SNAP_NAME = "index.snap"
LOCK_NAME = "LOCK"
FORMAT_NAME = "tensorkv-ssdhash"
FORMAT_VERSION = 2  # 2: checksums seeded with the segment id, free segment files reused
MADV_POPULATE_READ = 22  # Linux >= 5.14: map a range's page-cache pages without faulting


def seg_name(seg_id: int) -> str:
    """File name of segment ``seg_id``."""
    return f"seg-{seg_id:08d}.dat"


def free_name(n: int) -> str:
    """File name of free (reusable) segment file ``n``."""
    return f"free-{n:08d}.dat"


def list_free(path: str) -> list[str]:
    """Paths of the free segment files in ``path``."""
    return sorted(os.path.join(path, n) for n in os.listdir(path)
                  if n.startswith("free-") and n.endswith(".dat"))


def list_segments(path: str) -> list[int]:
    """Ids of the segment files in ``path``, ascending."""
    out = []
    for name in os.listdir(path):
        if name.startswith("seg-") and name.endswith(".dat"):
            try:
                out.append(int(name[4:-4]))
            except ValueError:
                continue
    return sorted(out)


def fsync_dir(path: str) -> None:
    """Fsync a directory so renames and new files in it are durable."""
    pages.fsync_path(path)


def make_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, then fsync the parent of each directory it made.

    A new directory's entry is durable only once its parent is fsynced; without that, a
    power loss can take a tier's directory, and every row flushed into it, away.
    """
    path = os.path.abspath(path)
    missing = []
    p = path
    while not os.path.isdir(p) and os.path.dirname(p) != p:
        missing.append(p)
        p = os.path.dirname(p)
    os.makedirs(path, exist_ok=True)
    for d in reversed(missing):
        fsync_dir(os.path.dirname(d))


def write_all(fd: int, data: memoryview | bytes) -> None:
    """``os.write`` until every byte is written."""
    mv = memoryview(data).cast("B")
    while mv.nbytes:
        n = os.write(fd, mv)
        mv = mv[n:]


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """``os.pwrite`` at ``offset`` until every byte is written."""
    mv = memoryview(data).cast("B")
    while mv.nbytes:
        n = os.pwrite(fd, mv, offset)
        mv = mv[n:]
        offset += n


def wipe(path: str) -> None:
    """Delete the tier files in directory ``path`` (the caller holds its ``LOCK``).

    Raises
    ------
    StorePathError
        When ``path`` holds other files too: only a tier directory is wiped.
    """
    names = os.listdir(path)
    ours = {META_NAME, SNAP_NAME, LOCK_NAME, META_NAME + ".tmp", SNAP_NAME + ".tmp"}
    other = sorted(n for n in names if n not in ours and not (
        n.startswith(("seg-", "free-")) and n.endswith(".dat")))
    if other:
        raise StorePathError(
            f"{path!r} holds files that are not SSDHASH tier files ({other[:5]}); overwrite "
            "only wipes a tier directory: give an empty or new directory"
        )
    for n in names:
        if n != LOCK_NAME:
            os.unlink(os.path.join(path, n))
    fsync_dir(path)


def atomic_write(path: str, chunks: list[Any]) -> None:
    """Write ``chunks`` to ``path`` via a temporary file, fsync, rename and directory fsync."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for c in chunks:
            write_all(fd, c)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def segment_header(seg_id: int, record_bytes: int, stored_bytes: int) -> bytes:
    """The 64-byte header of a segment file."""
    h = SEG_MAGIC + struct.pack("<QQQ", seg_id, record_bytes, stored_bytes)
    return h + b"\0" * (SEG_HEADER - len(h))


def check_segment_header(raw: bytes, seg_id: int, record_bytes: int, path: str) -> None:
    """Raise CorruptRecordError unless ``raw`` is the right header for this segment."""
    if len(raw) < SEG_HEADER or raw[:8] != SEG_MAGIC:
        raise CorruptRecordError(f"{path}: not a tensorkv SSDHASH segment (bad magic)")
    sid, rb, _ = struct.unpack("<QQQ", raw[8:32])
    if sid != seg_id or rb != record_bytes:
        raise CorruptRecordError(
            f"{path}: header says segment {sid} with {rb}-byte records; expected segment "
            f"{seg_id} with {record_bytes}-byte records"
        )


_populate_ok = True


@dataclass
class Segment:
    """One segment file: ``rows`` records assigned, of which ``written`` are in the file."""

    seg_id: int
    path: str
    rows: int = 0
    written: int = 0
    live: int = 0
    fd: int | None = None  # write descriptor (active segment only)
    arr: np.ndarray | None = None  # uint64[mapped_rows, words] view of an mmap
    mm: mmap.mmap | None = None

    @property
    def write_fd(self) -> int:
        """The write descriptor of the active segment (a sealed segment has none)."""
        if self.fd is None:
            raise StoreError(f"segment {self.seg_id} is sealed; only the active segment is "
                             "written")
        return self.fd

    def mapped(self, words: int, need: int) -> np.ndarray:
        """A uint64 view of the first ``need`` rows (the whole file is mapped, once).

        The head segment is preallocated to its full size, so it is mapped once and later
        appends show through the shared mapping; a sealed segment is mapped at its final size.
        """
        if self.arr is None or self.arr.shape[0] < need:
            size = os.path.getsize(self.path)
            n = (size - SEG_HEADER) // (words * 8)
            if n <= 0:
                return np.empty((0, words), np.uint64)
            with open(self.path, "rb") as f:
                mm = mmap.mmap(f.fileno(), SEG_HEADER + n * words * 8, access=mmap.ACCESS_READ)
            self.mm = mm
            self.arr = np.frombuffer(mm, np.uint64, count=n * words, offset=SEG_HEADER).reshape(
                n, words
            )
        return self.arr[:need]

    def populate(self, start: int, stop: int, words: int) -> None:
        """Map the page-cache pages of records ``[start, stop)`` into the process now.

        Called after they are written: later reads of them do not fault, and mapped pages
        count as in use to the kernel (a proactive reclaimer that pages out unmapped file
        pages leaves them alone). A no-op where ``MADV_POPULATE_READ`` is missing.
        """
        global _populate_ok
        if self.mm is None or not _populate_ok or stop <= start:
            return
        lo = SEG_HEADER + start * words * 8
        hi = min(SEG_HEADER + stop * words * 8, len(self.mm))
        lo -= lo % mmap.PAGESIZE
        if hi <= lo:
            return
        try:
            self.mm.madvise(MADV_POPULATE_READ, lo, hi - lo)
        except (OSError, ValueError):
            _populate_ok = False  # an older kernel: reads fault the pages in instead

    def unmap(self) -> None:
        """Drop the mapping (it closes when no array refers to it)."""
        self.arr = None
        self.mm = None

    @property
    def dead(self) -> int:
        """Records that are no longer the live copy of their key (including tombstones)."""
        return self.rows - self.live


def write_snapshot(path: str, header: dict[str, Any], keys: np.ndarray, locs: np.ndarray) -> int:
    """Atomically write an index snapshot; return its size in bytes."""
    hj = json.dumps(header, sort_keys=True).encode()
    hj += b" " * (-len(hj) % 8)
    head = SNAP_MAGIC + struct.pack("<Q", len(hj)) + hj
    k = np.ascontiguousarray(keys, np.int64)
    v = np.ascontiguousarray(locs, np.int64)
    h = xxhash.xxh3_64()
    for c in (memoryview(head), k.data, v.data):
        h.update(c.cast("B"))
    atomic_write(path, [head, k, v, h.digest()])
    return len(head) + k.nbytes + v.nbytes + 8


def read_snapshot(path: str) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """Read and verify a snapshot; CorruptRecordError when it is damaged."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 24 or raw[:8] != SNAP_MAGIC:
        raise CorruptRecordError(f"{path}: not a tensorkv SSDHASH index snapshot")
    if xxhash.xxh3_64_digest(memoryview(raw)[:-8]) != raw[-8:]:
        raise CorruptRecordError(f"{path}: index snapshot fails its checksum")
    (hlen,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16 : 16 + hlen])
    n = int(header["rows"])
    off = 16 + hlen
    if len(raw) != off + 16 * n + 8:
        raise CorruptRecordError(f"{path}: index snapshot has the wrong length for {n} rows")
    keys = np.frombuffer(raw, np.int64, count=n, offset=off).copy()
    locs = np.frombuffer(raw, np.int64, count=n, offset=off + 8 * n).copy()
    return header, keys, locs
