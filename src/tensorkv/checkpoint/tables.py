"""Embedding-table rows in checkpoints: hash-bucketed blocks (key lists: ``keylists.py``).

Rows come from ``table.export(chunk_rows)``. Each exported chunk is split by hash bucket (the
top ``bucket_bits`` bits of ``splitmix64(key)``); the rows of one bucket of one chunk form a
*block*: one record holding keys, values, slots, freq and version (see ``docs/format.md``).
The manifest lists each block with its row count and the smallest and largest key hash in it,
so a restore onto shard ``j`` of ``M`` reads only the blocks whose hash range overlaps the
shard's range and never scans the store.
"""

from __future__ import annotations

import struct
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from tensorkv.checkpoint import layout
from tensorkv.checkpoint.keylists import ADDED, FULL, REMOVED, piece_key
from tensorkv.checkpoint.progress import OnBytes
from tensorkv.checkpoint.writer import BlockWriter
from tensorkv.codec import decode, encode_parts
from tensorkv.embedding.protocol import Table
from tensorkv.errors import CheckpointError, CorruptRecordError
from tensorkv.stores.base import KVStore

BLOCK_MAGIC = b"TKVB"
BLOCK_VERSION = 1
FIELDS = ("keys", "values", "slots", "freq", "version")
_BHEAD = struct.Struct("<4sBBH")  # magic, version, n arrays, reserved
DEFAULT_BLOCK_ROWS = 16384  # rows per block (see the block-size measurements in format.md)
DEFAULT_BUCKET_BITS = 4  # 16 hash buckets per exported chunk
READ_GROUP_BYTES = 64 * 1024 * 1024  # bytes of blocks fetched per store read


class Rows(NamedTuple):
    """Rows of a table as arrays (the fields of an export chunk)."""

    keys: np.ndarray
    values: np.ndarray
    slots: np.ndarray
    freq: np.ndarray
    version: np.ndarray


def as_rows(chunk: Any) -> Rows:
    """Normalise an export chunk (NamedTuple, dataclass or tuple) to :class:`Rows`."""
    if isinstance(chunk, tuple) and not hasattr(chunk, "keys"):
        return Rows(*chunk[:5])
    return Rows(*(getattr(chunk, f) for f in FIELDS))


def take(rows: Rows, sel: np.ndarray | slice) -> Rows:
    """Rows selected by a boolean mask, slice or index array."""
    return Rows(*(a[sel] for a in rows))


# ----------------------------------------------------------------------------- records
def _pad8(n: int) -> int:
    return (n + 7) & ~7


FieldSpec = tuple[np.dtype, tuple[int, ...]]  # (dtype, row shape) of one block field


