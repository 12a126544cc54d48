"""Numba kernels for the lower tiers: hash index, record checksums, mmap gathers.

:class:`HashIndex` (int64 key -> location, linear probing with ``DELETED`` markers), the
checksummed trailer of stored records (:func:`seal`, :func:`first_invalid`) and gathers from
memory-mapped record files. See docs/internals.md ("The hash index") and docs/tiers.md.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tensorkv.kernels.hashindex import PREFETCH_DISTANCE, prefetch1

EMPTY = -1
DELETED = -2
FLAG_PUT = 1
FLAG_TOMB = 2

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_LOW32 = np.uint64(0xFFFFFFFF)
_U_PUT = np.uint64(FLAG_PUT)
_U_TOMB = np.uint64(FLAG_TOMB)


@njit(nogil=True, cache=True, inline="always")
def _mix(key: np.int64) -> np.uint64:
    z = np.uint64(key) + _GOLD
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@njit(nogil=True, cache=True, inline="always")
def _prefetch_home(tkeys, tvals, k, mask):
    """Start loading the home slot of key ``k`` (independent misses then overlap)."""
    h = np.int64(_mix(k) & mask)
    prefetch1(tvals, h)
    prefetch1(tkeys, h)


@njit(nogil=True, cache=True, inline="always")
def _live_slot(tkeys, tvals, k, mask):
    """Slot of live key ``k``, or -1."""
    h = np.int64(_mix(k) & mask)
    while True:
        v = tvals[h]
        if v == EMPTY:
            return -1
        if v != DELETED and tkeys[h] == k:
            return h
        h = np.int64((np.uint64(h) + np.uint64(1)) & mask)


@njit(nogil=True, cache=True)
def index_lookup(tkeys, tvals, q, out):
    """``out[i]`` = value of ``q[i]`` or -1."""
    mask = np.uint64(tkeys.size - 1)
    n = q.size
    for i in range(n):
        if i + PREFETCH_DISTANCE < n:  # the home slots of a key ahead
            _prefetch_home(tkeys, tvals, q[i + PREFETCH_DISTANCE], mask)
        h = _live_slot(tkeys, tvals, q[i], mask)
        out[i] = tvals[h] if h >= 0 else -1


@njit(nogil=True, cache=True)
def _find_or_slot(tkeys, tvals, k, mask):
    # Returns (slot, found): the key's slot, or the slot to insert into.
    h = np.int64(_mix(k) & mask)
    first_del = -1
    while True:
        v = tvals[h]
        if v == EMPTY:
            if first_del >= 0:
                return first_del, False
            return h, False
        if v == DELETED:
            if first_del < 0:
                first_del = h
        elif tkeys[h] == k:
            return h, True
        h = np.int64((np.uint64(h) + np.uint64(1)) & mask)


@njit(nogil=True, cache=True)
def index_apply(tkeys, tvals, q, vals, tomb, old):
    """Apply puts (``tomb[i] == 0``: set ``q[i] -> vals[i]``) and deletes in order.

    ``old[i]`` receives the previous value (-1 when absent). Returns
    ``(live_delta, deleted_slots_delta)``. The caller keeps the load below 1.
    """
    mask = np.uint64(tkeys.size - 1)
    live = 0
    dels = 0
    m = q.size
    for i in range(m):
        if i + PREFETCH_DISTANCE < m:
            _prefetch_home(tkeys, tvals, q[i + PREFETCH_DISTANCE], mask)
        k = q[i]
        h, found = _find_or_slot(tkeys, tvals, k, mask)
        if found:
            old[i] = tvals[h]
            if tomb[i]:
                tvals[h] = DELETED
                live -= 1
                dels += 1
            else:
                tvals[h] = vals[i]
        else:
            old[i] = -1
            if not tomb[i]:
                if tvals[h] == DELETED:
                    dels -= 1
                tkeys[h] = k
                tvals[h] = vals[i]
                live += 1
    return live, dels


@njit(nogil=True, cache=True)
def index_take(tkeys, tvals, q, out):
    """Remove each key of ``q`` and put its value in ``out[i]`` (-1 where absent).

    :func:`index_lookup` and a delete in one probe per key. Returns how many were removed
    (each becomes a ``DELETED`` slot).
    """
    mask = np.uint64(tkeys.size - 1)
    n = q.size
    taken = 0
    for i in range(n):
        if i + PREFETCH_DISTANCE < n:
            _prefetch_home(tkeys, tvals, q[i + PREFETCH_DISTANCE], mask)
        h = _live_slot(tkeys, tvals, q[i], mask)
        if h < 0:
            out[i] = -1
            continue
        out[i] = tvals[h]
        tvals[h] = DELETED
        taken += 1
    return taken


@njit(nogil=True, cache=True)
def index_repoint(tkeys, tvals, q, old_vals, new_vals, moved):
    """``q[i] -> new_vals[i]`` where ``q[i]`` still maps to ``old_vals[i]``; returns how many.

    ``moved[i]`` says whether key ``i`` was repointed (a compare-and-set per key, one probe).
    """
    mask = np.uint64(tkeys.size - 1)
    n = 0
    m = q.size
    for i in range(m):
        if i + PREFETCH_DISTANCE < m:
            _prefetch_home(tkeys, tvals, q[i + PREFETCH_DISTANCE], mask)
        h, found = _find_or_slot(tkeys, tvals, q[i], mask)
        if found and tvals[h] == old_vals[i]:
            tvals[h] = new_vals[i]
            moved[i] = True
            n += 1
        else:
            moved[i] = False
    return n


@njit(nogil=True, cache=True)
def index_items(tkeys, tvals, keys_out, vals_out):
    """Copy live entries out; returns their count."""
    n = 0
    for h in range(tkeys.size):
        v = tvals[h]
        if v >= 0:
            keys_out[n] = tkeys[h]
            vals_out[n] = v
            n += 1
    return n


@njit(nogil=True, cache=True)
def index_insert_new(tkeys, tvals, q, vals):
    """Insert keys known to be absent and unique (rehash / snapshot load)."""
    mask = np.uint64(tkeys.size - 1)
    for i in range(q.size):
        k = q[i]
        h = np.int64(_mix(k) & mask)
        while tvals[h] != EMPTY:
            h = np.int64((np.uint64(h) + np.uint64(1)) & mask)
        tkeys[h] = k
        tvals[h] = vals[i]


# ----------------------------------------------------------------------------- checksums
@njit(nogil=True, cache=True, inline="always")
def _lane(h, w):
    h ^= w * _P1
    return ((h << np.uint64(31)) | (h >> np.uint64(33))) * _P2


@njit(nogil=True, cache=True, inline="always")
def _checksum_row(row, nwords, flags):
    """32-bit checksum of ``row[:nwords]`` and ``flags``.

    Four independent multiply-rotate lanes over the words (so the CPU overlaps them),
    merged and finalised like splitmix64.
    """
    h0 = _GOLD ^ np.uint64(nwords)
    h1 = _P1
    h2 = _P2
    h3 = _M1
    j = 0
    while j + 4 <= nwords:
        h0 = _lane(h0, row[j])
        h1 = _lane(h1, row[j + 1])
        h2 = _lane(h2, row[j + 2])
        h3 = _lane(h3, row[j + 3])
        j += 4
    while j < nwords:
        h0 = _lane(h0, row[j])
        j += 1
    h = (h0 ^ ((h1 << np.uint64(7)) | (h1 >> np.uint64(57)))
         ^ ((h2 << np.uint64(13)) | (h2 >> np.uint64(51)))
         ^ ((h3 << np.uint64(29)) | (h3 >> np.uint64(35))))
    h ^= np.uint64(flags) * _P1
    h ^= h >> np.uint64(29)
    h *= _M1
    h ^= h >> np.uint64(32)
    return (h ^ (h >> np.uint64(32))) & _LOW32


@njit(nogil=True, cache=True, inline="always")
def _seed_mix(seed):
    """32-bit mask a record's checksum is XORed with (splitmix64 of the seed)."""
    return _mix(np.int64(seed)) & _LOW32


