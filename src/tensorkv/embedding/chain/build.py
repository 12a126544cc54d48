"""Building a table's rows from its storage arguments: :func:`resolve_storage`, :func:`open_rows`.

:func:`open_rows` opens every tier a :class:`~tensorkv.embedding.chain.specs.StorageOption`
names and returns the table's :class:`~tensorkv.embedding.chain.rows.ChainBackend`; see
docs/tiers.md ("Tier chains").
"""

from __future__ import annotations

import os
from typing import Any

from tensorkv import config
from tensorkv.embedding.arena import RowArena
from tensorkv.embedding.chain import assist
from tensorkv.embedding.chain.rows import ChainBackend
from tensorkv.embedding.chain.specs import DRAM, HBM, KV, PMEM, StorageOption
from tensorkv.embedding.chain.tierchain import DEFAULT_MAX_PENDING_BYTES, TierChain
from tensorkv.embedding.rows import ArenaBackend
from tensorkv.embedding.tiers.base import LowerTier, RecordLayout
from tensorkv.embedding.tiers.dram import DRAMTier
from tensorkv.embedding.tiers.hbm_arena import HBMArena
from tensorkv.embedding.tiers.ssdhash_files import make_dirs
from tensorkv.errors import ConfigError, ShapeError, SpillDataExistsError


def resolve_storage(storage: Any, storage_path: Any = None, storage_size: Any = None,
                    cache_strategy: str | None = None) -> StorageOption | None:
    """Turn a table's storage arguments into a :class:`StorageOption` (None: DRAM only).

    Raises
    ------
    ConfigError
        Paths or sizes without a storage type, both spellings at once, or an unknown type.
    """
    if storage is None:
        if storage_path is not None or storage_size is not None or cache_strategy is not None:
            raise ConfigError("storage_path/storage_size/cache_strategy need storage="
                              "'DRAM_SSDHASH' (or another storage type) or "
                              "storage=StorageOption(...)")
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


def _budget_rows(spec: Any, record_bytes: int) -> int | None:
    """The rows a tier's size holds (None: unbounded); a size under one row is refused."""
    if spec.size is None:
        return None
    rows = int(spec.size) // record_bytes
    if rows < 1:
        raise ConfigError(
            f"{spec.kind} tier size {spec.size} bytes holds no row: a row with its optimizer "
            f"slots and metadata takes {record_bytes} bytes here; give at least "
            f"{record_bytes} bytes (e.g. storage_size=['1GiB']), or None for no limit")
    return rows


def _open_lowers(specs: list[Any], layout: RecordLayout,
                 storage: StorageOption) -> list[tuple[LowerTier, int | None]]:
    """Open the tiers below tier 0, each empty, with its budget in rows."""
    lowers: list[tuple[LowerTier, int | None]] = []
    try:
        for s in specs:
            budget = _budget_rows(s, layout.record_bytes)
            if isinstance(s, DRAM):  # host memory below HBM
                lowers.append((DRAMTier(layout), budget))
                continue
            extra: dict[str, Any] = {"overwrite": storage.overwrite}
            if isinstance(s, KV) and s.url.startswith("lmdb://") and "sync" not in s.options:
                # like the LevelDB/RocksDB stores: no fsync per commit; flush() syncs
                extra["sync"] = False
            if isinstance(s, PMEM):  # the chain enforces the budget, by rows
                extra["max_bytes"] = None
                if s.path is not None:
                    make_dirs(os.path.dirname(s.path))
            try:
                tier = s.open(layout, **extra)
            except ShapeError as e:  # data of another layout
                raise _in_use(s.kind, s.location, f"rows of another layout ({e})",
                              storage) from None
            lowers.append((tier, budget))
            if len(tier):
                raise _in_use(s.kind, tier.location, f"{len(tier)} rows", storage)
    except BaseException:
        for t, _ in lowers:
            t.close()
        raise
    return lowers


