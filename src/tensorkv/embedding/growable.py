"""Per-row arrays that grow in place inside a reserved, huge-page address range.

A table's row arrays grow by a few percent at a time while new ids stream in. ``ndarray.resize``
reallocates and zero-fills the new part of the buffer on the inserting thread, in 4 KiB pages
that the kernel faults in one by one (about 2 GB/s on a small VM). :func:`resized` instead
keeps an array of more than :data:`MIN_BYTES` in an anonymous mapping reserved well beyond its
size (``MAP_NORESERVE``: address space only, no memory committed) and advised for
transparent huge pages: growing is a new view of the same memory, with no copy and no fill;
the rows are faulted in 2 MiB at a time when first written (about 11 GB/s on the same VM).
Only when an array outgrows its reservation is it copied, into one :data:`RESERVE_FACTOR`
times larger.

Outside Linux, and for small arrays, it falls back to ``ndarray.resize``.
"""

from __future__ import annotations

import math
import mmap
import sys

import numpy as np

#: Arrays smaller than this (bytes) grow with ``ndarray.resize``.
MIN_BYTES = 4 << 20
#: A new reservation holds this many times the bytes asked for (address space only).
RESERVE_FACTOR = 32
_HUGE = 2 << 20
_MAP_NORESERVE = 0x4000  # Linux's value; the mmap module does not export it before 3.13
_PAGE = mmap.PAGESIZE


def _mapping(arr: np.ndarray) -> mmap.mmap | None:
    """The reservation ``arr`` views, if any."""
    base = arr.base
    while base is not None:
        if isinstance(base, memoryview):
            base = base.obj
        if isinstance(base, mmap.mmap):
            return base
        base = getattr(base, "base", None)
    return None


def _reserve(nbytes: int) -> mmap.mmap:
    size = -(-max(nbytes * RESERVE_FACTOR, MIN_BYTES) // _HUGE) * _HUGE
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return m


def resized(arr: np.ndarray, rows: int) -> np.ndarray:
    """``arr`` with ``rows`` entries along axis 0: contents kept, new rows zero.

    May return ``arr`` itself (resized in place) or a new array: callers keep the result and
    drop references to the old array, whose memory may no longer hold the rows' current
    values after a move to a larger reservation.
    """
    rows = int(rows)
    per_row = math.prod(arr.shape[1:])
    shape = (rows, *arr.shape[1:])
    need = rows * per_row * arr.itemsize
    m = _mapping(arr)
    if m is None and (need < MIN_BYTES or not sys.platform.startswith("linux")):
        arr.resize(shape, refcheck=False)
        return arr
    old = arr.shape[0]
    if m is not None and need <= len(m):
        if rows < old:  # zero what is given up: a later growth must find zero rows
            arr[rows:old] = 0
            lo = -(-need // _PAGE) * _PAGE
            hi = old * per_row * arr.itemsize // _PAGE * _PAGE
            if hi > lo:
                m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        return np.frombuffer(m, arr.dtype, count=rows * per_row).reshape(shape)
    m = _reserve(need)
    out = np.frombuffer(m, arr.dtype, count=rows * per_row).reshape(shape)
    keep = min(old, rows)
    out[:keep] = arr[:keep]
    return out


__all__ = ["MIN_BYTES", "RESERVE_FACTOR", "resized"]
