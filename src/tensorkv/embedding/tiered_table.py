"""TieredEmbeddingTable: an :class:`EmbeddingTable` whose rows spill to lower tiers.

The table wraps every batch operation in :class:`~tensorkv.embedding.tiered.TierChain` calls:
promote the batch's keys into tier 0, run the :class:`EmbeddingTable` operation there, then
move tier 0's excess down in the background. Tier 0 is the DRAM arena, or an
:class:`~tensorkv.embedding.tiers.hbm.HBMArena` (rows in torch tensors on a device) for
``HBM*`` storage types.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from tensorkv import config
from tensorkv.embedding import assist
from tensorkv.embedding.storage import DRAM, HBM, PMEM, StorageOption
from tensorkv.embedding.storage import KVTier as KVTierSpec
from tensorkv.embedding.table import EmbeddingTable, ExportChunk
from tensorkv.embedding.tiered import DEFAULT_MAX_PENDING_BYTES, TierChain
from tensorkv.embedding.tiers.base import LowerTier, RecordLayout
from tensorkv.embedding.tiers.hbm import DRAMTier, HBMArena
from tensorkv.errors import ConfigError


class _SettlingLock:
    """The table's readers-writer lock; entering it first settles a deferred demotion.

    A lookup may leave its demotion running on the helper thread (see
    :meth:`TierChain.after`); whatever reads or changes tier 0 next takes this lock, and
    finds the demotion finished. Only :meth:`TieredEmbeddingTable.apply_gradients` enters
    without settling, for the promotion check of the batch just looked up.
    """

    def __init__(self, lock: Any, owner: TieredEmbeddingTable) -> None:
        self._lock = lock
        self._owner = owner

    def _settle(self) -> None:
        chain = getattr(self._owner, "_chain", None)
        if chain is not None:
            chain.settle()

    @contextmanager
    def read(self) -> Iterator[None]:
        """Shared section."""
        with self._lock.read():
            self._settle()
            yield

    @contextmanager
    def write(self, settle: bool = True) -> Iterator[None]:
        """Exclusive section (``settle=False``: a deferred demotion may still run)."""
        with self._lock.write():
            if settle:
                self._settle()
            yield


def _budget_rows(size: int | None, record_bytes: int) -> int | None:
    return None if size is None else max(1, int(size) // record_bytes)


def resolve_storage(storage: Any, storage_path: Any, storage_size: Any,
                    cache_strategy: str | None) -> StorageOption | None:
    """Turn the table's storage arguments into a :class:`StorageOption` (None: DRAM only)."""
    if storage is None:
        if storage_path is not None or storage_size is not None:
            raise ConfigError("storage_path/storage_size need storage='DRAM_SSDHASH' (or another"
                              " storage type) or storage=StorageOption(...)")
        return None
    if isinstance(storage, StorageOption):
        if storage_path is not None or storage_size is not None:
            raise ConfigError("give storage_path/storage_size inside the StorageOption, not "
                              "beside it")
        if cache_strategy is not None and cache_strategy != storage.cache_strategy:
            raise ConfigError("give cache_strategy inside the StorageOption, not beside it")
        return storage
    if isinstance(storage, str):
        return StorageOption(storage, storage_path=storage_path, storage_size=storage_size,
                             cache_strategy=cache_strategy or "lfu")
    raise ConfigError(f"storage={storage!r} must be a storage type name such as "
                      "'DRAM_SSDHASH' or a StorageOption")


