"""The engine of a Redis-resident table: rows packed into bucket hashes, with checksums.

Every row is one field of a Redis hash (a *bucket*) named ``<model_tag>:<table>{<tag>}``:
the field is the key's 8 little-endian bytes, the value the row's record
(:class:`~tensorkv.embedding.tiers.base.RecordLayout`: key, freq, version, change sequence,
values, slots) followed by the XXH64 checksum of the record. A batch goes out as HMGET
commands of at most ``keys_sending_size`` fields, pipelined per node, and replies are decoded
whole with numpy. Each read also reads its buckets' identity fields (epoch, version, intent:
:mod:`~tensorkv.embedding.redis.lua`) in the same round trip and refuses rows of a bucket
that was lost. Exact mode adds bucket locks (``<bucket>:lock``, same slot). Commits:
:mod:`~tensorkv.embedding.redis.commit`. Layout, locks and migration:
docs/redis_table.md.
"""

from __future__ import annotations

import functools
import itertools
import json
import operator
import os
import random
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from tensorkv.embedding.redis import lua
from tensorkv.embedding.redis.options import RedisTableOptions
from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.errors import (
    ConfigError,
    CorruptRecordError,
    RowLockError,
    ShapeError,
    TableLostError,
)
from tensorkv.kernels import resp
from tensorkv.kernels.checksums import record_checksums
from tensorkv.stores import open_store
from tensorkv.stores.redis_keys import bounds, key_slots
from tensorkv.stores.redis_raw import RawFallback

#: Fields per HMGET / HSET command at most (Lua's unpack() limit is ~8000 values).
SCRIPT_FIELDS = 2000
#: Redis Cluster hash slots.
SLOTS = 16384
_NO_BUCKETS = np.zeros(0, np.int64)
#: A bucket's identity fields, as one HMGET reply: ``[epoch, version, intent mark]``.
Head = list


@functools.lru_cache(maxsize=1)
def _tag_of_slot() -> np.ndarray:
    """For every Cluster slot, the smallest decimal number whose text hashes to it."""
    n = 1 << 18
    while True:
        slots = key_slots([b"%d" % i for i in range(n)])
        uniq, first = np.unique(slots, return_index=True)
        if uniq.size == SLOTS:
            return first
        n *= 2  # pragma: no cover - 2**18 numbers cover every slot


def generated_tags(n: int) -> tuple[str, ...]:
    """``n`` hash tags whose Cluster slots are spread evenly over the 16384 slots."""
    table = _tag_of_slot()
    targets = (2 * np.arange(n, dtype=np.int64) + 1) * SLOTS // (2 * n)
    tags = [str(int(t)) for t in table[targets % SLOTS]]
    if len(set(tags)) != n:  # more buckets than slots: suffix the repeats
        tags = [f"{t}.{i}" if n > SLOTS else t for i, t in enumerate(tags)]
    return tuple(tags)


