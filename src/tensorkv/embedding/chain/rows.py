"""A table's rows in a tier chain: :class:`ChainBackend`, the hooks a tiered table runs.

Around every batch operation the table promotes the batch's rows into tier 0, runs its own
logic there, then moves tier 0's excess down (:meth:`ChainBackend.after_batch`); operations of
one tiered table run one at a time, and :class:`SettlingLock` is its lock. See docs/tiers.md
("Tier chains").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tensorkv.embedding.chain.guard import LowerSnapshot
from tensorkv.embedding.chain.specs import StorageOption
from tensorkv.embedding.chain.tierchain import TierChain
from tensorkv.embedding.chunks import ExportChunk
from tensorkv.embedding.filters import Eviction
from tensorkv.embedding.locks import RWLock
from tensorkv.embedding.rows import ArenaBackend
from tensorkv.embedding.snapshot import RowsSnapshot, Tier0Snapshot
from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.errors import SnapshotInProgressError


class SettlingLock:
    """The table's readers-writer lock; entering it first settles a deferred demotion.

    A lookup may leave its demotion running on the helper thread (see
    :meth:`TierChain.after`); whatever reads or changes tier 0 next takes this lock, and
    finds the demotion finished. Only an update's promotion check of the batch just looked
    up enters without settling (``write(settle=False)``).
    """

    def __init__(self, chain: TierChain) -> None:
        self._lock = RWLock()
        self._chain = chain

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        """Shared section."""
        with self._lock.read():
            self._chain.settle()
            yield

    @contextlib.contextmanager
    def write(self, settle: bool = True) -> Iterator[None]:
        """Exclusive section (``settle=False``: a deferred demotion may still run)."""
        with self._lock.write():
            if settle:
                self._chain.settle()
            yield


def _run_held(held: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
    """Run held metadata writes in order, emptying ``held`` (a second call does nothing)."""
    while held:
        kernel, args = held.pop(0)
        kernel(*args)


class ChainBackend(ArenaBackend):
    """A table's rows in tier 0 plus lower tiers, moved by a :class:`TierChain`.

    Built by :func:`tensorkv.embedding.chain.build.open_rows`.

    Parameters
    ----------
    chain
        The tier chain (its ``arena`` is tier 0).
    storage
        The storage option the chain was built from (None: a chain of tier 0 alone).
    parallel, split
        How the optimizer kernel runs on tier 0 (see ``TableOptimizer.apply``).
    defer
        ``defer(fn)`` runs a lookup's demotion on the helper thread and returns a handle
        with ``join()`` (:func:`tensorkv.embedding.chain.assist.start`); None: inline.
    """

    tiered = True

    def __init__(self, chain: TierChain, storage: StorageOption | None, *,
                 parallel: bool | None = None, split: Any = None, defer: Any = None) -> None:
        super().__init__(chain.arena)
        self.chain = chain
        self.storage = storage
        self.layout: RecordLayout = chain.layout
        self.lock = SettlingLock(chain)
        self.op = threading.RLock()
        self.parallel = parallel
        self.split = split
        self._defer = defer
        # With a helper thread, the metadata writes of a batch (frequency counts after a
        # lookup, versions after an update) are held here, as (kernel, args), and run with
        # the batch's demotion task
        self._held_meta: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    # --- around one batch operation ------------------------------------------------------------
    def promote_lookup(self, keys: np.ndarray) -> np.ndarray:
        """Promote a lookup's keys (counting tier-0 hits and misses); returns their rows."""
        with self.lock.write():
            rows = self.arena.find(keys)
            self.chain.promote(keys, count=True, rows=rows)
        return rows

    def promote_update(self, keys: np.ndarray) -> np.ndarray | None:
        """Promote an update's keys; returns their rows when all are resident, else None.

        The batch just looked up needs no promotion: its rows are valid while the lookup's
        demotion may still run, so this enters the lock without settling it.
        """
        with self.lock.write(settle=False):
            self.chain.promote(keys)
            rows = self.chain.batch_rows(keys)
        if rows is not None and (rows < 0).any():
            return None  # keys to insert (or drop, under admission): the general path
        return rows

    def promote(self, keys: np.ndarray) -> None:  # noqa: D102
        with self.lock.write():
            self.chain.promote(keys)

    @contextlib.contextmanager
    def holding_meta(self) -> Iterator[None]:
        """Let the operation hold its metadata writes for :meth:`after_batch`.

        If the operation fails, what it held runs at once: its rows were changed.
        """
        try:
            yield
        except BaseException:
            _run_held(self._held_meta)
            raise

    def meta_write(self, kernel: Callable[..., Any], *args: Any) -> None:
        """Hold a metadata write (an arena method) for the batch's demotion task.

        Run at once without a helper thread. Tier 0's arrays stay put until the writes run:
        tier 0 grows only after a settle.
        """
        if self._defer is None:
            kernel(*args)
        else:
            self._held_meta.append((kernel, args))

    def run_held_meta(self) -> None:  # noqa: D102
        _run_held(self._held_meta)

    def after_batch(self, keys: np.ndarray) -> None:
        """Move tier 0's excess down after a batch, with the batch's held metadata writes.

        The held writes run first, on the helper thread when the demotion is deferred
        (:meth:`TierChain.after`); the lock settles them before anything reads or changes
        tier 0 again.
        """
        held, self._held_meta = self._held_meta, []
        try:
            with self.lock.write():
                self.chain.after(keys, defer=self._defer,
                                 first=(lambda: _run_held(held)) if held else None)
        except BaseException:
            _run_held(held)  # settling an earlier task failed: the writes still land
            raise

    def after(self, keys: np.ndarray, protect: bool = True) -> None:  # noqa: D102
        with self.lock.write():
            self.chain.after(keys, protect=protect)

    def start_prefetch(self, keys: np.ndarray) -> None:  # noqa: D102
        with self.lock.write():
            self.chain.start_prefetch(keys)

    # --- rows below tier 0 ---------------------------------------------------------------------
    def read_lower(self, keys: np.ndarray) -> tuple[np.ndarray, Any]:  # noqa: D102
        found, recs = self.chain.read(keys)
        return found, self.layout.unpack(recs)

    def lower_len(self) -> int:
        """Rows below tier 0 (settles a demotion and lands every write first)."""
        return self.chain.lower_len()

    def lower_keys(self) -> np.ndarray:  # noqa: D102
        return self.chain.lower_keys()

    def export_lower(self, chunk_rows: int, since: int) -> Iterator[ExportChunk]:  # noqa: D102
        return self.chain.export(chunk_rows, since)

    def evict_keys(self, eviction: Eviction, step: int) -> np.ndarray:  # noqa: D102
        return self.chain.evict(eviction, step)

    def remove_lower(self, keys: np.ndarray) -> int:  # noqa: D102
        return self.chain.remove_lower(keys)

    def clear_lower(self) -> None:  # noqa: D102
        self.chain.clear()

    # --- snapshots -----------------------------------------------------------------------------
    def quiesce(self) -> None:
        """Finish a deferred demotion and take a prefetch over (inside the table's barrier)."""
        self.chain.settle()
        self.chain.join_prefetch()

    def open_snapshot(self, meta: dict[str, Any]) -> RowsSnapshot:
        """Tier 0's rows (those held for write-backs and prefetches too) and the lower tiers'.

        Call inside :meth:`frozen`.
        """
        chain, a = self.chain, self.arena
        if a.snap is not None or chain.snap is not None:
            raise SnapshotInProgressError(
                "this table has a snapshot open already (a save still writing it); release it "
                "first, or wait for the save (SaveHandle.result())")
        with chain.lock:
            rows, keys, stale = chain.snapshot_parts()
            t0 = Tier0Snapshot(a, rows, keys)
            low = LowerSnapshot(chain, np.concatenate([keys, stale])) if chain.lowers else None
            a.snap = t0
            chain.snap = low
        return RowsSnapshot(meta, t0, low)

    # --- lifecycle -----------------------------------------------------------------------------
    def sync(self) -> None:
        """Land every background write (the writer reads held tier-0 rows until then)."""
        self.chain.sync()

    def wait_writes(self) -> None:
        """Land every background write, then make tier 0 dense and give back held memory."""
        with self.op:
            self.chain.sync()
            with self.lock.write():
                self.chain.pack_tier0(release=True)

    def flush(self) -> None:
        """Land every background write and flush the lower tiers; then as :meth:`wait_writes`."""
        with self.op:
            self.chain.flush()
            with self.lock.write():
                self.chain.pack_tier0(release=True)

    def close(self) -> None:  # noqa: D102
        with self.op:
            self.chain.close()

    @property
    def device(self) -> Any:
        """The torch device of tier 0 (``"cpu"`` for a DRAM tier 0)."""
        return getattr(self.arena, "device", "cpu")

    def add_stats(self, stats: dict[str, Any]) -> None:
        """``tier0_rows``, ``tiers`` (per tier figures) and ``rows`` over every tier."""
        self.chain.sync()
        stats["tier0_rows"] = stats["rows"]
        stats["tiers"] = self.chain.stats()
        for st, (tier, _) in zip(stats["tiers"][1:], self.chain.lowers, strict=True):
            st["temporary"] = tier.temporary  # a temporary directory, removed on close
        stats["rows"] = sum(int(t["rows"]) for t in stats["tiers"])

    def spill_locations(self) -> list[str]:
        """Where the lower tiers keep rows: absolute paths or URLs, ``(temporary)`` marked."""
        return [f"{t.location}{' (temporary)' if t.temporary else ''}"
                for t, _ in self.chain.lowers if t.location is not None]

    def add_meta(self, meta: dict[str, Any]) -> None:  # noqa: D102
        meta["storage"] = None if self.storage is None else self.storage.to_dict()


__all__ = ["ChainBackend", "SettlingLock"]
