"""Per-row arrays that grow in place inside a reserved, huge-page address range.

A table's row arrays grow by a few percent at a time while new ids stream in. ``ndarray.resize``
reallocates and zero-fills the new part of the buffer on the inserting thread, in 4 KiB pages
that the kernel faults in one by one (about 2 GB/s on a small VM). :func:`resized` instead
keeps an array of more than :data:`MIN_BYTES` in an anonymous mapping reserved well beyond its
size (``MAP_NORESERVE``: address space only, no memory committed) and advised for
transparent huge pages: growing is a new view of the same memory, with no copy and no fill.
Only when an array outgrows its reservation is it copied, into one :data:`RESERVE_FACTOR`
times larger.

The rows a growing array will use next are faulted in ahead by one background thread
(``madvise(MADV_POPULATE_WRITE)``, which allocates pages without changing their contents, so
it never races with the rows being written): the inserting thread then writes into memory
that is already there. ``TENSORKV_PREFAULT=0`` turns this off.

Outside Linux, and for small arrays, it falls back to ``ndarray.resize``. :func:`resized_all`
resizes several arrays all or nothing: every allocation happens before any array changes.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import queue
import sys
import threading
from collections.abc import Callable, Sequence

import numpy as np

from tensorkv import config

#: Arrays smaller than this (bytes) grow with ``ndarray.resize``.
MIN_BYTES = 4 << 20
#: A new reservation holds this many times the bytes asked for (address space only).
RESERVE_FACTOR = 32
_HUGE = 2 << 20
_MAP_NORESERVE = 0x4000  # Linux's value; the mmap module does not export it before 3.13
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_PAGE = mmap.PAGESIZE
_CHUNK = 32 << 20  # bytes faulted in per madvise call (a newer request can then go first)


class _Reservation(mmap.mmap):
    """An anonymous mapping that remembers how far its memory has been faulted in."""

    populated = 0


def _mapping(arr: np.ndarray) -> _Reservation | None:
    """The reservation ``arr`` views, if any."""
    base = arr.base
    while base is not None:
        if isinstance(base, memoryview):
            base = base.obj
        if isinstance(base, _Reservation):
            return base
        base = getattr(base, "base", None)
    return None


def _reserve(nbytes: int) -> _Reservation:
    size = -(-max(nbytes * RESERVE_FACTOR, MIN_BYTES) // _HUGE) * _HUGE
    m = _Reservation(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return m


class _Prefaulter:
    """One daemon thread that faults in the next rows of growing arrays."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[_Reservation, int]] = queue.SimpleQueue()
        libc = ctypes.CDLL(None, use_errno=True)  # ctypes calls release the GIL
        self.madvise = libc.madvise
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.working = True
        threading.Thread(target=self._run, name="tensorkv-prefault", daemon=True).start()

    def _run(self) -> None:
        while True:
            m, stop = self.jobs.get()
            if m.closed:
                continue
            base = _address(m)
            while self.working and m.populated < stop and not m.closed:
                lo = m.populated
                hi = min(stop, lo + _CHUNK)
                if self.madvise(base + lo, hi - lo, _MADV_POPULATE_WRITE) != 0:
                    self.working = False  # kernel without MADV_POPULATE_WRITE: stop trying
                    break
                m.populated = hi
            del m


def _address(m: _Reservation) -> int:
    """Start address of a mapping."""
    return int(np.frombuffer(m, np.uint8, count=1).ctypes.data)


_prefaulter: _Prefaulter | None = None
_prefault_lock = threading.Lock()
_enabled: bool | None = None


def prefault_enabled() -> bool:
    """Whether growing arrays are faulted in ahead (``TENSORKV_PREFAULT``, read once).

    Arenas call it when they are created, so a malformed value raises ``ConfigError`` there
    and never in the middle of a growth.
    """
    global _enabled
    if _enabled is None:
        _enabled = config.env_bool(config.ENV_PREFAULT, True)
    return _enabled


