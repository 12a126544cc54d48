"""Checksums of fixed-size records: XXH64 of each row's leading bytes, in one numba call.

A Redis-resident table stores every row as ``record || checksum`` (docs/redis_table.md,
"Layout"); :func:`record_checksums` computes the checksums of a whole batch at once.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tensorkv.kernels.hashing import xxh64_one


@njit(nogil=True, cache=True)
def _checksums(flat, width, nbytes, seed, out):  # pragma: no cover - compiled
    for i in range(out.shape[0]):
        out[i] = xxh64_one(flat, i * width, i * width + nbytes, seed)


def record_checksums(buf: np.ndarray, nbytes: int, seed: int = 0) -> np.ndarray:
    """XXH64 of ``buf[i, :nbytes]`` for every row of a C-contiguous ``uint8[n, width]`` buffer.

    Returns an ``int64[n]`` array (the hashes' bits).
    """
    n, width = buf.shape
    out = np.empty(n, np.uint64)
    if n:
        _checksums(buf.reshape(-1), np.int64(width), np.int64(nbytes), np.uint64(seed), out)
    return out.view(np.int64)


__all__ = ["record_checksums"]
