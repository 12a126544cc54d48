"""One embedding table of one tag, read in chunks: scans, pages, rows of keys, samples.

A :class:`TableView` reads the table's blocks (``docs/format.md``) straight from the store,
a group of blocks at a time, and never holds the whole table. Rows come in a fixed *scan
order*: the saved shards in turn, each shard's blocks in their manifest order; for an
incremental tag, the rows of its newest link first, then each older link's rows that no newer
link replaced or removed. ``offset`` numbers rows in that order (pages of the web viewer).

Chunks yielded by :meth:`TableView.chunks` may be views of the store's memory (LMDB) that stay
valid only until the next chunk is asked for: copy what must be kept (the methods that return
rows return copies).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from tensorkv.checkpoint import keylists, layout, tables
from tensorkv.checkpoint.load import table_links
from tensorkv.checkpoint.tables import Rows
from tensorkv.errors import QueryError
from tensorkv.stores.base import KVStore
from tensorkv.viewer.limits import MAX_NUMBER_CHARS, check_length, shown

#: Bytes of blocks fetched from the store per read (one LMDB transaction, one Redis round trip).
READ_GROUP_BYTES = 128 * 1024 * 1024
_MADV_DONTNEED = 4  # <sys/mman.h> on Linux: drop this process's mapping of the pages


class Chunk(NamedTuple):
    """Rows of a table read together.

    Attributes
    ----------
    offset
        Scan-order position of the chunk's first row.
    rows
        keys (int64), values ``[n, dim]``, slots ``[n, slot columns]``, freq and version
        (int64): possibly views of the store's memory, valid until the next chunk.
    """

    offset: int
    rows: Rows


@dataclass
class _Part:
    """One block to read: where it is, its entry, and the keys a newer link overrides."""

    key: bytes
    block: list[int]  # [bucket, n, rows, min hash, max hash]
    what: str
    exclude: np.ndarray | None  # sorted keys to drop (chains), or None

    @property
    def exact(self) -> bool:
        return self.exclude is None


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_META_BYTES = 8 + 8 + 8  # key, freq, version of a table row


def table_rows_at(ent: dict[str, Any]) -> int:
    """Rows of a table entry of a manifest at its tag (incremental entries: ``num_keys``)."""
    n = 0
    for info in ent["shards"].values():
        if "num_keys" in info:
            n += int(info["num_keys"])
        else:  # format 1: every tag held its full key list and full rows
            n += sum(int(b[2]) for b in info["blocks"])
    return n


def slot_columns(ent: dict[str, Any]) -> int:
    """Optimizer slot columns per row of a table entry (0 when the optimizer is unknown)."""
    from tensorkv.embedding.optimizers import optimizer_from_config

    cfg = (ent.get("meta", {}).get("optimizer") or {}).get("config")
    if not cfg:
        return 0
    try:
        return int(optimizer_from_config(cfg).num_slots) * int(ent["dim"])
    except Exception:  # a config of a newer tensorkv: size unknown, not an error here
        return 0


def row_bytes(ent: dict[str, Any]) -> int:
    """Stored bytes of one row of a table entry (key, value, slots, frequency, version)."""
    dtype = str(ent.get("meta", {}).get("dtype", "float32"))
    return _META_BYTES + int(ent["dim"]) * _ITEMSIZE.get(dtype, 4) + 4 * slot_columns(ent)


def _unmap(buffers: list[Any]) -> None:
    """Drop this process's mapping of the whole pages inside each buffer (a hint)."""
    from tensorkv import pages

    ranges = []
    for b in buffers:
        a = np.frombuffer(b, np.uint8)
        ranges.append((a.ctypes.data, a.ctypes.data + a.nbytes))
    pages.madvise_ranges(ranges, _MADV_DONTNEED)


def copy_rows(rows: Rows) -> Rows:
    """Rows that own their memory (copies of views)."""
    return Rows(*(np.array(a, copy=True) for a in rows))


