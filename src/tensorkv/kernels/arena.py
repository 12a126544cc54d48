"""Row-arena kernels: gather, scatter, duplicate summing, per-row metadata updates.

All kernels are ``@njit(nogil=True, cache=True)`` so threads run them in parallel. Row index
``-1`` means "no row" and is skipped by every kernel that takes rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tensorkv.kernels.hashindex import home_slot


@njit(nogil=True, cache=True)
def gather_rows(values, rows, out):  # pragma: no cover - compiled
    """``out[i] = values[rows[i]]`` for ``rows[i] >= 0``; other rows of ``out`` are untouched."""
    dim = values.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        if r >= 0:
            for c in range(dim):
                out[i, c] = values[r, c]


@njit(nogil=True, cache=True)
def find_gather(index, keys, values, out, rows_out):  # pragma: no cover
    """Fused index lookup + gather; returns the number of keys not found (rows ``-1``).

    Runs in two passes (all probes, then all copies) so independent cache misses overlap.
    """
    mask = np.int64(index.shape[0] - 1)
    n = keys.shape[0]
    misses = 0
    for i in range(n):
        k = keys[i]
        h = home_slot(k, mask)
        r = index[h, 1]
        while r >= 0 and index[h, 0] != k:
            h = (h + 1) & mask
            r = index[h, 1]
        rows_out[i] = r
        if r < 0:
            misses += 1
    dim = values.shape[1]
    for i in range(n):
        r = rows_out[i]
        if r >= 0:
            for c in range(dim):
                out[i, c] = values[r, c]
    return misses


@njit(nogil=True, cache=True)
def scatter_rows(values, rows, src):  # pragma: no cover - compiled
    """``values[rows[i]] = src[i]`` in order (a later duplicate wins); ``-1`` rows skipped."""
    dim = values.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        if r >= 0:
            for c in range(dim):
                values[r, c] = src[i, c]


@njit(nogil=True, cache=True)
def fill_slots(slots, rows, init, dim):  # pragma: no cover - compiled
    """Set slot ``k`` (columns ``k*dim:(k+1)*dim``) of each row to ``init[k]``."""
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        for k in range(init.shape[0]):
            v = init[k]
            for c in range(k * dim, (k + 1) * dim):
                slots[r, c] = v


@njit(nogil=True, cache=True)
def dedup_sum(rows, grads, uniq_out, sums_out):  # pragma: no cover - compiled
    """Sum gradients of duplicate rows in order of first occurrence (IndexedSlices semantics).

    Rows ``< 0`` are dropped. Sums accumulate in input order, matching ``np.add.at``.
    Returns the number of unique rows written to ``uniq_out``/``sums_out``.
    """
    n = rows.shape[0]
    dim = grads.shape[1]
    size = 16
    while size < 2 * n:
        size *= 2
    mask = np.int64(size - 1)
    tab_row = np.full(size, -1, np.int64)
    tab_pos = np.empty(size, np.int64)
    u = 0
    for i in range(n):
        r = rows[i]
        if r < 0:
            continue
        h = home_slot(r, mask)
        while tab_row[h] >= 0 and tab_row[h] != r:
            h = (h + 1) & mask
        if tab_row[h] < 0:
            tab_row[h] = r
            tab_pos[h] = u
            uniq_out[u] = r
            for c in range(dim):
                sums_out[u, c] = grads[i, c]
            u += 1
        else:
            p = tab_pos[h]
            for c in range(dim):
                sums_out[p, c] += grads[i, c]
    return u


@njit(nogil=True, cache=True)
def nonfinite_positions(grads):  # pragma: no cover - compiled
    """Boolean per row of ``grads``: does it hold a NaN or an Inf?

    ``v * 0`` is 0 for finite ``v`` and NaN for NaN/Inf, so one vectorisable sum per row
    tells (a NaN sum is the only value not equal to itself).
    """
    n, dim = grads.shape
    out = np.zeros(n, np.bool_)
    for i in range(n):
        s = np.float32(0.0)
        for c in range(dim):
            s += grads[i, c] * np.float32(0.0)
        out[i] = s != s
    return out


@njit(nogil=True, cache=True)
def bump_freq(freq, rows):  # pragma: no cover - compiled
    """``freq[rows[i]] += 1`` per occurrence; ``-1`` rows skipped."""
    for i in range(rows.shape[0]):
        r = rows[i]
        if r >= 0:
            freq[r] += 1


@njit(nogil=True, cache=True)
def set_meta(version, seq, rows, step, mseq):  # pragma: no cover - compiled
    """Record the last-update step and change sequence of the given rows."""
    for i in range(rows.shape[0]):
        r = rows[i]
        if r >= 0:
            version[r] = step
            seq[r] = mseq


@njit(nogil=True, cache=True)
def row_l2(values, rows):  # pragma: no cover - compiled
    """Euclidean norm of each given row (float64)."""
    out = np.empty(rows.shape[0], np.float64)
    dim = values.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        s = 0.0
        for c in range(dim):
            v = np.float64(values[r, c])
            s += v * v
        out[i] = np.sqrt(s)
    return out


@njit(nogil=True, cache=True)
def live_rows(live, seq, start, stop, since):  # pragma: no cover - compiled
    """Live rows in ``[start, stop)`` whose change sequence is ``> since``, in row order."""
    out = np.empty(stop - start, np.int64)
    m = 0
    for r in range(start, stop):
        if live[r] and seq[r] > since:
            out[m] = r
            m += 1
    return out[:m]
