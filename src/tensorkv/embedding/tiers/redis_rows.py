"""The engine of a Redis-resident table: rows packed into bucket hashes, with checksums.

Every row is one field of a Redis hash (a *bucket*) named ``<model_tag>:<table>{<tag>}``:
the field is the key's 8 little-endian bytes, the value the row's record
(:class:`~tensorkv.embedding.tiers.base.RecordLayout`: key, freq, version, change sequence,
values, slots) followed by the XXH64 checksum of the record. A batch goes out as HMGET /
HSET / HDEL commands of at most ``keys_sending_size`` fields, pipelined per node, and replies
are decoded whole with numpy. Exact mode adds bucket locks (``<bucket>:lock``, same slot)
and fenced writes. Layout, locks and migration: docs/redis_table.md.
"""

from __future__ import annotations

import functools
import itertools
import json
import operator
import os
import random
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import numpy as np

from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.embedding.tiers.redis_options import RedisTableOptions
from tensorkv.errors import ConfigError, CorruptRecordError, RowLockError, ShapeError
from tensorkv.kernels import resp
from tensorkv.kernels.checksums import record_checksums
from tensorkv.stores import open_store, redis_raw
from tensorkv.stores.redis_keys import bounds, key_slots
from tensorkv.stores.redis_raw import RawFallback

#: Fields per Lua script call (Lua's unpack() limit is ~8000 values).
SCRIPT_FIELDS = 2000
#: Redis Cluster hash slots.
SLOTS = 16384

# KEYS: bucket, lock. ARGV: token, n (fields to set), n field/value pairs, fields to delete.
_FENCED_WRITE = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local n = tonumber(ARGV[2])
if n > 0 then redis.call('HSET', KEYS[1], unpack(ARGV, 3, 2 + 2 * n)) end
if #ARGV > 2 + 2 * n then return redis.call('HDEL', KEYS[1], unpack(ARGV, 3 + 2 * n, #ARGV)) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# The raw path sends the scripts' text (EVAL), never EVALSHA: a batch whose fenced writes
# answered NOSCRIPT while its lock releases ran could not be sent again.
_FENCED_BODY, _RELEASE_BODY = _FENCED_WRITE.encode(), _RELEASE.encode()
_NO_BUCKETS = np.zeros(0, np.int64)
_SET_ABSENT = """
local n = 0
for i = 1, #ARGV, 2 do n = n + redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) end
return n
"""


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

    def of(self, keys: np.ndarray) -> np.ndarray:
        """Bucket of each key (int64)."""
        if self.by_hash:
            return (_mix(keys) % np.uint64(self.n)).astype(np.int64)
        return np.mod(keys, self.n)

    def describe(self) -> dict[str, Any]:
        """What the bucket layout depends on (kept in Redis beside the rows)."""
        return {"model_tag": self.model_tag, "storage_slice": self.n, "tags": list(self.tags),
                "using_hash_storage_slice": self.by_hash}


def _key_bytes(keys: np.ndarray) -> np.ndarray:
    """Hash fields of int64 keys as ``uint8[n, 8]`` (little-endian)."""
    return np.ascontiguousarray(keys, "<i8").view(np.uint8).reshape(-1, 8)


def encode_fields(keys: np.ndarray) -> list[bytes]:
    """Hash fields of int64 keys: their 8 little-endian bytes."""
    return keys.astype("<i8").view("V8").tolist()


def _interleave(a: list[Any], b: list[Any]) -> list[Any]:
    out: list[Any] = [None] * (2 * len(a))
    out[0::2] = a
    out[1::2] = b
    return out


