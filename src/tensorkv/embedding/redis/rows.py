"""A table whose rows live in Redis: :class:`RedisBackend`, the hooks the table runs.

Tier 0 is a working set: each operation reads its keys' rows from Redis into it (in exact
mode after locking their buckets), the table runs its own logic there, and the operation's
end commits the rows it changed (and deletes the rows it removed), all or nothing
(:mod:`~tensorkv.embedding.redis.commit`), then empties it. So the table computes
exactly as the DRAM table does, and nothing stays in memory between operations (but an
optional read cache of a read-only table).

Every call that may write announces itself first (:meth:`RedisBackend.begin_write`): a read-only
table refuses it before anything changes; a commit that fails puts the table's step back; and
a commit whose reply never came is settled by the next call, which is not applied again if it
is the same call retried. See docs/redis_table.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorkv.embedding.arena import RowArena
from tensorkv.embedding.chunks import ExportChunk
from tensorkv.embedding.filters import Eviction
from tensorkv.embedding.redis import commit as redis_commit
from tensorkv.embedding.redis import lua
from tensorkv.embedding.redis import migrate as redis_migrate
from tensorkv.embedding.redis.engine import RedisRowEngine
from tensorkv.embedding.redis.near_cache import open_near_cache
from tensorkv.embedding.redis.options import RedisTableOptions
from tensorkv.embedding.rows import ArenaBackend, Place, place_chunks
from tensorkv.embedding.tiers.base import RecordLayout, RowSink, RowSource
from tensorkv.errors import ReadOnlyError, RowLockError, StoreUnavailableError, TableLostError

_NO_KEYS = np.empty(0, np.int64)
_LOADED = -1  # the change sequence of a row read from Redis and not changed since
#: Times a read is repeated after it met other operations' intents and resolved them.
_INTENT_ROUNDS = 8


class _Operation:
    """A reentrant operation lock; the outermost exit commits (or, on error, drops) the set."""

    def __init__(self, rows: RedisBackend) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._rows = rows

    def __enter__(self) -> None:
        self._lock.acquire()
        self._depth += 1

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if self._depth == 1:
                self._rows.finish(ok=exc_type is None)
        finally:
            self._depth -= 1
            self._lock.release()


@dataclass
class _Call:
    """A call that may write, as :meth:`RedisBackend.begin_write` saw it."""

    table: Any
    what: str
    args: tuple[Any, ...]
    step: int
    mseq: int


@dataclass
class _Pending:
    """A call whose commit reply never came: what settles it, and what it would have set."""

    state: redis_commit.OpState
    fingerprint: bytes
    step: int
    mseq: int


def fingerprint(what: str, args: tuple[Any, ...], step: int) -> bytes:
    """A digest of a call (its name, arguments and the table's step before it)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{what}|{step}".encode())
    for a in args:
        if isinstance(a, np.ndarray):
            h.update(f"|{a.dtype.str}{a.shape}|".encode())
            h.update(np.ascontiguousarray(a).view(np.uint8).data)
        else:
            h.update(f"|{a!r}".encode())
    return h.digest()


class RedisBackend(ArenaBackend):
    """A table's rows in Redis buckets, read into a working set per operation.

    Built by :func:`open_redis_rows`.

    Parameters
    ----------
    engine
        The Redis side (:class:`~tensorkv.embedding.redis.engine.RedisRowEngine`).
    arena
        Tier 0: the working set of one operation.
    storage
        The :class:`~tensorkv.embedding.chain.specs.StorageOption` it was opened from.
    """

    tiered = True

    def __init__(self, engine: RedisRowEngine, arena: RowArena, storage: Any) -> None:
        super().__init__(arena)
        self.engine = engine
        self.options: RedisTableOptions = engine.options
        self.layout: RecordLayout = engine.layout
        self.storage = storage
        self.op = _Operation(self)
        self._exact = self.options.consistency == "exact" and not self.options.read_only
        self._token: bytes | None = None
        self._locked = _NO_KEYS
        self._loaded: list[np.ndarray] = []
        self._corrupt: list[np.ndarray] = []
        self._removed: list[np.ndarray] = []
        self._call: _Call | None = None
        self._pending: _Pending | None = None
        self._replay = False
        self._cache: RowArena | None = None
        self._cache_at = 0.0
        if self.options.read_cache_rows:
            self._cache = RowArena(arena.dim, arena.slot_width, dtype=arena.dtype)
        self._near = open_near_cache(engine)
        self._counts = {"cache_hits": 0, "rows_read": 0, "rows_written": 0, "replayed": 0}

    # --- around one batch operation ------------------------------------------------------------
    def begin_write(self, table: Any, what: str, *args: Any) -> None:
        """The table starts ``what``, a call that may write (inside :attr:`op`).

        A read-only table refuses it with :class:`~tensorkv.errors.ReadOnlyError` (nothing
        has changed). Otherwise the table's step and mutation sequence are kept, to be put
        back if the commit fails, and an earlier call whose commit reply never came is
        settled first: if it was applied and this is the same call (same arguments, same
        step), this one runs without writing, as the retry of an applied operation.
        """
        if self.options.read_only:
            o = self.options
            raise ReadOnlyError(
                f"{what}: table {o.table_name!r} under {o.model_tag_runtime!r} at {o.url!r} "
                "was opened with read_only=True (serving) and never writes to Redis; nothing "
                "was changed. Use lookup(keys, insert=False) to read, or open the table "
                "without read_only to train")
        if self._call is not None:
            return
        self._call = _Call(table, what, args, int(table._step), int(table._mseq))
        if self.engine.unfinished:
            redis_commit.finish_unfinished(self.engine)
        if self._pending is not None:
            self._settle(self._call)

    def _settle(self, call: _Call) -> None:
        p = self._pending
        assert p is not None
        applied = redis_commit.settle(self.engine, p.state)
        self._pending = None
        if not applied:
            return
        if fingerprint(call.what, call.args, call.step) == p.fingerprint:
            self._replay = True  # the retry of an applied call: run it, write nothing
            self._counts["replayed"] += 1
        else:  # the earlier call was applied: its step counts
            call.table._step, call.table._mseq = p.step, p.mseq
            call.step, call.mseq = p.step, p.mseq

    def promote_lookup(self, keys: np.ndarray) -> np.ndarray:
        """Read the lookup's rows into the working set; returns every key's row (-1: none)."""
        self._load(keys)
        return self.arena.find(keys)

    def promote_update(self, keys: np.ndarray) -> np.ndarray | None:
        """Read an update's rows; returns their rows when every key has one, else None."""
        self._load(keys)
        rows = self.arena.find(keys)
        return None if (rows < 0).any() else rows

    def promote(self, keys: np.ndarray) -> None:
        """Read the rows an upsert, import or remove replaces (a corrupt row reads as absent)."""
        self._load(keys, replace=True)

    def _load(self, keys: np.ndarray, replace: bool = False, serve: bool = True) -> None:
        a = self.arena
        if keys.shape[0] == 0:
            return
        need = (np.setdiff1d(np.unique(self.engine.runtime.of(keys)), self._locked)
                if self._exact else _NO_KEYS)
        want = np.unique(keys[a.find(keys) < 0])
        if want.size == 0:
            if need.size:
                self._lock_buckets(need)
            return
        sink = RowSink(a, self.layout)
        if self._cache is not None:
            want = self._from_cache(want, sink)
        near = self._near
        if near is None:
            self._fetch(want, need, sink, replace)
            return
        cand, crow = near.candidates(want)
        if not serve:  # read them all
            cand[:] = False
        ck, crow = want[cand], crow[cand]
        heads = np.unique(self.engine.runtime.of(ck))
        near.begin(self.engine)
        try:
            got, recs = self._fetch(want[~cand], need, sink, replace, heads)
        except TableLostError:
            near.empty()
            raise
        finally:
            near.end(self.engine)
        hit = near.hits(ck, crow)
        served = near.recs[crow[hit]]  # (a copy) before admitting rows moves cache rows
        near.admit(got, recs)
        near.count(int(hit.sum()), int(want.size - hit.sum()))
        if hit.any():
            hk = ck[hit]
            rows, _ = a.insert(hk)
            sink.write(served, None, rows)
            a.seq[rows] = _LOADED
            self._loaded.append(hk)
        if not hit.all():  # their buckets moved: read them (and cache them) again
            self._load(ck[~hit], replace, serve=False)

    def _fetch(self, want: np.ndarray, need: np.ndarray, sink: RowSink, replace: bool,
               heads: np.ndarray = _NO_KEYS) -> tuple[np.ndarray, np.ndarray]:
        """Read ``want`` into the working set, locking ``need`` first (exact mode).

        ``heads``: more buckets whose identity fields the round trip reads. Returns the keys
        found and their sealed rows.
        """
        a = self.arena
        bad: list[np.ndarray] | None = [] if replace else None
        hb = heads.tolist()
        if need.size:  # take the locks and read the rows in one round trip
            self._token = self._token or lua.new_op()
            self._locked = np.union1d(self._locked, need)
            marks: list[tuple[int, bytes]] = []
            pos, recs = self.engine.lock_get(need, want, self._token, bad, marks, hb)
            for _ in range(_INTENT_ROUNDS):
                if not marks:
                    break
                # another operation's intent in a bucket this one holds: finish or roll it
                # back, then read again
                redis_commit.resolve(self.engine, self.engine.runtime,
                                     [m for m in marks if not m[1].startswith(self._token)])
                marks = []
                if bad is not None:
                    bad.clear()
                pos, recs = self.engine.get_found(want, read=False, bad_out=bad, marks=marks,
                                                  heads_of=hb)
            else:
                raise RowLockError(f"{self.engine.where()}: intents of other operations kept "
                                   "appearing in buckets this operation holds; retry")
        else:
            pos, recs = self._read(want, bad, hb)
        if bad:  # written over or removed at the commit
            self._corrupt.append(np.concatenate(bad))
        got = want[pos]
        self._counts["rows_read"] += int(want.size)
        if got.size:
            rows, _ = a.insert(got)
            sink.write(recs, None, rows)
            a.seq[rows] = _LOADED
            self._loaded.append(got)
            if self._cache is not None:
                self._to_cache(got, recs)
        return got, recs

    def _read(self, keys: np.ndarray, bad: list[np.ndarray] | None = None,
              heads: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``keys`` read without locks, with the intents of committed operations."""
        for _ in range(_INTENT_ROUNDS):
            marks: list[tuple[int, bytes]] = []
            if bad is not None:
                bad.clear()
            pos, recs = self.engine.get_found(keys, read=self.options.read_only, bad_out=bad,
                                              marks=marks, heads_of=heads or ())
            if not marks:
                return pos, recs
            laid = redis_commit.overlay_found(self.engine, self.engine.runtime, keys, pos,
                                              recs, marks)
            if laid is not None:
                return laid
        raise RowLockError(f"{self.engine.where()}: intents of other operations kept leaving "
                           "the buckets while they were read; retry")

    def _lock_buckets(self, need: np.ndarray) -> None:
        self._token = self._token or lua.new_op()
        self.engine.lock(need, self._token)
        self._locked = np.union1d(self._locked, need)

    def _from_cache(self, want: np.ndarray, sink: RowSink) -> np.ndarray:
        """Move cached rows of ``want`` into the working set; returns the keys still wanted."""
        c = self._cache
        assert c is not None
        if time.monotonic() - self._cache_at > self.options.read_cache_seconds:
            c.clear()
            self._cache_at = time.monotonic()
        crow = c.find(want)
        hit = crow >= 0
        if hit.any():
            hk = want[hit]
            buf = RowSource(c, self.layout, hk, crow[hit]).pack()
            rows, _ = self.arena.insert(hk)
            sink.write(buf, None, rows)
            self.arena.seq[rows] = _LOADED
            self._counts["cache_hits"] += int(hk.size)
        return want[~hit]

    def _to_cache(self, keys: np.ndarray, recs: np.ndarray) -> None:
        c = self._cache
        assert c is not None
        cap = self.options.read_cache_rows
        if len(c) + keys.size > cap:
            c.clear()
            keys, recs = keys[:cap], recs[:cap]
        rows, _ = c.insert(keys)
        RowSink(c, self.layout).write(np.ascontiguousarray(recs), None, rows)

    def finish(self, ok: bool) -> None:
        """End of an operation: commit what changed (if ``ok``), empty the working set.

        A failed commit (or a failed operation) puts the table's step and mutation sequence
        back; a commit whose reply never came is remembered for the next call to settle.
        """
        call, self._call = self._call, None
        replay, self._replay = self._replay, False
        try:
            if ok and not self.options.read_only and not replay:
                self._commit()
            elif not ok:
                self._restore(call)
        except redis_commit.OutcomeUnknown as exc:
            after = (0, 0) if call is None else (int(call.table._step), int(call.table._mseq))
            self._restore(call)
            if call is not None:
                self._pending = _Pending(exc.state, fingerprint(call.what, call.args,
                                                                call.step), *after)
            raise StoreUnavailableError(
                f"{self.engine.where()}: the connection failed while the operation's commit "
                f"was on its way ({exc.cause}); whether it was applied is not known yet. The "
                "table's step is unchanged; the next call settles it first: retry the same "
                "call (it is never applied twice)") from exc.cause
        except BaseException:
            self._restore(call)
            raise
        finally:
            a = self.arena
            if len(a):
                a.remove(a.keys())
            self._loaded, self._corrupt, self._removed = [], [], []
            token, locked = self._token, self._locked
            self._token, self._locked = None, _NO_KEYS
            if token is not None and locked.size:
                with contextlib.suppress(Exception):  # the first error is the one to see
                    self.engine.unlock(locked, token)

    @staticmethod
    def _restore(call: _Call | None) -> None:
        if call is not None:
            call.table._step, call.table._mseq = call.step, call.mseq

    def _commit(self) -> None:
        """Commit what changed, all or nothing (releases the bucket locks)."""
        a = self.arena
        hw = a.high_water
        live = np.flatnonzero(a.live[:hw].view(np.bool_))
        changed = live[a.seq[live] != _LOADED]
        keys = a.row_key[changed].copy()
        loaded = np.concatenate(self._loaded) if self._loaded else _NO_KEYS
        if self._corrupt:  # rows that failed their checks go, unless written over
            loaded = np.concatenate([loaded, *self._corrupt])
        deleted = loaded[a.find(loaded) < 0] if loaded.size else _NO_KEYS
        if self._removed:
            deleted = np.union1d(deleted, np.concatenate(self._removed))
        buf = np.zeros((keys.size, self.engine.width), np.uint8)
        if keys.size:
            RowSource(a, self.layout, keys, changed).pack(buf)
            self.engine.seal(buf)
        op = self._token or lua.new_op()
        try:
            redis_commit.commit(self.engine, op, keys, buf, deleted, self._locked, self._exact)
        except BaseException:
            if self._near is not None:  # written or not: what it cached of them is unknown
                self._near.invalidate(np.union1d(self.engine.runtime.of(keys),
                                                 self.engine.runtime.of(deleted)))
            raise
        if self._near is not None:
            self._near.committed(self.engine, keys, buf, deleted)
        self._locked = _NO_KEYS
        self._counts["rows_written"] += int(keys.size)

    # --- rows below tier 0 ---------------------------------------------------------------------
    def read_lower(self, keys: np.ndarray) -> tuple[np.ndarray, Any]:  # noqa: D102
        pos, got = self._read(keys)
        found = np.zeros(keys.shape[0], bool)
        found[pos] = True
        recs = np.zeros((keys.shape[0], self.layout.record_bytes), np.uint8)
        recs[pos] = got[:, :self.layout.record_bytes]
        return found, self.layout.unpack(recs)

    def lower_len(self) -> int:
        """Rows in Redis (a bucket holding an intent counted as the intent leaves it)."""
        marks: list[tuple[int, bytes]] = []
        lens = self.engine.bucket_lengths(marks=marks)
        for k, _ in marks:
            lens[k] = redis_commit.bucket_rows(self.engine, self.engine.runtime, k)[0].size
        return sum(lens)

    def lower_keys(self) -> np.ndarray:
        """Keys in Redis (a bucket holding an intent read as the intent leaves it)."""
        marks: list[tuple[int, bytes]] = []
        keys = self.engine.keys(marks)
        if not marks:
            return keys
        b = self.engine.runtime
        marked = np.asarray([k for k, _ in marks], np.int64)
        parts = [keys[~np.isin(b.of(keys), marked)]]
        parts += [redis_commit.bucket_rows(self.engine, b, int(k))[0] for k in marked]
        return np.concatenate(parts)

    def _chunks(self, chunk_rows: int, since: int) -> Iterator[ExportChunk]:
        rb = self.layout.record_bytes
        for keys, recs in redis_commit.scan(self.engine, chunk_rows=chunk_rows):
            f = self.layout.unpack(np.ascontiguousarray(recs[:, :rb]))
            keep = f.change_seq > since
            if not keep.all():
                f = type(f)(*(x[keep] for x in f))
                keys = keys[keep]
            if keys.size:
                yield ExportChunk(keys.copy(), f.values.copy(), f.slots.copy(), f.freq.copy(),
                                  f.version.copy(), f.change_seq.copy())

    def export(self, chunk_rows: int, since: int | None) -> Iterator[ExportChunk]:
        """Chunks of the rows in Redis changed after ``since``, by ``table_store_mode``.

        Mode 0: the rows; mode 1: the rows are dumped to files under ``model_lib_abs_dir``
        and nothing is yielded; mode 2: nothing (the rows stay in Redis only).
        """
        mode = self.options.table_store_mode
        if mode == 1:
            redis_migrate.dump(self.engine, chunk_rows)
        if mode != 0:
            return iter(())
        return self._chunks(chunk_rows, -1 if since is None else int(since))

    def export_into(self, place: Place, chunk_rows: int, since: int | None) -> Iterator[int]:
        """:meth:`export` into buffers from ``place``."""
        return place_chunks(place, self.export(chunk_rows, since))

    def evict_keys(self, eviction: Eviction, step: int) -> np.ndarray:
        """Keys ``eviction`` removes at ``step``, judged over every row (a full scan)."""
        a = self.arena
        whole = RowArena(a.dim, a.slot_width, dtype=a.dtype)
        sink = RowSink(whole, self.layout)
        for keys, recs in redis_commit.scan(self.engine):
            out = a.find(keys) >= 0  # rows of the working set are newer
            if out.any():
                keys, recs = keys[~out], np.ascontiguousarray(recs[~out])
            rows, _ = whole.insert(keys)
            sink.write(recs, None, rows)
        held = a.keys()
        if held.size:
            rows, _ = whole.insert(held)
            sink.write(RowSource(a, self.layout, held, a.find(held)).pack(), None, rows)
        return whole.row_key[eviction.select(whole, step)].copy()

    def remove_lower(self, keys: np.ndarray) -> int:
        """Delete ``keys`` (rows not in the working set) with the operation's commit."""
        if keys.size:
            if self._exact:
                need = np.setdiff1d(np.unique(self.engine.runtime.of(keys)), self._locked)
                if need.size:
                    self._lock_buckets(need)
            self._removed.append(keys)
        return int(keys.size)

    def clear_lower(self) -> None:
        """Empty every bucket (in exact mode under the locks of every bucket)."""
        if self._near is not None:
            self._near.empty()
        redis_commit.clear(self.engine, lua.new_op(), self._exact)

    @property
    def rows_in_checkpoint(self) -> bool:
        """Whether :meth:`export` carries the rows (``table_store_mode=0``)."""
        return self.options.table_store_mode == 0

    # --- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Close the connection."""
        with self.op:
            self.engine.close()

    def add_stats(self, stats: dict[str, Any]) -> None:
        """``rows`` in Redis and ``redis``: the layout and counters."""
        stats["tier0_rows"] = stats["rows"]
        stats["rows"] = len(self.engine)
        stats["redis"] = {**self.engine.stats(), **self._counts}
        if self._near is not None:
            stats["redis"]["near_cache"] = self._near.stats()

    def spill_locations(self) -> list[str]:
        """The Redis URL."""
        return [str(self.engine.store.url)]

    def add_meta(self, meta: dict[str, Any]) -> None:
        """The storage options, and the epoch of the rows a tag without rows relies on."""
        meta["storage"] = self.storage.to_dict()
        if self.options.table_store_mode == 2:
            meta["redis_epoch"] = self.engine.runtime.epoch

    def check_restore(self, meta: dict[str, Any]) -> None:
        """Refuse a ``table_store_mode=2`` tag whose rows Redis no longer holds.

        Such a tag holds the step and optimizer state only; its rows are those Redis held
        under the epoch it records. A table with another epoch (Redis lost the rows and the
        table was created again, or it was emptied with ``on_lost="start_empty"``) would
        pair that state with other rows, so the load raises ``TableLostError``.
        """
        saved = meta.get("redis_epoch")
        now = self.engine.runtime.epoch
        if self.options.table_store_mode != 2 or saved is None or saved == now:
            return
        o = self.options
        raise TableLostError(
            f"the tag's rows of table {o.table_name!r} live in Redis under model tag "
            f"{o.model_tag_runtime!r} and epoch {saved}, but that table now has epoch {now}: "
            "Redis lost the rows (a restart without persistence, a flush, an eviction) or the "
            "table was emptied or created again since the save. Nothing was loaded. Restore "
            "the rows from a tag saved with table_store_mode=0 (or from the Redis backup), "
            "then load again (docs/redis_table.md, 'Lost data')")


def open_redis_rows(storage: Any, *, dim: int, dtype: str, num_slots: int,
                    capacity: int | None = None) -> RedisBackend:
    """Open the Redis rows of ``storage`` (``StorageOption("REDIS", ...)``) for a table.

    Checks the layout record in Redis, imports an older tag or bucket layout on first open,
    and restores an empty tag from mode-1 dump files (:func:`redis_migrate.prepare`).
    """
    layout = RecordLayout(dim, dtype, num_slots)
    engine = RedisRowEngine(storage.redis, layout)
    try:
        redis_migrate.prepare(engine)
    except BaseException:
        engine.close()
        raise
    arena = RowArena(dim, num_slots * dim, capacity=capacity, dtype=dtype)
    return RedisBackend(engine, arena, storage)


__all__ = ["RedisBackend", "open_redis_rows"]
