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


@njit(nogil=True, cache=True)
def split_by_shard(uniq, inverse, num_shards, order_out, bounds_out, dest_out,
                   counts_out):  # pragma: no cover - compiled
    """Group distinct keys by shard in one pass (a stable counting sort).

    The shard of a key is :func:`tensorkv.checkpoint.layout.shard_of_keys`' (splitmix64,
    then the hash's range). Writes ``order_out`` (positions in ``uniq``, shard by shard, in
    first-sighting order), ``bounds_out`` (``num_shards + 1`` starts), ``dest_out[i]`` (the
    place of sighting ``i``'s key in that order) and ``counts_out`` (sightings per key,
    zeroed here).
    """
    u = uniq.shape[0]
    sid = np.empty(u, np.int64)
    n = np.uint64(num_shards)
    lo32 = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    for s in range(num_shards + 1):
        bounds_out[s] = 0
    for j in range(u):
        z = np.uint64(uniq[j]) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        s = np.int64(((z >> s32) * n + (((z & lo32) * n) >> s32)) >> s32)
        sid[j] = s
        bounds_out[s + 1] += 1
    for s in range(num_shards):
        bounds_out[s + 1] += bounds_out[s]
    fill = bounds_out[:num_shards].copy()
    rank = np.empty(u, np.int64)
    for j in range(u):
        p = fill[sid[j]]
        fill[sid[j]] = p + 1
        order_out[p] = j
        rank[j] = p
        counts_out[j] = 0
    for i in range(inverse.shape[0]):
        j = inverse[i]
        counts_out[j] += 1
        dest_out[i] = rank[j]