@njit(nogil=True, cache=True)
def seal(records, flags, out, seed):
    """Copy ``records`` (uint64[n, w]) into ``out`` (uint64[n, w + 1]) with a trailer word.

    The stored checksum is XORed with a mask derived from ``seed``: SSDHASH seals with the
    segment id, so a record left in a reused segment file from its earlier life never
    validates; moving a record to another segment only changes that mask (:func:`reseed`).
    PMEM uses 0.
    """
    n, w = records.shape
    m = _seed_mix(seed)
    for i in range(n):
        row = records[i]
        for j in range(w):
            out[i, j] = row[j]
        c = _checksum_row(row, w, flags) ^ m
        out[i, w] = np.uint64(flags) | (c << np.uint64(32))


@njit(nogil=True, cache=True)
def seal_inplace(stored, flags, seed):
    """Write the trailer word (last column) of each row of ``stored`` (uint64[n, w + 1])."""
    n = stored.shape[0]
    w = stored.shape[1] - 1
    m = _seed_mix(seed)
    for i in range(n):
        c = _checksum_row(stored[i], w, flags) ^ m
        stored[i, w] = np.uint64(flags) | (c << np.uint64(32))


@njit(nogil=True, cache=True)
def reseed(stored, old_seed, new_seed):
    """Re-key sealed records from ``old_seed`` to ``new_seed`` (their bodies are not read)."""
    w = stored.shape[1] - 1
    d = (_seed_mix(old_seed) ^ _seed_mix(new_seed)) << np.uint64(32)
    for i in range(stored.shape[0]):
        stored[i, w] ^= d


