"""Checksums of fixed-size records: a 64-bit hash of each row's leading words, in one call.

A Redis-resident table stores every row as ``record || checksum`` (docs/redis_table.md,
"Layout"); :func:`record_checksums` computes the checksums of a whole batch at once. The hash
folds each little-endian 64-bit word in with a multiply and a rotation (XXH64's primes and
final avalanche): any change of one word changes the checksum, at memory speed.
"""

from __future__ import annotations

import numpy as np
from numba import njit

P1 = np.uint64(0x9E3779B185EBCA87)
P2 = np.uint64(0xC2B2AE3D27D4EB4F)
P3 = np.uint64(0x165667B19E3779F9)


@njit(nogil=True, cache=True)
def _checksums(words, nwords, seed, out):  # pragma: no cover - compiled
    for i in range(out.shape[0]):
        h = seed ^ (np.uint64(nwords) * P1)
        for j in range(nwords):
            h ^= words[i, j] * P2
            h = ((h << np.uint64(31)) | (h >> np.uint64(33))) * P1
        h ^= h >> np.uint64(33)
        h *= P2
        h ^= h >> np.uint64(29)
        h *= P3
        h ^= h >> np.uint64(32)
        out[i] = h


def record_checksums(buf: np.ndarray, nbytes: int, seed: int = 0) -> np.ndarray:
    """Checksum of ``buf[i, :nbytes]`` for every row of a C-contiguous ``uint8[n, width]``.

    ``width`` and ``nbytes`` are multiples of 8. Returns an ``int64[n]`` array (the bits).
    """
    n, width = buf.shape
    out = np.empty(n, np.uint64)
    if n:
        words = buf.reshape(-1).view(np.uint64).reshape(n, width // 8)
        _checksums(words, np.int64(nbytes // 8), np.uint64(seed), out)
    return out.view(np.int64)


__all__ = ["record_checksums"]
