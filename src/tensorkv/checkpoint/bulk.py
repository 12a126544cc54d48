"""The restore pipeline of ``tensorkv.load``: records read, verified and copied in one pass.

A restore reads every record of the tag once: dense chunks go straight into their new
arrays, and table blocks straight into the rows of a new row arena
(:meth:`EmbeddingTable.bulk_import`), each block at positions fixed in advance by the
manifest's row counts. So the rows are copied once, from the store's memory where the store
lends it (LMDB's memory map, lent value by value) or from the values read.

Work is split over threads (the copies, checksums and kernels release the GIL):

- ``RESTORE_THREADS`` workers each take a record, verify it (block and tensor checksums, row
  counts, shapes) and copy it to its place;
- the calling thread, in the tag's order, maps each finished block's keys into the new hash
  index (and applies an incremental link's removals), so a later duplicate wins exactly as
  :meth:`EmbeddingTable.import_` would;
- stores that copy values (RocksDB, LevelDB, Redis) are read in groups of
  ``READ_GROUP_BYTES`` on one more thread, a group ahead of the workers.

Nothing is committed here: the caller commits the bulk imports (and assigns the arrays)
only once every record has been read and verified, so a failed load changes nothing. The
records themselves are described in ``docs/format.md``.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorkv.checkpoint import dense, layout, tables
from tensorkv.checkpoint.progress import OnBytes
from tensorkv.errors import CorruptRecordError, ShapeError
from tensorkv.pages import FreshPages
from tensorkv.stores.base import KVStore

#: Worker threads that verify and copy records (the calling thread builds the hash index).
RESTORE_THREADS = max(2, min(8, os.cpu_count() or 1))
#: Bytes of records read per store call by stores without zero-copy reads.
READ_GROUP_BYTES = tables.READ_GROUP_BYTES
#: Bytes of records handed to the workers and not yet indexed (bounds the values held).
IN_FLIGHT_BYTES = 2 * READ_GROUP_BYTES


@dataclass
class Block:
    """One table block to restore into ``imp`` at positions ``pos ..``."""

    imp: Any  # tensorkv.embedding.table.BulkImport
    table: str
    key: bytes
    pos: int
    rows: int  # as the manifest says
    filt: bool  # straddles a shard boundary: keep only the rows of ``shard``
    shard: int | None
    num_shards: int | None
    what: str
    nbytes: int  # estimate, for grouping reads


@dataclass
class Removal:
    """Keys an incremental link removed, applied after the blocks before it."""

    imp: Any
    keys: np.ndarray


@dataclass
class Chunk:
    """One dense chunk to verify and copy into ``flat`` (the tensor's bytes)."""

    name: str
    entry: dict[str, Any]
    index: int
    key: bytes
    flat: np.ndarray
    nbytes: int
    pages: FreshPages


Item = Block | Removal | Chunk


def dense_items(
    name: str, entry: dict[str, Any], pages: FreshPages
) -> tuple[np.ndarray, list[Chunk]]:
    """A new array for a stored tensor and the chunk items that fill it.

    ``pages`` (a :class:`tensorkv.pages.FreshPages`) tracks the array: the copies
    into it follow its page policy.
    """
    out = np.empty(tuple(entry["shape"]), dtype=dense.entry_dtype(entry))
    flat = out.reshape(-1).view(np.uint8)
    pages.track(flat)
    cb = entry["chunk_bytes"]
    items = [
        Chunk(name, entry, i, layout.chunk_key(d), flat, min(cb, entry["nbytes"] - i * cb),
              pages)
        for i, d in enumerate(entry["chunks"])
    ]
    return out, items


def _check_slots(b: Block, rows: tables.Rows) -> None:
    t = b.imp.table
    want = int(t.num_slots) * int(t.dim)
    if rows.slots.shape[1:] != (want,):
        opt = getattr(getattr(t, "optimizer", None), "name", "?")
        raise ShapeError(
            f"table {b.table!r}: the checkpoint stores {rows.slots.shape[-1]} optimizer slot "
            f"columns per row but the target's optimizer {opt!r} uses {want}; build the "
            "target with the optimizer it was saved with"
        )


def _restore_block(b: Block, val: Any) -> int:
    """Verify one block record and copy its rows into place; returns the rows copied."""
    name = f"{b.what} ({b.key.decode()})"
    if val is None:
        raise CorruptRecordError(f"{name} is missing from the store; the tag is damaged")
    rows = tables.decode_block(val, name)
    if rows.keys.shape[0] != b.rows:
        raise CorruptRecordError(f"{name} holds {rows.keys.shape[0]} rows, expected {b.rows}")
    if b.filt:
        assert b.num_shards is not None
        rows = tables.take(rows, layout.shard_of_keys(rows.keys, b.num_shards) == b.shard)
    _check_slots(b, rows)
    return b.imp.put(b.pos, rows)


def _restore_chunk(c: Chunk, val: Any) -> int:
    piece = dense.check_piece(c.name, c.entry, c.index, c.key, val)
    dense.place_piece(c.name, c.entry, c.index, piece, c.flat, c.pages)
    return piece.nbytes


def _values(store: KVStore, records: list[Block | Chunk], stack: ExitStack) -> Iterator[Any]:
    """The value of each record, in order, valid until ``stack`` closes.

    A zero-copy store lends each value as it is reached (``iter_buffers``); other stores
    are read in groups, the next group fetched on a helper thread while this one is used.
    """
    keys = [r.key for r in records]
    if getattr(store, "zero_copy_reads", False) and hasattr(store, "iter_buffers"):
        # one read transaction; each value lent as the workers need it, so reading the
        # pages the page cache lost overlaps the copies
        yield from stack.enter_context(store.iter_buffers(keys))
        return
    groups: list[tuple[int, int]] = []
    lo = size = 0
    for i, r in enumerate(records):
        size += r.nbytes
        if size >= READ_GROUP_BYTES or i == len(records) - 1:
            groups.append((lo, i + 1))
            lo, size = i + 1, 0
    if not groups:
        return
    pool = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="tensorkv-ckpt-read"))
    nxt = pool.submit(store.get_many, keys[groups[0][0] : groups[0][1]])
    for gi in range(len(groups)):
        vals = nxt.result()
        if gi + 1 < len(groups):
            a, b = groups[gi + 1]
            nxt = pool.submit(store.get_many, keys[a:b])
        yield from vals
        del vals


