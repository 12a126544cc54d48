"""Numba kernels of the checkpoint code: a row gather for table blocks, a sorted-key search.

Imported on first use (inside functions of ``tables`` and ``keylists``), so that
``import tensorkv`` does not load numba. The block records the gather fills are described
in "Table blocks" in ``docs/format.md``.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def _gather_bytes(src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    w = src.shape[1]
    for i in range(idx.shape[0]):
        r = idx[i]
        for j in range(w):
            out[i, j] = src[r, j]


@njit(nogil=True, cache=True)
def _gather_items(src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    for i in range(idx.shape[0]):
        out[i] = src[idx[i]]


def rows_contiguous(a: np.ndarray) -> bool:
    """Whether each row ``a[i]`` is one contiguous run of bytes (the array may be strided)."""
    if a.ndim <= 1:
        return True
    inner = a.dtype.itemsize
    for size, stride in zip(a.shape[:0:-1], a.strides[:0:-1], strict=True):
        if size > 1 and stride != inner:
            return False
        inner *= size
    return True


def gather_rows(src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = src[idx]`` along axis 0 into a C-contiguous ``out``.

    ``src`` may be strided along axis 0 (fields viewed in a record buffer), as long as each
    row is contiguous (:func:`rows_contiguous`); any fixed-size dtype.
    """
    n = src.shape[0]
    if src.size == 0 or idx.shape[0] == 0:
        return
    if not rows_contiguous(src) or src.dtype.hasobject:
        np.take(src, idx, axis=0, out=out)
        return
    idx = np.asarray(idx, dtype=np.int64)
    if src.ndim == 1:
        if src.dtype.itemsize in (1, 2, 4, 8):  # as unsigned ints of the same width
            word = np.dtype(f"u{src.dtype.itemsize}")
            _gather_items(src.view(word), idx, out.view(word))
        else:
            np.take(src, idx, axis=0, out=out)
        return
    row = src.dtype.itemsize * (src.size // n)
    try:  # each row as one run of bytes: a read-only view of src
        rows = np.lib.stride_tricks.as_strided(
            src.view(np.uint8), shape=(n, row), strides=(src.strides[0], 1), writeable=False
        )
    except ValueError:  # pragma: no cover - a layout the byte view cannot express
        np.take(src, idx, axis=0, out=out)
        return
    aligned = row % 8 == 0 and src.strides[0] % 8 == 0 and src.ctypes.data % 8 == 0
    lane = np.dtype(np.uint64) if aligned else np.dtype(np.uint8)
    o = out.reshape(idx.shape[0], -1).view(np.uint8)
    _gather_bytes(rows.view(lane), idx, o.view(lane))


@njit(nogil=True, cache=True)
def _member_sorted(  # pragma: no cover
    hay: np.ndarray, needles: np.ndarray, out: np.ndarray
) -> None:
    n = hay.shape[0]
    lo = 0  # every later needle's lower bound is at or after this one's
    for i in range(needles.shape[0]):
        x = needles[i]
        if lo >= n:
            out[i] = False
            continue
        if hay[lo] < x:
            # gallop: double the step until hay[cur] >= x, then bisect (prev, cur]
            prev = lo
            step = 1
            cur = lo + 1
            while cur < n and hay[cur] < x:
                prev = cur
                step *= 2
                cur = prev + step
            a = prev + 1
            b = cur if cur < n else n
            while a < b:
                m = (a + b) >> 1
                if hay[m] < x:
                    a = m + 1
                else:
                    b = m
            lo = a
        out[i] = lo < n and hay[lo] == x


def member_sorted(hay: np.ndarray, needles: np.ndarray) -> np.ndarray:
    """Boolean mask: which of the ascending int64 ``needles`` occur in the ascending ``hay``.

    A galloping merge: time grows with ``len(needles) * log(len(hay) / len(needles))`` and
    memory is read near where the previous needle was found, so a few changed keys are looked
    up in a large key list at a fraction of the cost of independent binary searches.
    """
    out = np.empty(needles.shape[0], dtype=np.bool_)
    if needles.shape[0]:
        _member_sorted(hay, needles, out)
    return out