def _prefault(m: _Reservation, used: int, step: int) -> None:
    """Ask the background thread to fault in ``m`` up to ``config.PREFAULT_AHEAD`` steps ahead."""
    global _prefaulter
    stop = min(len(m), -(-(used + config.PREFAULT_AHEAD * max(step, _PAGE)) // _PAGE) * _PAGE)
    if stop <= m.populated or not prefault_enabled():
        return
    with _prefault_lock:
        if _prefaulter is None:
            _prefaulter = _Prefaulter()
    if _prefaulter.working:
        _prefaulter.jobs.put((m, stop))


def _small(arr: np.ndarray, rows: int) -> bool:
    """Whether ``arr`` at ``rows`` rows stays out of reservations (small, or not Linux)."""
    need = int(rows) * math.prod(arr.shape[1:]) * arr.itemsize
    return need < MIN_BYTES or not sys.platform.startswith("linux")


def _prepare(arr: np.ndarray, rows: int) -> Callable[[], np.ndarray]:
    """Allocate what resizing ``arr`` to ``rows`` needs; return the step that finishes it.

    Nothing of ``arr`` changes here, so an allocation that fails leaves it as it was. The
    returned step allocates nothing: it copies or re-views the contents and returns the
    resized array (``arr`` must not be used afterwards).
    """
    rows = int(rows)
    per_row = math.prod(arr.shape[1:])
    shape = (rows, *arr.shape[1:])
    need = rows * per_row * arr.itemsize
    old = arr.shape[0]
    keep = min(old, rows)
    m = _mapping(arr)
    if m is None and _small(arr, rows):
        small = np.zeros(shape, arr.dtype)

        def copy_small() -> np.ndarray:
            small[:keep] = arr[:keep]
            return small

        return copy_small
    old_bytes = old * per_row * arr.itemsize
    if m is not None and need <= len(m):
        within = m

        def view() -> np.ndarray:
            if rows < old:  # zero what is given up: a later growth must find zero rows
                arr[rows:old] = 0
                lo = -(-need // _PAGE) * _PAGE
                hi = old_bytes // _PAGE * _PAGE
                if hi > lo:
                    within.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                    within.populated = min(within.populated, lo)
            else:
                _prefault(within, need, need - old_bytes)
            return np.frombuffer(within, arr.dtype, count=rows * per_row).reshape(shape)

        return view
    fresh = _reserve(need)
    out = np.frombuffer(fresh, arr.dtype, count=rows * per_row).reshape(shape)

    def copy_into_reservation() -> np.ndarray:
        out[:keep] = arr[:keep]
        fresh.populated = keep * per_row * arr.itemsize // _PAGE * _PAGE
        _prefault(fresh, need, need - old_bytes)
        return out

    return copy_into_reservation


def resized_all(arrays: Sequence[np.ndarray], rows: int) -> list[np.ndarray]:
    """Each of ``arrays`` with ``rows`` entries along axis 0: contents kept, new rows zero.

    Every new array is allocated before any of ``arrays`` changes: when an allocation fails
    (``MemoryError``, ``OSError``), every array is left as it was, so arrays that must keep
    the same number of rows never end up with different ones. Each result may be the old
    array's memory (re-viewed in its reservation) or a new array: callers keep the results
    and drop their references to the old arrays.
    """
    finish = [_prepare(a, rows) for a in arrays]
    return [f() for f in finish]


def resized(arr: np.ndarray, rows: int) -> np.ndarray:
    """``arr`` with ``rows`` entries along axis 0: contents kept, new rows zero.

    May return ``arr`` itself (a small array, resized in place) or a new array: callers keep
    the result and drop references to the old array, whose memory may no longer hold the rows'
    current values after a move to a larger reservation. Arrays that must keep the same
    number of rows are resized together with :func:`resized_all`.
    """
    if _mapping(arr) is None and _small(arr, rows):
        arr.resize((int(rows), *arr.shape[1:]), refcheck=False)
        return arr
    return _prepare(arr, rows)()


__all__ = ["MIN_BYTES", "RESERVE_FACTOR", "prefault_enabled", "resized", "resized_all"]
