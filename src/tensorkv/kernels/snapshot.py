"""Kernels of table snapshots: claiming rows once, and a growable set of int64 keys.

:func:`claim_rows` picks, from a batch of tier-0 rows, those that belong to a snapshot and
have not been copied for it yet, and marks them copied (each row is copied once, by whoever
claims it first: the exporter or a writer about to change it). :func:`set_add` /
:func:`set_has` / :func:`set_rehash` keep a set of keys (those whose lower-tier state a
snapshot has settled). See docs/format.md ("What a tag is a snapshot of").
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tensorkv.kernels.hashindex import PREFETCH_DISTANCE, home_slot, prefetch1


@njit(nogil=True, cache=True)
def claim_rows(rows, member, captured, out, mark):  # pragma: no cover - compiled
    """Rows of ``rows`` that are members and not captured yet, marked ``mark``; returns count.

    ``member`` and ``captured`` are ``uint8`` per row of the snapshot (rows past their length,
    and ``-1``, are never members); ``captured`` is 0 (not yet), 1 (captured) or 2 (being
    copied by the exporter). A row given twice is claimed once. The claimed rows are written
    to ``out[:count]`` in the order given.
    """
    hw = member.shape[0]
    m = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        if 0 <= r < hw and member[r] and captured[r] == 0:
            captured[r] = mark
            out[m] = r
            m += 1
    return m


@njit(nogil=True, cache=True)
def count_marked(rows, captured, mark):  # pragma: no cover - compiled
    """How many of ``rows`` (``-1`` and rows past ``captured`` skipped) are marked ``mark``."""
    hw = captured.shape[0]
    n = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        if 0 <= r < hw and captured[r] == mark:
            n += 1
    return n


@njit(nogil=True, cache=True)
def members_since(member, captured, seq, since):  # pragma: no cover - compiled
    """Member rows not captured yet whose change sequence is ``> since``, in row order."""
    hw = member.shape[0]
    out = np.empty(hw, np.int64)
    m = 0
    for r in range(hw):
        if member[r] and captured[r] == 0 and seq[r] > since:
            out[m] = r
            m += 1
    return out[:m]


@njit(nogil=True, cache=True)
def set_add(tab, store, n, keys, new_out):  # pragma: no cover - compiled
    """Add ``keys`` to the set ``(tab, store[:n])``; returns the new size.

    ``tab`` is ``int32[2**b]`` (``-1``: empty; else a position in ``store``), with room for
    every key (``2**b >= 2 * (n + len(keys))``), and ``store`` has room for ``n + len(keys)``
    keys. ``new_out[i]`` says whether ``keys[i]`` was added by this call (its first
    occurrence among ``keys``, and absent before).
    """
    mask = np.int64(tab.shape[0] - 1)
    k_n = keys.shape[0]
    for i in range(k_n):
        if i + PREFETCH_DISTANCE < k_n:
            prefetch1(tab, home_slot(keys[i + PREFETCH_DISTANCE], mask))
        k = keys[i]
        h = home_slot(k, mask)
        while True:
            p = tab[h]
            if p < 0:
                tab[h] = n
                store[n] = k
                n += 1
                new_out[i] = True
                break
            if store[p] == k:
                new_out[i] = False
                break
            h = (h + 1) & mask
    return n


@njit(nogil=True, cache=True)
def set_has(tab, store, keys, out):  # pragma: no cover - compiled
    """``out[i]``: whether ``keys[i]`` is in the set ``(tab, store)``."""
    mask = np.int64(tab.shape[0] - 1)
    k_n = keys.shape[0]
    for i in range(k_n):
        if i + PREFETCH_DISTANCE < k_n:
            prefetch1(tab, home_slot(keys[i + PREFETCH_DISTANCE], mask))
        k = keys[i]
        h = home_slot(k, mask)
        found = False
        while True:
            p = tab[h]
            if p < 0:
                break
            if store[p] == k:
                found = True
                break
            h = (h + 1) & mask
        out[i] = found


@njit(nogil=True, cache=True)
def set_rehash(store, n, tab):  # pragma: no cover - compiled
    """Fill an empty (all ``-1``) ``tab`` with the positions of the ``n`` keys of ``store``."""
    mask = np.int64(tab.shape[0] - 1)
    for p in range(n):
        h = home_slot(store[p], mask)
        while tab[h] >= 0:
            h = (h + 1) & mask
        tab[h] = p
