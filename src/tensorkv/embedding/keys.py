"""Key normalisation for embedding tables: int64 arrays as they are, str/bytes hashed.

:func:`as_int64_keys` hashes strings with the stable XXH64 of their UTF-8 bytes, so a string
maps to the same row in every process and on every platform (docs/internals.md, "Kernels").
A batch is all integers or all strings: a mix, and integers outside int64, are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorkv.errors import KeyRangeError, KeyTypeError, ShapeError
from tensorkv.kernels.hashing import hash_keys

_INT64 = (-(1 << 63), 1 << 63)  # the key range: [lo, hi)


def as_int64_keys(keys: Any) -> tuple[np.ndarray, int]:
    """Normalise keys to a 1-D C-contiguous int64 array.

    Parameters
    ----------
    keys
        A 1-D array of any integer dtype, a list/tuple of ints, or a sequence / ``U`` /
        ``S`` / object array of ``str``/``bytes`` (hashed with XXH64, see
        :mod:`tensorkv.kernels.hashing`). Integer keys must lie in int64: a uint64 key
        ``>= 2**63`` is refused, not wrapped (``keys.view(np.int64)`` keeps the bit pattern
        when that is what is meant).

    Returns
    -------
    (keys, collisions)
        The int64 keys, and the number of distinct strings of this call that hashed to a key
        already taken by another string of the same call (0 for integer keys).

    Raises
    ------
    ShapeError
        For a single key, a 2-D array, or a float/bool dtype.
    KeyTypeError
        For a batch mixing integer and str/bytes keys (or other types).
    KeyRangeError
        For an integer key outside int64.
    """
    if isinstance(keys, (str, bytes, int, np.integer)):
        raise ShapeError(
            f"keys={keys!r} is a single key; pass a 1-D array or list of keys, e.g. [{keys!r}]"
        )
    if not isinstance(keys, np.ndarray):
        if isinstance(keys, (list, tuple)) and keys and isinstance(keys[0], (str, bytes)):
            return _hash_strings(keys)
        try:
            arr = np.asarray(keys)
        except (ValueError, OverflowError) as e:
            raise ShapeError(f"keys could not be read as an array ({e}); pass a 1-D int64 "
                             "array or a list of str/bytes") from None
        if arr.size == 0:
            arr = arr.astype(np.int64)
        elif arr.ndim == 1 and arr.dtype.kind in "fUSO":
            # numpy made strings or floats of a list: mixed types or ints beyond int64?
            found = _from_objects(arr.tolist() if arr.dtype.kind == "O" else list(keys))
            if found is not None:
                return found
        keys = arr
    if keys.ndim != 1:
        raise ShapeError(
            f"keys have shape {keys.shape}; pass a 1-D array of keys (use keys.ravel() and "
            "reshape the result)"
        )
    kind = keys.dtype.kind
    if kind == "i":
        return np.ascontiguousarray(keys, dtype=np.int64), 0
    if kind == "u":
        if keys.dtype.itemsize < 8:
            return keys.astype(np.int64), 0
        k = np.ascontiguousarray(keys).view(np.int64)
        if k.size and k.min() < 0:  # one pass: uint64 keys >= 2**63 view as negative
            bad = np.flatnonzero(k < 0)
            raise _range_error(int(keys[bad[0]]), int(bad[0]), bad.size, k.size)
        return k, 0
    if kind in "US":
        return _hash_strings(keys.tolist())
    if kind == "O":
        found = _from_objects(keys.tolist())
        if found is not None:
            return found
    raise ShapeError(
        f"keys have dtype {keys.dtype}; keys must be integers (int64) or str/bytes. Cast "
        "whole-number float ids with keys.astype(np.int64)"
    )


def _from_objects(items: list) -> tuple[np.ndarray, int] | None:
    """Keys of a list of Python objects: all str/bytes (hashed) or all ints (range-checked).

    Returns None when the items are neither (floats...: the caller's dtype error applies).
    """
    is_str = [isinstance(k, (str, bytes)) for k in items]
    is_int = [isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in items]
    if all(is_str):
        return _hash_strings(items)
    if all(is_int):
        try:
            return np.asarray(items, dtype=np.int64), 0
        except OverflowError:
            bad = [i for i, k in enumerate(items) if not _INT64[0] <= int(k) < _INT64[1]]
            raise _range_error(int(items[bad[0]]), bad[0], len(bad), len(items)) from None
    if any(is_str):
        raise _mixed_error(items)
    if any(is_int) and any(isinstance(k, bool) for k in items):
        raise _mixed_error(items)
    return None


def _mixed_error(items: Sequence) -> KeyTypeError:
    types = sorted({type(k).__name__ for k in items})
    first = type(items[0])
    i = next(i for i, k in enumerate(items) if type(k) is not first)
    why = (" (1 and '1' are different keys)"
           if any(isinstance(k, (str, bytes)) for k in items)
           and any(isinstance(k, (int, np.integer)) for k in items) else "")
    return KeyTypeError(
        f"keys mix types {' and '.join(types)} (key {items[0]!r} is {first.__name__}, key "
        f"{items[i]!r} at position {i} is {type(items[i]).__name__}); a batch holds integer "
        f"keys or str/bytes keys, never both{why}. Convert them to one type, e.g. "
        "[str(k) for k in keys] to hash every key as a string"
    )


def _range_error(key: int, pos: int, n_bad: int, n: int) -> KeyRangeError:
    unsigned = _INT64[1] <= key < 2 * _INT64[1]
    fix = ("if they are unsigned 64-bit ids or hashes, keep their bit pattern (one int64 key "
           "per id) with np.asarray(keys, dtype=np.uint64).view(np.int64)"
           if unsigned else "remap the keys into int64")
    return KeyRangeError(
        f"key {key} (position {pos}; {n_bad} of {n} keys) lies outside int64 "
        f"[-2**63, 2**63), the keys a table stores, and is refused rather than wrapped; {fix}"
    )


def _hash_strings(items: Sequence) -> tuple[np.ndarray, int]:
    try:
        hashed = hash_keys(items)
    except KeyTypeError:
        raise _mixed_error(items) from None
    n_hash = np.unique(hashed).size
    if n_hash < len(items):
        distinct = len({k.encode("utf-8") if isinstance(k, str) else bytes(k) for k in items})
        return hashed, max(0, distinct - n_hash)
    return hashed, 0
