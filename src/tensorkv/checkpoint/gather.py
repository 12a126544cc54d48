"""A numba row gather for building table blocks (imported on first use)."""

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


def gather_rows(src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = src[idx]`` along axis 0, for C-contiguous arrays of any fixed-size dtype."""
    n = src.shape[0]
    if src.ndim == 1 or src.size == 0 or idx.shape[0] == 0:
        np.take(src, idx, axis=0, out=out)
        return
    row = src.dtype.itemsize * (src.size // n)
    if row % 8 == 0:
        s = src.reshape(n, -1).view(np.uint64)
        o = out.reshape(idx.shape[0], -1).view(np.uint64)
    else:
        s = src.reshape(n, -1).view(np.uint8)
        o = out.reshape(idx.shape[0], -1).view(np.uint8)
    _gather_bytes(s, idx, o)
