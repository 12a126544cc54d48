"""Fetching the next batch's rows up from the lower tiers while the current batch trains.

A :class:`FetchJob` runs on the table's write-back queue and moves the rows of the announced
keys into held tier-0 rows (:class:`Fetched`) through a :class:`GuardedSink`;
:meth:`~tensorkv.embedding.chain.tierchain.TierChain.start_prefetch` starts it and
:meth:`~tensorkv.embedding.chain.tierchain.TierChain.join_prefetch` takes it over. Why this
stays consistent with the other threads: docs/tiers.md ("Prefetch").
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorkv.embedding.chain import guard
from tensorkv.embedding.chain.core import ChainCore
from tensorkv.embedding.chain.pending import distinct, find_keys, key_map
from tensorkv.embedding.tiers.base import RowSink

CHUNK_KEYS = 2048  # keys read between two checks of ``stop``


class GuardedSink(RowSink):
    """A :class:`RowSink` that writes while holding ``guard`` (tier 0's arrays stay put)."""

    def __init__(self, arena: Any, layout: Any, guard: Any) -> None:
        super().__init__(arena, layout)
        self.guard = guard

    def write_many(self, pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """:meth:`RowSink.write_many` (which :meth:`RowSink.write` goes through) under the guard."""
        with self.guard:
            super().write_many(pieces)


@dataclass
class Fetched:
    """What a prefetch job moved up: keys, the held rows now holding them, and the rest.

    Attributes
    ----------
    keys, rows
        Distinct keys fetched and their held tier-0 rows.
    spare
        Held rows the job did not use (freed by the training thread).
    by_tier
        Rows fetched from each lower tier (index 0: tier 1).
    error
        The exception that stopped the job early (what it fetched before is kept).
    """

    keys: np.ndarray
    rows: np.ndarray
    spare: np.ndarray
    by_tier: list[int] = field(default_factory=list)
    error: BaseException | None = None


class FetchJob:
    """One prefetch: run on the table's write-back queue, stopped early on request.

    Parameters
    ----------
    chain
        The tier chain.
    keys
        The next batch's keys.
    held
        Held tier-0 rows the job may fill.
    """

    def __init__(self, chain: ChainCore, keys: np.ndarray, held: np.ndarray) -> None:
        self.chain = chain
        self.keys = keys
        self.held = held
        self.stop = threading.Event()  # set by the training thread: finish the chunk, return
        self.done = threading.Event()
        self.result: Fetched | None = None

    def __call__(self) -> None:
        """Run the fetch (on the write-back thread); ``done`` is set however it ends."""
        try:
            self.result = fetch(self.chain, self.keys, self.held, self.stop)
        finally:
            self.done.set()

    def not_run(self) -> Fetched:
        """The result of a job removed from the queue before it started."""
        empty = np.empty(0, np.int64)
        return Fetched(empty, empty, self.held, [0] * len(self.chain.lowers))


def fetch(chain: ChainCore, keys: np.ndarray, held: np.ndarray,
          stop: threading.Event | None = None) -> Fetched:
    """Background job: move the rows of ``keys`` stored below tier 0 into ``held`` rows.

    At most ``held.size`` rows are fetched (the first ones found, in key order of first
    occurrence); keys in the write-back buffer or with stale lower copies are left to the
    promotion, as are keys already in tier 0 (no lower tier holds them). ``stop``: checked
    between chunks; once set, the job returns what it has fetched.
    """
    lowers = [t for t, _ in chain.lowers]
    by_tier = [0] * len(lowers)
    got_keys: list[np.ndarray] = []
    got_rows: list[np.ndarray] = []
    used = 0
    try:
        uniq, _ = distinct(keys)
        with chain.lock:
            skip = [p.keys for p in chain.pending] + list(chain.stale)
        if skip:
            uniq = uniq[find_keys(key_map(np.concatenate(skip)), uniq) < 0]
        sink = GuardedSink(chain.arena, chain.layout, chain.pack_lock)
        for start in range(0, uniq.size, CHUNK_KEYS):
            if used >= held.size or (stop is not None and stop.is_set()):
                break
            left = uniq[start:start + CHUNK_KEYS]
            for ti, tier in enumerate(lowers):
                if left.size == 0 or used >= held.size:
                    break
                if left.size > held.size - used:  # fetch only what the held rows hold
                    left = left[tier.contains(left)][:held.size - used]
                base = used

                def alloc(found: np.ndarray, base: int = base) -> np.ndarray:
                    return held[base:base + int(found.sum())]

                found = guard.take_into(chain, tier, left, alloc, sink)
                n = int(found.sum())
                if n:
                    got = left[found]
                    got_keys.append(got)
                    got_rows.append(held[base:base + n])
                    used += n
                    by_tier[ti] += n
                    if not tier.takes_on_read:  # the copies go in the background
                        with chain.lock:
                            chain.stale.append(got)
                        chain.queue.submit(functools.partial(chain.drop_lower, got))
                    left = left[~found]
        error = None
    except BaseException as e:  # kept: the training thread re-raises it after taking the rows
        error = e
    empty = np.empty(0, np.int64)
    return Fetched(np.concatenate(got_keys) if got_keys else empty,
                   np.concatenate(got_rows) if got_rows else empty,
                   held[used:], by_tier, error)


__all__ = ["CHUNK_KEYS", "FetchJob", "Fetched", "GuardedSink", "fetch"]