def concat_rows(parts: Sequence[Rows], like: Rows | None = None) -> Rows:
    """One set of rows from several (empty rows shaped like ``like`` when there are none)."""
    if not parts:
        if like is None:
            raise ValueError("concat_rows of no parts needs like=")
        return Rows(*(a[:0].copy() for a in like))
    if len(parts) == 1:
        return copy_rows(parts[0])
    return Rows(*(np.concatenate(cols) for cols in zip(*parts, strict=True)))


def _union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.union1d(a, b).astype(np.int64, copy=False)


class TableView:
    """Read-only access to table ``name`` of the tag whose manifest is ``doc``.

    Build one with :meth:`tensorkv.viewer.Catalog.table`.

    Attributes
    ----------
    name, tag
        The table and the tag.
    dim, dtype
        Row width and value dtype.
    rows
        Rows at the tag.
    slot_columns
        Optimizer slot columns per row.
    chained
        Whether the tag's rows come from several links (an incremental tag).
    release_pages
        Stores that lend values from a memory map (LMDB): after each group of blocks is
        read, unmap its pages from this process (``madvise(MADV_DONTNEED)``; the page cache
        keeps them). A scan then holds at most one group (``READ_GROUP_BYTES``) in the
        process's resident memory instead of every page it read, at the cost of mapping the
        pages again on the next scan (about 1 s per 2.7 GB here): for a long-running server.
    """

    def __init__(self, store: KVStore, doc: dict[str, Any], name: str, *,
                 release_pages: bool = False):
        self.store = store
        self.release_pages = release_pages
        self.doc = doc
        self.name = name
        self.tag: str = doc["tag"]
        ent = doc["tables"][name]
        self.entry = ent
        self.dim = int(ent["dim"])
        self.dtype = str(ent.get("meta", {}).get("dtype", "float32"))
        self.rows = table_rows_at(ent)
        self.slot_columns = slot_columns(ent)
        self.meta: dict[str, Any] = ent.get("meta", {})
        self._parts = self._plan()
        self.chained = any(not p.exact for p in self._parts)

    def __len__(self) -> int:
        return self.rows

    def __repr__(self) -> str:
        return f"TableView({self.name!r}, tag={self.tag!r}, rows={self.rows}, dim={self.dim})"

    # ------------------------------------------------------------------ planning
    def _plan(self) -> list[_Part]:
        parts: list[_Part] = []
        for s, chain in table_links(self.store, self.doc, self.name).items():
            shadow = np.empty(0, np.int64)  # keys a newer link replaced or removed
            for i, (tag, ent, info) in enumerate(reversed(chain)):
                hash_tag = ent.get("hash_tag")
                prefix = layout.table_prefix(ent.get("data_tag", tag), self.name, int(s), hash_tag)
                what = f"table {self.name!r} (tag {tag!r}, shard {s})"
                if info.get("removed_pieces"):
                    shadow = _union(shadow, keylists.read_key_list(
                        self.store, prefix, info["removed_pieces"], what, keylists.REMOVED))
                exclude = shadow if (len(chain) > 1 and shadow.size) else None
                blocks = info["blocks"]
                parts += [_Part(layout.block_key(prefix, b[1], b[0], hash_tag), b,
                                f"{what} block {b[1]}", exclude) for b in blocks]
                if i + 1 < len(chain) and blocks:  # older links: drop the keys this one holds
                    sel = [(b, False) for b in blocks]
                    keys = [np.array(r.keys) for r in tables.read_blocks(
                        self.store, prefix, sel, what, None, None, hash_tag)]
                    shadow = _union(shadow, np.concatenate(keys))
        return parts

    # ------------------------------------------------------------------ reading
    def _decode(self, part: _Part, val: Any, hash_range: tuple[int, int] | None) -> Rows:
        from tensorkv.errors import CorruptRecordError

        if val is None:
            raise CorruptRecordError(f"{part.what} ({part.key.decode()}) is missing from the "
                                     "store; the tag is damaged")
        rows = tables.decode_block(val, part.what)
        if rows.keys.shape[0] != part.block[2]:
            raise CorruptRecordError(
                f"{part.what} holds {rows.keys.shape[0]} rows, expected {part.block[2]}")
        mask = None
        if part.exclude is not None:
            mask = ~keylists.sorted_member(part.exclude, rows.keys)
        if hash_range is not None and not (
                hash_range[0] <= part.block[3] and part.block[4] <= hash_range[1]):
            h = layout.splitmix64(rows.keys)
            inside = (h >= np.uint64(hash_range[0])) & (h <= np.uint64(hash_range[1]))
            mask = inside if mask is None else mask & inside
        return rows if mask is None else tables.take(rows, mask)

    def _groups(self, parts: list[_Part]) -> list[list[_Part]]:
        per_row = 8 * 3 + 4 * (self.dim + self.slot_columns) + 64
        groups: list[list[_Part]] = []
        size = 0
        for p in parts:
            nbytes = p.block[2] * per_row
            if not groups or size + nbytes > READ_GROUP_BYTES:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        return groups

    def _read(self, parts: list[_Part], hash_range: tuple[int, int] | None = None
              ) -> Iterator[tuple[_Part, Rows]]:
        """Decoded rows of each part (views valid until the next one is asked for)."""
        groups = self._groups(parts)
        if getattr(self.store, "zero_copy_reads", False):
            for group in groups:
                with self.store.get_many_buffers([p.key for p in group]) as vals:
                    try:
                        for p, v in zip(group, vals, strict=True):
                            yield p, self._decode(p, v, hash_range)
                    finally:  # also when the caller stops early (a page, a sample)
                        if self.release_pages:
                            _unmap([v for v in vals if v is not None])
            return
        if not groups:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="tensorkv-viewer-read") as pool:
            nxt = pool.submit(self.store.get_many, [p.key for p in groups[0]])
            for gi, group in enumerate(groups):
                vals = nxt.result()
                if gi + 1 < len(groups):
                    nxt = pool.submit(self.store.get_many, [p.key for p in groups[gi + 1]])
                for p, v in zip(group, vals, strict=True):
                    yield p, self._decode(p, v, hash_range)
                del vals

    def chunks(self, *, start: int = 0, hash_range: tuple[int, int] | None = None
               ) -> Generator[Chunk, None, None]:
        """Every row from scan position ``start`` on, a block at a time.

        Parameters
        ----------
        start
            Skip the rows before this scan position (blocks before it are not read when the
            tag is not incremental).
        hash_range
            Only rows whose key hash (``splitmix64``, see ``docs/format.md``) lies in
            ``[lo, hi]`` (inclusive); only the blocks that can hold them are read. Offsets
            then count the selected rows only.

        Yields
        ------
        Chunk
            Views valid until the next chunk: copy what must be kept.
        """
        if start < 0:
            raise QueryError(f"start={start} must be >= 0")
        parts = self._parts
        if hash_range is not None:
            lo, hi = int(hash_range[0]), int(hash_range[1])
            parts = [p for p in parts if p.block[4] >= lo and p.block[3] <= hi]
        pos = 0
        skip = 0
        if hash_range is None:  # skip whole blocks of known size without reading them
            while skip < len(parts) and parts[skip].exact and pos + parts[skip].block[2] <= start:
                pos += parts[skip].block[2]
                skip += 1
        for _, rows in self._read(parts[skip:], hash_range):
            n = rows.keys.shape[0]
            if pos + n <= start or n == 0:
                pos += n
                continue
            if pos < start:
                rows = tables.take(rows, slice(start - pos, None))
                yield Chunk(start, rows)
            else:
                yield Chunk(pos, rows)
            pos += n

    def page(self, offset: int, limit: int) -> Rows:
        """Copies of the rows at scan positions ``offset .. offset + limit - 1``."""
        if limit < 0:
            raise QueryError(f"limit={limit} must be >= 0")
        got: list[Rows] = []
        n = 0
        it = self.chunks(start=offset)
        try:
            for ch in it:
                if n >= limit:
                    break
                take = ch.rows if n + len(ch.rows.keys) <= limit else tables.take(
                    ch.rows, slice(0, limit - n))
                got.append(copy_rows(take))
                n += len(take.keys)
        finally:
            it.close()
        return concat_rows(got, self.empty())

    def empty(self) -> Rows:
        """No rows, with this table's dtypes and row widths."""
        from tensorkv.checkpoint.dense import entry_dtype

        vdt = entry_dtype({"dtype": self.dtype})
        return Rows(np.empty(0, np.int64), np.empty((0, self.dim), vdt),
                    np.empty((0, self.slot_columns), np.float32),
                    np.empty(0, np.int64), np.empty(0, np.int64))

    def lookup(self, keys: Any) -> tuple[Rows, np.ndarray]:
        """The rows of the given keys, and which keys have one.

        Only the blocks whose hash range can hold a key are read.

        Returns
        -------
        (rows, found)
            ``rows`` (copies) of the keys found, in the order of ``keys`` (duplicates
            once, where first given); ``found`` a boolean mask over ``keys``.
        """
        k = as_keys(keys)
        if k.size == 0:
            return self.empty(), np.zeros(0, bool)
        uniq = np.unique(k)
        hs = np.sort(layout.splitmix64(uniq))
        parts = self._parts
        if parts:
            lo = np.array([p.block[3] for p in parts], np.uint64)
            hi = np.array([p.block[4] for p in parts], np.uint64)
            hit = np.searchsorted(hs, lo, "left") < np.searchsorted(hs, hi, "right")
            parts = [p for p, h in zip(parts, hit, strict=True) if h]
        got: list[Rows] = []
        for _, rows in self._read(parts):
            m = keylists.sorted_member(uniq, rows.keys)
            if m.any():
                got.append(copy_rows(tables.take(rows, m)))
        rows = concat_rows(got, self.empty())
        order = np.argsort(rows.keys, kind="stable")
        sk = rows.keys[order]
        pos = np.searchsorted(sk, k)
        pos_c = np.minimum(pos, max(len(sk) - 1, 0))
        found = (pos < len(sk)) & (sk[pos_c] == k) if len(sk) else np.zeros(len(k), bool)
        _, first = np.unique(k, return_index=True)
        want = np.zeros(len(k), bool)
        want[first] = True
        want &= found
        return tables.take(rows, order[pos_c[want]]), found

    def sample(self, n: int, seed: int = 0) -> Rows:
        """About ``n`` rows spread over the table: whole blocks chosen at random, then rows.

        Reads only the blocks it takes (enough of them to hold ``n`` rows), so a sample of a
        10M-row table costs a few blocks, not a scan.
        """
        if n <= 0:
            return self.empty()
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(self._parts))
        sizes = np.array([self._parts[int(i)].block[2] for i in order], np.int64)
        k = int(np.searchsorted(np.cumsum(sizes), 2 * n)) + 1
        chosen = [self._parts[int(i)] for i in np.sort(order[:k])]
        got = [copy_rows(r) for _, r in self._read(chosen)]
        rows = concat_rows(got, self.empty())
        if len(rows.keys) > n:
            pick = np.sort(rng.choice(len(rows.keys), n, replace=False))
            rows = tables.take(rows, pick)
        return rows


def as_keys(keys: Any) -> np.ndarray:
    """Keys as an int64 array (ints or numeric strings).

    Raises
    ------
    QueryError
        A key is not an integer in the int64 range (or its text is longer than
        :data:`~tensorkv.viewer.limits.MAX_NUMBER_CHARS`).
    """
    if isinstance(keys, np.ndarray) and keys.dtype == np.int64:
        return keys.reshape(-1)
    vals = [keys] if isinstance(keys, (int, str, np.integer)) else list(keys)
    out = np.empty(len(vals), np.int64)
    for i, v in enumerate(vals):  # user input: a handful of keys
        if isinstance(v, str):
            check_length("key", v.strip(), MAX_NUMBER_CHARS)
        try:
            iv = int(v, 0) if isinstance(v, str) else int(v)
        except (TypeError, ValueError):
            raise QueryError(f"key {shown(v)} is not an integer; table keys are int64") from None
        if not -(2**63) <= iv < 2**63:
            raise QueryError(f"key {shown(v)} is outside the int64 range of table keys")
        out[i] = iv
    return out
