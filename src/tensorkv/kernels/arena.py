"""Row-arena kernels: gather, scatter, duplicate summing, per-row metadata updates.

Row index ``-1`` means "no row" and is skipped by every kernel that takes rows. See
docs/internals.md ("The row arena").
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tensorkv.kernels.hashindex import (
    PREFETCH_DISTANCE,
    home_slot,
    index_find,
    prefetch,
    prefetch1,
)


@njit(nogil=True, cache=True, inline="always")
def prefetch_row(values, r):  # pragma: no cover - compiled
    """Prefetch every 64-byte line of row ``r`` of a float32 2-D array."""
    for c in range(0, values.shape[1], 16):
        prefetch(values, r, c)


@njit(nogil=True, cache=True)
def gather_rows(values, rows, out):  # pragma: no cover - compiled
    """``out[i] = values[rows[i]]`` for ``rows[i] >= 0``; other rows of ``out`` are untouched."""
    n = rows.shape[0]
    dim = values.shape[1]
    for i in range(n):
        if i + PREFETCH_DISTANCE < n:
            ra = rows[i + PREFETCH_DISTANCE]
            if ra >= 0:
                prefetch_row(values, ra)
        r = rows[i]
        if r >= 0:
            for c in range(dim):
                out[i, c] = values[r, c]


@njit(nogil=True, cache=True)
def find_gather(index, keys, values, out, rows_out):  # pragma: no cover
    """Fused index lookup + gather; returns the number of keys not found (rows ``-1``).

    Two passes with software prefetch: all probes (prefetching the home slot of the key
    ``PREFETCH_DISTANCE`` ahead), then all copies (prefetching the value row ahead), so
    independent cache misses overlap instead of stalling one by one.
    """
    misses = index_find(index, keys, rows_out)
    gather_rows(values, rows_out, out)
    return misses


@njit(nogil=True, cache=True, parallel=True)
def find_gather_parallel(index, keys, values, out, rows_out, parts):  # pragma: no cover
    """:func:`find_gather` over ``parts`` contiguous ranges of keys on numba's threads.

    Each range's probes and copies are independent cache misses, so two threads overlap
    twice as many; the result equals the serial kernel's.
    """
    n = keys.shape[0]
    misses = np.zeros(parts, np.int64)
    for j in prange(parts):
        lo = n * j // parts
        hi = n * (j + 1) // parts
        misses[j] = find_gather(index, keys[lo:hi], values, out[lo:hi], rows_out[lo:hi])
    return misses.sum()


@njit(nogil=True, cache=True, parallel=True)
def find_parallel(index, keys, rows_out, parts):  # pragma: no cover - compiled
    """:func:`~tensorkv.kernels.hashindex.index_find` over ``parts`` ranges on numba's threads."""
    n = keys.shape[0]
    for j in prange(parts):
        lo = n * j // parts
        hi = n * (j + 1) // parts
        index_find(index, keys[lo:hi], rows_out[lo:hi])


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
def dedup_table_size(n):  # pragma: no cover - compiled
    """Slots of the scratch hash table :func:`dedup_sum` uses for ``n`` ids."""
    size = 16
    while size < 2 * n:
        size *= 2
    return size


@njit(nogil=True, cache=True, inline="always")
def _sum_positions(grads, pos, u, ndup, sums_out, bad_out):  # pragma: no cover - compiled
    """Sum ``grads`` rows into ``sums_out[unique position]`` in input order; flag non-finite.

    ``pos[i]`` is the unique position of row ``i`` (>= 0 at its first occurrence, ``-1 - p``
    at a later one).
    """
    n = grads.shape[0]
    dim = grads.shape[1]
    for i in range(n):  # first occurrences: straight copies, in order
        p = pos[i]
        if p >= 0:
            for c in range(dim):
                sums_out[p, c] = grads[i, c]
    if ndup:
        for i in range(n):  # later occurrences, added in input order
            p = pos[i]
            if p < 0:
                p = -1 - p
                for c in range(dim):
                    sums_out[p, c] += grads[i, c]
    for p in range(u):
        s = np.float32(0.0)
        for c in range(dim):
            s += sums_out[p, c] * np.float32(0.0)
        bad_out[p] = s != s


@njit(nogil=True, cache=True)
def dedup_sum(ids, grads, uniq_out, sums_out, bad_out, tab, pos):  # pragma: no cover
    """Sum gradients of duplicate ids in order of first occurrence (IndexedSlices semantics).

    ``ids`` are keys or rows (any int64; with ``skip_negative`` semantics left to callers).
    Sums accumulate in input order, matching ``np.add.at``. ``bad_out[u]`` says whether the
    sum of unique id ``u`` holds a NaN or Inf (true iff some summand did, or it overflowed).
    Returns the number of unique ids written to ``uniq_out``/``sums_out``/``bad_out``.
    ``tab`` (int64 ``[2**b, 2]``, ``2**b >= 2 n``, see :func:`dedup_table_size`) and ``pos``
    (int64 ``[>= n]``) are scratch space, so repeated calls allocate nothing.
    """
    n = ids.shape[0]
    size = dedup_table_size(n)
    mask = np.int64(size - 1)
    for h in range(size):  # (id, unique position); position -1 = empty
        tab[h, 1] = -1
    u = 0
    ndup = 0
    for i in range(n):
        key = ids[i]
        h = home_slot(key, mask)
        while tab[h, 1] >= 0 and tab[h, 0] != key:
            h = (h + 1) & mask
        if tab[h, 1] < 0:
            tab[h, 0] = key
            tab[h, 1] = u
            uniq_out[u] = key
            pos[i] = u
            u += 1
        else:
            pos[i] = -1 - tab[h, 1]
            ndup += 1
    _sum_positions(grads, pos, u, ndup, sums_out, bad_out)
    return u


