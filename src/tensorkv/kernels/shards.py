"""Kernels of the parameter server's client: gradients summed straight into shard order."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def sum_rows_at(grads, dest, seen, sums_out, bad_out):  # pragma: no cover - compiled
    """``sums_out[dest[i]]`` = the sum of the ``grads`` rows sent there, in input order.

    A row's first gradient is copied and the later ones added in input order: the same
    operations, in the same order, as :func:`tensorkv.kernels.arena.dedup_sum`, so the sums
    are the same bits. ``seen`` (bool, one per output row, all False) is scratch.
    ``bad_out[p]`` says whether sum ``p`` holds a NaN or an Inf.
    """
    n = grads.shape[0]
    dim = grads.shape[1]
    for i in range(n):
        p = dest[i]
        if not seen[p]:
            seen[p] = True
            for c in range(dim):
                sums_out[p, c] = grads[i, c]
        else:
            for c in range(dim):
                sums_out[p, c] += grads[i, c]
    for p in range(sums_out.shape[0]):
        s = np.float32(0.0)
        for c in range(dim):
            s += sums_out[p, c] * np.float32(0.0)
        bad_out[p] = s != s


@njit(nogil=True, cache=True)
def gather_part(rows, dest, lo, hi, out):  # pragma: no cover - compiled
    """``out[i] = rows[dest[i] - lo]`` for every ``i`` with ``lo <= dest[i] < hi``.

    One shard's answer (the rows of distinct keys ``lo..hi`` in shard order) scattered
    straight into batch order: ``dest[i]`` is sighting ``i``'s key's place in shard order.
    """
    dim = rows.shape[1]
    for i in range(dest.shape[0]):
        r = dest[i]
        if lo <= r < hi:
            src = r - lo
            for c in range(dim):
                out[i, c] = rows[src, c]
