"""The tier chain behind a tiered table: promotion, demotion, write-back, cascades.

:class:`TierChain` holds tier 0 (a DRAM or HBM arena, where every read and update happens)
and the lower tiers (:class:`~tensorkv.embedding.tiers.base.LowerTier`), which keep rows as
whole records: :meth:`TierChain.promote` runs before each batch, :meth:`TierChain.after`
after it. docs/tiers.md ("Tier chains") tells the whole story.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from typing import Any, TypeGuard

import numpy as np

from tensorkv.embedding.arena import HostRows, RowArena
from tensorkv.embedding.chain import guard, prefetch
from tensorkv.embedding.chain.core import BatchRows, Lower
from tensorkv.embedding.chain.pending import Pending, distinct, find_keys, key_map
from tensorkv.embedding.chain.writeback import WriteQueue
from tensorkv.embedding.chunks import ExportChunk
from tensorkv.embedding.filters import Eviction
from tensorkv.embedding.tiers.base import LowerTier, RecordLayout, RowSink, RowSource
from tensorkv.errors import ConfigError, StoreClosedError, TableError
from tensorkv.kernels import cache as ck

DEFAULT_MAX_PENDING_BYTES = 256 * 1024 * 1024
CASCADE_LOW_WATER = 0.9  # a full lower tier cascades down to this share of its budget
PREFETCH_MIN_ROWS = 4096  # rows held for a prefetch before its first result sizes them
# tier 0's row capacity kept beyond its rows when memory held for a burst is given back
SPARE_ROWS_SHARE = 0.5
SPARE_ROWS_MIN = 65536


class TierChain:
    """Tier 0 (a row arena) plus lower tiers, with promotion, demotion and write-back.

    The caller (the table) holds its write lock around :meth:`promote`, the operation and
    :meth:`after`; the chain's own lock serialises it with the background writer.

    Parameters
    ----------
    arena
        Tier 0.
    layout
        Record layout of the lower tiers.
    budget_rows
        Most rows tier 0 keeps between batches (None: unbounded).
    lowers
        ``(tier, budget_rows or None)`` pairs, fastest first.
    policy
        ``"lru"`` or ``"lfu"``: which tier-0 rows move down.
    name
        For messages.
    max_pending_bytes
        Bytes of evicted rows that may wait for their background write; more blocks.
    """

    def __init__(
        self,
        arena: RowArena,
        layout: RecordLayout,
        budget_rows: int | None,
        lowers: list[tuple[LowerTier, int | None]],
        policy: str = "lfu",
        name: str = "table",
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        if policy not in ("lru", "lfu"):
            raise ConfigError(f"cache_strategy={policy!r} must be 'lru' or 'lfu'")
        self.arena = arena
        self.layout = layout
        self.budget = budget_rows
        self.lowers = [Lower(tier, budget) for tier, budget in lowers]
        self.policy = policy
        self.max_pending_bytes = int(max_pending_bytes)
        self.split: Any = None  # how promotions copy records (see RowSink), set by the table
        self.tick = np.zeros(arena.capacity, np.int64)
        self.cur = 0
        # LRU order without scanning tier 0 (LFU victims are chosen by a scan of the counts)
        self.recency = ck.RecencyLog() if policy == "lru" else None
        # the batch's rows as promote() found them, and as after() left them
        self._batch: BatchRows | None = None
        self._last: BatchRows | None = None
        self.lock = threading.RLock()
        # The writer holds ``pack_lock`` while it reads detached rows; tier 0 holds it while
        # its arrays move (growth). Never acquire ``lock`` while holding ``pack_lock``.
        self.pack_lock = threading.Lock()
        arena.resize_guard = self.pack_lock
        self.pending: list[Pending] = []
        self.pending_bytes = 0
        # a demotion running on the helper thread (see after(defer=...)) and its guard
        self._demotion: Any = None
        self._settle_lock = threading.Lock()
        self.landed: list[Pending] = []  # landed batches whose held rows are not freed yet
        self.stale: list[np.ndarray] = []  # keys promoted out of lower tiers, delete queued
        self.queue = WriteQueue(name)
        # prefetch (:mod:`tensorkv.embedding.chain.prefetch`): the job in flight, the rows it
        # fetched (a held batch: keys not mapped yet) and how many rows the next one holds
        self._prefetch: prefetch.FetchJob | None = None
        self.fetched: Pending | None = None
        self.fetch_rows = PREFETCH_MIN_ROWS
        # In a prefetching loop (lookup i, prefetch i + 1, apply i) the writes of the rows
        # lookup i moved down wait for the prefetch, so its job runs first on the queue
        self._prefetching = False
        self._deferred: list[Pending] = []
        # an open snapshot of the lower tiers (:class:`~tensorkv.embedding.chain.guard.
        # LowerSnapshot`): every change below tier 0 goes through :mod:`.guard`, which settles
        # the keys it touches first
        self.snap: guard.LowerSnapshot | None = None
        names = ["tier0"] + [f"tier{i + 1}" for i in range(len(self.lowers))]
        self.counters = {n: dict.fromkeys(("hits", "misses", "promotions", "evictions"), 0)
                         for n in names}
        self.counters["tier0"]["prefetched"] = 0
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosedError(
                "this tiered table was closed (its lower tiers are released); create a new "
                "table and load it from a checkpoint"
            )

    # ------------------------------------------------------------------ prefetch
    def _held(self) -> list[Pending]:
        """Batches of detached rows searched before the lower tiers: pending, then fetched."""
        return self.pending + [self.fetched] if self.fetched is not None else self.pending

    def start_prefetch(self, keys: np.ndarray) -> None:
        """Start moving the lower-tier rows of ``keys`` up in the background (training thread).

        Call under the table's write lock. Rows of an earlier prefetch that no batch used go
        back down first. See :mod:`tensorkv.embedding.chain.prefetch`.
        """
        self._check_open()
        self.queue.check()
        if not self.lowers or keys.size == 0:
            return
        self.settle()
        self.join_prefetch()
        self._release_fetched()
        a = self.arena
        last = self._last
        valid = last is not None and last.state is a.state \
            and last.state_copy is not None and np.array_equal(last.state_copy, a.state)
        held = a.hold_rows(min(int(keys.size), self.fetch_rows))
        self._ensure_tick()
        if valid and last is not None:  # holding rows moves no key: its rows stay valid
            self._last = BatchRows(last.keys, last.rows, a.state, a.state.copy())
        job = prefetch.FetchJob(self, keys.copy(), held)
        self._prefetch = job
        self._prefetching = True
        self.queue.submit(job, first=True)  # before queued writes: the next lookup waits
        self._submit_deferred()

    def join_prefetch(self) -> None:
        """Wait for the prefetch in flight and take its rows over (training thread)."""
        job, self._prefetch = self._prefetch, None
        if job is None:
            return
        job.stop.set()  # what it has not fetched yet, this batch's promotion reads itself
        if self.queue.cancel(job):
            got = job.not_run()
        else:
            job.done.wait()
            got = job.result if job.result is not None else job.not_run()
        self.arena.free_rows(got.spare)
        n = int(got.keys.size)
        # the next prefetch holds room for a quarter more than this one found (at least the
        # minimum): a job stops early when its held rows run out
        self.fetch_rows = max(PREFETCH_MIN_ROWS, n + n // 4)
        if n:
            self.fetched = Pending.make(got.keys, got.rows, self.layout.record_bytes)
            self.counters["tier0"]["prefetched"] += n
            for ti, c in enumerate(got.by_tier, start=1):
                self.counters[f"tier{ti}"]["promotions"] += c
        if got.error is not None:
            raise TableError(
                f"prefetching rows from the lower tiers failed: {got.error!r}. Rows read "
                "before the error are kept; the next lookup reads the rest itself"
            ) from got.error

    def _release_fetched(self) -> None:
        """Send fetched rows no batch took back down (they become a pending batch)."""
        f, self.fetched = self.fetched, None
        if f is not None and f.live.any():
            self._queue_down(f, int(f.live.sum()))

    # ------------------------------------------------------------------ reads of lower tiers
    def _stale(self) -> np.ndarray:
        """Keys whose lower-tier copies are stale: promoted, their delete still queued."""
        parts = [p.keys[~p.live] for p in self.pending if not p.live.all()] + self.stale
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def lookup_lower(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found, records)`` of distinct ``keys`` below tier 0, without moving them.

        Call under the chain lock. The pending buffer is searched first, then each lower
        tier; copies whose delete is still queued are ignored.
        """
        n = keys.size
        found = np.zeros(n, np.bool_)
        recs = np.zeros((n, self.layout.record_bytes), np.uint8)
        if n == 0:
            return found, recs
        for p in self._held():
            left = np.flatnonzero(~found)
            if left.size == 0:
                break
            idx = p.find(keys[left])
            hit = idx >= 0
            if hit.any():  # the held rows cannot move: only this thread grows tier 0
                recs[left[hit]] = self._read_rows(p.rows[idx[hit]])
                found[left[hit]] = True
        stale = self._stale()
        for tier, _ in self.lowers:
            left = np.flatnonzero(~found)
            if stale.size and left.size:
                left = left[find_keys(key_map(stale), keys[left]) < 0]
            if left.size == 0:
                break
            f, r = tier.get(keys[left])
            if f.any():
                recs[left[f]] = r[f]
                found[left[f]] = True
        return found, recs

    def drop_lower(self, keys: np.ndarray) -> None:
        """Background job: delete promoted keys' copies from every lower tier."""
        for tier, _ in self.lowers:  # readers ignore these copies until the list drops them
            guard.delete(self, tier, keys, discard=True)
        with self.lock:
            self.stale = [s for s in self.stale if s is not keys]

    # ------------------------------------------------------------------ per batch
    def _ensure_tick(self) -> None:
        cap = self.arena.capacity
        if self.tick.shape[0] < cap:
            self.tick.resize(cap, refcheck=False)

    def promote(self, keys: np.ndarray, count: bool = False,
                rows: np.ndarray | None = None) -> int:
        """Move keys present below tier 0 up into tier 0; returns how many moved.

        ``count``: record tier-0 hits/misses of this batch (a repeated missing key counts as
        one miss, as in a per-key cache). ``rows``: the keys' tier-0 rows if the caller has
        just found them (``-1``: absent); they are updated in place for the promoted keys.
        """
        self._check_open()
        self.queue.check()
        self._submit_deferred()
        a = self.arena
        last, self._last = self._last, None
        if not count and self._valid(last, keys, same=True):
            # the same batch as the previous operation (lookup, then apply_gradients), and no
            # row was inserted or removed since (but maybe other rows moved down, by a
            # demotion still running): every key that exists anywhere is resident, and its
            # rows are the most recently used already (no new tick, no touch)
            self._batch = BatchRows(keys, last.rows, a.state,
                                    None if last.state_copy is None else a.state.copy(), True)
            return 0
        self.settle()
        self.join_prefetch()  # its rows may be some of this batch's
        self._reclaim()
        # the writer caught up: undo a spread left by a burst of writes (rows move)
        if not self.pending and self.pack_tier0(spread=1.5) and rows is not None:
            rows[:] = a.find(keys)
        self.cur += 1
        if rows is None:
            rows = a.find(keys)
        miss = rows < 0
        if not miss.any():
            if count:
                self.counters["tier0"]["hits"] += keys.size
            # after() may reuse these rows if the operation inserts and removes nothing
            self._batch = BatchRows(keys, rows, a.state, a.state.copy())
            return 0
        self._batch = None
        mpos = np.flatnonzero(miss)
        mk, inv = distinct(keys[mpos])
        if count:
            self.counters["tier0"]["misses"] += mk.size
            self.counters["tier0"]["hits"] += keys.size - mk.size
        if not self.lowers and not self.pending:
            return 0
        with self.lock:
            mrows, where = self._take_lower(mk)
        got = mrows >= 0
        if got.any():
            for ti in range(1, len(self.lowers) + 1):  # pending rows count for tier 1
                c = int(((where == ti) | (where == 0)).sum()) if ti == 1 \
                    else int((where == ti).sum())
                if c:
                    self.counters[f"tier{ti}"]["promotions"] += c
        if self.fetched is not None and not self.fetched.live.any():
            self.fetched = None  # every fetched row is in use
        # the batch's rows now, so after() need not look them up again
        rows[mpos] = mrows[inv]
        self._batch = BatchRows(keys, rows, a.state, a.state.copy())
        return int(got.sum())

    def _take_lower(self, mk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Move the distinct keys ``mk`` found below tier 0 into tier 0 (call under lock).

        Returns ``(rows, where)``: each key's new tier-0 row (-1: not found) and where it
        came from (0: the pending buffer, ``i``: lower tier ``i``, -2: a prefetch, -1:
        nowhere). Pending rows are taken at once (their held rows are attached again), and
        so are the rows of tiers that move on read (SSDHASH); other lower-tier copies are
        deleted by a queued background job (until it runs, readers ignore them).
        """
        a = self.arena
        n = mk.size
        rows = np.full(n, -1, np.int64)
        where = np.full(n, -1, np.int64)
        sink = RowSink(a, self.layout, self.split)
        for p in self._held():
            left = np.flatnonzero(rows < 0)
            if left.size == 0:
                break
            idx = p.find(mk[left])
            hit = idx >= 0
            if hit.any():  # the row still holds the data: map the key to it again, no copy
                pos, j = left[hit], idx[hit]
                p.live[j] = False
                a.attach(mk[pos], p.rows[j])
                rows[pos] = p.rows[j]
                where[pos] = -2 if p is self.fetched else 0
        stale = self._stale()
        stale_map = key_map(stale) if stale.size else None
        queued: list[np.ndarray] = []  # keys whose lower-tier copy a background job deletes
        for ti, (tier, _) in enumerate(self.lowers):
            left = np.flatnonzero(rows < 0)
            if stale_map is not None and left.size:
                left = left[find_keys(stale_map, mk[left]) < 0]
            if left.size == 0:
                break
            q = mk[left]
            placed: list[np.ndarray] = []

            def alloc(found: np.ndarray, q: np.ndarray = q, placed: list = placed) -> np.ndarray:
                new_rows, _ = a.insert(q[found])
                placed.append(new_rows)
                return new_rows

            found = guard.take_into(self, tier, q, alloc, sink)
            if placed:
                pos = left[found]
                rows[pos] = placed[0]
                where[pos] = ti + 1
                if not tier.takes_on_read:
                    queued.append(mk[pos])
        if queued:
            gone = np.concatenate(queued)
            self.stale.append(gone)
            self.queue.submit(lambda: self.drop_lower(gone))
        return rows, where

    def _touch(self, rows: np.ndarray) -> None:
        """Give ``rows`` the current tick (and log them for LRU)."""
        if self.recency is not None:
            self.recency.touch(self.arena.live, self.tick, rows, self.cur)
        else:
            ck.touch(self.tick, rows, self.cur)

    def _valid(self, b: BatchRows | None, keys: np.ndarray,
               same: bool = False) -> TypeGuard[BatchRows]:
        """Whether ``b`` holds the rows of ``keys`` in tier 0 as it is now.

        ``b.state_copy`` is None while a deferred demotion runs: it moves other rows only,
        and anything else that changes tier 0 settles it first (:meth:`settle`), which fills
        the copy in. ``same``: ``keys`` may be an equal array rather than the very same one.
        """
        a = self.arena
        return b is not None and b.state is a.state and \
            (b.keys is keys or (same and np.array_equal(b.keys, keys))) and \
            (b.state_copy is None or np.array_equal(b.state_copy, a.state))

    def batch_rows(self, keys: np.ndarray) -> np.ndarray | None:
        """Tier-0 rows of ``keys`` as :meth:`promote` left them (None: unknown or stale).

        The table's lookup uses them instead of probing the index again.
        """
        b = self._batch
        return b.rows if self._valid(b, keys) else None

    def after(self, keys: np.ndarray, protect: bool = True, defer: Any = None,
              first: Any = None) -> int:
        """Mark the batch's rows as used now and move tier-0 excess down; returns rows moved.

        ``protect``: never move the batch's own rows (they are the most recent anyway; without
        protection tier 0 is trimmed to its budget even after a batch larger than it).
        ``defer`` (with ``protect``): a function that runs a task in the background and
        returns a handle with ``join()`` (:func:`tensorkv.embedding.chain.assist.start`). The
        touch, the choice of victims and their removal from tier 0's index then run there
        (returns 0), and :meth:`settle` finishes the move before tier 0 is next read or
        changed: meanwhile the caller may only update this batch's rows (an optimizer step
        on the rows of the lookup just made). The same victims move either way. ``first``:
        a function run before the touch, in the same place (the batch's metadata writes,
        such as frequency counts, which an LFU choice of victims reads).
        """
        self.settle()
        a = self.arena
        self._ensure_tick()
        b, self._batch = self._batch, None
        if self._valid(b, keys):
            rows = b.rows  # no row was inserted or removed since promote(): rows still valid
            touch = None if b.touched else rows  # rows to give the current tick
        else:
            rows = touch = a.find(keys)
        self._reclaim()  # frees rows (not keys): the batch's rows stay valid
        excess = len(a) - self.budget if self.budget is not None and self.lowers else 0
        protect_tick = self.cur if protect else -1
        work = touch is not None or excess > 0 or first is not None
        if defer is not None and protect and work:
            self._demotion = defer(
                lambda: self._detach_victims(touch, excess, protect_tick, first))
            self._last = BatchRows(keys, rows, a.state, None)
            return 0
        p = self._detach_victims(touch, excess, protect_tick, first)
        if p is not None:
            self._move_down(p)
        if protect:  # demotion spared the batch: its rows stay valid for the next operation
            self._last = BatchRows(keys, rows, a.state, a.state.copy())
        return 0 if p is None else int(p.keys.size)

    def _detach_victims(self, touch: np.ndarray | None, excess: int,
                        protect_tick: int, first: Any = None) -> Pending | None:
        """Run ``first()``, touch rows ``touch``, pick ``excess`` victims, detach them.

        Returns the victims as a pending batch for :meth:`_move_down` (None: no victim).
        Runs on the training thread or, deferred, on the helper thread (see :meth:`after`).
        """
        if first is not None:
            first()
        if touch is not None:
            self._touch(touch)
        if excess <= 0:
            return None
        a = self.arena
        if self.recency is not None:
            victims = self.recency.take(a.live, self.tick, excess, protect_tick)
        else:
            victims = ck.select_victims(a.live, self.tick, a.freq, a.high_water,
                                        protect_tick, excess, self.policy)
        if victims.size == 0:
            return None
        # detached, not copied: the writer packs the rows into records and tier 0 reuses
        # them once their batch has landed (_reclaim)
        keys = a.row_key[victims].copy()
        return Pending.make(keys, a.detach(keys), self.layout.record_bytes)

    def settle(self) -> None:
        """Finish a deferred demotion (see :meth:`after`); re-raises its error.

        Waits for the helper thread, or runs the demotion here if it has not started, then
        queues the write of the detached rows. Any thread may call it, any number of times.
        """
        if self._demotion is None:
            return
        with self._settle_lock:
            task = self._demotion
            if task is None:
                return
            try:
                p = task.join()
            finally:
                self._demotion = None
            a = self.arena
            for name in ("_last", "_batch"):  # tier 0 as the batch's rows now find it
                b = getattr(self, name)
                if b is not None and b.state_copy is None:
                    setattr(self, name, b._replace(state_copy=a.state.copy()))
            if p is not None:
                self._move_down(p)

    def _read_rows(self, rows: np.ndarray) -> np.ndarray:
        """Whole records of tier-0 rows (padding zeroed)."""
        return RowSource(self.arena, self.layout, self.arena.row_key[rows], rows).pack()

    def records_of(self, keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Records of tier-0 ``rows`` under ``keys`` (held rows too; any thread)."""
        return RowSource(self.arena, self.layout, keys, rows, self.pack_lock).pack()

    def snapshot_parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(rows, keys, stale)`` for a snapshot of the chain.

        Rows held in tier 0 without a key in its index (pending write-backs, fetched rows)
        and their keys, and the keys whose lower-tier copies are stale. Call under the chain
        lock, with no demotion or prefetch running (the table's barrier).
        """
        held = [p for p in self._held() if p.live.any()]
        rows = np.concatenate([p.rows[p.live] for p in held]) if held else np.empty(0, np.int64)
        keys = np.concatenate([p.keys[p.live] for p in held]) if held else np.empty(0, np.int64)
        return rows, keys, self._stale()

    def _move_down(self, p: Pending) -> None:
        """Queue the write of detached rows ``p``; block while too much is pending."""
        self._queue_down(p, p.keys.size)
        if self.pending_bytes > self.max_pending_bytes:
            self._submit_deferred()
            self.queue.wait_below(2)  # let the writer catch up: at most the newest in flight
            self._reclaim()

    def _queue_down(self, p: Pending, n_rows: int) -> None:
        """Make ``p`` a pending batch and queue its write to tier 1 (``n_rows`` move down).

        In a prefetching loop the write waits for the next prefetch's job (see
        :meth:`start_prefetch`, :meth:`_submit_deferred`).
        """
        with self.lock:
            self.pending.append(p)
            self.pending_bytes += p.nbytes
        self.counters["tier0"]["evictions"] += n_rows
        if self._prefetching:
            self._deferred.append(p)
        else:
            self.queue.submit(lambda: self._land(p))

    def _submit_deferred(self) -> None:
        """Queue the writes of batches moved down while a prefetch was expected."""
        done, self._deferred = self._deferred, []
        for p in done:
            self.queue.submit(functools.partial(self._land, p))

    def _reclaim(self) -> None:
        """Free the held rows of landed batches (training thread, under the table's lock).

        A row whose key was promoted back while its batch was in flight is in use again and
        stays.
        """
        if not self.landed:
            return
        with self.lock:
            done, self.landed = self.landed, []
        for p in done:
            self.arena.free_rows(p.rows[p.live])

    def _land(self, p: Pending) -> None:
        """Background job: pack a pending batch, write it to tier 1, then cascade (pool thread).

        A key promoted back meanwhile may have its row changed while it is packed: that copy
        is stale and deleted again once it has landed.
        """
        tier = self.lowers[0].tier
        with self.lock:
            sel = np.flatnonzero(p.live)
        keys = p.keys[sel]
        if sel.size:  # the tier packs the rows, holding pack_lock while it reads them
            guard.put_rows(self, tier, keys, RowSource(self.arena, self.layout, keys,
                                                       p.rows[sel], self.pack_lock))
        with self.lock:
            dead = ~p.live[sel]
        if dead.any():  # promoted while in flight: the landed copies are stale
            guard.delete(self, tier, keys[dead])
        with self.lock:
            late = ~p.live[sel] & ~dead  # promoted while the delete above ran
            if late.any():
                guard.delete(self, tier, keys[late])
            self.pending = [q for q in self.pending if q is not p]
            self.pending_bytes -= p.nbytes
            self.landed.append(p)
        self._cascade(0)

    def _cascade(self, ti: int) -> None:
        """Move the coldest rows of lower tier ``ti`` to ``ti + 1`` while it is over budget.

        Runs on the write-back thread. The scan that picks the coldest rows runs without the
        chain lock (the training thread keeps promoting meanwhile); only the move itself
        (get, put below, delete) holds it, so a promotion sees each row in exactly one tier.
        A picked row that was promoted since is no longer found and stays where it went.
        """
        while ti + 1 < len(self.lowers):
            tier, budget = self.lowers[ti]
            if budget is None or len(tier) <= budget:
                return
            n_move = len(tier) - int(budget * CASCADE_LOW_WATER)
            allk, alls = tier.scores("freq" if self.policy == "lfu" else "change_seq")
            order = np.lexsort((allk, alls))[:n_move]
            mk = allk[order]
            with self.lock:
                self.counters[f"tier{ti + 1}"]["evictions"] += guard.move_down(self, ti, mk)
            ti += 1

    def pack_tier0(self, spread: float = 2.0, release: bool = False) -> int:
        """Make tier 0's rows dense again once no row is held for a pending write.

        Tier 0 may have held many rows for in-flight writes (a bulk load outpaces the
        writer): its live rows are then spread over a larger arena, which slows every
        gather and update. Packs when the rows in use span more than ``spread`` times their
        number. ``release``: also give back row capacity past the rows in use plus a spare
        share (``SPARE_ROWS_SHARE`` of them, at least ``SPARE_ROWS_MIN``) when the arena
        holds more than twice that, so tier 0's memory returns to about its budget after a
        bulk load. Call under the table's write lock, with nothing pending (after
        :meth:`sync`, or between batches when the writer has caught up). Returns the rows
        moved.
        """
        self.settle()
        a = self.arena
        if self.pending or self.fetched is not None or self._prefetch is not None:
            return 0  # held rows would be overwritten
        self._reclaim()
        n = len(a)
        moved = 0
        if a.high_water > spread * n and a.high_water - n >= 1024:
            src, dst = a.pack_rows()
            self._ensure_tick()
            self.tick[dst] = self.tick[src]
            if self.recency is not None:  # the log names rows: rebuild it in LRU order
                order = np.argsort(self.tick[:n], kind="stable")
                self.recency.reset(order, self.tick[order])
            self._batch = self._last = None
            moved = int(src.size)
        if release:
            keep = a.high_water + max(int(n * SPARE_ROWS_SHARE), SPARE_ROWS_MIN)
            if a.capacity > 2 * keep:
                self.tick.resize(a.shrink_rows(keep), refcheck=False)
        return moved

    # ------------------------------------------------------------------ whole-table views
    def sync(self) -> None:
        """Wait until every pending batch has landed (re-raising a failed write).

        A prefetch is finished first and the rows it fetched go back down, so the lower tiers
        hold every row below tier 0 afterwards.
        """
        self._check_open()
        try:
            self.settle()
            self.join_prefetch()
        finally:
            self._release_fetched()
            self._submit_deferred()
            self.queue.flush()

    def lower_len(self) -> int:
        """Rows below tier 0 (after :meth:`sync`)."""
        self.sync()
        return int(sum(len(t) for t, _ in self.lowers))

    def lower_keys(self) -> np.ndarray:
        """Keys below tier 0 (after :meth:`sync`)."""
        self.sync()
        parts = [t.keys() for t, _ in self.lowers]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def read(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found, records)`` of keys below tier 0, without moving them."""
        self._check_open()
        self.queue.check()
        self.settle()
        self.join_prefetch()  # no row is on its way up meanwhile
        with self.lock:
            return self.lookup_lower(keys)

    def export(self, chunk_rows: int, since: int) -> Iterator[ExportChunk]:
        """Chunks of the rows below tier 0 changed after ``since``."""
        self.sync()
        for tier, _ in self.lowers:
            for k, r in tier.scan(chunk_rows):
                f = self.layout.unpack(r)
                keep: Any = f.change_seq > since
                if not keep.any():
                    continue
                if keep.all():  # a full export: slices, not boolean gathers
                    keep = slice(None)
                yield ExportChunk(
                    k[keep].copy(), np.ascontiguousarray(f.values[keep]),
                    np.ascontiguousarray(f.slots[keep]), f.freq[keep].copy(),
                    f.version[keep].copy(), f.change_seq[keep].copy(),
                )

    def evict(self, eviction: Eviction, step: int) -> np.ndarray:
        """Keys that ``eviction`` removes across every tier (the same keys as one arena)."""
        self.sync()
        a = self.arena
        rules = Eviction(steps_to_live=eviction.steps_to_live,
                         l2_threshold=eviction.l2_threshold)
        view = a.host_view()  # the arena itself, or a host copy of device rows
        gone = [view.row_key[rules.select(view, step)]]
        meta_k, meta_f, meta_v = [], [], []
        for tier, _ in self.lowers:
            for k, r in tier.scan():
                f = self.layout.unpack(r)
                fa = HostRows(k.copy(), f.freq.copy(), f.version.copy(), f.values)
                gone.append(fa.row_key[rules.select(fa, step)])
                if eviction.max_rows is not None:
                    meta_k.append(fa.row_key)
                    meta_f.append(fa.freq)
                    meta_v.append(fa.version)
        dead = np.unique(np.concatenate(gone))
        if eviction.max_rows is not None:
            hw = a.high_water
            live = np.flatnonzero(a.live[:hw])
            keys = np.concatenate([a.row_key[live]] + meta_k)
            freq = np.concatenate([a.freq[live]] + meta_f)
            ver = np.concatenate([a.version[live]] + meta_v)
            keep = ~np.isin(keys, dead) if dead.size else np.ones(keys.size, np.bool_)
            keys, freq, ver = keys[keep], freq[keep], ver[keep]
            n_evict = keys.size - eviction.max_rows
            if n_evict > 0:
                order = np.lexsort((keys, ver, freq) if eviction.policy == "lfu"
                                   else (keys, freq, ver))
                dead = np.concatenate([dead, keys[order[:n_evict]]])
        return dead

    def remove_lower(self, keys: np.ndarray) -> int:
        """Delete keys from every lower tier (after :meth:`sync`); returns how many were there."""
        self.sync()
        n = 0
        for tier, _ in self.lowers:
            if keys.size:
                n += guard.delete(self, tier, keys)
        return n

    def clear(self) -> None:
        """Drop every row below tier 0 (call after :meth:`sync`, with tier 0 cleared)."""
        self.sync()
        guard.clear(self)
        self.landed = []  # their rows belonged to the arena that was just cleared
        self.tick[:] = 0
        if self.recency is not None:
            self.recency.clear()
        self._last = None

    def flush(self) -> None:
        """Land pending writes and make the lower tiers durable."""
        self.sync()
        for tier, _ in self.lowers:
            tier.flush()

    def close(self) -> None:
        """Flush and close the lower tiers (a second call does nothing)."""
        if self.closed:
            return
        try:
            self.sync()
        finally:
            guard.closing(self)  # an open snapshot keeps the rows it has not read yet
            self.closed = True
            for tier, _ in self.lowers:
                tier.close()

    def stats(self) -> list[dict[str, Any]]:
        """Per-tier rows, bytes, hits, misses, promotions, evictions (and tier counters)."""
        self.settle()
        a = self.arena
        out = [{"tier": 0, "kind": a.kind, "rows": len(a), "bytes": a.nbytes,
                "budget_rows": self.budget, "pending_rows": sum(int(p.live.sum())
                                                                for p in self.pending),
                "pending_bytes": self.pending_bytes, **self.counters["tier0"]}]
        for i, (tier, budget) in enumerate(self.lowers, start=1):
            st = tier.stats()
            out.append({"tier": i, "kind": tier.kind, "budget_rows": budget,
                        **st, **self.counters[f"tier{i}"],
                        "compactions": st.get("compactions", 0)})
        return out


__all__ = ["DEFAULT_MAX_PENDING_BYTES", "TierChain"]
