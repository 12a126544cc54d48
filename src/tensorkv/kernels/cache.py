"""Cache kernels of tiered tables: victim selection (LRU / LFU) and an offline LRU simulator.

:func:`select_victims` and :class:`RecencyLog` pick the tier-0 rows to move down (never rows
of the current batch); :func:`lru_hits` / :func:`lru_hit_ratio` replay a key trace through an
exact per-key LRU cache. See docs/tiers.md ("Tier chains") and docs/internals.md ("Kernels").
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tensorkv.errors import ConfigError
from tensorkv.kernels.arena import PREFETCH_DISTANCE
from tensorkv.kernels.hashindex import prefetch1


@njit(nogil=True, cache=True)
def _candidates(live, tick, freq, hw, cur, lfu, rows_out, score_out):  # pragma: no cover
    n = 0
    for r in range(hw):
        if live[r] and tick[r] != cur:
            rows_out[n] = r
            if lfu:
                # frequency first, then age: (freq << 24) | tick's low bits keeps order for ties
                f = freq[r]
                if f > (1 << 38):
                    f = 1 << 38
                score_out[n] = (f << 24) | (tick[r] & 0xFFFFFF)
            else:
                score_out[n] = tick[r]
            n += 1
    return n


@njit(nogil=True, cache=True)
def _lru_victims(live, tick, hw, cur, n, out, max_span):  # pragma: no cover - compiled
    """Exact LRU selection by counting ticks (no sort): returns the count, -1 if span too big."""
    tmin = np.int64(1) << 62
    tmax = -(np.int64(1) << 62)
    m = 0
    for r in range(hw):
        if live[r] and tick[r] != cur:
            m += 1
            t = tick[r]
            if t < tmin:
                tmin = t
            if t > tmax:
                tmax = t
    if m == 0:
        return 0
    if m <= n:
        k = 0
        for r in range(hw):
            if live[r] and tick[r] != cur:
                out[k] = r
                k += 1
        return k
    span = tmax - tmin + 1
    if span > max_span:
        return -1
    counts = np.zeros(span, np.int64)
    for r in range(hw):
        if live[r] and tick[r] != cur:
            counts[tick[r] - tmin] += 1
    acc = 0
    cut = 0
    for i in range(span):
        if acc + counts[i] >= n:
            cut = i
            break
        acc += counts[i]
    at_cut = n - acc
    k = 0
    for r in range(hw):
        if live[r] and tick[r] != cur:
            d = tick[r] - tmin
            if d < cut:
                out[k] = r
                k += 1
            elif d == cut and at_cut > 0:
                out[k] = r
                k += 1
                at_cut -= 1
    return k


@njit(nogil=True, cache=True)
def touch(tick, rows, cur):  # pragma: no cover - compiled
    """Set ``tick[rows] = cur`` for rows >= 0."""
    for i in range(rows.shape[0]):
        r = rows[i]
        if r >= 0:
            tick[r] = cur


def select_victims(
    live: np.ndarray,
    tick: np.ndarray,
    freq: np.ndarray,
    high_water: int,
    cur: int,
    n: int,
    policy: str,
) -> np.ndarray:
    """Rows to move out of tier 0.

    Parameters
    ----------
    live
        ``uint8`` live flag per row.
    tick
        ``int64`` access tick per row.
    freq
        ``int64`` access count per row.
    high_water
        Rows ``>= high_water`` are unused.
    cur
        Current tick: rows with this tick belong to the current batch and are protected.
    n
        How many victims to pick (fewer when fewer rows are unprotected).
    policy
        ``"lru"`` or ``"lfu"``.

    Returns
    -------
    numpy.ndarray
        ``int64`` rows, unique, at most ``n``.
    """
    if n <= 0 or high_water == 0:
        return np.empty(0, np.int64)
    if policy == "lru":
        out = np.empty(min(n, high_water), np.int64)
        k = _lru_victims(live, tick, high_water, np.int64(cur), np.int64(n), out,
                         np.int64(1 << 22))
        if k >= 0:
            return out[:k]
    rows = np.empty(high_water, np.int64)
    score = np.empty(high_water, np.int64)
    m = _candidates(live, tick, freq, high_water, np.int64(cur), policy == "lfu", rows, score)
    if m <= n:
        return rows[:m].copy()
    part = np.argpartition(score[:m], n - 1)[:n]
    return rows[part]


# ----------------------------------------------------------------------------- recency log
@njit(nogil=True, cache=True)
def _log_touch(tick, rows, start, cur, log_rows, log_ticks, end):  # pragma: no cover
    """``tick[rows[start:]] = cur``; append each row whose tick changes to the log at ``end``.

    Returns ``(new end, position reached)``: the position is ``len(rows)`` when done, less
    when the log filled up (the caller compacts or grows it and resumes there).
    """
    cap = log_rows.shape[0]
    n = rows.shape[0]
    for i in range(start, n):
        if i + PREFETCH_DISTANCE < n and rows[i + PREFETCH_DISTANCE] >= 0:
            prefetch1(tick, rows[i + PREFETCH_DISTANCE])  # one tick per row: random lines
        r = rows[i]
        if r < 0 or tick[r] == cur:
            continue
        if end >= cap:
            return end, i
        tick[r] = cur
        log_rows[end] = r
        log_ticks[end] = cur
        end += 1
    return end, rows.shape[0]


@njit(nogil=True, cache=True)
def _log_take(live, tick, log_rows, log_ticks, head, end, protect, n, out):  # pragma: no cover
    """Walk the log from ``head``: take up to ``n`` live rows whose latest touch is the entry.

    Entries are in touch order, so the first valid ones are the least recently used rows. A
    taken row's tick becomes -1 (a later entry of it is then stale too). Stops at the first
    entry of tick ``protect`` (the current batch). Returns ``(taken, new head)``.
    """
    k = 0
    i = head
    while i < end and k < n:
        t = log_ticks[i]
        if t == protect:
            break
        r = log_rows[i]
        if live[r] and tick[r] == t:
            out[k] = r
            k += 1
            tick[r] = -1
        i += 1
    return k, i


@njit(nogil=True, cache=True)
def _log_compact(live, tick, log_rows, log_ticks, head, end):  # pragma: no cover - compiled
    """Move the valid entries of ``[head, end)`` to the front, in order; return their count."""
    m = 0
    for i in range(head, end):
        r = log_rows[i]
        t = log_ticks[i]
        if live[r] and tick[r] == t:
            log_rows[m] = r
            log_ticks[m] = t
            m += 1
    return m


class RecencyLog:
    """Exact LRU order of tier-0 rows without scanning them: a log of touches.

    Every time a row's access tick changes, ``(row, tick)`` is appended; an entry is *valid*
    while the row is live and still has that tick, so each live row has exactly one valid
    entry, and the valid entries in log order are the rows from least to most recently used.
    Taking victims walks the log from the front, skipping stale entries; the log is compacted
    (stale entries dropped) when it fills. Work is proportional to the touches, not to the
    rows held, which matters once tier 0 holds millions of rows.

    Parameters
    ----------
    capacity
        Initial entries (grows as needed).
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        capacity = max(int(capacity), 16)
        self.rows = np.empty(capacity, np.int64)
        self.ticks = np.empty(capacity, np.int64)
        self.head = 0
        self.end = 0

    def __len__(self) -> int:
        """Entries between the head and the end (valid or not)."""
        return self.end - self.head

    def touch(self, live: np.ndarray, tick: np.ndarray, rows: np.ndarray, cur: int) -> None:
        """Set ``tick[rows] = cur`` (``-1`` rows skipped) and log the rows whose tick changed."""
        start = 0
        while True:
            end, start = _log_touch(tick, rows, np.int64(start), np.int64(cur), self.rows,
                                    self.ticks, np.int64(self.end))
            self.end = int(end)
            if start >= rows.shape[0]:
                return
            self._make_room(live, tick, rows.shape[0] - int(start))

    def _make_room(self, live: np.ndarray, tick: np.ndarray, need: int) -> None:
        m = int(_log_compact(live, tick, self.rows, self.ticks, np.int64(self.head),
                             np.int64(self.end)))
        self.head, self.end = 0, m
        cap = self.rows.shape[0]
        if m + need > cap // 2:  # keep the log at most half full after a compaction
            new = max(2 * (m + need), cap)
            self.rows.resize(new, refcheck=False)
            self.ticks.resize(new, refcheck=False)

    def take(self, live: np.ndarray, tick: np.ndarray, n: int, protect: int) -> np.ndarray:
        """Up to ``n`` least recently used live rows, none of tick ``protect`` (-1: none).

        The rows' ticks become -1; the caller moves them out of tier 0.
        """
        out = np.empty(max(int(n), 0), np.int64)
        k, head = _log_take(live, tick, self.rows, self.ticks, np.int64(self.head),
                            np.int64(self.end), np.int64(protect), np.int64(n), out)
        self.head = int(head)
        return out[:k]

    def clear(self) -> None:
        """Forget every entry."""
        self.head = self.end = 0

    def reset(self, rows: np.ndarray, ticks: np.ndarray) -> None:
        """Replace the log by one entry per row, ``rows`` least recently used first."""
        n = rows.shape[0]
        if self.rows.shape[0] < 2 * n:
            self.rows = np.empty(2 * n, np.int64)
            self.ticks = np.empty(2 * n, np.int64)
        self.rows[:n] = rows
        self.ticks[:n] = ticks
        self.head, self.end = 0, n