def _mix(keys: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser of the keys' bits (uint64): an even spread of any key set."""
    z = keys.view(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Buckets:
    """The bucket hashes of one model tag: names, lock names and the bucket of each key.

    Parameters
    ----------
    prefix
        The store's namespace.
    model_tag, table
        Bucket names are ``<model_tag>:<table>{<tag>}``.
    n
        Number of buckets (``storage_slice``).
    tags
        One hash tag per bucket (None: :func:`generated_tags`).
    by_hash
        A key's bucket by :func:`_mix` (else ``key mod n``).
    """

    def __init__(self, prefix: bytes, model_tag: str, table: str, n: int,
                 tags: Sequence[str] | None, by_hash: bool) -> None:
        self.n = n
        self.by_hash = by_hash
        self.tags = tuple(tags) if tags is not None else generated_tags(n)
        self.model_tag = model_tag
        base = prefix + f"{model_tag}:{table}".encode()
        self.names = [base + b"{" + t.encode() + b"}" for t in self.tags]
        self.locks = [b + b":lock" for b in self.names]
        self.meta_key = base + b":layout"
        self.marker_key = base + b":migration"
        #: The table's epoch every bucket must hold (None: not checked).
        self.epoch: str | None = None
        #: The highest version seen of each bucket (-1: none yet).
        self.seen = np.full(n, -1, np.int64)

    def of(self, keys: np.ndarray) -> np.ndarray:
        """Bucket of each key (int64)."""
        if self.by_hash:
            return (_mix(keys) % np.uint64(self.n)).astype(np.int64)
        return np.mod(keys, self.n)

    def describe(self) -> dict[str, Any]:
        """What the bucket layout depends on (kept in Redis beside the rows)."""
        return {"model_tag": self.model_tag, "storage_slice": self.n, "tags": list(self.tags),
                "using_hash_storage_slice": self.by_hash}


def key_bytes(keys: np.ndarray) -> np.ndarray:
    """Hash fields of int64 keys as ``uint8[n, 8]`` (little-endian)."""
    return np.ascontiguousarray(keys, "<i8").view(np.uint8).reshape(-1, 8)


def encode_fields(keys: np.ndarray) -> list[bytes]:
    """Hash fields of int64 keys: their 8 little-endian bytes."""
    return keys.astype("<i8").view("V8").tolist()


def interleave(a: list[Any], b: list[Any]) -> list[Any]:
    """``[a0, b0, a1, b1, ...]``."""
    out: list[Any] = [None] * (2 * len(a))
    out[0::2] = a
    out[1::2] = b
    return out


def _text(x: Any) -> bytes | None:
    return None if x is None else bytes(x)


class RedisRowEngine:
    """Rows of one table in Redis: batched reads with identity checks, locks and scans.

    Parameters
    ----------
    options
        The table's options.
    layout
        Record layout of the rows.
    """

    def __init__(self, options: RedisTableOptions, layout: RecordLayout) -> None:
        from tensorkv.stores.redis import RedisStore

        self.options = options
        self.layout = layout
        self.record_bytes = layout.record_bytes
        self.width = layout.record_bytes + 8  # record, then its checksum
        store_options = dict(options.store_options)
        if options.read_only:  # no write command can leave this process
            store_options["readonly"] = True
        store = open_store(options.url, **store_options)
        if not isinstance(store, RedisStore):  # pragma: no cover - the URL check forbids it
            store.close()
            raise ConfigError(f"{options.url!r} is not a Redis URL")
        self.store = store
        #: Reads go where a read-only table may read (replicas, if asked); writers read the
        #: primaries, the only copies their locks cover.
        self.rd = options.read_only
        #: Versions are checked to grow only on the primaries (replicas lag behind each other).
        self.strict_versions = not (options.read_only and options.redis_read_access_slave)
        o = options
        prefix = store.options.prefix
        self.runtime = Buckets(prefix, o.model_tag_runtime, o.table_name, o.storage_slice,
                               o.redis_hash_tags_runtime, o.using_hash_storage_slice)
        self.source = Buckets(prefix, str(o.model_tag_import), o.table_name,
                              int(o.storage_slice_import or o.storage_slice),
                              o.redis_hash_tags_import, o.using_hash_storage_slice)
        self._ks = max(1, min(o.keys_sending_size, SCRIPT_FIELDS))
        #: The servers' run ids when the table was opened (for the messages of lost data).
        self.run_ids: str | None = None
        #: Committed two-phase operations whose intents are not all applied yet (see
        #: :func:`~tensorkv.embedding.redis.commit.finish`).
        self.unfinished: list[Any] = []
        #: When a list: :meth:`check_heads` appends ``(bucket, version, has intent)`` of
        #: every runtime bucket it checks (the near-cache's view of a round trip).
        self.head_log: list[tuple[int, int, bool]] | None = None
        #: When a list: the sockets the raw reads came on, and None for a read that ran on
        #: the generic path (whose connection is not known).
        self.raw_sockets: list[Any] | None = None
        #: ``(buckets, versions)`` the last commit set, when one script reported them.
        self.committed: tuple[np.ndarray, np.ndarray] | None = None
        self.counters = {"reads": 0, "writes": 0, "deletes": 0, "round_trips": 0,
                         "lock_waits": 0, "migrated": 0, "raw_fallbacks": 0,
                         "resolved_intents": 0, "two_phase_commits": 0, "settled": 0}

    def close(self) -> None:
        """Close the connection."""
        self.store.close()

    def where(self, b: Buckets | None = None) -> str:
        """The table, for messages."""
        b = b or self.runtime
        return (f"table {self.options.table_name!r} under model tag {b.model_tag!r} at "
                f"{self.options.url!r}")

    def script(self, body: str, key: bytes, keys: Sequence[bytes], args: Sequence[Any],
               read: bool = False) -> Any:
        """Run one Lua script (routed by ``key``); returns its reply."""
        return self.store.execute([(key, ("EVAL", body, len(keys), *keys, *args))],
                                  read=read)[0]

    def scripts(self, calls: Sequence[tuple[str, Sequence[bytes], Sequence[Any]]],
                read: bool = False) -> list[Any]:
        """Run Lua scripts ``(body, keys, args)`` pipelined (routed by their first key)."""
        return self.store.execute([(keys[0], ("EVAL", body, len(keys), *keys, *args))
                                   for body, keys, args in calls], read=read)

    # ----------------------------------------------------------------- layout metadata
    def layout_meta(self, b: Buckets) -> dict[str, Any]:
        """The JSON kept at ``<model_tag>:<table>:layout``."""
        return {"format": "tensorkv-redis-table", "version": 2,
                "layout": self.layout.to_dict(), **b.describe()}

    def read_meta(self, b: Buckets) -> dict[str, Any] | None:
        """The layout record of ``b``'s tag, or None."""
        raw = self.store.execute([(b.meta_key, ("GET", b.meta_key))], read=self.rd)[0]
        return None if raw is None else json.loads(raw)

    def check_meta(self, b: Buckets, meta: dict[str, Any] | None, what: str) -> None:
        """Refuse rows stored with another record layout or bucket layout."""
        if meta is None:
            return
        stored = RecordLayout.from_dict(meta["layout"])
        where = f"{self.options.url!r} under {b.model_tag!r}:{self.options.table_name!r}"
        if stored != self.layout:
            raise ShapeError(f"{where} holds rows of {stored}; this table has {self.layout} "
                             "(dim, dtype and optimizer slots must match); use another "
                             "model_tag or table_name")
        mine = b.describe()
        diff = [k for k in ("storage_slice", "tags", "using_hash_storage_slice")
                if meta.get(k) != mine[k]]
        if diff:
            raise ConfigError(
                f"{where} holds rows bucketed with storage_slice={meta.get('storage_slice')}, "
                f"using_hash_storage_slice={meta.get('using_hash_storage_slice')} and hash tags "
                f"{(meta.get('tags') or [])[:4]}...; {what} differs in {', '.join(diff)}. To "
                "rehash them, give the stored values as storage_slice_import / "
                "redis_hash_tags_import")

    def write_meta(self, b: Buckets, **extra: Any) -> None:
        """Record ``b``'s layout (overwriting), with ``extra`` fields (epoch, state)."""
        self.store.execute([(b.meta_key, ("SET", b.meta_key,
                                          json.dumps({**self.layout_meta(b), **extra})))])

    # ----------------------------------------------------------------- identity
    def check_heads(self, b: Buckets, heads: Sequence[tuple[int, Head]]) -> list[tuple[int, bytes]]:
        """Check the identity fields ``[epoch, version, mark]`` read of buckets of ``b``.

        Raises :class:`~tensorkv.errors.TableLostError` when a bucket lost its epoch (or holds
        another one) or went back to an older version; returns ``[(bucket, intent mark)]`` of
        the buckets holding an intent.
        """
        lost: list[tuple[int, str]] = []
        marks: list[tuple[int, bytes]] = []
        for k, (e, v, m) in heads:
            if b.epoch is not None and (e is None or e.decode() != b.epoch):
                lost.append((k, "holds no epoch" if e is None else f"holds epoch {e.decode()}"))
                continue
            ver = -1 if v is None else int(v)
            if ver < b.seen[k] and self.strict_versions:
                lost.append((k, f"went back from version {int(b.seen[k])} to {ver}"))
                continue
            b.seen[k] = max(int(b.seen[k]), ver)
            if m is not None:
                marks.append((k, bytes(m)))
            if self.head_log is not None and b is self.runtime:
                self.head_log.append((k, ver, m is not None))
        if lost:
            raise self.lost(b, lost)
        return marks

    def lost(self, b: Buckets, problems: Sequence[tuple[int, str]]) -> TableLostError:
        """The error for buckets of ``b`` that lost their rows (``[(bucket, what)]``)."""
        meta = None
        try:
            meta = self.read_meta(b)
            now = self.store.identity()
        except Exception:  # noqa: BLE001 - the message is best effort; the error stands
            now = None
        k, what = problems[0]
        head = (f"{self.where(b)}: {len(problems)} of its {b.n} buckets lost their rows "
                f"(bucket {b.names[k]!r} {what})")
        if any("epoch moved:" in w for _, w in problems):
            return TableLostError(
                f"{self.where(b)} was rehashed into another bucket layout by another process "
                "since this one opened it (or the rehash is under way); nothing was read or "
                "written. Open the table again with the new layout's options")
        if meta is not None and meta.get("epoch") not in (None, b.epoch):
            return TableLostError(
                f"{self.where(b)} was emptied (on_lost='start_empty'), re-created or rehashed "
                f"by another process since this one opened it (epoch {b.epoch} -> "
                f"{meta.get('epoch')}); nothing was read or written. Open the table again")
        server = ""
        if self.run_ids is not None and now is not None and now != self.run_ids:
            server = f"; the server's run id changed from {self.run_ids} to {now} (a restart " \
                     "or a failover)"
        return TableLostError(
            f"{head}{server}: the server restarted without persistence, was flushed, evicted "
            "the keys or failed over to a replica that lacks them. Nothing was read or "
            "written, and no row is re-created from its initial value. Restore the rows: open "
            "the table with on_lost='start_empty' (it empties what is left under a new epoch; "
            "every other process must reopen) and load a checkpoint into it (tensorkv.load), "
            "or restore the server's data. Run Redis with persistence (appendonly yes) and "
            "replicas to avoid this")

    def heads(self, b: Buckets, buckets: Sequence[int]) -> list[tuple[int, Head]]:
        """``[(bucket, [epoch, version, mark])]`` of ``buckets`` of ``b`` (one round trip)."""
        replies = self.store.execute([(b.names[k], ("HMGET", b.names[k], *lua.HEAD))
                                      for k in buckets], read=self.rd)
        return [(k, [_text(x) for x in r]) for k, r in zip(buckets, replies, strict=True)]

    # ----------------------------------------------------------------- encoding
    def seal(self, recs: np.ndarray) -> np.ndarray:
        """Append each record's checksum: ``uint8[n, width]`` (``recs`` may be that wide)."""
        n = recs.shape[0]
        if recs.shape[1] == self.width:
            out = recs
        else:
            out = np.zeros((n, self.width), np.uint8)
            out[:, : self.record_bytes] = recs
        out[:, self.record_bytes:].view(np.int64)[:, 0] = record_checksums(out, self.record_bytes)
        return out

    def decode(self, replies: list[Any], keys: np.ndarray | None, where: str,
               bad_out: list[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(found, records uint8[found, width])`` of HMGET values, checksums checked.

        ``keys``: the key each value was asked for (checked against the record's key field).
        A row failing its checks raises :class:`CorruptRecordError`, or, with ``bad_out``,
        reads as absent and its key is appended to ``bad_out``.
        """
        n = len(replies)
        found = np.fromiter(map(operator.is_not, replies, itertools.repeat(None)), bool, n)
        nf = int(found.sum())
        blob = b"".join(itertools.compress(replies, found))
        if len(blob) != nf * self.width and bad_out is not None and keys is not None:
            lens = np.fromiter(map(len, itertools.compress(replies, found)), np.int64, nf)
            wrong = np.flatnonzero(found)[lens != self.width]
            bad_out.append(keys[wrong])
            replies = list(replies)
            for i in wrong.tolist():  # rows of the wrong size only
                replies[i] = None
            return self.decode(replies, keys, where, bad_out)
        if len(blob) != nf * self.width:
            self._wrong_sizes(where, [len(v) for v in itertools.compress(replies, found)
                                      if len(v) != self.width])
        recs = np.frombuffer(blob, np.uint8).reshape(nf, self.width)
        return self.verify(found, recs, keys, where, bad_out)

    def _wrong_sizes(self, where: str, sizes: list[int]) -> NoReturn:
        raise CorruptRecordError(
            f"{where} holds values of {sizes[:3]} bytes; rows of this table are {self.width} "
            "bytes (record + checksum): a value written by something else, or another layout")

    def verify(self, found: np.ndarray, recs: np.ndarray, keys: np.ndarray | None, where: str,
               bad_out: list[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Check the checksums (and keys) of ``recs``, the rows of ``keys[found]``.

        Returns ``(found, recs)``, without the failing rows when ``bad_out`` is given (see
        :meth:`decode`); otherwise a failing row raises :class:`CorruptRecordError`.
        """
        nf = recs.shape[0]
        sums = recs[:, self.record_bytes:].copy().view(np.int64)[:, 0]
        bad_rows = np.flatnonzero(record_checksums(recs, self.record_bytes) != sums)
        if keys is not None and nf:
            rk = recs[:, :8].copy().view(np.int64)[:, 0]
            bad_rows = np.union1d(bad_rows, np.flatnonzero(rk != keys[found]))
        if bad_rows.size and bad_out is not None and keys is not None:
            pos = np.flatnonzero(found)[bad_rows]
            bad_out.append(keys[pos])
            found[pos] = False
            return found, np.delete(recs, bad_rows, axis=0)
        if bad_rows.size:
            rk = recs[bad_rows, :8].copy().view(np.int64)[:, 0]
            raise CorruptRecordError(
                f"{bad_rows.size} rows in {where} fail their checksum or hold another key "
                f"(keys {rk[:8].tolist()}): half-written or changed outside tensorkv. Nothing "
                "was read. table.remove, upsert or import_ of those keys replaces them")
        return found, recs

    # ----------------------------------------------------------------- batches
    def grouped(self, b: Buckets, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                              list[tuple[int, int, int]]]:
        """``(order, sorted bucket ids, [(bucket, start, stop)...])`` chunks of sorted keys."""
        bk = b.of(keys)
        order = np.argsort(bk, kind="stable")
        sb = bk[order]
        cuts = bounds(keys.shape[0], self._ks, groups=sb).tolist()
        chunks = [(int(sb[a]), a, c) for a, c in zip(cuts[:-1], cuts[1:], strict=True)]
        return order, sb, chunks

    def _chunked(self, b: Buckets, keys: np.ndarray) -> tuple[np.ndarray,
                                                              list[tuple[int, int, int]]]:
        """:meth:`grouped`'s order and chunks (none for no keys)."""
        if keys.shape[0] == 0:
            return np.zeros(0, np.int64), []
        order, _, chunks = self.grouped(b, keys)
        return order, chunks

    def get(self, keys: np.ndarray, b: Buckets | None = None, read: bool = True,
            bad_out: list[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(found bool[n], records uint8[n, width])`` of ``keys`` (absent rows zero).

        ``read``: may read from replicas (``redis_read_access_slave``); ``bad_out``: see
        :meth:`decode`.
        """
        n = keys.shape[0]
        pos, recs = self.get_found(keys, b, read, bad_out)
        found = np.zeros(n, bool)
        found[pos] = True
        out = np.zeros((n, self.width), np.uint8)
        out[pos] = recs
        return found, out

    def get_found(self, keys: np.ndarray, b: Buckets | None = None, read: bool = True,
                  bad_out: list[np.ndarray] | None = None,
                  marks: list[tuple[int, bytes]] | None = None,
                  heads_of: Sequence[int] = (),
                  ) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, records)``: where in ``keys`` a row was found, and those rows.

        The records (``uint8[m, width]``, read-only) come in reply order, without a copy.
        The buckets' identity fields (and those of ``heads_of``) are read in the same round
        trip, each before the bucket's rows, and checked (:meth:`check_heads`) before any row
        is returned; ``marks`` receives the intents found.
        """
        b = b or self.runtime
        n = keys.shape[0]
        if n == 0 and not len(heads_of):
            return np.zeros(0, np.int64), np.zeros((0, self.width), np.uint8)
        order, chunks = self._chunked(b, keys)
        sk = keys[order]
        read = self.rd or (read and self.options.redis_read_access_slave)
        where = f"{self.options.url!r} ({b.model_tag})"
        self.counters["round_trips"] += 1
        self.counters["reads"] += n
        hb = sorted({k for k, _, _ in chunks} | set(heads_of))
        try:
            found_s, recs, heads = self._get_raw(b, sk, chunks, read, where, bad_out, hb)
        except RawFallback:
            self.counters["raw_fallbacks"] += 1
            if self.raw_sockets is not None:
                self.raw_sockets.append(None)
            fields = encode_fields(sk)
            cmds = ([(b.names[k], ("HMGET", b.names[k], *lua.HEAD)) for k in hb]
                    + [(b.names[k], ("HMGET", b.names[k], *fields[a:c])) for k, a, c in chunks])
            replies = self.store.execute(cmds, read=read)
            heads = [(k, [_text(x) for x in r]) for k, r in zip(hb, replies, strict=False)]
            found_m = self.check_heads(b, heads)
            flat = list(itertools.chain.from_iterable(replies[len(hb):]))
            found_s, recs = self.decode(flat, sk, where, bad_out)
        else:
            found_m = self.check_heads(b, heads)
        if marks is not None:
            marks += found_m
        return order[found_s], recs

    def _get_raw(self, b: Buckets, sk: np.ndarray, chunks: list[tuple[int, int, int]],
                 read: bool, where: str, bad_out: list[np.ndarray] | None,
                 head_buckets: Sequence[int], locks: Sequence[int] = (), token: bytes = b"",
                 taken: list[bool] | None = None,
                 ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, Head]]]:
        """:meth:`get_found` of the sorted keys ``sk`` on the raw RESP path.

        ``locks``: buckets whose locks are taken (SET NX) for ``token`` before the reads, in
        the same round trip; whether each was taken is appended to ``taken``. Returns the
        rows found, and the identity fields of ``head_buckets`` (unchecked).
        """
        n = sk.shape[0]
        framed = resp.frame_columns([key_bytes(sk)]) if n else []
        row = len(resp.bulk(bytes(self.width)))
        ttl = b"%d" % int(self.options.lock_ttl_seconds * 1000)
        lead = [(b.locks[k], [resp.array_head(6, (b"SET", b.locks[k], token, b"NX", b"PX",
                                                  ttl))]) for k in locks]
        heads = [(b.names[k], [resp.array_head(2 + len(lua.HEAD), (b"HMGET", b.names[k],
                                                                    *lua.HEAD))])
                 for k in head_buckets]
        nl, nh = len(lead), len(heads)
        cmds = lead + heads + [(b.names[k], [resp.array_head(c - a + 2, (b"HMGET", b.names[k])),
                                             framed[a:c]]) for k, a, c in chunks]
        elems = [0] * nl + [len(lua.HEAD)] * nh + [c - a for _, a, c in chunks]
        groups = self.store.execute_raw([c[0] for c in cmds], [c[1] for c in cmds], elems,
                                        [16 + m * row for m in elems], read=read,
                                        row_width=self.width)
        if self.raw_sockets is not None:
            self.raw_sockets += [r.sock for r in groups]
        lens, group = np.empty(n, np.int64), np.empty(n, np.int64)
        got = [False] * nl
        head_out: list[tuple[int, Head]] = []
        for g, r in enumerate(groups):
            for j, i in enumerate(r.commands):
                if i < nl:
                    got[i] = bool(r.rtype[j] == resp.SIMPLE)
                    continue
                if r.rtype[j] != resp.ARRAY:
                    raise RawFallback(f"HMGET answered with reply type {int(r.rtype[j])}")
                e = int(r.roff[j])
                if i < nl + nh:
                    if r.rval[j] != len(lua.HEAD):
                        raise RawFallback("HMGET answered with another number of fields")
                    head_out.append((head_buckets[i - nl], [
                        None if ln < 0 else r.buf[o:o + ln].tobytes()
                        for o, ln in zip(r.eoff[e:e + len(lua.HEAD)].tolist(),
                                         r.elen[e:e + len(lua.HEAD)].tolist(), strict=True)]))
                    continue
                _, a, c = chunks[i - nl - nh]
                if r.rval[j] != c - a:
                    raise RawFallback("HMGET answered with another number of fields")
                lens[a:c], group[a:c] = r.elen[e:e + c - a], g
        if taken is not None:
            taken += got
        found = lens >= 0
        wrong = found & (lens != self.width)
        if wrong.any():
            if bad_out is None:
                self._wrong_sizes(where, lens[wrong].tolist())
            bad_out.append(sk[wrong])
            found &= ~wrong
        if len(groups) == 1:  # the rows came in key order
            recs = groups[0].rows
        else:  # each connection's rows came in key order: merge them
            recs = np.empty((int(np.count_nonzero(found)), self.width), np.uint8)
            dst = np.cumsum(found) - 1
            for g, r in enumerate(groups):
                recs[dst[found & (group == g)]] = r.rows
        if recs.shape[0] != int(np.count_nonzero(lens == self.width)):
            raise RawFallback("a field of the row width outside the rows")  # pragma: no cover
        found_s, recs = self.verify(found, recs, sk, where, bad_out)
        head_out.sort(key=operator.itemgetter(0))
        return found_s, recs, head_out

    # ----------------------------------------------------------------- locks
    def lock(self, buckets: np.ndarray, token: bytes) -> bytes:
        """Take the locks of ``buckets`` (sorted, unique) for ``token``, in order.

        Locks are taken in bucket order, a prefix at a time, so writers never deadlock;
        raises :class:`RowLockError` after ``lock_wait_seconds``.
        """
        b = self.runtime
        ttl = int(self.options.lock_ttl_seconds * 1000)
        pending = buckets.tolist()
        held: list[int] = []
        deadline = time.monotonic() + self.options.lock_wait_seconds
        pause = 0.0002
        while pending:
            res = self.store.execute([(b.locks[k], ("SET", b.locks[k], token, "NX", "PX", ttl))
                                      for k in pending])
            ok = [bool(r) for r in res]
            if all(ok):
                held += pending
                break
            first = ok.index(False)
            held += pending[:first]
            late = [k for k, g in zip(pending[first:], ok[first:], strict=True) if g]
            self.unlock(np.asarray(late, np.int64), token)
            pending = pending[first:]
            self.counters["lock_waits"] += 1
            if time.monotonic() > deadline:
                self.unlock(np.asarray(held, np.int64), token)
                raise RowLockError(
                    f"bucket {b.names[pending[0]]!r} stayed locked by another writer for "
                    f"lock_wait_seconds={self.options.lock_wait_seconds}; nothing was changed. "
                    "Retry, or check for a stuck writer (its lock expires after "
                    f"lock_ttl_seconds={self.options.lock_ttl_seconds})")
            time.sleep(pause * (1 + random.random()))
            pause = min(pause * 2, 0.004)
        return token

    def lock_get(self, buckets: np.ndarray, keys: np.ndarray, token: bytes,
                 bad_out: list[np.ndarray] | None = None,
                 marks: list[tuple[int, bytes]] | None = None,
                 heads_of: Sequence[int] = (),
                 ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`lock` ``buckets`` and :meth:`get_found` ``keys`` (unique) in one round trip.

        Returns ``(positions, records)``; ``marks`` receives the intents found on the
        buckets read (those of ``heads_of`` too). When a lock is busy, the locks after it are
        released and the rest is done as by :meth:`lock`, then the rows are read again.
        """
        b = self.runtime
        order, chunks = self._chunked(b, keys)
        taken: list[bool] = []
        hb = sorted({k for k, _, _ in chunks} | set(buckets.tolist()) | set(heads_of))
        heads: list[tuple[int, Head]] = []
        try:
            found, recs, heads = self._get_raw(b, keys[order], chunks, False,
                                               f"{self.options.url!r} ({b.model_tag})",
                                               bad_out, hb, buckets.tolist(), token, taken)
        except RawFallback:
            self.counters["raw_fallbacks"] += 1
            self.unlock(buckets, token)  # any lock the raw attempt took
            taken = [False] * buckets.size
        self.counters["round_trips"] += 1
        if all(taken):
            found_m = self.check_heads(b, heads)
            if marks is not None:
                marks += found_m
            self.counters["reads"] += int(keys.shape[0])
            return order[found], recs
        first = taken.index(False)
        late = buckets[first:][np.asarray(taken[first:], bool)]
        self.unlock(late, token)
        self.lock(buckets[first:], token)
        if bad_out is not None:
            bad_out.clear()
        return self.get_found(keys, read=False, bad_out=bad_out, marks=marks,
                              heads_of=hb)

    def unlock(self, buckets: np.ndarray, token: bytes) -> None:
        """Release the locks of ``buckets`` this token holds."""
        b = self.runtime
        if buckets.size:
            self.scripts([(lua.RELEASE, [b.locks[k]], [token]) for k in buckets.tolist()])

    # ----------------------------------------------------------------- whole buckets
    def bucket_lengths(self, b: Buckets | None = None,
                       marks: list[tuple[int, bytes]] | None = None) -> list[int]:
        """Rows in each bucket (the buckets' identity checked; ``marks``: see :meth:`keys`)."""
        b = b or self.runtime
        res = self.scripts([(lua.COUNT, [k], []) for k in b.names], read=self.rd)
        found = self.check_heads(b, [(i, [_text(x) for x in r[1:4]])
                                     for i, r in enumerate(res)])
        if marks is not None:
            marks += found
        return [int(r[0]) for r in res]

    def __len__(self) -> int:
        return sum(self.bucket_lengths())

    def read_bucket(self, b: Buckets, i: int) -> tuple[np.ndarray, np.ndarray, dict[bytes, bytes]]:
        """``(keys, sealed records, other fields)`` of bucket ``i``, read atomically (HGETALL).

        The rows are those of one moment of the bucket; its identity is checked. The other
        fields are its identity fields and any intent (:mod:`.lua`).
        """
        name = b.names[i]
        flat = self.store.execute([(name, ("HGETALL", name))], read=self.rd)[0]
        # redis-py answers with a dict through its callbacks (a Cluster), a flat list without
        fields = list(flat) if isinstance(flat, dict) else flat[0::2]
        values = list(flat.values()) if isinstance(flat, dict) else flat[1::2]
        lens = np.fromiter(map(len, fields), np.int64, len(fields))
        is_row = lens == 8
        meta = {bytes(f): bytes(v) for f, v, r in zip(fields, values, is_row.tolist(),
                                                       strict=True) if not r}
        if set(meta) - set(lua.META_FIELDS):
            raise CorruptRecordError(f"bucket {name!r} holds fields that are not 8-byte keys: "
                                     "it was written by something else")
        self.check_heads(b, [(i, [meta.get(f) for f in lua.HEAD])])
        rows = list(itertools.compress(fields, is_row))
        keys = np.frombuffer(b"".join(rows), "<i8").astype(np.int64)
        _, recs = self.decode(list(itertools.compress(values, is_row)), keys, repr(name))
        return keys, recs, meta

    def keys(self, marks: list[tuple[int, bytes]] | None = None) -> np.ndarray:
        """Every stored key (the buckets' identity checked).

        ``marks`` receives the buckets holding an intent (their keys are as stored, without
        it).
        """
        b = self.runtime
        n = b.n
        res = self.store.execute([(k, ("HMGET", k, *lua.HEAD)) for k in b.names]
                                 + [(k, ("HKEYS", k)) for k in b.names], read=self.rd)
        found = self.check_heads(b, [(i, [_text(x) for x in r]) for i, r in enumerate(res[:n])])
        if marks is not None:
            marks += found
        parts = []
        for r in res[n:]:
            lens = np.fromiter(map(len, r), np.int64, len(r))
            rows = list(itertools.compress(r, lens == 8))
            parts.append(np.frombuffer(b"".join(rows), "<i8").astype(np.int64))
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def put_absent(self, b: Buckets, keys: np.ndarray, sealed: np.ndarray) -> int:
        """Write rows whose keys ``b`` does not hold yet (HSETNX); returns rows written."""
        if keys.shape[0] == 0:
            return 0
        order, _, chunks = self.grouped(b, keys)
        fields = encode_fields(keys[order])
        vals = sealed[order].view(f"V{self.width}").ravel().tolist()
        calls = [(lua.SET_ABSENT, [b.names[k]], interleave(fields[a:c], vals[a:c]))
                 for k, a, c in chunks]
        return int(sum(int(r) for r in self.scripts(calls)))

    def stats(self) -> dict[str, Any]:
        """Counters and the layout of the table in Redis."""
        o = self.options
        return {"kind": "redis", "url": self.store.url, "mode": self.store.mode,
                "model_tag": o.model_tag_runtime, "table_name": o.table_name,
                "storage_slice": o.storage_slice, "consistency": o.consistency,
                "epoch": self.runtime.epoch,
                "buckets": [n.decode() for n in self.runtime.names[:4]]
                + (["..."] if o.storage_slice > 4 else []),
                "row_bytes": self.width, **self.counters}


def dump_path(options: RedisTableOptions) -> str:
    """The directory of a mode-1 dump: ``model_lib_abs_dir/<model_tag>/<table>``."""
    return os.path.join(str(options.model_lib_abs_dir), options.model_tag_runtime,
                        options.table_name)


__all__ = ["SCRIPT_FIELDS", "Buckets", "RedisRowEngine", "dump_path", "encode_fields",
           "generated_tags", "interleave", "key_bytes"]
