"""Rows on their way between tiers (:class:`Pending`) and the scratch key maps that find them.

A :class:`Pending` batch holds detached tier-0 rows whose write to a lower tier has not
landed yet, or rows a prefetch filled that no key maps to yet; :func:`key_map` and
:func:`find_keys` find keys in it. See docs/tiers.md ("Tier chains").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tensorkv.kernels import hashindex as hk


def distinct(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values of ``x`` in order of first occurrence, and each value's index among them."""
    tab = np.empty(hk.map_slots(x.size), np.int32)
    uniq = np.empty(x.size, np.int64)
    inv = np.empty(x.size, np.int64)
    u = hk.map_distinct(x, tab, uniq, inv)
    return uniq[:u], inv


#: A scratch map of :func:`key_map`: its slot table and distinct keys.
KeyMap = tuple[np.ndarray, np.ndarray]


def key_map(keys: np.ndarray) -> KeyMap:
    """A scratch hash map of distinct ``keys`` to their positions (see :func:`find_keys`)."""
    tab = np.empty(hk.map_slots(keys.size), np.int32)
    uniq = np.empty(keys.size, np.int64)
    hk.map_distinct(keys, tab, uniq, np.empty(keys.size, np.int64))
    return tab, uniq


def find_keys(m: KeyMap, q: np.ndarray) -> np.ndarray:
    """Position of each query key among the distinct keys of a :func:`key_map` (``-1``: absent)."""
    out = np.empty(q.size, np.int64)
    hk.map_find(m[0], m[1], q, out)
    return out


@dataclass(eq=False)
class Pending:
    """Rows moved out of tier 0 whose write to tier 1 has not landed yet.

    The rows stay in tier 0's arrays, *detached* (no key maps to them and they are not
    reused) until the batch has landed: the background writer packs them into records
    itself, so the training thread never copies a row it moves down.
    """

    keys: np.ndarray  # distinct
    rows: np.ndarray  # the detached tier-0 rows holding the data
    live: np.ndarray  # False once the key was promoted back (its row is attached again)
    map: KeyMap  # key -> position (:func:`key_map`)
    nbytes: int

    @classmethod
    def make(cls, keys: np.ndarray, rows: np.ndarray, record_bytes: int) -> Pending:
        """A batch of distinct ``keys`` held in ``rows``, records of ``record_bytes``."""
        return cls(keys, rows, np.ones(keys.size, np.bool_), key_map(keys),
                   int(keys.size) * int(record_bytes))

    def find(self, q: np.ndarray) -> np.ndarray:
        """Index into this batch of each query key that is live here, -1 elsewhere."""
        if self.keys.size == 0 or q.size == 0:
            return np.full(q.size, -1, np.int64)
        idx = find_keys(self.map, q)
        idx[idx >= 0] = np.where(self.live[idx[idx >= 0]], idx[idx >= 0], -1)
        return idx


__all__ = ["KeyMap", "Pending", "distinct", "find_keys", "key_map"]
