"""Key normalisation for embedding tables: int64 arrays as they are, str/bytes hashed.

:func:`as_int64_keys` hashes strings with the stable XXH64 of their UTF-8 bytes, so a string
maps to the same row in every process and on every platform (docs/internals.md, "Kernels").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorkv.errors import ShapeError
from tensorkv.kernels.hashing import hash_keys


def as_int64_keys(keys: Any) -> tuple[np.ndarray, int]:
    """Normalise keys to a 1-D C-contiguous int64 array.

    Parameters
    ----------
    keys
        A 1-D array of any integer dtype (uint64 keys keep their bit pattern), a list/tuple of
        ints, or a sequence / ``U`` / ``S`` / object array of ``str``/``bytes`` (hashed with
        XXH64, see :mod:`tensorkv.kernels.hashing`).

    Returns
    -------
    (keys, collisions)
        The int64 keys, and the number of distinct strings of this call that hashed to a key
        already taken by another string of the same call (0 for integer keys).

    Raises
    ------
    ShapeError
        For a single key, a 2-D array, a float/bool dtype, or mixed key types.
    """
    if isinstance(keys, (str, bytes, int, np.integer)):
        raise ShapeError(
            f"keys={keys!r} is a single key; pass a 1-D array or list of keys, e.g. [{keys!r}]"
        )
    if not isinstance(keys, np.ndarray):
        if isinstance(keys, (list, tuple)) and keys and isinstance(keys[0], (str, bytes)):
            return _hash_strings(keys)
        try:
            keys = np.asarray(keys)
        except (ValueError, OverflowError) as e:
            raise ShapeError(f"keys could not be read as an array ({e}); pass a 1-D int64 "
                             "array or a list of str/bytes") from None
        if keys.size == 0:
            keys = keys.astype(np.int64)
    if keys.ndim != 1:
        raise ShapeError(
            f"keys have shape {keys.shape}; pass a 1-D array of keys (use keys.ravel() and "
            "reshape the result)"
        )
    kind = keys.dtype.kind
    if kind == "i":
        return np.ascontiguousarray(keys, dtype=np.int64), 0
    if kind == "u":
        if keys.dtype.itemsize == 8:
            return np.ascontiguousarray(keys).view(np.int64), 0
        return keys.astype(np.int64), 0
    if kind in "US":
        return _hash_strings(keys.tolist())
    if kind == "O":
        items = keys.tolist()
        if all(isinstance(k, (str, bytes)) for k in items):
            return _hash_strings(items)
        if all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in items):
            try:
                return np.asarray(items, dtype=np.int64), 0
            except OverflowError:
                raise ShapeError("an integer key does not fit in int64") from None
        types = sorted({type(k).__name__ for k in items})
        raise ShapeError(
            f"keys are an object array mixing types {types}; give all keys as int64 or "
            "all as str/bytes"
        )
    raise ShapeError(
        f"keys have dtype {keys.dtype}; keys must be integers (int64) or str/bytes. Cast "
        "whole-number float ids with keys.astype(np.int64)"
    )


def _hash_strings(items: Sequence) -> tuple[np.ndarray, int]:
    try:
        hashed = hash_keys(items)
    except TypeError as e:
        raise ShapeError(f"{e}") from None
    n_hash = np.unique(hashed).size
    if n_hash < len(items):
        distinct = len({k.encode("utf-8") if isinstance(k, str) else bytes(k) for k in items})
        return hashed, max(0, distinct - n_hash)
    return hashed, 0
