"""A coherent near-cache of a Redis-resident table's hot rows, in the process that reads them.

Why it is never stale. Every write of a bucket's rows (a commit, an intent applied, an
import's copy, a reset) increments the bucket's version ``~v`` in the same atomic step
(:mod:`~tensorkv.embedding.redis.lua`). A cached row remembers the *generation* of its
bucket it was read under; a generation stands for one version of the bucket. Each read of
the table reads the version of every bucket it touches (cached keys' buckets included) in
the same round trip as its rows, on the same connection and before the rows: a bucket whose
version moved starts a new generation, which invalidates all its cached rows at once, and a
cached row is served only when its bucket's version, read in this very round trip, is the
one it was cached at. A row read after its bucket's version is cached under that version or
an older one, never a newer one, so the check can only err towards a miss. The rows a process
commits itself update its cache when the commit moved the bucket by exactly one version (no
other write came between); otherwise the bucket is invalidated.

What else empties it. A bucket that lost its epoch or went back in version raises
:class:`~tensorkv.errors.TableLostError` before any row is served (the identity checks of
:meth:`~tensorkv.embedding.redis.engine.RedisRowEngine.check_heads`); and the cache
trusts versions only on the connections it has used since it was filled: a reply on a new
connection (a restart or a failover drops every connection to the old server) or on the
generic path empties the cache first, so versions of a server restarted from an older
snapshot that caught up again are never compared with rows of the old one.

Bounded by rows and bytes; admission by the table's own frequency counter stored in each
row; when full, the rows of invalidated buckets go first, then the least frequent.
Statistics: ``stats()["redis"]["near_cache"]``. See docs/redis_table.md ("The near-cache").
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from tensorkv.embedding.arena import RowArena
from tensorkv.embedding.redis.engine import Buckets, RedisRowEngine
from tensorkv.kernels import hashindex as hk

#: Byte offset of a record's frequency (``int64``; the header is key, freq, version, seq).
_FREQ_AT = 8
#: Share of the rows evicted at once when the cache is full (amortises the selection).
_EVICT_SHARE = 8


class NearCache:
    """Rows of one table, each valid while its bucket's version has not moved.

    Parameters
    ----------
    buckets
        The table's runtime buckets (the key -> bucket rule).
    width
        Bytes of a sealed row (record and checksum).
    max_rows, max_bytes
        Bounds (0: no bound of that kind; at least one must be given).
    min_freq
        Rows whose stored frequency is below this are not admitted.
    """

    def __init__(self, buckets: Buckets, width: int, max_rows: int, max_bytes: int,
                 min_freq: int) -> None:
        cap = [int(max_rows)] if max_rows else []
        if max_bytes:
            cap.append(int(max_bytes) // (width + 40))  # + index, generation, freq, bucket
        self.capacity = max(1, min(cap))
        self.b = buckets
        self.width = width
        self.min_freq = int(min_freq)
        self.index = RowArena(1, capacity=self.capacity, growth=False)
        self.recs = np.zeros((self.capacity, width), np.uint8)
        self.rgen = np.zeros(self.capacity, np.int64)
        self.rbucket = np.zeros(self.capacity, np.int64)
        self.rfreq = np.zeros(self.capacity, np.int64)
        n = buckets.n
        self.gen = np.zeros(n, np.int64)
        self.gver = np.full(n, -1, np.int64)  # the version each generation stands for
        self._ok = np.zeros(n, bool)  # buckets checked in the current round trip
        self._sockets: weakref.WeakSet[Any] = weakref.WeakSet()
        self.counts = {"hits": 0, "misses": 0, "invalidations": 0, "admitted": 0,
                       "evicted": 0, "updated_by_own_commits": 0, "emptied": 0}

    # --- rounds: the round trips that read rows -------------------------------------------
    def candidates(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(is candidate, cache row)`` of ``keys``: cached under their bucket's generation."""
        crow = np.empty(keys.shape[0], np.int64)
        hk.index_find(self.index.index, keys, crow)  # one thread: batches are small here
        cand = crow >= 0
        if cand.any():
            c = crow[cand]
            cand[cand] = self.rgen[c] == self.gen[self.rbucket[c]]
        return cand, crow

    def begin(self, engine: RedisRowEngine) -> None:
        """A round trip starts: record what it reads of every bucket."""
        engine.head_log = []
        engine.raw_sockets = []
        self._ok[:] = False

    def end(self, engine: RedisRowEngine) -> None:
        """The round trip's rows came: move each bucket read to the version it holds."""
        log, socks = engine.head_log, engine.raw_sockets or [None]
        engine.head_log = engine.raw_sockets = None
        if log is None:  # pragma: no cover - begin() always ran
            return
        trusted = None not in socks
        if not trusted or any(s not in self._sockets for s in socks):
            self.empty()  # a new connection: maybe another server process
            for s in socks:
                if s is not None:
                    self._sockets.add(s)
        seen: dict[int, int] = {}
        spoiled: set[int] = set()
        for k, ver, marked in log:
            if marked or seen.get(k, ver) != ver or not trusted:
                spoiled.add(k)  # an intent, or two versions in one round: trust neither
            seen[k] = ver
        for k, ver in seen.items():
            if k in spoiled:
                self.invalidate(np.asarray([k], np.int64))
                continue
            if self.gver[k] != ver:
                self._bump(k)
                self.gver[k] = ver
            self._ok[k] = True

    def hits(self, keys: np.ndarray, crow: np.ndarray) -> np.ndarray:
        """Which candidate ``keys`` (cache rows ``crow``) hold, as checked in this round."""
        bk = self.rbucket[crow]
        return self._ok[bk] & (self.rgen[crow] == self.gen[bk])

    def count(self, hits: int, misses: int) -> None:
        """Count served and missed keys."""
        self.counts["hits"] += hits
        self.counts["misses"] += misses

    # --- filling and updating --------------------------------------------------------------
    def admit(self, keys: np.ndarray, recs: np.ndarray) -> None:
        """Cache rows read in this round (of buckets it checked without an intent)."""
        if keys.size == 0:
            return
        bk = self.b.of(keys)
        freq = recs[:, _FREQ_AT:_FREQ_AT + 8].copy().view(np.int64)[:, 0]
        keep = self._ok[bk] & (freq >= self.min_freq)
        if keep.any():
            self._put(keys[keep], np.ascontiguousarray(recs[keep]), bk[keep], freq[keep])

    def committed(self, engine: RedisRowEngine, keys: np.ndarray, sealed: np.ndarray,
                  deleted: np.ndarray) -> None:
        """Take in a commit of this process: ``keys`` (rows ``sealed``) and ``deleted``.

        A bucket the commit moved from the version its cached rows stand for to the next
        one changed by this commit alone: its rows are updated; any other bucket written is
        invalidated.
        """
        written = np.union1d(self.b.of(keys), self.b.of(deleted))
        if written.size == 0:
            return
        done = engine.committed
        follow = np.zeros(0, np.int64)
        if done is not None:
            wb, ver = done
            nxt = (self.gver[wb] >= 0) & (self.gver[wb] + 1 == ver)
            follow = wb[nxt]
            self.gver[follow] = ver[nxt]
        self.invalidate(np.setdiff1d(written, follow))
        if follow.size == 0:
            return
        if deleted.size:
            gone = deleted[np.isin(self.b.of(deleted), follow)]
            self.index.remove(gone)
        bk = self.b.of(keys)
        mine = np.isin(bk, follow)
        if mine.any():
            k, r, b = keys[mine], sealed[mine], bk[mine]
            freq = r[:, _FREQ_AT:_FREQ_AT + 8].copy().view(np.int64)[:, 0]
            crow = self.index.find(k)
            there = crow >= 0
            self.recs[crow[there]] = r[there]
            self.rgen[crow[there]] = self.gen[b[there]]  # what the bucket holds now
            self.rfreq[crow[there]] = freq[there]
            self.counts["updated_by_own_commits"] += int(there.sum())
            new = ~there & (freq >= self.min_freq)
            if new.any():
                self._put(k[new], np.ascontiguousarray(r[new]), b[new], freq[new])

    def invalidate(self, buckets: np.ndarray) -> None:
        """Forget what is known of ``buckets`` (their cached rows stop being served)."""
        for k in buckets.tolist():
            self._bump(k)
            self.gver[k] = -1
            self._ok[k] = False

    def empty(self) -> None:
        """Drop every row (a new connection, lost data, a clear)."""
        if len(self.index):
            self.index.remove(self.index.keys())
            self.counts["emptied"] += 1
        self.gen += 1
        self.gver[:] = -1
        self._ok[:] = False

    def _bump(self, k: int) -> None:
        self.gen[k] += 1
        self.counts["invalidations"] += 1

    def _put(self, keys: np.ndarray, recs: np.ndarray, bk: np.ndarray,
             freq: np.ndarray) -> None:
        if keys.shape[0] > self.capacity:  # keep the most frequent
            top = np.argpartition(-freq, self.capacity - 1)[:self.capacity]
            keys, recs, bk, freq = keys[top], recs[top], bk[top], freq[top]
        fresh = self.index.find(keys) < 0
        room = self.capacity - len(self.index)
        if int(fresh.sum()) > room:
            self._evict(int(fresh.sum()) - room + self.capacity // _EVICT_SHARE)
        rows, _ = self.index.insert(keys)
        self.recs[rows] = recs
        self.rgen[rows] = self.gen[bk]
        self.rbucket[rows] = bk
        self.rfreq[rows] = freq
        self.counts["admitted"] += int(keys.shape[0])

    def _evict(self, n: int) -> None:
        """Drop ``n`` rows: those of invalidated generations first, then the least frequent."""
        keys = self.index.keys()
        n = min(n, keys.size)
        if n <= 0:
            return
        rows = self.index.find(keys)
        score = np.where(self.rgen[rows] == self.gen[self.rbucket[rows]], self.rfreq[rows], -1)
        out = np.argpartition(score, n - 1)[:n] if n < keys.size else np.arange(keys.size)
        self.index.remove(keys[out])
        self.counts["evicted"] += int(n)

    def stats(self) -> dict[str, Any]:
        """Rows, bytes, bounds and counters."""
        n = len(self.index)
        return {"rows": n, "bytes": n * (self.width + 40), "capacity_rows": self.capacity,
                "min_freq": self.min_freq, **self.counts}


def open_near_cache(engine: RedisRowEngine) -> NearCache | None:
    """The near-cache the table's options ask for (None without one)."""
    o = engine.options
    if not (o.near_cache_rows or o.near_cache_bytes):
        return None
    return NearCache(engine.runtime, engine.width, o.near_cache_rows, o.near_cache_bytes,
                     o.near_cache_min_freq)


__all__ = ["NearCache", "open_near_cache"]
