"""``tensorkv.save``: write a model into a KVStore as a tag (data first, manifest last).

A save has two phases. The *snapshot* (:func:`take_snapshots`, on the calling thread): every
table's operations are held off at once, each table's snapshot is taken and the dense tensors
are copied, so the tag records one state of the whole model; with a step scope it waits for
the training step running to end first (:mod:`tensorkv.checkpoint.steps`). The *write*
(:func:`write_save`): a pending marker, the dense chunks (on a helper thread) and each table's
blocks and key list (:func:`save_table`: in full, or only what changed since the parent), a
flush, then the manifest. ``blocking=False`` runs the write on a background thread and
returns a :class:`~tensorkv.checkpoint.handle.SaveHandle`. The records and the order that
make a tag atomic are in "Checkpoint layout" and "Atomic tags" in ``docs/format.md``; what a
tag captures in "What a tag is a snapshot of".
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, overload

import numpy as np

from tensorkv import config
from tensorkv.checkpoint import (
    claims,
    dense,
    keylists,
    layout,
    manifest,
    refs,
    runs,
    tables,
    writer,
)
from tensorkv.checkpoint.access import writeback_starter
from tensorkv.checkpoint.handle import SaveHandle, release, reserve
from tensorkv.checkpoint.objects import collect_parts
from tensorkv.checkpoint.progress import OnBytes, bar
from tensorkv.checkpoint.shards import merge_if_complete
from tensorkv.checkpoint.staging import shard_store
from tensorkv.checkpoint.steps import StepScope, default_scope
from tensorkv.embedding.protocol import Table
from tensorkv.embedding.snapshot import LiveSnapshot, TableSnapshot
from tensorkv.errors import CheckpointError, TagExistsError, UnsupportedOperationError
from tensorkv.stores.base import KVStore

#: ``dense_fn()`` of :func:`begin_save`: the dense tensors by name and extra manifest metadata.
DenseFn = Callable[[], tuple[dict[str, Any], dict[str, Any] | None]]


def _check_shards(shard: int | None, num_shards: int | None) -> tuple[int, int]:
    if shard is None and num_shards is None:
        return 0, 1
    if shard is None or num_shards is None:
        raise CheckpointError(
            f"shard={shard!r} and num_shards={num_shards!r}: give both (shard i of N) or neither"
        )
    if not isinstance(num_shards, int) or num_shards < 1:
        raise CheckpointError(f"num_shards={num_shards!r} must be a positive int")
    if not isinstance(shard, int) or not 0 <= shard < num_shards:
        raise CheckpointError(f"shard={shard!r} must be an int in [0, {num_shards})")
    return shard, num_shards


def _default_tag(step: int | None) -> str:
    if step is not None:
        return f"step-{step}"
    t = time.time()
    return time.strftime("ckpt-%Y%m%d-%H%M%S", time.gmtime(t)) + f"-{int(t * 1e6) % 1000000:06d}"


def _row_bytes(table: Table) -> int:
    meta_dim = int(getattr(table, "dim", 0) or 0)
    nslots = 0
    opt = getattr(table, "optimizer", None)
    if opt is not None and hasattr(opt, "slot_names"):
        nslots = len(opt.slot_names())
    return 8 + 4 * meta_dim * (1 + nslots) + 16


def _parent_keys(
    store: KVStore, parent_doc: dict[str, Any], name: str, shard: str, table: Table,
    parent_info: dict[str, Any],
) -> keylists.KeySet:
    """The key set of a table shard at the parent tag.

    Taken from memory when this table object saved that state, else rebuilt from the key
    lists along the parent chain.
    """
    hit = keylists.cached(table, parent_info["state"])
    if hit is not None:
        return hit
    return keylists.chain_key_set(store, parent_doc, name, shard, manifest.getter(store))


def save_table(
    store: KVStore,
    tag: str,
    name: str,
    table: Table,
    shard: int,
    num_shards: int,
    parent_doc: dict[str, Any] | None,
    opts: dict[str, Any],
    on_bytes: OnBytes | None,
    snap: TableSnapshot | None = None,
) -> dict[str, Any]:
    """Write one shard of a table's rows and key list; return its manifest entry.

    Parameters
    ----------
    store
        The destination store.
    tag
        The data tag the records are written under.
    name
        The table's name.
    table
        The EmbeddingTable (its identity: which states it saved or loaded before).
    shard, num_shards
        Which shard of the save this is.
    parent_doc
        The parent manifest of an incremental save, or None for a full save. Only the rows
        changed since the parent are written when this table object wrote or loaded it;
        otherwise the table is saved in full, with a warning.
    opts
        ``hash_tag``, ``bucket_bits``, ``block_rows`` (see :func:`save`) and optionally
        ``after_write`` (see :class:`tensorkv.checkpoint.writer.BlockWriter`) and ``check``
        (called between chunks; raises to stop the save).
    on_bytes
        Called with the byte count of each batch written (progress), or None.
    snap
        The table's snapshot to write (released here); None: one is taken now.

    Returns
    -------
    dict
        The table's manifest entry (``meta``, ``dim``, ..., ``shards`` holding this shard).
    """
    if snap is None:
        snap = table.snapshot() if hasattr(table, "snapshot") else LiveSnapshot(table)
    try:
        return _save_table(store, tag, name, table, shard, parent_doc, opts, on_bytes, snap)
    finally:
        snap.release()


def _save_table(store: KVStore, tag: str, name: str, table: Table, shard: int,
                parent_doc: dict[str, Any] | None, opts: dict[str, Any],
                on_bytes: OnBytes | None, snap: TableSnapshot) -> dict[str, Any]:
    hash_tag = opts["hash_tag"]
    bucket_bits = opts["bucket_bits"]
    chunk_rows = opts["block_rows"] << bucket_bits
    check = opts.get("check")
    prefix = layout.table_prefix(tag, name, shard, hash_tag)
    w = writer.BlockWriter(
        store, prefix, hash_tag, on_bytes, opts.get("after_write"), owner=table
    )
    seq = snap.mutation_seq
    meta = snap.meta
    entry: dict[str, Any] = {
        "meta": meta,
        "dim": int(meta.get("dim", getattr(table, "dim", 0))),
        "bucket_bits": bucket_bits,
        "hash_tag": hash_tag,
        "full": True,
        "shards": {},
    }
    try:
        info: dict[str, Any] = {}
        since = None
        parent_info = None
        if parent_doc is not None:
            pent = parent_doc["tables"].get(name)
            pinfo = None if pent is None else pent["shards"].get(str(shard))
            known = tables.known_states(table)
            same_layout = pent is not None and pent.get("hash_tag") == hash_tag
            if pinfo is not None and pinfo.get("state") in known and same_layout:
                since = known[pinfo["state"]]
                parent_info = pinfo
            else:
                why = (
                    "the parent tag has no such table shard"
                    if pinfo is None
                    else "this table object did not write or load the parent tag"
                )
                warnings.warn(
                    f"incremental save of table {name!r} to tag "
                    f"{layout.split_data_tag(tag)[0]!r}: {why} "
                    f"({parent_doc['tag']!r}); saving it in full",
                    stacklevel=5,
                )
                info["note"] = f"full save: {why}"
        if since is None:
            runs = tables.SortedRuns()  # merged on the helper thread as chunks arrive
            blocks = tables.write_table(w, snap, chunk_rows, bucket_bits, on_keys=runs.append,
                                        check=check)
            keyset = keylists.KeySet(tables.merge_sorted(runs))
            info["key_list"] = "full"
            info["key_pieces"] = keylists.write_key_list(w, keyset.base, keylists.FULL)
            removed = np.empty(0, np.int64)
        else:
            assert parent_doc is not None and parent_info is not None
            entry["full"] = False
            parent: list[keylists.KeySet] = []
            new_parts: list[np.ndarray] = []

            def parent_keys() -> keylists.KeySet:
                if not parent:
                    parent.append(
                        _parent_keys(store, parent_doc, name, str(shard), table, parent_info)
                    )
                return parent[0]

            def on_keys(run: np.ndarray) -> None:
                # on the helper thread, while the rows are gathered: the changed keys the
                # parent lacks are the added ones
                new_parts.append(run[~parent_keys().contains(run)])

            # Export chunks of block_rows changed rows (blocks of ~block_rows / 2**bucket_bits
            # rows): a small delta is then written while the rest is still being gathered.
            blocks = tables.write_table(
                w, snap, opts["block_rows"], bucket_bits, since, on_keys=on_keys, check=check
            )
            pset = parent_keys()
            added = tables.merge_sorted(new_parts)
            if len(snap) == len(pset) + len(added):
                removed = np.empty(0, np.int64)
            else:  # some keys were removed since the parent: diff the key sets
                pkeys = pset.to_array()
                keys = np.sort(np.asarray(snap.keys(), dtype=np.int64))
                removed = pkeys[~keylists.sorted_member(keys, pkeys)]
            keyset = pset.apply(added, removed, check=False)
            info["key_list"] = "delta"
            info["key_pieces"] = 0
            info["added"] = int(len(added))
            info["added_pieces"] = (
                keylists.write_key_list(w, added, keylists.ADDED) if len(added) else 0
            )
        info.update(
            {
                "blocks": blocks,
                "rows": int(sum(b[2] for b in blocks)),
                "num_keys": int(len(keyset)),
                "removed": int(len(removed)),
                "removed_pieces": (
                    keylists.write_key_list(w, removed, keylists.REMOVED) if len(removed) else 0
                ),
                "seq": seq,
            }
        )
        w.flush()
    except BaseException:
        w.abort()
        raise
    info["full"] = since is None
    info["state"] = tables.remember_state(table, seq)
    keylists.remember(table, info["state"], keyset)
    entry["shards"][str(shard)] = info
    return entry


# --------------------------------------------------------------------------- the snapshot phase
def _shares_memory(arr: np.ndarray, src: Any) -> bool:
    """Whether ``arr`` (from :func:`dense.to_numpy`) may be the memory of ``src`` itself."""
    if isinstance(src, np.ndarray):
        return bool(np.may_share_memory(arr, src))
    if dense.is_torch_tensor(src):
        if src.device.type != "cpu":
            return False  # to_numpy copied it to the host
        storage = src.untyped_storage()
        lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        p = int(arr.__array_interface__["data"][0])
        return lo <= p < hi or lo < p + arr.nbytes <= hi
    return True  # another array-like: copy to be safe


def take_snapshots(
    tables_in: dict[str, Any], dense_fn: DenseFn, scope: StepScope | None = None,
    chunk_bytes: int = config.CHECKPOINT_CHUNK_BYTES, stored: set[str] | None = None,
) -> tuple[dict[str, TableSnapshot], dict[str, dense.DenseSnapshot], dict[str, Any]]:
    """Take one snapshot of every table and of the dense tensors, all at one moment.

    With ``scope``, the training step running ends first and the next waits
    (:meth:`StepScope.exclusive`). Then every table is frozen at once (in the order of their
    ids, so two saves never wait for each other), each table's snapshot is taken and
    ``dense_fn()`` runs; its tensors are hashed in chunks of ``chunk_bytes``, and the chunks
    whose digests are not in ``stored`` (what the target store is known to hold) are copied.
    Only the copies of tier 0's keys and of those chunks, and the hashing, happen in here.

    Returns
    -------
    (snapshots, dense snapshots, metadata)
        A snapshot per table name, a :class:`~tensorkv.checkpoint.dense.DenseSnapshot` per
        dense tensor, and the extra metadata ``dense_fn`` gave.
    """
    seen: dict[int, str] = {}
    for name, t in tables_in.items():
        if id(t) in seen:
            raise CheckpointError(f"one table object is saved under two names ({seen[id(t)]!r} "
                                  f"and {name!r}); save it once")
        seen[id(t)] = name
    snaps: dict[str, TableSnapshot] = {}
    with scope.exclusive() if scope is not None else contextlib.nullcontext(), \
            contextlib.ExitStack() as frozen:
        for t in sorted(tables_in.values(), key=id):
            if hasattr(t, "freeze"):
                frozen.enter_context(t.freeze())
        try:
            dense_in, extra = dense_fn()
            parts = []  # the dense chunks are hashed on helpers while the tables snapshot
            for name, val in dense_in.items():
                layout.check_var_name(name)
                arr, tdt = dense.to_numpy(name, val)
                parts.append((name, arr, tdt, not _shares_memory(arr, val),
                              dense.start_digests(arr, chunk_bytes)))
            for name, t in tables_in.items():
                snaps[name] = t.snapshot() if hasattr(t, "snapshot") else LiveSnapshot(t)
            dense_s = {name: dense.snapshot_tensor(arr, tdt, chunk_bytes, owned, stored or set(),
                                                   digests)
                       for name, arr, tdt, owned, digests in parts}
        except BaseException:
            for s in snaps.values():
                s.release()
            raise
    clash = sorted(set(dense_s) & set(tables_in))
    if clash:
        for s in snaps.values():
            s.release()
        raise CheckpointError(f"names {clash} are both module state and embedding tables")
    return snaps, dense_s, dict(extra or {})


# --------------------------------------------------------------------------- the API
@overload
def save(
    obj: Any,
    url: str | KVStore,
    tag: str | None = None,
    *,
    step: int | None = None,
    incremental: bool = False,
    shard: int | None = None,
    num_shards: int | None = None,
    run: str | None = None,
    metadata: dict[str, Any] | None = None,
    progress: bool | None = None,
    ttl: float | None = None,
    parent: str | None = None,
    hash_tag: str | None = None,
    block_rows: int = tables.DEFAULT_BLOCK_ROWS,
    bucket_bits: int = tables.DEFAULT_BUCKET_BITS,
    chunk_bytes: int = config.CHECKPOINT_CHUNK_BYTES,
    blocking: Literal[True] = True,
    step_scope: StepScope | bool = True,
    on_pending: str | None = None,
) -> str: ...


@overload
def save(
    obj: Any,
    url: str | KVStore,
    tag: str | None = None,
    *,
    step: int | None = None,
    incremental: bool = False,
    shard: int | None = None,
    num_shards: int | None = None,
    run: str | None = None,
    metadata: dict[str, Any] | None = None,
    progress: bool | None = None,
    ttl: float | None = None,
    parent: str | None = None,
    hash_tag: str | None = None,
    block_rows: int = tables.DEFAULT_BLOCK_ROWS,
    bucket_bits: int = tables.DEFAULT_BUCKET_BITS,
    chunk_bytes: int = config.CHECKPOINT_CHUNK_BYTES,
    blocking: Literal[False],
    step_scope: StepScope | bool = True,
    on_pending: str | None = None,
) -> SaveHandle: ...


@overload
def save(
    obj: Any,
    url: str | KVStore,
    tag: str | None = None,
    *,
    step: int | None = None,
    incremental: bool = False,
    shard: int | None = None,
    num_shards: int | None = None,
    run: str | None = None,
    metadata: dict[str, Any] | None = None,
    progress: bool | None = None,
    ttl: float | None = None,
    parent: str | None = None,
    hash_tag: str | None = None,
    block_rows: int = tables.DEFAULT_BLOCK_ROWS,
    bucket_bits: int = tables.DEFAULT_BUCKET_BITS,
    chunk_bytes: int = config.CHECKPOINT_CHUNK_BYTES,
    blocking: bool = True,
    step_scope: StepScope | bool = True,
    on_pending: str | None = None,
) -> str | SaveHandle: ...


def save(
    obj: Any,
    url: str | KVStore,
    tag: str | None = None,
    *,
    step: int | None = None,
    incremental: bool = False,
    shard: int | None = None,
    num_shards: int | None = None,
    run: str | None = None,
    metadata: dict[str, Any] | None = None,
    progress: bool | None = None,
    ttl: float | None = None,
    parent: str | None = None,
    hash_tag: str | None = None,
    block_rows: int = tables.DEFAULT_BLOCK_ROWS,
    bucket_bits: int = tables.DEFAULT_BUCKET_BITS,
    chunk_bytes: int = config.CHECKPOINT_CHUNK_BYTES,
    blocking: bool = True,
    step_scope: StepScope | bool = True,
    on_pending: str | None = None,
) -> str | SaveHandle:
    """Save a model into a key-value store as a new tag.

    The tag records one state of the model: every table and dense tensor as they were at one
    moment between two table operations (between two training steps with a step scope),
    whatever other threads do meanwhile. Data is written first and the manifest last, so a
    save that dies midway leaves no visible tag and every earlier tag loadable.

    Parameters
    ----------
    obj
        A dict of numpy arrays / torch tensors / EmbeddingTables, an EmbeddingTable, or a
        torch ``nn.Module`` (its ``state_dict()`` plus the EmbeddingTables held as attributes
        anywhere in its module tree). A table with a ``save_sharded`` method (a
        ``ShardedEmbeddingTable``) saved alone to a URL has each of its shards write its rows.
    url
        Store URL (``lmdb:///path``, ``redis://host:6379/0``, ...) or an open KVStore.
    tag
        Tag name (default ``step-<step>`` or a timestamp). Must not exist yet.
    step
        Training step, recorded in the manifest.
    incremental
        Store only the table rows changed (and keys removed) since the parent tag (default: the
        latest tag). A table that did not write or load the parent is saved in full, with a
        warning. Dense chunks identical to stored ones are never written twice either way.
    shard, num_shards
        Save shard ``shard`` of ``num_shards``; the tag becomes visible when the last shard
        finishes (or on :func:`tensorkv.checkpoint.merge`). Every shard must give the same
        ``num_shards``, ``step``, ``incremental`` and ``parent`` (the first shard fixes the
        parent of an incremental save); a shard that differs, or meets shards of another
        run of the tag, raises :class:`~tensorkv.errors.ShardRunError`. Into a LevelDB or
        RocksDB URL each shard writes a stage of its own and takes turns on the store.
    run
        Identity of one sharded save, the same for its every shard and new for each attempt
        (e.g. ``f"{job_id}-{restart_count}"``): a shard of another run is refused. Without
        it the run is known by a token its first shard records (see docs/format.md for what
        that can and cannot tell apart).
    metadata
        JSON-serialisable user data kept in the manifest.
    progress
        Progress bar: None (auto: on a terminal, after ``config.PROGRESS_MIN_SECONDS``; never
        for ``blocking=False``), True or False.
    ttl
        Seconds after which the tag expires (invisible to loads, removed by gc).
    parent
        Parent tag of an incremental save (default: the latest tag).
    hash_tag
        Redis Cluster hash tags in table keys: None, ``"table"``, ``"bucket"`` or a literal.
    block_rows, bucket_bits, chunk_bytes
        Layout tuning: rows per table block, hash buckets per export chunk (2**bits), dense
        chunk size in bytes.
    blocking
        True: return once the tag is published. False: return a
        :class:`~tensorkv.checkpoint.handle.SaveHandle` as soon as the snapshot is taken (the
        training threads are held off only for that) and write in the background;
        ``handle.result()`` gives the tag or raises the save's error.
    step_scope
        True (default): take the snapshot between two training steps of the process's
        default step scope (``tensorkv.training_step()``, ``tensorkv.torch.Optimizer``): the
        step running ends first, the next waits. Free when no step runs. A
        :class:`~tensorkv.checkpoint.steps.StepScope`: that scope. False: between two table
        operations, with no wait for steps.
    on_pending
        A table of this save still being written by an earlier save: ``"wait"`` for it or
        ``"error"`` (:class:`~tensorkv.errors.SaveInProgressError`); default
        ``TENSORKV_SAVE_PENDING`` or ``"wait"``.

    Returns
    -------
    str or SaveHandle
        The tag name (``blocking=True``), or the handle of the save in flight.

    Raises
    ------
    StepScopeError
        The calling thread is inside a training step of ``step_scope``.

    Notes
    -----
    Memory kept after a save, with the saved table objects (released when they are): each
    table's sorted key set at the saved state (8 bytes per key), so the next incremental save
    does not read it back, and record buffers, at most ``writer.KEEP_BYTES`` (320 MB) over all
    tables, so the next save reuses memory instead of touching fresh pages. While a save
    writes, its snapshot holds memory: the dense tensors' copies, 10 bytes per row of tier 0,
    the rows training changes before the save has read them (at most one copy of tier 0),
    and for tiered tables 16 bytes per key below tier 0 plus the records moved or deleted
    before the save read them (``SaveHandle.stats()``; docs/format.md).
    """
    sharded = getattr(obj, "save_sharded", None)  # a table whose shards save themselves
    if sharded is not None and isinstance(url, str) and shard is None and num_shards is None:
        if not blocking:
            raise UnsupportedOperationError(
                "blocking=False is not available for a sharded table saved on its own (its "
                "shards save themselves); save it with blocking=True")
        return str(sharded(url, _default_tag(step) if tag is None else tag, step=step,
                           incremental=incremental, parent=parent, metadata=metadata, ttl=ttl))
    kind, tables_in, dense_fn = collect_parts(obj)
    return begin_save(kind, tables_in, dense_fn, url, tag, step=step, incremental=incremental,
                      shard=shard, num_shards=num_shards, run=run, metadata=metadata,
                      progress=progress,
                      ttl=ttl, parent=parent, hash_tag=hash_tag, block_rows=block_rows,
                      bucket_bits=bucket_bits, chunk_bytes=chunk_bytes, blocking=blocking,
                      step_scope=step_scope, on_pending=on_pending)


def begin_save(
    kind: str,
    tables_in: dict[str, Any],
    dense_fn: DenseFn,
    url: str | KVStore,
    tag: str | None = None,
    *,
    step: int | None = None,
    incremental: bool = False,
    shard: int | None = None,
    num_shards: int | None = None,
    run: str | None = None,
    metadata: dict[str, Any] | None = None,
    progress: bool | None = None,
    ttl: float | None = None,
    parent: str | None = None,
    hash_tag: str | None = None,
    block_rows: int = tables.DEFAULT_BLOCK_ROWS,
    bucket_bits: int = tables.DEFAULT_BUCKET_BITS,
    chunk_bytes: int = config.CHECKPOINT_CHUNK_BYTES,
    blocking: bool = True,
    step_scope: StepScope | bool = True,
    on_pending: str | None = None,
) -> str | SaveHandle:
    """:func:`save` of a model given as its tables and a function producing its dense part.

    ``dense_fn()`` runs inside the snapshot's barrier and returns the dense tensors by name
    and extra metadata for the manifest (merged into ``metadata``): state that changes in
    place while training (a torch optimizer's) is read there. The other arguments are
    :func:`save`'s.
    """
    shard_i, nshards = _check_shards(shard, num_shards)
    run = runs.check_run_id(run)
    if nshards > 1 and tag is None and step is None:
        raise CheckpointError(
            f"shard={shard_i} of num_shards={nshards}: give tag= or step=, the same for every "
            "shard (a default tag from the clock would differ between shards)"
        )
    tag = layout.check_tag(_default_tag(step) if tag is None else tag)
    if ttl is not None and (not isinstance(ttl, (int, float)) or ttl <= 0):
        raise CheckpointError(f"ttl={ttl!r} must be a positive number of seconds")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1024:
        raise CheckpointError(f"chunk_bytes={chunk_bytes!r} must be an int >= 1024")
    if not isinstance(block_rows, int) or block_rows < 1:
        raise CheckpointError(f"block_rows={block_rows!r} must be a positive int")
    if not isinstance(bucket_bits, int) or not 0 <= bucket_bits <= 8:
        raise CheckpointError(f"bucket_bits={bucket_bits!r} must be an int in [0, 8]")
    if not isinstance(blocking, bool):
        raise CheckpointError(f"blocking={blocking!r} must be True or False")
    if metadata is not None:
        try:
            json.dumps(metadata)
        except TypeError as exc:
            raise CheckpointError(f"metadata is not JSON-serialisable: {exc}") from None
    scope: StepScope | None
    if step_scope is True:
        scope = default_scope()
    elif step_scope is False or step_scope is None:
        scope = None
    elif isinstance(step_scope, StepScope):
        scope = step_scope
    else:
        raise CheckpointError(f"step_scope={step_scope!r} must be True, False or a StepScope")
    config.save_pending(on_pending)  # bad values fail here, before anything waits
    nice = config.save_nice() if not blocking else 0
    handle = SaveHandle(tag, tables_in.values())
    reserve(handle, on_pending)
    where = url if isinstance(url, str) else url.url
    try:
        t0 = time.perf_counter()
        snaps, dense_s, extra = take_snapshots(tables_in, dense_fn, scope, chunk_bytes,
                                               dense.stored_digests(where))
        meta = dict(metadata or {})
        meta.update(extra)
    except BaseException:
        release(handle)
        raise
    handle.attach(list(snaps.values()), sum(d.nbytes for d in dense_s.values()),
                  time.perf_counter() - t0)
    opts: dict[str, Any] = {
        "hash_tag": hash_tag, "bucket_bits": bucket_bits, "block_rows": block_rows,
        "check": handle.check,
    }

    def work() -> str:
        return write_save(handle, kind, url, tables_in, snaps, dense_s,
                          step=step, incremental=incremental, shard=(shard_i, nshards), run=run,
                          metadata=meta or metadata, progress=progress if blocking else
                          bool(progress), ttl=ttl, parent=parent, chunk_bytes=chunk_bytes,
                          opts=opts)

    handle.run(work, background=not blocking, nice=nice)
    return handle.result() if blocking else handle


# --------------------------------------------------------------------------- the write phase
def write_save(
    handle: SaveHandle, kind: str, url: str | KVStore, tables_in: dict[str, Any],
    snaps: dict[str, TableSnapshot], dense_s: dict[str, dense.DenseSnapshot], *,
    step: int | None, incremental: bool,
    shard: tuple[int, int], run: str | None, metadata: dict[str, Any] | None, progress: bool | None,
    ttl: float | None, parent: str | None, chunk_bytes: int, opts: dict[str, Any],
) -> str:
    """Write a save's snapshots into the store and publish the tag; returns the tag."""
    tag = handle.tag
    shard_i, nshards = shard
    with shard_store(url, nshards > 1) as store:
        opts["after_write"] = writeback_starter(store)
        what = f"tag {tag!r}" + (f" (shard {shard_i} of {nshards})" if nshards > 1 else "")
        # A shard joins the run saving its tag (or begins one) and writes under the run's
        # data tag, so two runs never share a key (runs.py).
        r = None
        data_tag, mkey = tag, layout.manifest_key(tag)
        if nshards > 1:
            r = runs.join(store, tag, run=run, shard=shard_i, num_shards=nshards, step=step,
                          incremental=incremental, parent=parent)
            data_tag, mkey = r.data_tag, layout.run_part_key(tag, r.token, shard_i)
        # The pending marker goes first, created atomically: of two processes saving this
        # tag one goes on, the other fails here. The chunks referenced now (read below) are
        # then safe from a concurrent delete_tag or gc, which keep unreferenced chunks while
        # a save runs.
        pkey = layout.pending_key(data_tag, shard_i)
        with claims.holding(store, pkey, what) as c:
            if r is not None:
                r = runs.confirm(store, r, shard_i, c)
            else:
                runs.refuse_running(store, tag)
            if store.get(layout.manifest_key(tag)) is not None or store.get(mkey) is not None:
                raise TagExistsError(
                    f"{what} {'is already saved' if nshards > 1 else 'already exists'} in "
                    f"{store.url!r}; choose another tag or delete it first with tensorkv.delete_tag"
                )

            def drop_tables() -> None:  # the table data of this save (shared chunks are gc's)
                for name in tables_in:
                    store.delete_prefix(layout.table_prefix(data_tag, name, shard_i,
                                                            opts["hash_tag"]))

            if c.took_over is not None:  # a dead process's save of this tag: drop its data
                drop_tables()
            parent_doc = None
            docs = manifest.read_all(store, include_expired=True)  # once: parent and chunks
            if incremental and r is not None:  # the parent the run's first shard fixed
                parent_doc = None if r.parent is None else manifest.read(store, r.parent)
            elif incremental:
                if parent is not None:
                    parent_doc = manifest.read(store, parent)
                else:
                    now = time.time()
                    live = {t: d for t, d in docs.items() if not manifest.is_expired(d, now)}
                    if live:
                        parent_doc = live[manifest.sorted_tags(live)[-1]]
            doc = manifest.new_manifest(
                tag,
                step=step,
                parent=None if parent_doc is None else parent_doc["tag"],
                metadata=metadata,
                num_shards=nshards,
                ttl=ttl,
            )
            doc["kind"] = kind
            doc["incremental"] = False
            doc["shards"] = [shard_i]
            if r is not None or run is not None:
                doc["run"] = r.identity() if r is not None else {"id": run, "token": None}
            total = sum(int(d.entry["nbytes"]) for d in dense_s.values()) + sum(
                snaps[n].approx_rows * _row_bytes(t) for n, t in tables_in.items()
            )
            pbar = bar(total, f"save {tag}", progress)
            progress_lock = threading.Lock()

            def on_bytes(n: int) -> None:  # called from the writer threads too
                with progress_lock:
                    pbar.update(n)

            c.on_failure = drop_tables
            try:
                known = refs.referenced_chunks(store, docs)
                _write_records(store, data_tag, doc, dense_s, tables_in, snaps,
                               (shard_i, nshards), parent_doc, opts, known, on_bytes)
                if data_tag != tag:
                    for ent in doc["tables"].values():
                        ent["data_tag"] = data_tag
                store.flush()
                handle.publishing()  # a cancel() from now on comes too late
                doc["created"] = time.time()  # the tag's life starts when it becomes visible
                if ttl is not None:
                    doc["expires"] = doc["created"] + float(ttl)
                claims.publish(c, what, mkey, manifest.encode_manifest(doc), refs.record_keys(doc))
                dense.remember_stored(url if isinstance(url, str) else store.url, known)
                if r is not None:  # while the claim is held: gc and delete_tag leave the run
                    c.on_failure = None  # the shard is saved: its records stay with its manifest
                    merge_if_complete(store, r)
            finally:
                pbar.close()
    return tag


def _write_records(
    store: KVStore, tag: str, doc: dict[str, Any], dense_s: dict[str, dense.DenseSnapshot],
    tables_in: dict[str, Any], snaps: dict[str, TableSnapshot], shard: tuple[int, int],
    parent_doc: dict[str, Any] | None, opts: dict[str, Any], known: set[str],
    on_bytes: OnBytes,
) -> None:
    """Write the dense chunks (on a helper thread) and every table's records of a save.

    Fills ``doc["dense"]`` and ``doc["tables"]``; a failure stops both writers first.
    """
    shard_i, nshards = shard
    dense_w = writer.BlockWriter(store, b"", None, on_bytes, opts["after_write"])

    doc["dense"] = {name: d.entry for name, d in dense_s.items()}  # hashed in the snapshot

    def write_dense() -> None:  # queues the chunks the store lacks on dense_w's writer thread
        dense.write_tensors(dense_w, dense_s, known, on_bytes)
        dense_w.send()

    with ThreadPoolExecutor(1, thread_name_prefix="tensorkv-ckpt-dense") as helper:
        dense_job = helper.submit(write_dense)
        try:
            for name, table in tables_in.items():
                ent = save_table(
                    store, tag, name, table, shard_i, nshards, parent_doc, opts, on_bytes,
                    snaps[name],
                )
                doc["tables"][name] = ent
                if not ent["full"]:
                    doc["incremental"] = True
            dense_job.result()
            dense_w.flush()
        except BaseException:
            dense_job.cancel()
            with contextlib.suppress(BaseException):
                dense_job.result()
            dense_w.abort()
            raise