def _in_use(kind: str, where: str | None, what: str,
            storage: StorageOption) -> SpillDataExistsError:
    name = f"{storage.storage_type!r}, storage_path=..." if storage.storage_type else "tiers=[...]"
    return SpillDataExistsError(
        f"the {kind} tier at {where!r} already holds {what}, left by an earlier table. A "
        "table's lower tiers are its spill space, not a checkpoint, and are not reopened: "
        "the rows held in memory at close, the step and the optimizer state are not in "
        "them (tensorkv.save/load keep a table). To wipe it and start empty pass "
        f"overwrite=True: storage=StorageOption({name}, overwrite=True); or give a new or "
        "empty path, or no path for a temporary directory removed on close"
    )


def open_rows(
    storage: StorageOption,
    *,
    dim: int,
    dtype: str,
    num_slots: int,
    capacity: int | None = None,
    max_pending_bytes: int | str = DEFAULT_MAX_PENDING_BYTES,
    device: Any = "cuda",
) -> ArenaBackend:
    """Open the tiers of ``storage`` for rows of ``dim``: :class:`ChainBackend`, or Redis rows.

    ``StorageOption("REDIS", ...)`` opens a table whose rows live in Redis
    (:class:`~tensorkv.embedding.redis.rows.RedisBackend`).

    Parameters
    ----------
    storage
        The chain of tiers.
    dim, dtype, num_slots
        Row width, value storage dtype and optimizer slots of the table.
    capacity
        Initial row capacity of a DRAM tier 0.
    max_pending_bytes
        Evicted bytes that may wait for their background write before the caller blocks.
    device
        torch device of an HBM tier 0 (ignored for a DRAM tier 0).
    """
    if storage.redis is not None:  # rows live in Redis: a working set per operation
        from tensorkv.embedding.redis.rows import open_redis_rows

        return open_redis_rows(storage, dim=dim, dtype=dtype, num_slots=num_slots,
                               capacity=capacity)
    pending = config.parse_size(max_pending_bytes, what="max_pending_bytes")
    if pending < 1:
        raise ConfigError(f"max_pending_bytes={max_pending_bytes!r} must be at least 1 byte")
    layout = RecordLayout(dim, dtype, num_slots)
    specs = storage.tier_specs()
    budget0 = [_budget_rows(s, layout.record_bytes) for s in specs][0]  # before opening any
    arena: RowArena
    if isinstance(specs[0], HBM):
        if dtype != "float32":
            raise ConfigError(f"an HBM tier 0 holds float32 rows; dtype={dtype!r} needs a DRAM "
                              "tier 0 (storage='DRAM_...')")
        arena = HBMArena(dim, num_slots * dim, device=device)
    else:
        arena = RowArena(dim, num_slots * dim, capacity=capacity, dtype=dtype)
    lowers = _open_lowers(specs[1:], layout, storage)
    # The write-back pool keeps cores busy while the table trains: a multi-threaded
    # optimizer kernel would wait for its slowest thread (the one sharing a core with a
    # writer), so it runs serially unless cores outnumber the training plus writer threads.
    parallel = None if not lowers or (os.cpu_count() or 1) > 2 * (
        1 + config.eviction_threads()) else False
    # ... but its rows, and those of promoted-record copies, are shared with the helper
    # thread, which takes a chunk whenever the writer leaves a core idle (the training
    # thread never waits for a chunk the helper has not started)
    helper = assist.run_split if config.assist_thread() else None
    chain = TierChain(arena, layout, budget0, lowers,
                      storage.cache_strategy, name=f"table(dim={dim})",
                      max_pending_bytes=pending)
    chain.split = helper
    # a lookup's demotion runs on the helper while the training thread sums gradients
    return ChainBackend(chain, storage, parallel=parallel,
                     split=helper if parallel is False else None,
                     defer=assist.start if helper is not None else None)


__all__ = ["open_rows", "resolve_storage"]