@njit(nogil=True, cache=True)
def first_invalid(stored, start, stop, seed):
    """Index of the first record in ``[start, stop)`` whose trailer is wrong (else ``stop``)."""
    w = stored.shape[1] - 1
    m = _seed_mix(seed)
    for i in range(start, stop):
        t = stored[i, w]
        flags = t & _LOW32
        if flags != _U_PUT and flags != _U_TOMB:
            return i
        if (_checksum_row(stored[i], w, flags) ^ m) != (t >> np.uint64(32)):
            return i
    return stop


@njit(nogil=True, cache=True)
def verify_rows(stored, rows, expect_keys, bad, seed):
    """``bad[i]`` = 1 key mismatch, 2 not a put, 3 checksum mismatch, 0 fine."""
    w = stored.shape[1] - 1
    m = _seed_mix(seed)
    for i in range(rows.size):
        r = rows[i]
        t = stored[r, w]
        flags = t & _LOW32
        if np.int64(stored[r, 0]) != expect_keys[i]:
            bad[i] = 1
        elif flags != _U_PUT:
            bad[i] = 2
        elif (_checksum_row(stored[r], w, flags) ^ m) != (t >> np.uint64(32)):
            bad[i] = 3
        else:
            bad[i] = 0


# ----------------------------------------------------------------------------- gathers
@njit(nogil=True, cache=True)
def gather(src, rows, out, out_pos):
    """``out[out_pos[i], :] = src[rows[i], :out.shape[1]]`` (uint64 words)."""
    w = out.shape[1]
    for i in range(rows.size):
        r = rows[i]
        o = out_pos[i]
        for j in range(w):
            out[o, j] = src[r, j]


@njit(nogil=True, cache=True)
def scatter(dst, rows, src):
    """``dst[rows[i], :src.shape[1]] = src[i]`` (uint64 words)."""
    w = src.shape[1]
    for i in range(rows.size):
        r = rows[i]
        for j in range(w):
            dst[r, j] = src[i, j]


@njit(nogil=True, cache=True)
def group_by(groups, ngroups):
    """Counting sort: returns ``(order, starts)`` so group g is ``order[starts[g]:starts[g+1]]``."""
    counts = np.zeros(ngroups + 1, np.int64)
    for i in range(groups.size):
        counts[groups[i] + 1] += 1
    for g in range(ngroups):
        counts[g + 1] += counts[g]
    starts = counts.copy()
    order = np.empty(groups.size, np.int64)
    for i in range(groups.size):
        g = groups[i]
        order[counts[g]] = i
        counts[g] += 1
    return order, starts


@njit(nogil=True, cache=True)
def last_occurrence(keys):
    """``bool[n]``: True where ``keys[i]`` does not occur again later in the batch."""
    n = keys.size
    cap = 1
    while cap < 2 * n + 2:
        cap *= 2
    tk = np.empty(cap, np.int64)
    tv = np.full(cap, EMPTY, np.int64)
    mask = np.uint64(cap - 1)
    keep = np.zeros(n, np.bool_)
    for i in range(n - 1, -1, -1):
        k = keys[i]
        h = np.int64(_mix(k) & mask)
        seen = False
        while tv[h] != EMPTY:
            if tk[h] == k:
                seen = True
                break
            h = np.int64((np.uint64(h) + np.uint64(1)) & mask)
        if not seen:
            tk[h] = k
            tv[h] = 1
            keep[i] = True
    return keep


