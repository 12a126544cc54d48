"""Distinct ids of several features in one pass: the dedup of an embedding collection.

A collection's batch is the ids of every feature of a group laid end to end (feature after
feature). :func:`distinct_segments` finds each feature's distinct ids, in order of first
occurrence, as a separate key space (the same id in two features is two rows), and writes them
end to end too, so that feature ``s``'s distinct ids are one slice of the output: the slice its
table is looked up with, and the slice of the rows its gradient comes back in.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tensorkv.kernels.hashindex import home_slot


@njit(nogil=True, cache=True)
def distinct_segments(keys, ends, pads, has_pad, tab, uniq_out, inv_out, counts,
                      padded):  # pragma: no cover - compiled
    """Distinct keys of each segment, segment after segment, and each key's position.

    Parameters
    ----------
    keys
        int64 ``[n]``: the segments end to end.
    ends
        int64 ``[segments]``: segment ``s`` is ``keys[ends[s - 1]:ends[s]]``.
    pads, has_pad
        int64 and bool ``[segments]``: the padding id of each segment, if it has one. Padding
        ids are left out and their position is ``-1``.
    tab
        int32 scratch of ``map_slots(longest segment)`` slots (a power of two), overwritten.
    uniq_out
        int64 ``[n]``: receives the distinct keys, segment after segment.
    inv_out
        int64 ``[n]``: receives each key's position in ``uniq_out`` (``-1``: padding).
    counts
        int64 ``[segments]``: receives the number of distinct keys of each segment.
    padded
        int64 ``[segments]``: receives the number of padding ids of each segment.

    Returns
    -------
    int
        Number of distinct keys written, all segments together.
    """
    mask = np.int64(tab.shape[0] - 1)
    u = 0
    lo = 0
    for s in range(ends.shape[0]):
        hi = ends[s]
        start = u
        if hi > lo:
            tab[:] = -1
        pad = pads[s]
        use_pad = has_pad[s]
        n_pad = 0
        for i in range(lo, hi):
            k = keys[i]
            if use_pad and k == pad:
                inv_out[i] = -1
                n_pad += 1
                continue
            h = home_slot(k, mask)
            while True:
                p = tab[h]
                if p < 0:
                    tab[h] = u
                    uniq_out[u] = k
                    inv_out[i] = u
                    u += 1
                    break
                if uniq_out[p] == k:
                    inv_out[i] = p
                    break
                h = (h + 1) & mask
        counts[s] = u - start
        padded[s] = n_pad
        lo = hi
    return u