def restore(store: KVStore, items: list[Item], on_bytes: OnBytes | None = None) -> None:
    """Read, verify and place every item (see the module docstring).

    Raises the error of the first bad record in ``items`` order, once every worker has
    stopped; the bulk imports are then half filled and must be dropped.
    """
    records = [it for it in items if not isinstance(it, Removal)]
    with ExitStack() as stack:  # the values read stay valid until every worker has stopped
        values = _values(store, records, stack)
        pool = ThreadPoolExecutor(RESTORE_THREADS, thread_name_prefix="tensorkv-ckpt-restore")
        try:
            _run(pool, items, values, on_bytes)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _run(
    pool: ThreadPoolExecutor, items: list[Item], values: Iterator[Any], on_bytes: OnBytes | None
) -> None:
    pending: deque[tuple[Item, Future[int] | None]] = deque()
    in_flight = 0

    def finish() -> None:
        nonlocal in_flight
        it, fut = pending.popleft()
        if isinstance(it, Removal):
            if len(it.keys):
                it.imp.remove(it.keys)
            return
        assert fut is not None
        n = fut.result()
        in_flight -= it.nbytes
        if isinstance(it, Block):
            it.imp.index(it.pos, it.pos + n)
        if on_bytes:
            on_bytes(it.nbytes)

    for it in items:
        if isinstance(it, Removal):
            pending.append((it, None))
            continue
        if isinstance(it, Block):
            fut = pool.submit(_restore_block, it, next(values))
        else:
            fut = pool.submit(_restore_chunk, it, next(values))
        pending.append((it, fut))
        in_flight += it.nbytes
        while in_flight > IN_FLIGHT_BYTES:
            finish()
    while pending:
        finish()