@njit(nogil=True, cache=True)
def dedup_rows(rows, grads, uniq_out, sums_out, bad_out, first, pos):  # pragma: no cover
    """:func:`dedup_sum` for ids that are arena rows (all >= 0): no hashing.

    ``first`` (int64, one entry per arena row, all ``-1``) maps a row to its unique position
    while the kernel runs and is all ``-1`` again when it returns. Same sums, order and flags
    as :func:`dedup_sum` over the rows' keys, since a key and its row are one-to-one.
    """
    n = rows.shape[0]
    u = 0
    ndup = 0
    for i in range(n):
        if i + PREFETCH_DISTANCE < n:  # one entry per arena row: random, often uncached
            prefetch1(first, rows[i + PREFETCH_DISTANCE])
        r = rows[i]
        p = first[r]
        if p < 0:
            first[r] = u
            uniq_out[u] = r
            pos[i] = u
            u += 1
        else:
            pos[i] = -1 - p
            ndup += 1
    _sum_positions(grads, pos, u, ndup, sums_out, bad_out)
    for p in range(u):
        first[uniq_out[p]] = -1
    return u


@njit(nogil=True, cache=True)
def nonfinite_positions(grads):  # pragma: no cover - compiled
    """Boolean per row of ``grads``: True where it holds a NaN or an Inf.

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
def bump_freq(freq, seq, rows, mseq):  # pragma: no cover - compiled
    """``freq[rows[i]] += 1`` per occurrence and ``seq[rows[i]] = mseq``; ``-1`` rows skipped.

    A sighting changes the row's frequency, so the row counts as changed for
    ``export(since=...)`` (incremental checkpoints) like any other update.
    """
    n = rows.shape[0]
    for i in range(n):
        if i + PREFETCH_DISTANCE < n and rows[i + PREFETCH_DISTANCE] >= 0:
            prefetch1(freq, rows[i + PREFETCH_DISTANCE])
        r = rows[i]
        if r >= 0:
            freq[r] += 1
            seq[r] = mseq


@njit(nogil=True, cache=True)
def set_meta(version, seq, rows, step, mseq):  # pragma: no cover - compiled
    """Record the last-update step and change sequence of the given rows."""
    n = rows.shape[0]
    for i in range(n):
        if i + PREFETCH_DISTANCE < n and rows[i + PREFETCH_DISTANCE] >= 0:
            prefetch1(version, rows[i + PREFETCH_DISTANCE])
            prefetch1(seq, rows[i + PREFETCH_DISTANCE])
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


# --- bulk loading (a restore builds a new arena from rows at known positions) ----------------
@njit(nogil=True, cache=True)
def bulk_index(index, row_key, live, start, stop, state):  # pragma: no cover - compiled
    """Map ``row_key[r] -> r`` for the rows ``start .. stop-1``, in order; mark them live.

    The caller has written the rows' keys into ``row_key``. A key already in
    the index moves to its newer row (a later duplicate wins) and its earlier row is marked
    dead. The index must have room for every key (no growth here). ``state`` gets the new
    size and ``next_row >= stop``; the free list is left alone (see
    :func:`rebuild_free_list`). Returns the number of keys that were already present.
    """
    mask = np.int64(index.shape[0] - 1)
    dups = 0
    added = 0
    for r in range(start, stop):
        if r + PREFETCH_DISTANCE < stop:
            prefetch(index, home_slot(row_key[r + PREFETCH_DISTANCE], mask), 0)
        k = row_key[r]
        h = home_slot(k, mask)
        while True:
            old = index[h, 1]
            if old < 0:
                index[h, 0] = k
                index[h, 1] = r
                added += 1
                break
            if index[h, 0] == k:
                live[old] = 0
                index[h, 1] = r
                dups += 1
                break
            h = (h + 1) & mask
        live[r] = 1
    state[0] += added  # SIZE
    if stop > state[1]:  # NEXT_ROW
        state[1] = stop
    return dups


@njit(nogil=True, cache=True)
def rebuild_free_list(live, row_key, state):  # pragma: no cover - compiled
    """Thread every row below ``next_row`` that is not live onto a new free list.

    Lowest rows first (they are reused first). Returns the number of free rows.
    """
    head = np.int64(-1)
    n = 0
    for r in range(state[1] - 1, -1, -1):  # NEXT_ROW
        if live[r] == 0:
            row_key[r] = head
            head = r
            n += 1
    state[2] = head  # FREE_HEAD
    state[3] = n  # N_FREE
    return n

