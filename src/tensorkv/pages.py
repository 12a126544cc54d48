"""Page hints: ``madvise``, early writeback of written files, a page policy for bulk fills.

:func:`start_writeback` starts writing a file's dirty pages at once. :class:`FreshPages` puts
large arrays filled once in bulk (a restore's new arenas) on base pages, populates each range
just before it is written, and asks for huge pages again on release.
:func:`retain_freed_memory` lets glibc reuse freed write buffers instead of mapping fresh
pages for every large write. All of it is a hint. Why, with measurements: docs/internals.md
("Bulk loads and page hints").
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from tensorkv import config

MADV_NORMAL, MADV_RANDOM, MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_POPULATE_WRITE = 0, 1, 14, 15, 23
SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait
_LIBC: dict[str, Any] = {}  # libc function name -> ctypes function or None, on first use
# the argument types (ctypes names) of the libc functions used here; all return int
_SIGNATURES = {
    "madvise": ("c_void_p", "c_size_t", "c_int"),
    "sync_file_range": ("c_int", "c_int64", "c_int64", "c_uint"),
    "mallopt": ("c_int", "c_int"),
}
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h> mallopt parameters
#: environment variables through which a user tunes glibc's malloc himself (then: hands off)
_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
_RETAIN: list[bool] = []  # [whether the thresholds were set], once decided
_RETAIN_LOCK = threading.Lock()
_NO_POPULATE: list[bool] = []  # [True] once the kernel refused MADV_POPULATE_WRITE


def _libc(name: str) -> Any:
    """The libc function ``name`` (one of ``_SIGNATURES``) via ctypes, or None off Linux."""
    if name not in _LIBC:
        fn = None
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                fn = getattr(ctypes.CDLL(None, use_errno=True), name)
                fn.argtypes = [getattr(ctypes, t) for t in _SIGNATURES[name]]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):  # pragma: no cover - every Linux libc has them
                fn = None
        _LIBC[name] = fn
    return _LIBC[name]


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> bool:
    """Ask the kernel to start writing back the dirty pages of ``fd`` in a byte range.

    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``: the pages are queued for the disk and the
    call returns without waiting for them (``nbytes=0``: to the end of the file). A later
    ``fsync`` then finds most of them written and waits only for the rest, instead of
    writing everything while the caller waits. Only a hint, no durability promise: returns
    False where the call is missing (not Linux) or refused (errors are ignored).
    """
    fn = _libc("sync_file_range")
    return fn is not None and fn(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE) == 0


def madvise_ranges(ranges: Iterable[tuple[int, int]], advice: int) -> bool:
    """``madvise`` the whole pages inside each address range ``(start, stop)``.

    Returns False if the call is unavailable (not Linux) or refused for any range. Only a
    hint: nothing depends on it but speed.
    """
    fn = _libc("madvise")
    if fn is None:
        return False
    page = mmap.PAGESIZE
    ok = True
    for start, stop in ranges:
        lo = (start + page - 1) // page * page
        hi = stop // page * page
        if hi > lo and fn(lo, hi - lo, advice) != 0:
            ok = False
    return ok


def madvise(arrays: Iterable[np.ndarray], advice: int) -> bool:
    """``madvise`` the whole pages of each array (see :func:`madvise_ranges`)."""
    return madvise_ranges(((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays), advice)


def file_mappings(path: str) -> list[tuple[int, int]]:
    """Address ranges where this process maps the file ``path`` (from ``/proc/self/maps``).

    Empty where ``/proc`` is missing or the file is not mapped.
    """
    import os

    real = os.path.realpath(path)
    out = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].rstrip("\n") == real:
                    lo, hi = parts[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return out


def populate(arrays: Iterable[np.ndarray]) -> None:
    """Map the pages of arrays about to be written, in one call per array.

    A no-op once the kernel has refused ``MADV_POPULATE_WRITE`` (before Linux 5.14).
    """
    if not _NO_POPULATE and not madvise(arrays, MADV_POPULATE_WRITE):
        _NO_POPULATE.append(True)


class FreshPages:
    """New arrays filled for the first time, on base pages (see the module docstring).

    Thread-safe: :meth:`prepare` may run on several threads at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrays: list[np.ndarray] = []

    def track(self, *arrays: np.ndarray) -> None:
        """Ask for base pages for these new arrays (before anything touches them)."""
        madvise(arrays, MADV_NOHUGEPAGE)
        with self._lock:
            self._arrays.extend(arrays)

    def prepare(self, *views: np.ndarray) -> None:
        """Map the pages of ``views`` (of tracked arrays) just before they are written."""
        populate(views)

    def release(self) -> None:
        """Stop tracking the arrays and ask for huge pages again for them."""
        with self._lock:
            arrays, self._arrays = self._arrays, []
        madvise(arrays, MADV_HUGEPAGE)


def retain_freed_memory() -> bool:
    """Let glibc keep freed blocks of up to 32 MiB for reuse; decided once per process.

    LMDB builds each write transaction in blocks from ``malloc`` (a value larger than half a
    page takes a block of its own) and frees them at commit. With glibc's default thresholds a
    commit of more than a few hundred KiB hands that memory back to the kernel at once
    (``munmap``, or trimming the heap top), and the next transaction faults in and zeroes
    fresh pages for all of it again: the write runs at a third of the speed of a plain file
    write (docs/benchmarks.md). This sets ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` to
    :data:`~tensorkv.config.MALLOC_MMAP_THRESHOLD` and
    :data:`~tensorkv.config.MALLOC_TRIM_THRESHOLD`, the values glibc's own adaptive thresholds
    reach once a process frees one 32 MiB block, so that the memory is reused.

    A no-op (returns False) off glibc, with ``TENSORKV_MALLOC_RETAIN=0``, or when the user
    tunes malloc himself (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TOP_PAD_`` or a ``glibc.malloc`` entry in ``GLIBC_TUNABLES``).
    """
    if _RETAIN:
        return _RETAIN[0]
    with _RETAIN_LOCK:
        if not _RETAIN:
            _RETAIN.append(_set_malloc_thresholds())
    return _RETAIN[0]


def freed_memory_decided() -> bool:
    """Whether :func:`retain_freed_memory` has run in this process (a cheap check)."""
    return bool(_RETAIN)


def _set_malloc_thresholds() -> bool:
    if not config.malloc_retain() or any(os.environ.get(v) for v in _MALLOC_ENV):
        return False
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not a GNU system
        libc = ""
    fn = _libc("mallopt") if libc.startswith("glibc") else None
    if fn is None:
        return False
    return bool(fn(M_MMAP_THRESHOLD, config.MALLOC_MMAP_THRESHOLD) == 1
                and fn(M_TRIM_THRESHOLD, config.MALLOC_TRIM_THRESHOLD) == 1)


def fsync_path(path: str) -> None:
    """Fsync a file or a directory by path (a directory: its new entries and renames)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
