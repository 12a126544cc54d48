"""Stable 64-bit hashing of str/bytes keys: XXH64, implemented in numba.

:func:`hash_keys` packs a batch (:func:`pack_keys`) and hashes it in one kernel call
(:func:`xxh64_batch`); a key's hash is the same on every platform and in every process. See
docs/internals.md ("Kernels").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

from tensorkv.errors import KeyTypeError

P1 = np.uint64(0x9E3779B185EBCA87)
P2 = np.uint64(0xC2B2AE3D27D4EB4F)
P3 = np.uint64(0x165667B19E3779F9)
P4 = np.uint64(0x85EBCA77C2B2AE63)
P5 = np.uint64(0x27D4EB2F165667C5)


@njit(nogil=True, cache=True, inline="always")
def _rotl(x, r):  # pragma: no cover - compiled
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit(nogil=True, cache=True, inline="always")
def _read64(buf, p):  # pragma: no cover - compiled
    v = np.uint64(0)
    for b in range(8):
        v |= np.uint64(buf[p + b]) << np.uint64(8 * b)
    return v


@njit(nogil=True, cache=True, inline="always")
def _read32(buf, p):  # pragma: no cover - compiled
    v = np.uint64(0)
    for b in range(4):
        v |= np.uint64(buf[p + b]) << np.uint64(8 * b)
    return v


@njit(nogil=True, cache=True, inline="always")
def _round(acc, lane):  # pragma: no cover - compiled
    acc = acc + lane * P2
    acc = _rotl(acc, 31)
    return acc * P1


@njit(nogil=True, cache=True, inline="always")
def _merge(acc, v):  # pragma: no cover - compiled
    acc = acc ^ _round(np.uint64(0), v)
    return acc * P1 + P4


@njit(nogil=True, cache=True)
def xxh64_one(buf, start, end, seed):  # pragma: no cover - compiled
    """XXH64 of ``buf[start:end]`` with ``seed`` (uint64)."""
    n = end - start
    p = start
    if n >= 32:
        v1 = seed + P1 + P2
        v2 = seed + P2
        v3 = seed
        v4 = seed - P1
        limit = end - 32
        while p <= limit:
            v1 = _round(v1, _read64(buf, p))
            v2 = _round(v2, _read64(buf, p + 8))
            v3 = _round(v3, _read64(buf, p + 16))
            v4 = _round(v4, _read64(buf, p + 24))
            p += 32
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        h = _merge(h, v1)
        h = _merge(h, v2)
        h = _merge(h, v3)
        h = _merge(h, v4)
    else:
        h = seed + P5
    h = h + np.uint64(n)
    while p + 8 <= end:
        h = h ^ _round(np.uint64(0), _read64(buf, p))
        h = _rotl(h, 27) * P1 + P4
        p += 8
    if p + 4 <= end:
        h = h ^ (_read32(buf, p) * P1)
        h = _rotl(h, 23) * P2 + P3
        p += 4
    while p < end:
        h = h ^ (np.uint64(buf[p]) * P5)
        h = _rotl(h, 11) * P1
        p += 1
    h = h ^ (h >> np.uint64(33))
    h = h * P2
    h = h ^ (h >> np.uint64(29))
    h = h * P3
    h = h ^ (h >> np.uint64(32))
    return h


@njit(nogil=True, cache=True)
def xxh64_batch(buf, offsets, seed, out):  # pragma: no cover - compiled
    """``out[i] = XXH64(buf[offsets[i]:offsets[i+1]], seed)`` for every key."""
    for i in range(offsets.shape[0] - 1):
        out[i] = xxh64_one(buf, offsets[i], offsets[i + 1], seed)


def pack_keys(keys: Sequence[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate str/bytes keys into one ``uint8`` buffer plus ``int64`` offsets.

    Raises
    ------
    TypeError
        When an element is neither ``str`` nor ``bytes``.
    """
    encoded = []
    for k in keys:
        if isinstance(k, str):
            encoded.append(k.encode("utf-8"))
        elif isinstance(k, (bytes, bytearray, memoryview)):
            encoded.append(bytes(k))
        else:
            raise KeyTypeError(
                f"key {k!r} of type {type(k).__name__} is neither str nor bytes; give all "
                "keys as str/bytes, or all as integers in an int64 array"
            )
    lengths = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded))
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    buf = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    if buf.size == 0:
        buf = np.zeros(1, np.uint8)
    return buf, offsets


def hash_keys(keys: Sequence[str | bytes], seed: int = 0) -> np.ndarray:
    """Stable XXH64 of each str/bytes key, as int64 (the unsigned digest's bit pattern).

    Parameters
    ----------
    keys
        A sequence (list, tuple, numpy ``U``/``S``/object array) of ``str`` or ``bytes``.
    seed
        XXH64 seed (0..2**64-1).

    Returns
    -------
    numpy.ndarray
        int64 array of ``len(keys)`` hashes.
    """
    buf, offsets = pack_keys(keys)
    out = np.empty(len(offsets) - 1, np.uint64)
    xxh64_batch(buf, offsets, np.uint64(seed), out)
    return out.view(np.int64)