@njit(nogil=True, cache=True)
def _lru_sim(ids, n_ids, capacity, hit_out):  # pragma: no cover - compiled
    prev = np.full(n_ids, -1, np.int64)
    nxt = np.full(n_ids, -1, np.int64)
    cached = np.zeros(n_ids, np.bool_)
    head = -1  # most recent
    tail = -1  # least recent
    size = 0
    hits = 0
    for i in range(ids.shape[0]):
        x = ids[i]
        if cached[x]:
            hits += 1
            hit_out[i] = True
            if head == x:
                continue
            # unlink
            p, q = prev[x], nxt[x]
            if p >= 0:
                nxt[p] = q
            if q >= 0:
                prev[q] = p
            if tail == x:
                tail = p
        else:
            if size >= capacity:
                v = tail
                tail = prev[v]
                if tail >= 0:
                    nxt[tail] = -1
                else:
                    head = -1
                cached[v] = False
                prev[v] = -1
                nxt[v] = -1
                size -= 1
            cached[x] = True
            size += 1
        # push front
        prev[x] = -1
        nxt[x] = head
        if head >= 0:
            prev[head] = x
        head = x
        if tail < 0:
            tail = x
    return hits


def lru_hits(keys: np.ndarray, capacity: int) -> np.ndarray:
    """Which accesses of the trace ``keys`` hit an exact per-key LRU cache of ``capacity`` keys.

    Parameters
    ----------
    keys
        The accessed keys, in order (any integer dtype).
    capacity
        Keys the cache holds (>= 1); the cache starts empty.

    Returns
    -------
    numpy.ndarray
        ``bool[len(keys)]``: True where the access was a hit.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ConfigError(f"capacity={capacity!r} must be a positive integer")
    keys = np.asarray(keys).ravel()
    hit = np.zeros(keys.size, np.bool_)
    if keys.size == 0:
        return hit
    uniq, ids = np.unique(keys, return_inverse=True)
    _lru_sim(ids.astype(np.int64).ravel(), uniq.size, int(capacity), hit)
    return hit


def lru_hit_ratio(keys: np.ndarray, capacity: int) -> float:
    """Hit ratio of an exact per-key LRU cache of ``capacity`` keys over the trace ``keys``.

    Parameters
    ----------
    keys
        The accessed keys, in order (any integer dtype).
    capacity
        Keys the cache holds (>= 1).

    Returns
    -------
    float
        ``hits / len(keys)`` (0.0 for an empty trace); a key's first access is a miss.
    """
    hit = lru_hits(keys, capacity)
    return float(hit.mean()) if hit.size else 0.0


__all__ = [
    "RecencyLog", "lru_hit_ratio", "lru_hits", "select_victims", "touch",
]