def new_block(
    m: int, fields: tuple[FieldSpec, ...], alloc: Callable[[int], np.ndarray] | None = None
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Allocate a block record of ``m`` rows and write its header.

    Returns
    -------
    (buf, payloads)
        The uint8 record buffer (from ``alloc(nbytes)`` when given) and, per field, the
        C-contiguous ``[m, *row shape]`` view of its payload, to be filled by the caller and
        then sealed with :func:`seal_block`.
    """
    from tensorkv.codec import header_size

    shapes = [(m, *rs) for _, rs in fields]
    dtypes = [np.dtype(dt) for dt, _ in fields]
    lengths = [
        header_size(len(sh)) + int(np.prod(sh, dtype=np.int64)) * dt.itemsize
        for sh, dt in zip(shapes, dtypes, strict=True)
    ]
    head_len = _BHEAD.size + 8 * len(fields)
    size = head_len + sum(_pad8(n) for n in lengths)
    buf = np.empty(size, dtype=np.uint8) if alloc is None else alloc(size)
    buf[: _BHEAD.size] = np.frombuffer(
        _BHEAD.pack(BLOCK_MAGIC, BLOCK_VERSION, len(fields), 0), dtype=np.uint8
    )
    buf[_BHEAD.size : head_len] = np.asarray(lengths, dtype="<u8").view(np.uint8)
    payloads = []
    off = head_len
    for sh, dt, ln in zip(shapes, dtypes, lengths, strict=True):
        hs = header_size(len(sh))
        payloads.append(buf[off + hs : off + ln].view(dt).reshape(sh))
        buf[off + ln : off + _pad8(ln)] = 0
        off += _pad8(ln)
    return buf, payloads


def seal_block(buf: np.ndarray, payloads: list[np.ndarray]) -> None:
    """Write each field's tensor-record header (shape, xxh3 of the filled payload)."""
    from tensorkv.codec import header_size

    off = _BHEAD.size + 8 * len(payloads)
    for payload in payloads:
        head, _ = encode_parts(payload)
        hs = header_size(payload.ndim)
        buf[off : off + hs] = np.frombuffer(head, dtype=np.uint8)
        off += _pad8(hs + payload.nbytes)


def encode_block(
    rows: Rows, index: np.ndarray | slice | None = None,
    alloc: Callable[[int], np.ndarray] | None = None,
) -> np.ndarray:
    """One block record: a small header, then one tensor record per field (8-aligned).

    With ``index``, the rows ``field[index]`` are gathered straight into the record, so a
    block costs one copy of its bytes. ``alloc(nbytes)`` may supply the uint8 buffer.
    """
    arrays = [np.asarray(a) for a in rows]
    if index is None:
        index = slice(None)
    if isinstance(index, slice):
        index = np.arange(arrays[0].shape[0], dtype=np.int64)[index]
    buf, payloads = new_block(
        int(index.shape[0]), tuple((a.dtype, tuple(a.shape[1:])) for a in arrays), alloc
    )
    for a, payload in zip(arrays, payloads, strict=True):
        _fill(a, index, payload)
    seal_block(buf, payloads)
    return buf


def _fill(a: np.ndarray, index: np.ndarray, payload: np.ndarray) -> None:
    """``payload[:] = a[index]`` (rows)."""
    if not payload.size:
        return
    from tensorkv.checkpoint.gather import gather_rows

    gather_rows(a, index, payload)  # numba where rows are contiguous runs, else np.take


def decode_block(buf: bytes | memoryview, what: str) -> Rows:
    """Parse and verify a block record (zero-copy views into ``buf``)."""
    mv = memoryview(buf)
    if mv.nbytes < _BHEAD.size:
        raise CorruptRecordError(f"{what} is truncated ({mv.nbytes} bytes)")
    magic, version, n, _ = _BHEAD.unpack_from(mv, 0)
    if magic != BLOCK_MAGIC or n != len(FIELDS):
        raise CorruptRecordError(f"{what} is not a table block record (or is corrupted)")
    if version != BLOCK_VERSION:
        raise CheckpointError(f"{what} has block version {version}; upgrade tensorkv")
    off = _BHEAD.size + 8 * n
    if mv.nbytes < off:
        raise CorruptRecordError(f"{what} is truncated ({mv.nbytes} bytes)")
    lengths = struct.unpack_from(f"<{n}Q", mv, _BHEAD.size)
    arrays = []
    for field, ln in zip(FIELDS, lengths, strict=True):
        try:
            arrays.append(decode(mv[off : off + ln], key=f"{what} field {field}"))
        except CorruptRecordError as exc:
            raise CorruptRecordError(f"{what}: field {field!r} is corrupted ({exc})") from None
        off += _pad8(ln)
    if off != mv.nbytes:
        raise CorruptRecordError(f"{what} has {mv.nbytes - off} bytes more than its fields")
    rows = Rows(*arrays)
    m = rows.keys.shape[0]
    if any(a.shape[0] != m for a in rows):
        raise CorruptRecordError(f"{what}: its fields have different row counts")
    return rows


# ----------------------------------------------------------------------------- identity
_TOKENS: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
_TOKENS_BY_ID: dict[int, dict[str, int]] = {}


def known_states(table: Table) -> dict[str, int]:
    """The checkpoint states (state id -> mutation_seq) this table object wrote or loaded."""
    try:
        return _TOKENS.setdefault(table, {})
    except TypeError:  # not weak-referenceable
        return _TOKENS_BY_ID.setdefault(id(table), {})


def remember_state(table: Table, seq: int) -> str:
    """Record that ``table`` at ``seq`` equals a new checkpoint state; return its id."""
    sid = uuid.uuid4().hex
    known_states(table)[sid] = int(seq)
    return sid


def table_seq(table: Table) -> int:
    """The table's mutation counter."""
    return int(table.mutation_seq)


# ----------------------------------------------------------------------------- writing
def write_blocks(
    w: BlockWriter, chunks: Iterable[Any], bucket_bits: int,
    on_keys: Callable[[np.ndarray], object] | None = None, start: int = 0,
    check: Callable[[], None] | None = None,
) -> list[list[int]]:
    """Write rows as hash-bucketed blocks; return their manifest entries.

    Each entry is ``[bucket, n, rows, hash_min, hash_max]``. ``on_keys`` (if given) is called
    with each chunk's keys, sorted (int64), in chunk order; ``check`` (if given) before each
    chunk (it raises to stop).
    """
    blocks: list[list[int]] = []
    n = start
    for chunk in chunks:
        if check is not None:
            check()
        rows = as_rows(chunk)
        m = rows.keys.shape[0]
        if m == 0:
            continue
        if on_keys is not None:
            on_keys(np.sort(np.asarray(rows.keys, dtype=np.int64)))
        h, order, bounds = _bucket_order(rows.keys, bucket_bits)
        for bucket in range(len(bounds) - 1):
            lo, hi = int(bounds[bucket]), int(bounds[bucket + 1])
            if hi == lo:
                continue
            idx: np.ndarray | slice = slice(lo, hi) if order is None else order[lo:hi]
            hs = h[lo:hi]
            record = encode_block(rows, idx, w.alloc)
            w.put(layout.block_key(w.prefix, n, bucket, w.hash_tag), record)
            blocks.append([bucket, n, hi - lo, int(hs.min()), int(hs.max())])
            n += 1
    return blocks


def _bucket_order(
    keys: np.ndarray, bucket_bits: int
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(hashes in bucket order, the order (None: identity), bucket bounds) of a chunk."""
    h = layout.splitmix64(keys)
    if not bucket_bits:
        return h, None, np.array([0, h.shape[0]])
    # bucket ids fit in a byte, so the stable argsort is a radix (counting) sort
    b = layout.bucket_of_hash(h, bucket_bits).astype(np.uint8)
    order = np.argsort(b, kind="stable")
    bounds = np.searchsorted(b[order], np.arange((1 << bucket_bits) + 1))
    return h[order], order, bounds


def _gathers_in_place(table: Any) -> bool:
    """Whether ``table.export_into`` gathers every row straight from a host row arena.

    Only then is it used (:attr:`EmbeddingTable.exports_in_place`); rows of tiered tables come
    through export's chunks, which :func:`write_blocks`' row gather copies faster than
    ``export_into``'s ``np.take``.
    """
    return bool(getattr(table, "exports_in_place", False)) and hasattr(table, "export_into")


def write_table(
    w: BlockWriter, table: Any, chunk_rows: int, bucket_bits: int, since: int | None = None,
    on_keys: Callable[[np.ndarray], object] | None = None,
    check: Callable[[], None] | None = None,
) -> list[list[int]]:
    """Write a table's rows (all, or those changed after ``since``) as hash-bucketed blocks.

    ``table`` is a table or a table's snapshot
    (:class:`~tensorkv.embedding.snapshot.TableSnapshot`): anything with ``export``. Those
    whose ``export_into`` gathers rows in place (``exports_in_place``) gather their rows
    straight into the block records, so each row is copied once before the store's own copy;
    others go through :func:`write_blocks`. Returns what :func:`write_blocks` returns;
    ``check`` (if given) runs before each chunk and raises to stop.

    ``on_keys`` (if given) is called with each chunk's keys, sorted (int64), in chunk order.
    With ``export_into`` the sorting and ``on_keys`` run on a helper thread while the rows are
    gathered and written; every call has returned (or its error is raised here) when this
    function returns.
    """
    if not _gathers_in_place(table):
        chunks = table.export(chunk_rows=chunk_rows) if since is None else table.export(
            chunk_rows=chunk_rows, since=since
        )
        return write_blocks(w, chunks, bucket_bits, on_keys, check=check)
    blocks: list[list[int]] = []
    pending: list[tuple[list[int], np.ndarray, list[np.ndarray]]] = []
    helper = ThreadPoolExecutor(1, thread_name_prefix="tensorkv-ckpt-keys")
    jobs: list[Future[None]] = []

    def sort_keys(keys: np.ndarray) -> None:
        assert on_keys is not None
        on_keys(np.sort(keys))

    def place(
        keys: np.ndarray, fields: tuple[FieldSpec, ...]
    ) -> list[tuple[np.ndarray, list[np.ndarray]]]:
        # runs under the table's shared lock: only hashing, sorting and allocation here
        keys = np.asarray(keys, dtype=np.int64)
        if on_keys is not None:  # sorted (and handed on) while the rows are gathered
            jobs.append(helper.submit(sort_keys, keys))
        h, order, bounds = _bucket_order(keys, bucket_bits)
        if order is None:
            order = np.arange(keys.shape[0], dtype=np.int64)
        groups = []
        for bucket in range(len(bounds) - 1):
            lo, hi = int(bounds[bucket]), int(bounds[bucket + 1])
            if hi == lo:
                continue
            buf, payloads = new_block(hi - lo, fields, w.alloc)
            hs = h[lo:hi]
            pending.append(([bucket, 0, hi - lo, int(hs.min()), int(hs.max())], buf, payloads))
            groups.append((order[lo:hi], payloads))
        return groups

    try:
        for _ in table.export_into(place, chunk_rows=chunk_rows, since=since):
            if check is not None:
                check()
            for entry, buf, payloads in pending:
                seal_block(buf, payloads)
                entry[1] = len(blocks)
                w.put(layout.block_key(w.prefix, entry[1], entry[0], w.hash_tag), buf)
                blocks.append(entry)
            pending.clear()
            while jobs and jobs[0].done():
                jobs.pop(0).result()  # raise a helper's error early
        for job in jobs:
            job.result()
    finally:
        helper.shutdown(wait=True, cancel_futures=True)
    return blocks


def _merge2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # a stable sort (timsort) of two concatenated sorted runs is one linear merge
    return np.sort(np.concatenate((a, b)), kind="stable")


class SortedRuns(list[np.ndarray]):
    """Sorted int64 arrays, merged as they arrive (a binary counter of runs).

    ``append`` merges the newest run into the previous one while that is no larger, so runs
    are merged while the store writes, and :func:`merge_sorted` at the end merges only a
    few runs (log2 of the chunks).
    """

    def append(self, run: np.ndarray) -> None:  # noqa: D102
        while self and len(self[-1]) <= len(run):
            run = _merge2(super().pop(), run)
        super().append(run)


def merge_sorted(parts: list[np.ndarray]) -> np.ndarray:
    """One sorted int64 array from sorted int64 arrays (smallest runs merged first)."""
    if not parts:
        return np.empty(0, np.int64)
    runs = sorted(parts, key=len)
    while len(runs) > 1:
        runs.append(_merge2(runs.pop(0), runs.pop(0)))
        runs.sort(key=len)
    return runs[0]


def blocks_for_shard(
    blocks: list[list[int]], shard: int | None, num_shards: int | None
) -> list[tuple[list[int], bool]]:
    """The blocks a restore onto ``shard`` of ``num_shards`` needs.

    Each comes with a flag saying whether it must be filtered row by row (its hash range
    straddles a shard boundary).
    """
    if shard is None:
        return [(b, False) for b in blocks]
    assert num_shards is not None
    out = []
    for b in blocks:
        lo, hi = layout.shard_of_hash(np.array([b[3], b[4]], dtype=np.uint64), num_shards)
        if lo <= shard <= hi:
            out.append((b, not (lo == hi == shard)))
    return out


def read_blocks(
    store: KVStore,
    prefix: bytes,
    selected: list[tuple[list[int], bool]],
    what: str,
    shard: int | None,
    num_shards: int | None,
    hash_tag: str | None,
    on_bytes: OnBytes | None = None,
) -> Iterator[Rows]:
    """Read, verify and (at shard boundaries) filter the selected blocks.

    The next group of blocks is fetched on a helper thread while this group is decoded, so
    the store's I/O overlaps the caller's copying.
    """
    step = max(1, READ_GROUP_BYTES // max(1, _block_bytes_hint(selected)))
    groups = [selected[lo : lo + step] for lo in range(0, len(selected), step)]

    def fetch(group: list[tuple[list[int], bool]]) -> tuple[list[bytes], list[bytes | None]]:
        keys = [layout.block_key(prefix, b[1], b[0], hash_tag) for b, _ in group]
        return keys, store.get_many(keys)

    if not groups:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="tensorkv-ckpt-read") as pool:
        nxt = pool.submit(fetch, groups[0])
        for gi, group in enumerate(groups):
            keys, vals = nxt.result()
            if gi + 1 < len(groups):
                nxt = pool.submit(fetch, groups[gi + 1])
            for (b, filt), key, val in zip(group, keys, vals, strict=True):
                name = f"{what} block {b[1]} ({key.decode()})"
                if val is None:
                    raise CorruptRecordError(
                        f"{name} is missing from the store; the tag is damaged"
                    )
                rows = decode_block(val, name)
                if rows.keys.shape[0] != b[2]:
                    raise CorruptRecordError(
                        f"{name} holds {rows.keys.shape[0]} rows, expected {b[2]}"
                    )
                if on_bytes:
                    on_bytes(len(val))
                if filt:
                    assert num_shards is not None
                    mask = layout.shard_of_keys(rows.keys, num_shards) == shard
                    rows = take(rows, mask)
                yield rows
            del keys, vals


def _block_bytes_hint(selected: list[tuple[list[int], bool]]) -> int:
    # rows per block times a generous row size; only used to size read groups
    return max((b[2] for b, _ in selected), default=1) * 600


def record_keys(prefix: bytes, info: dict[str, Any], hash_tag: str | None) -> list[bytes]:
    """Every record key of one table shard (blocks, then its key lists), in order."""
    out = [layout.block_key(prefix, b[1], b[0], hash_tag) for b in info["blocks"]]
    for kind, field in ((FULL, "key_pieces"), (ADDED, "added_pieces"), (REMOVED, "removed_pieces")):
        out += [piece_key(prefix, kind, i) for i in range(info.get(field, 0))]
    return out


def filter_keys(keys: np.ndarray, shard: int | None, num_shards: int | None) -> np.ndarray:
    """Keys that belong to ``shard`` of ``num_shards`` (all when shard is None)."""
    if shard is None:
        return keys
    assert num_shards is not None
    return keys[layout.shard_of_keys(keys, num_shards) == shard]