class TieredEmbeddingTable(EmbeddingTable):
    """An :class:`EmbeddingTable` whose rows spill from DRAM to lower tiers.

    ``EmbeddingTable(dim, ..., storage=...)`` builds one (so does this class directly).

    Takes every :class:`EmbeddingTable` argument plus the storage ones below. Training through
    any chain gives bit-identical values, slots, frequencies and versions to the DRAM-only
    table on the same inputs; ``len``, ``keys``, ``contains``, ``frequency``, ``version``,
    ``remove``, ``export``/``import_`` and eviction (TTL, L2, ``max_rows``) see every tier.

    Operations of one tiered table run one at a time (a per-table mutex spans promotion, the
    operation and demotion); whole-table views (``len``, ``keys``, ``export``, ``evict``) first
    wait for the pending background writes.

    Parameters
    ----------
    storage
        A :class:`StorageOption` or a storage type name (``"DRAM_SSDHASH"``...).
    storage_path, storage_size, cache_strategy
        As for :class:`StorageOption` when ``storage`` is a name. Sizes are bytes; a tier
        holds ``size // record_bytes`` rows (``RecordLayout(dim, num_slots=...)``).
    max_pending_bytes
        Evicted bytes that may wait for their background write before the caller blocks
        (bytes or a size string such as ``"64MiB"``).
    device
        torch device of an HBM tier 0 (``"cuda"``; ``"cpu"`` runs the same code anywhere).
        Ignored for a DRAM tier 0.
    **kwargs
        :class:`EmbeddingTable` arguments.
    """

    def __init__(self, dim: int, *, storage: Any = None, storage_path: Any = None,
                 storage_size: Any = None, cache_strategy: str | None = None,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES, device: Any = "cuda",
                 **kwargs: Any) -> None:
        opt = resolve_storage(storage, storage_path, storage_size, cache_strategy)
        max_pending_bytes = config.parse_size(max_pending_bytes, what="max_pending_bytes")
        if max_pending_bytes < 1:
            raise ConfigError(f"max_pending_bytes={max_pending_bytes!r} must be at least 1 byte")
        if opt is not None and not kwargs.get("growth", True):
            raise ConfigError("growth=False cannot be combined with storage tiers; the tier "
                              "sizes bound the rows (storage_size=[...])")
        super().__init__(dim, **kwargs)
        self.storage = opt
        self._op = threading.RLock()
        self._lock = _SettlingLock(self._lock, self)
        layout = RecordLayout(self.dim, self.dtype, self.num_slots)
        self.layout = layout
        lowers: list[tuple[LowerTier, int | None]] = []
        budget = None
        policy = "lfu"
        if opt is not None:
            specs = opt.tier_specs()
            policy = opt.cache_strategy
            if isinstance(specs[0], HBM):
                if self.dtype != "float32":
                    raise ConfigError(f"an HBM tier 0 holds float32 rows; dtype={self.dtype!r} "
                                      "needs a DRAM tier 0 (storage='DRAM_...')")
                self._arena = HBMArena(self.dim, self.num_slots * self.dim, device=device)
            budget = _budget_rows(specs[0].size, layout.record_bytes)
            try:
                for s in specs[1:]:
                    if isinstance(s, DRAM):  # host memory below HBM
                        lowers.append((DRAMTier(layout), _budget_rows(s.size,
                                                                      layout.record_bytes)))
                        continue
                    extra = {}
                    if isinstance(s, KVTierSpec) and s.url.startswith("lmdb://") and \
                            "sync" not in s.options:
                        # like the LevelDB/RocksDB stores: no fsync per commit; flush() syncs
                        extra = {"sync": False}
                    if isinstance(s, PMEM):  # the chain enforces the budget, by rows
                        extra = {"max_bytes": None}
                        os.makedirs(os.path.dirname(os.path.abspath(s.path)), exist_ok=True)
                    tier = s.open(layout, **extra)
                    lowers.append((tier, _budget_rows(s.size, layout.record_bytes)))
                    if len(tier):
                        raise ConfigError(
                            f"tier {tier!r} already holds {len(tier)} rows; a table's lower "
                            "tiers are its spill space and must start empty. Use an empty "
                            "storage_path, or delete the old tier data (restore tables from "
                            "checkpoints)"
                        )
            except BaseException:
                for t, _ in lowers:
                    t.close()
                raise
        # The write-back pool keeps cores busy while the table trains: a multi-threaded
        # optimizer kernel would wait for its slowest thread (the one sharing a core with a
        # writer), so it runs serially unless cores outnumber the training plus writer threads.
        self._parallel = None if not lowers or (os.cpu_count() or 1) > 2 * (
            1 + config.eviction_threads()) else False
        # ... but its rows, and those of promoted-record copies, are shared with the helper
        # thread, which takes a chunk whenever the writer leaves a core idle (the training
        # thread never waits for a chunk the helper has not started)
        helper = assist.run_split if config.assist_thread() else None
        self._split = helper if self._parallel is False else None
        self._chain = TierChain(self._arena, layout, budget, lowers, policy,
                                name=f"table(dim={self.dim})",
                                max_pending_bytes=max_pending_bytes)
        self._chain.split = helper
        # a lookup's demotion runs on the helper while the training thread sums gradients
        self._defer = assist.start if helper is not None else None
        # With a helper, the metadata writes of a batch (frequency counts after a lookup,
        # versions after an update) are held here, as (kernel, args), and run with the
        # batch's demotion task
        self._held_meta: list[tuple[Any, tuple]] = []

    @property
    def device(self) -> Any:
        """The torch device of tier 0 (``"cpu"`` for a DRAM tier 0)."""
        return getattr(self._arena, "device", "cpu")

    def _apply_rows(self, rows: np.ndarray, sums: np.ndarray) -> None:
        """The optimizer step on tier-0 rows; device rows go through the host kernel."""
        if isinstance(self._arena, HBMArena):
            self._arena.apply_optimizer(self.optimizer, rows, sums, self._step)
        else:
            self.optimizer.apply(self._arena.values, self._arena.slots, rows, sums, self._step,
                                 parallel=self._parallel, split=self._split)

    def _meta_write(self, kernel: Any, *args: Any) -> None:
        # Called only inside _deferring_meta (lookup's fast path, apply). The arrays in
        # ``args`` stay tier 0's until the writes run: tier 0 grows only after a settle.
        if self._defer is None:
            kernel(*args)
        else:
            self._held_meta.append((kernel, args))

    @staticmethod
    def _run_held(held: list[tuple[Any, tuple]]) -> None:
        """Run held metadata writes in order, emptying ``held`` (a second call does nothing)."""
        while held:
            kernel, args = held.pop(0)
            kernel(*args)

    @contextmanager
    def _deferring_meta(self) -> Iterator[None]:
        """Let the operation hold its metadata writes for :meth:`_after` (with a helper thread).

        If the operation fails, what it held runs at once: its rows were changed.
        """
        try:
            yield
        except BaseException:
            self._run_held(self._held_meta)
            raise

    def _after(self, k: np.ndarray) -> None:
        """Move tier 0's excess down after a batch, with the batch's held metadata writes.

        The held writes run first, on the helper thread when the demotion is deferred
        (:meth:`TierChain.after`); the table's lock settles them before anything reads or
        changes tier 0 again.
        """
        held, self._held_meta = self._held_meta, []
        try:
            with self._lock.write():
                self._chain.after(k, defer=self._defer,
                                  first=(lambda: self._run_held(held)) if held else None)
        except BaseException:
            self._run_held(held)  # settling an earlier task failed: the writes still land
            raise

    def _init_rows(self, rows: np.ndarray, keys: np.ndarray) -> None:
        if isinstance(self._arena, HBMArena):
            self._arena.init_rows(self.initializer, rows, keys, self.seed, self._slot_init)
        else:
            super()._init_rows(rows, keys)

    # ------------------------------------------------------------------ batch operations
    def lookup_torch(self, keys: Any, insert: bool = True) -> Any:
        """:meth:`lookup` as a float32 torch tensor on tier 0's device.

        With an HBM tier 0 the lookup does the usual work on the host (promotion, insertion,
        admission, frequency counts) and the rows are gathered on the device
        (``index_select``): only keys without a row (not admitted, or ``insert=False``) have
        their initial/default value made on the host and copied up; the batch's values never
        travel to the host. With a DRAM tier 0 it is ``torch.from_numpy(lookup(keys))``.
        """
        import torch

        k = self._as_keys(keys)
        if not isinstance(self._arena, HBMArena):
            return torch.from_numpy(self.lookup(k, insert))
        # ``raw`` marks the values as gathered: _lookup only writes the rows of keys it inserts
        # or leaves out, and the device gather reads every row that exists
        return self._promoted_lookup(k, insert, None,
                                     raw=np.empty((k.shape[0], self.dim), np.float32),
                                     then=lambda host: self._arena.lookup_torch(k, fill=host))

    def prefetch(self, keys: Any) -> None:
        """Start moving the next batch's rows up from the lower tiers in the background.

        Call it with the keys of batch ``i + 1`` once batch ``i`` has been looked up (before
        its :meth:`apply_gradients`, or before the dense model's forward pass): a background
        thread reads their records from the lower tiers into spare tier-0 rows while batch
        ``i`` trains, and the :meth:`lookup` of batch ``i + 1`` only maps the keys to those
        rows. Results are bit-identical with or without prefetching (rows move whole); the
        tier-0 hit/miss counters still count the prefetched keys as misses, and
        ``stats()["tiers"][0]["prefetched"]`` counts the rows moved ahead.

        One prefetch is in flight at a time: a second call first finishes the first, and
        rows it fetched that no lookup used go back down. Operations that read below
        tier 0 (``contains``, ``frequency``, ``len``, ``export``...) wait for it.

        Examples
        --------
        >>> import numpy as np, tempfile
        >>> from tensorkv import EmbeddingTable
        >>> t = EmbeddingTable(8, optimizer="adagrad", storage="DRAM_SSDHASH",
        ...                    storage_path=tempfile.mkdtemp(), storage_size=["64KiB"])
        >>> batches = [np.arange(i * 100, i * 100 + 100) for i in range(4)] * 2
        >>> for i, keys in enumerate(batches):
        ...     rows = t.lookup(keys)
        ...     if i + 1 < len(batches):
        ...         t.prefetch(batches[i + 1])
        ...     n = t.apply_gradients(keys, np.ones_like(rows))
        >>> t.close()
        """
        k = self._as_keys(keys)
        with self._op, self._lock.write():
            self._chain.start_prefetch(k)

    def lookup(self, keys: Any, insert: bool = True,  # noqa: D102
               out: np.ndarray | None = None) -> np.ndarray:
        k = self._as_keys(keys)
        self._lookup_buffer(k.shape[0], out)  # a bad ``out`` fails before anything moves
        return self._promoted_lookup(k, insert, out)

    lookup.__doc__ = EmbeddingTable.lookup.__doc__

    def _promoted_lookup(self, k: np.ndarray, insert: bool, out: np.ndarray | None,
                         raw: np.ndarray | None = None, then: Any = None) -> Any:
        """Promote the batch, look it up, then move tier 0's excess down.

        ``raw`` is passed to :meth:`_lookup`; ``then(result)``, if given, runs on the lookup's
        result under the read lock before anything moves down, and its value is returned.
        """
        with self._op:
            with self._lock.write():
                # every key's row, after promotion; the lookup gathers them without probing
                rows = self._arena.find(k)
                self._chain.promote(k, count=True, rows=rows)
            with self._deferring_meta():
                res = self._lookup(k, insert, out, rows, raw)
            if then is not None:
                with self._lock.read():
                    res = then(res)
            self._after(k)
        return res

    def apply_gradients(self, keys: Any, grads: Any, step: int | None = None) -> int:  # noqa: D102
        k = self._as_keys(keys)
        g = self._as_grads(grads, k.shape[0])
        if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
            raise ConfigError(f"step={step!r} must be an integer or None")
        with self._op:
            # the batch just looked up needs no promotion: its rows are valid while the
            # lookup's demotion may still run; the gradients are summed meanwhile, and the
            # write lock of the update settles it
            with self._lock.write(settle=False):
                self._chain.promote(k)
                rows = self._chain.batch_rows(k)
            if rows is not None and (rows < 0).any():
                rows = None  # keys to insert (or drop, under admission): the general path
            with self._deferring_meta():
                n = self._apply(k, g, step, rows)
            self._after(k)
        return n

    apply_gradients.__doc__ = EmbeddingTable.apply_gradients.__doc__

    def upsert(self, keys: Any, values: Any) -> None:  # noqa: D102
        k = self._as_keys(keys)
        with self._op:
            with self._lock.write():
                self._chain.promote(k)
            super().upsert(k, values)
            with self._lock.write():
                self._chain.after(k)

    upsert.__doc__ = EmbeddingTable.upsert.__doc__

    def remove(self, keys: Any) -> int:  # noqa: D102
        k = self._as_keys(keys)
        with self._op:
            with self._lock.write():
                self._chain.promote(k)
            return super().remove(k)

    remove.__doc__ = EmbeddingTable.remove.__doc__

    def import_(self, chunks: Iterable[Any]) -> int:  # noqa: D102
        if isinstance(chunks, tuple) and len(chunks) >= 5 and isinstance(chunks[0], np.ndarray):
            chunks = [chunks]
        total = 0
        with self._op:
            for ch in chunks:
                keys = self._check_chunk(ch)[0]
                with self._lock.write():
                    self._chain.promote(keys)
                total += super().import_([ch])
                with self._lock.write():
                    self._chain.after(keys, protect=False)
        return total

    import_.__doc__ = EmbeddingTable.import_.__doc__

    # ------------------------------------------------------------------ reads over all tiers
    def contains(self, keys: Any) -> np.ndarray:  # noqa: D102
        k = self._as_keys(keys)
        with self._op, self._lock.read():
            out = self._arena.find(k) >= 0
            miss = np.flatnonzero(~out)
            if miss.size:
                out[miss] = self._chain.read(k[miss])[0]
        return out

    contains.__doc__ = EmbeddingTable.contains.__doc__

    def _meta_of(self, keys: Any, name: str, missing: int) -> np.ndarray:
        k = self._as_keys(keys)
        with self._op, self._lock.read():
            rows = self._arena.find(k)
            out = getattr(self._arena, name)[np.maximum(rows, 0)].copy()
            out[rows < 0] = missing
            miss = np.flatnonzero(rows < 0)
            if miss.size:
                found, recs = self._chain.read(k[miss])
                f = self.layout.unpack(recs)
                vals = f.freq if name == "freq" else f.version
                out[miss[found]] = vals[found]
        return out

    def __len__(self) -> int:
        with self._op:
            lower = self._chain.lower_len()  # settles a demotion and lands every write first
            return len(self._arena) + lower

    def keys(self) -> np.ndarray:  # noqa: D102
        with self._op:
            return np.concatenate([super().keys(), self._chain.lower_keys()])

    keys.__doc__ = EmbeddingTable.keys.__doc__

    def export(self, chunk_rows: int = 65536, since: int | None = None) -> Iterator[ExportChunk]:
        """Yield every tier's rows (tier 0 first) in chunks; see :meth:`EmbeddingTable.export`."""
        yield from super().export(chunk_rows, since)
        yield from self._chain.export(int(chunk_rows), -1 if since is None else int(since))

    # ------------------------------------------------------------------ eviction, lifecycle
    def _evict_locked(self) -> int:
        self._run_held(self._held_meta)  # the eviction rules read the batch's new versions
        if self.eviction is None:
            return 0
        dead = self._chain.evict(self.eviction, self._step)
        if dead.size == 0:
            return 0
        removed = self._arena.remove(dead)
        n = int((removed >= 0).sum()) + self._chain.remove_lower(dead[removed < 0])
        self._mseq += 1
        self._stats["evictions"] += n
        return n

    def evict(self) -> int:  # noqa: D102
        with self._op:
            return super().evict()

    evict.__doc__ = EmbeddingTable.evict.__doc__

    def clear(self) -> None:  # noqa: D102
        with self._op:
            self._chain.sync()  # the writer reads held tier-0 rows until its batches land
            super().clear()
            self._chain.clear()

    clear.__doc__ = EmbeddingTable.clear.__doc__

    def wait_writes(self) -> None:
        """Block until every background write has landed in its tier (no fsync).

        Re-raises a failed write as :class:`~tensorkv.embedding.writeback.WriteBackError`.
        Tier 0's rows are made dense again if a bulk load left them spread out (it held
        more than twice its rows for writes in flight), and the memory it held for those
        writes is given back.
        """
        with self._op:
            self._chain.sync()
            with self._lock.write():
                self._chain.pack_tier0(release=True)

    def flush(self) -> None:
        """Wait for pending background writes and flush the lower tiers (durable).

        Tier 0's rows are also made dense again if a bulk load left them spread out, and the
        memory it held for writes in flight is given back.
        """
        with self._op:
            self._chain.flush()
            with self._lock.write():
                self._chain.pack_tier0(release=True)

    def close(self) -> None:
        """Flush and close the lower tiers (the table is unusable afterwards for tiered rows)."""
        with self._op:
            self._chain.close()

    def __enter__(self) -> TieredEmbeddingTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """Sizes and counters; ``rows`` counts every tier.

        :meth:`EmbeddingTable.stats` plus ``tier0_rows`` and ``tiers``: per tier its rows,
        bytes, hits, misses, promotions (rows moved up out of it), evictions (rows moved
        down out of it) and compactions.
        """
        with self._op:
            out = super().stats()
            self._chain.sync()
            out["tier0_rows"] = out["rows"]
            out["tiers"] = self._chain.stats()
            out["rows"] = sum(int(t["rows"]) for t in out["tiers"])
        return out

    def state_dict_meta(self) -> dict[str, Any]:  # noqa: D102
        meta = super().state_dict_meta()
        meta["storage"] = None if self.storage is None else self.storage.to_dict()
        return meta

    state_dict_meta.__doc__ = EmbeddingTable.state_dict_meta.__doc__


__all__ = ["TieredEmbeddingTable", "resolve_storage"]