class RedisRowEngine:
    """Rows of one table in Redis: batched reads, writes, locks, scans and migration.

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
        store = open_store(options.url, **dict(options.store_options))
        if not isinstance(store, RedisStore):  # pragma: no cover - the URL check forbids it
            store.close()
            raise ConfigError(f"{options.url!r} is not a Redis URL")
        self.store = store
        o = options
        prefix = store.options.prefix
        self.runtime = Buckets(prefix, o.model_tag_runtime, o.table_name, o.storage_slice,
                               o.redis_hash_tags_runtime, o.using_hash_storage_slice)
        self.source = Buckets(prefix, str(o.model_tag_import), o.table_name,
                              int(o.storage_slice_import or o.storage_slice),
                              o.redis_hash_tags_import, o.using_hash_storage_slice)
        self._ks = max(1, min(o.keys_sending_size, SCRIPT_FIELDS))
        self.counters = {"reads": 0, "writes": 0, "deletes": 0, "round_trips": 0,
                         "lock_waits": 0, "migrated": 0,
                         "raw_fallbacks": 0}

    def close(self) -> None:
        """Close the connection."""
        self.store.close()

    # ----------------------------------------------------------------- layout metadata
    def layout_meta(self, b: Buckets) -> dict[str, Any]:
        """The JSON kept at ``<model_tag>:<table>:layout``."""
        return {"format": "tensorkv-redis-table", "version": 1,
                "layout": self.layout.to_dict(), **b.describe()}

    def read_meta(self, b: Buckets) -> dict[str, Any] | None:
        """The layout record of ``b``'s tag, or None."""
        raw = self.store.execute([(b.meta_key, ("GET", b.meta_key))], read=False)[0]
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

    def write_meta(self, b: Buckets) -> None:
        """Record ``b``'s layout (overwriting)."""
        self.store.execute([(b.meta_key, ("SET", b.meta_key, json.dumps(self.layout_meta(b))))])

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
        """``(found, records uint8[found, width])`` of HMGET/HSCAN values, checksums checked.

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
    def _grouped(self, b: Buckets, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                               list[tuple[int, int, int]]]:
        """``(order, sorted bucket ids, [(bucket, start, stop)...])`` chunks of sorted keys."""
        bk = b.of(keys)
        order = np.argsort(bk, kind="stable")
        sb = bk[order]
        cuts = bounds(keys.shape[0], self._ks, groups=sb).tolist()
        chunks = [(int(sb[a]), a, c) for a, c in zip(cuts[:-1], cuts[1:], strict=True)]
        return order, sb, chunks

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
                  bad_out: list[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, records)``: where in ``keys`` a row was found, and those rows.

        The records (``uint8[m, width]``, read-only) come in reply order, without a copy.
        """
        b = b or self.runtime
        n = keys.shape[0]
        if n == 0:
            return np.zeros(0, np.int64), np.zeros((0, self.width), np.uint8)
        order, _, chunks = self._grouped(b, keys)
        sk = keys[order]
        read = read and self.options.redis_read_access_slave
        where = f"{self.options.url!r} ({b.model_tag})"
        self.counters["round_trips"] += 1
        self.counters["reads"] += n
        try:
            found_s, recs = self._get_raw(b, sk, chunks, read, where, bad_out)
        except RawFallback:
            self.counters["raw_fallbacks"] += 1
            fields = encode_fields(sk)
            cmds = [(b.names[k], ("HMGET", b.names[k], *fields[a:c])) for k, a, c in chunks]
            replies = self.store.execute(cmds, read=read)
            flat = list(itertools.chain.from_iterable(replies))
            found_s, recs = self.decode(flat, sk, where, bad_out)
        return order[found_s], recs

    def _get_raw(self, b: Buckets, sk: np.ndarray, chunks: list[tuple[int, int, int]],
                 read: bool, where: str, bad_out: list[np.ndarray] | None,
                 locks: Sequence[int] = (), token: bytes = b"",
                 taken: list[bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`get_found` of the sorted keys ``sk`` on the raw RESP path.

        ``locks``: buckets whose locks are taken (SET NX) for ``token`` before the reads, in
        the same round trip; whether each was taken is appended to ``taken``.
        """
        n = sk.shape[0]
        framed = resp.frame_columns([_key_bytes(sk)])
        row = len(resp.bulk(bytes(self.width)))
        ttl = b"%d" % int(self.options.lock_ttl_seconds * 1000)
        lead = [(b.locks[k], [resp.array_head(6, (b"SET", b.locks[k], token, b"NX", b"PX",
                                                  ttl))]) for k in locks]
        cmds = lead + [(b.names[k], [resp.array_head(c - a + 2, (b"HMGET", b.names[k])),
                                     framed[a:c]]) for k, a, c in chunks]
        elems = [0] * len(lead) + [c - a for _, a, c in chunks]
        groups = self.store.execute_raw([c[0] for c in cmds], [c[1] for c in cmds], elems,
                                        [16 + m * row for m in elems], read=read,
                                        row_width=self.width)
        lens, group = np.empty(n, np.int64), np.empty(n, np.int64)
        got = [False] * len(lead)
        for g, r in enumerate(groups):
            for j, i in enumerate(r.commands):
                if i < len(lead):
                    got[i] = bool(r.rtype[j] == resp.SIMPLE)
                    continue
                _, a, c = chunks[i - len(lead)]
                if r.rtype[j] != resp.ARRAY or r.rval[j] != c - a:
                    raise RawFallback(f"HMGET answered with reply type {int(r.rtype[j])}")
                e = int(r.roff[j])
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
        return self.verify(found, recs, sk, where, bad_out)

    def write(self, keys: np.ndarray, sealed: np.ndarray, deleted: np.ndarray,
              token: bytes | None = None, release: np.ndarray = _NO_BUCKETS) -> int:
        """HSET the sealed rows of ``keys``, HDEL ``deleted``; returns rows deleted.

        With ``token`` every bucket write is fenced: it lands only while this token holds the
        bucket's lock, else :class:`RowLockError` is raised after the batch. ``release``:
        buckets whose locks (held by ``token``) are released after the writes, in the same
        round trip.
        """
        if token is not None and (keys.size or deleted.size):
            try:
                return self._write_watched(keys, sealed, deleted, token, release)
            except RawFallback:
                self.counters["raw_fallbacks"] += 1
        parts = [(True, keys, sealed), (False, deleted, None)]
        cmds = [c for p in parts for c in self._write_commands(*p, token, raw=True)]
        if not cmds and not release.size:
            return 0
        n_set = sum(1 for c in cmds if c[0])
        n_write = len(cmds)
        locks = [self.runtime.locks[k] for k in release.tolist()]
        cmds += [(False, k, [resp.array_head(5, (b"EVAL", _RELEASE_BODY, b"1", k, token))])
                 for k in locks]
        self.counters["round_trips"] += 1
        try:
            res = self._ints(self.store.execute_raw(
                [c[1] for c in cmds], [c[2] for c in cmds], [0] * len(cmds),
                [32] * len(cmds)), len(cmds))
        except RawFallback:  # every command can run again: same rows, same fence token
            self.counters["raw_fallbacks"] += 1
            res = self.store.execute([c[1:] for p in parts
                                      for c in self._write_commands(*p, token, raw=False)]
                                     + [(k, ("EVAL", _RELEASE, 1, k, token)) for k in locks])
        res = res[:n_write]
        self.counters["writes"] += int(keys.shape[0])
        if token is not None and any(int(r) < 0 for r in res):
            self._lost_lock("the batch was written only in part")
        n_del = int(sum(int(r) for r in res[n_set:]))
        self.counters["deletes"] += n_del
        return n_del

    def _write_watched(self, keys: np.ndarray, sealed: np.ndarray, deleted: np.ndarray,
                       token: bytes, release: np.ndarray) -> int:
        """:meth:`write` fenced by WATCH on the bucket locks and one MULTI/EXEC.

        First round trip: WATCH the locks, read them (all must hold ``token``); second:
        MULTI, the plain HSET/HDEL, DEL of the ``release`` locks, EXEC. A lock that expired
        or changed hands after the WATCH aborts the EXEC: nothing is written. Raises
        :class:`RawFallback` on a Cluster (the Lua fence runs there) or on a dropped
        connection.
        """
        b = self.runtime
        written = np.unique(np.concatenate([b.of(keys), b.of(deleted)]))
        watched = [b.locks[k] for k in np.union1d(written, release).tolist()]
        n_locks = len(watched)
        with redis_raw.session(self.store) as call:
            r = call([resp.array_head(1 + n_locks, (b"WATCH", *watched)),
                      resp.array_head(1 + n_locks, (b"MGET", *watched))], 2, n_locks,
                     64 + n_locks * (len(token) + 16))
            if r.rtype.tolist() != [resp.SIMPLE, resp.ARRAY]:
                raise RawFallback("WATCH/MGET answered with other replies")
            held = [r.buf[o:o + n].tobytes() if n >= 0 else None
                    for o, n in zip(r.eoff.tolist(), r.elen.tolist(), strict=True)]
            if any(h != token for h in held):
                self._lost_lock("nothing was written")
            cmds = [c for p in [(True, keys, sealed), (False, deleted, None)]
                    for c in self._write_commands(*p, None, raw=True)]
            rel = [b.locks[k] for k in release.tolist()]
            tail = [resp.array_head(1 + len(rel), (b"DEL", *rel))] if rel else []
            pieces = ([resp.array_head(1, (b"MULTI",))] + [x for c in cmds for x in c[2]]
                      + tail + [resp.array_head(1, (b"EXEC",))])
            n = len(cmds) + len(tail)
            r = call(pieces, n + 2, n, 64 + 16 * n)
            redis_raw.check_errors(r)  # e.g. OOM while queueing: EXECABORT
            if r.rtype[-1] == resp.NIL:
                self._lost_lock("nothing was written")
            redis_raw.element_errors(r)  # e.g. WRONGTYPE: a bucket that is not a hash
            if r.rtype[-1] != resp.ARRAY or r.rval[-1] != n or (r.elen[:n] != -2).any():
                raise RawFallback("EXEC answered with other replies")
        res = r.eoff[:n].tolist()
        self.counters["round_trips"] += 2
        self.counters["writes"] += int(keys.shape[0])
        n_del = int(sum(v for c, v in zip(cmds, res, strict=False) if not c[0]))
        self.counters["deletes"] += n_del
        return n_del

    def _lost_lock(self, what: str) -> None:
        raise RowLockError(
            f"a bucket lock of table {self.options.table_name!r} at {self.options.url!r} "
            f"expired (lock_ttl_seconds={self.options.lock_ttl_seconds}) or the server "
            f"restarted before the batch was written; {what}. Retry the step; raise "
            "lock_ttl_seconds if steps take longer")

    def _write_commands(self, setting: bool, keys: np.ndarray, sealed: np.ndarray | None,
                        token: bytes | None, raw: bool) -> list[tuple[bool, bytes, Any]]:
        """``[(setting, bucket, command)]`` writing (HSET) or deleting (HDEL) ``keys``' rows.

        With ``token``: fenced writes (:data:`_FENCED_WRITE`). ``raw``: each command as RESP
        pieces, else as redis-py arguments.
        """
        if keys.shape[0] == 0:
            return []
        b = self.runtime
        order, _, chunks = self._grouped(b, keys)
        if raw:
            cols = [_key_bytes(keys)] + ([sealed] if setting else [])
            framed = resp.frame_columns(cols, order)
        else:
            fields = encode_fields(keys[order])
            vals = (sealed[order].view(f"V{self.width}").ravel().tolist()
                    if setting and sealed is not None else [])
        out: list[tuple[bool, bytes, Any]] = []
        for k, a, c in chunks:
            m, name = c - a, b.names[k]
            if token is None:
                lead: tuple[Any, ...] = (b"HSET" if setting else b"HDEL", name)
            else:
                script = (b"EVAL", _FENCED_BODY) if raw else (b"EVAL", _FENCED_WRITE)
                lead = (*script, b"2", name, b.locks[k], token, b"%d" % (m if setting else 0))
            if raw:
                n_args = len(lead) + m * (2 if setting else 1)
                out.append((setting, name, [resp.array_head(n_args, lead), framed[a:c]]))
            else:
                args = _interleave(fields[a:c], vals[a:c]) if setting else fields[a:c]
                out.append((setting, name, (*lead, *args)))
        return out

    @staticmethod
    def _ints(groups: list[Any], n: int) -> list[int]:
        """The integer replies of raw commands, in command order."""
        out = [0] * n
        for r in groups:
            if (r.rtype != resp.INT).any():
                raise RawFallback("a write answered with a reply that is not an integer")
            for i, v in zip(r.commands, r.rval.tolist(), strict=True):
                out[i] = v
        return out

    def delete(self, keys: np.ndarray) -> int:
        """HDEL ``keys``; returns how many were stored."""
        return self.write(keys[:0], np.zeros((0, self.width), np.uint8), keys)

    # ----------------------------------------------------------------- locks
    def lock(self, buckets: np.ndarray, token: bytes | None = None) -> bytes:
        """Take the locks of ``buckets`` (sorted, unique) in order; returns the token.

        ``token``: the token of locks this operation already holds (None: a new one).

        Locks are taken in bucket order, a prefix at a time, so writers never deadlock;
        raises :class:`RowLockError` after ``lock_wait_seconds``.
        """
        b = self.runtime
        token = token or uuid.uuid4().hex.encode()
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

    def lock_get(self, buckets: np.ndarray, keys: np.ndarray, token: bytes | None,
                 bad_out: list[np.ndarray] | None = None
                 ) -> tuple[bytes, np.ndarray, np.ndarray]:
        """:meth:`lock` ``buckets`` and :meth:`get_found` ``keys`` (unique) in one round trip.

        Returns ``(token, positions, records)``. When a lock is busy, the locks after it are
        released and the rest is done as by :meth:`lock`, then the rows are read again.
        """
        b = self.runtime
        token = token or uuid.uuid4().hex.encode()
        if keys.shape[0] == 0:
            return self.lock(buckets, token), np.zeros(0, np.int64), np.zeros((0, self.width),
                                                                               np.uint8)
        order, _, chunks = self._grouped(b, keys)
        taken: list[bool] = []
        try:
            found, recs = self._get_raw(b, keys[order], chunks, False,
                                        f"{self.options.url!r} ({b.model_tag})", bad_out,
                                        buckets.tolist(), token, taken)
        except RawFallback:
            self.counters["raw_fallbacks"] += 1
            self.unlock(buckets, token)  # any lock the raw attempt took
            taken = [False] * buckets.size
        self.counters["round_trips"] += 1
        if all(taken):
            self.counters["reads"] += int(keys.shape[0])
            return token, order[found], recs
        first = taken.index(False)
        late = buckets[first:][np.asarray(taken[first:], bool)]
        self.unlock(late, token)
        self.lock(buckets[first:], token)
        if bad_out is not None:
            bad_out.clear()
        return (token, *self.get_found(keys, read=False, bad_out=bad_out))

    def unlock(self, buckets: np.ndarray, token: bytes) -> None:
        """Release the locks of ``buckets`` this token holds."""
        b = self.runtime
        if buckets.size:
            self.store.execute([(b.locks[k], ("EVAL", _RELEASE, 1, b.locks[k], token))
                                for k in buckets.tolist()])

    # ----------------------------------------------------------------- whole table
    def bucket_lengths(self, b: Buckets | None = None) -> list[int]:
        """Rows in each bucket."""
        b = b or self.runtime
        return [int(r) for r in self.store.execute([(k, ("HLEN", k)) for k in b.names],
                                                   read=False)]

    def __len__(self) -> int:
        return sum(self.bucket_lengths())

    def scan_bucket(self, b: Buckets, i: int,
                    chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(keys, sealed records)`` chunks of bucket ``i`` (each row once)."""
        name = b.names[i]
        cursor: Any = 0
        seen = np.empty(0, np.int64)
        while True:
            cursor, flat = self.store.execute(
                [(name, ("HSCAN", name, cursor, "COUNT", chunk_rows))], read=False)[0]
            if flat:  # redis-py answers HSCAN with a dict (a flat list without its callbacks)
                fields = list(flat) if isinstance(flat, dict) else flat[0::2]
                values = list(flat.values()) if isinstance(flat, dict) else flat[1::2]
                keys = np.frombuffer(b"".join(fields), "<i8").astype(np.int64)
                if len(fields) * 8 != sum(map(len, fields)):
                    raise CorruptRecordError(f"bucket {name!r} holds fields that are not "
                                             "8-byte keys: it was written by something else")
                _, recs = self.decode(values, keys, repr(name))
                fresh = ~np.isin(keys, seen)
                if not fresh.all():
                    keys, recs = keys[fresh], recs[fresh]
                seen = np.concatenate([seen, keys])
                for a in range(0, keys.size, chunk_rows):  # COUNT is only a hint
                    yield keys[a:a + chunk_rows], recs[a:a + chunk_rows]
            if int(cursor) == 0:
                return

    def scan(self, chunk_rows: int = 65536,
             b: Buckets | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(keys, sealed records)`` chunks of every row of the tag."""
        b = b or self.runtime
        for i in range(b.n):
            yield from self.scan_bucket(b, i, chunk_rows)

    def keys(self) -> np.ndarray:
        """Every stored key."""
        b = self.runtime
        parts = [np.frombuffer(b"".join(r), "<i8").astype(np.int64) if r else
                 np.empty(0, np.int64)
                 for r in self.store.execute([(k, ("HKEYS", k)) for k in b.names])]
        return np.concatenate(parts)

    def clear(self) -> None:
        """Delete every bucket of the runtime tag."""
        self.store.execute([(k, ("UNLINK", k)) for k in self.runtime.names])

    def put_absent(self, b: Buckets, keys: np.ndarray, sealed: np.ndarray) -> int:
        """Write rows whose keys ``b`` does not hold yet (HSETNX); returns rows written."""
        if keys.shape[0] == 0:
            return 0
        order, _, chunks = self._grouped(b, keys)
        fields = encode_fields(keys[order])
        vals = sealed[order].view(f"V{self.width}").ravel().tolist()
        cmds = [(b.names[k], ("EVAL", _SET_ABSENT, b"1", b.names[k],
                              *_interleave(fields[a:c], vals[a:c]))) for k, a, c in chunks]
        return int(sum(int(r) for r in self.store.execute(cmds)))

    def stats(self) -> dict[str, Any]:
        """Counters and the layout of the table in Redis."""
        o = self.options
        return {"kind": "redis", "url": self.store.url, "mode": self.store.mode,
                "model_tag": o.model_tag_runtime, "table_name": o.table_name,
                "storage_slice": o.storage_slice, "consistency": o.consistency,
                "buckets": [n.decode() for n in self.runtime.names[:4]]
                + (["..."] if o.storage_slice > 4 else []),
                "row_bytes": self.width, **self.counters}


def dump_path(options: RedisTableOptions) -> str:
    """The directory of a mode-1 dump: ``model_lib_abs_dir/<model_tag>/<table>``."""
    return os.path.join(str(options.model_lib_abs_dir), options.model_tag_runtime,
                        options.table_name)


__all__ = ["Buckets", "RedisRowEngine", "dump_path", "encode_fields", "generated_tags"]