class HashIndex:
    """A growable int64 -> int64 (non-negative) hash index backed by the kernels above.

    Not thread-safe by itself; tiers call it under their lock.

    Parameters
    ----------
    capacity
        Initial number of entries it should hold without growing.
    max_load
        Fraction of slots (live + deleted) in use before the table doubles.
    """

    def __init__(self, capacity: int = 1024, max_load: float = 0.5) -> None:
        self.max_load = float(max_load)
        cap = 16
        while cap * self.max_load < capacity:
            cap *= 2
        self._keys = np.zeros(cap, np.int64)
        self._vals = np.full(cap, EMPTY, np.int64)
        self.live = 0
        self.deleted = 0

    def __len__(self) -> int:
        return self.live

    @property
    def capacity(self) -> int:
        """Number of slots."""
        return self._keys.size

    @property
    def nbytes(self) -> int:
        """Bytes held by the table."""
        return self._keys.nbytes + self._vals.nbytes

    def _rehash(self, need: int) -> None:
        cap = 16
        while cap * self.max_load < need:
            cap *= 2
        k, v = self.items()
        self._keys = np.zeros(cap, np.int64)
        self._vals = np.full(cap, EMPTY, np.int64)
        index_insert_new(self._keys, self._vals, k, v)
        self.deleted = 0

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more inserts without exceeding the load factor."""
        if self.live + self.deleted + extra > self.capacity * self.max_load:
            self._rehash(max(self.live + extra, 2 * self.live, 16))

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Values of the keys (-1 where absent)."""
        out = np.empty(keys.size, np.int64)
        index_lookup(self._keys, self._vals, keys, out)
        return out

    def apply(
        self, keys: np.ndarray, vals: np.ndarray, tomb: np.ndarray | None = None
    ) -> np.ndarray:
        """Apply puts/deletes in order; return the previous values (-1 where absent)."""
        n = keys.size
        if tomb is None:
            tomb = np.zeros(n, np.bool_)
        self.reserve(n)
        old = np.empty(n, np.int64)
        dl, dd = index_apply(self._keys, self._vals, keys, vals, tomb, old)
        self.live += dl
        self.deleted += dd
        return old

    def repoint(self, keys: np.ndarray, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        """Move keys still mapped to ``old`` to ``new``; return which moved (bool)."""
        moved = np.empty(keys.size, np.bool_)
        index_repoint(self._keys, self._vals, keys, old, new, moved)
        return moved

    def upsert(self, keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
        """Set ``keys -> vals``; return previous values (-1 where absent)."""
        return self.apply(keys, vals)

    def remove(self, keys: np.ndarray) -> np.ndarray:
        """Remove keys; return their previous values (-1 where absent)."""
        n = keys.size
        old = np.empty(n, np.int64)
        dl, dd = index_apply(
            self._keys, self._vals, keys, np.zeros(n, np.int64), np.ones(n, np.bool_), old
        )
        self.live += dl
        self.deleted += dd
        return old

    def take(self, keys: np.ndarray) -> np.ndarray:
        """Remove keys; return their values (-1 where absent): lookup and remove in one probe."""
        out = np.empty(keys.size, np.int64)
        n = int(index_take(self._keys, self._vals, keys, out))
        self.live -= n
        self.deleted += n
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, values)`` of every live entry."""
        k = np.empty(self.live, np.int64)
        v = np.empty(self.live, np.int64)
        n = index_items(self._keys, self._vals, k, v)
        assert n == self.live
        return k, v

    @classmethod
    def from_items(cls, keys: np.ndarray, vals: np.ndarray, max_load: float = 0.5) -> HashIndex:
        """Build from unique keys."""
        idx = cls(max(keys.size, 1024), max_load)
        index_insert_new(idx._keys, idx._vals, keys, vals)
        idx.live = keys.size
        return idx


@njit(nogil=True, cache=True)
def gather_tail(src, nsrc, tail, rows, out, out_pos):
    """Like :func:`gather`, but rows ``>= nsrc`` come from ``tail[row - nsrc]``."""
    w = out.shape[1]
    for i in range(rows.size):
        r = rows[i]
        o = out_pos[i]
        if r < nsrc:
            for j in range(w):
                out[o, j] = src[r, j]
        else:
            for j in range(w):
                out[o, j] = tail[r - nsrc, j]
