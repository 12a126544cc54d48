"""Admission and eviction kernels: a counting Bloom filter and eviction scores.

:func:`bloom_add` / :func:`bloom_query` count and estimate sightings; :func:`stale_rows` and
:func:`small_norm_rows` find rows for the eviction rules. Hashing and estimates:
docs/internals.md ("Admission filters and eviction rules").
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tensorkv.kernels.hashindex import mix64

_S1 = np.uint64(0x6A09E667F3BCC908)
_S2 = np.uint64(0xBB67AE8584CAA73B)


@njit(nogil=True, cache=True)
def bloom_add(counters, k, cap, seed, keys, est_out):  # pragma: no cover - compiled
    """Count one sighting per key occurrence; ``est_out[i]`` = estimated count afterwards."""
    m = np.uint64(counters.shape[0])
    s = np.uint64(seed)
    for i in range(keys.shape[0]):
        key = np.uint64(keys[i]) ^ s
        h1 = mix64(key ^ _S1)
        h2 = mix64(key ^ _S2) | np.uint64(1)
        est = 1 << 30
        for j in range(k):
            p = (h1 + np.uint64(j) * h2) % m
            c = np.int64(counters[p])
            if c < cap:
                c += 1
                counters[p] = c
            if c < est:
                est = c
        est_out[i] = est


@njit(nogil=True, cache=True)
def bloom_query(counters, k, seed, keys, est_out):  # pragma: no cover - compiled
    """Estimated count of each key (minimum of its ``k`` counters), without counting."""
    m = np.uint64(counters.shape[0])
    s = np.uint64(seed)
    for i in range(keys.shape[0]):
        key = np.uint64(keys[i]) ^ s
        h1 = mix64(key ^ _S1)
        h2 = mix64(key ^ _S2) | np.uint64(1)
        est = 1 << 30
        for j in range(k):
            p = (h1 + np.uint64(j) * h2) % m
            c = np.int64(counters[p])
            if c < est:
                est = c
        est_out[i] = est


@njit(nogil=True, cache=True)
def stale_rows(live, version, stop, min_version):  # pragma: no cover - compiled
    """Live rows in ``[0, stop)`` whose last-update step is ``< min_version``."""
    out = np.empty(stop, np.int64)
    m = 0
    for r in range(stop):
        if live[r] and version[r] < min_version:
            out[m] = r
            m += 1
    return out[:m]


@njit(nogil=True, cache=True)
def small_norm_rows(live, values, stop, threshold):  # pragma: no cover - compiled
    """Live rows in ``[0, stop)`` whose L2 norm is ``< threshold``."""
    out = np.empty(stop, np.int64)
    m = 0
    t2 = threshold * threshold
    dim = values.shape[1]
    for r in range(stop):
        if not live[r]:
            continue
        s = 0.0
        for c in range(dim):
            v = np.float64(values[r, c])
            s += v * v
        if s < t2:
            out[m] = r
            m += 1
    return out[:m]
