"""Commits of a Redis-resident table: all-or-nothing, and never applied twice.

An operation has an id (:func:`~tensorkv.embedding.redis.lua.new_op`), which is also the
token of its bucket locks. Its commit writes every row it changed and deletes every row it
removed, in every bucket, or nothing:

* One server (standalone, Sentinel), or one bucket: one Lua script (:data:`.lua.COMMIT`)
  checks every lock and every bucket's epoch, then writes all the buckets, records the
  operation's receipt in its first bucket (the *coordinator*) and releases the locks.
* Several buckets on a Cluster, where a script spans one hash slot: two phases. Each bucket
  but the coordinator is *prepared*: the rows it is to receive are stored in the bucket itself
  as an intent (:data:`.lua.PREPARE`); then the coordinator's commit script writes its
  own rows and records the operation as committed (the commit point); then each prepared
  bucket applies its intent (:data:`.lua.APPLY`), and the coordinator forgets the
  operation. A writer that dies leaves intents; the next process that locks such a bucket
  asks the coordinator (:data:`.lua.DECIDE`): committed (apply it), aborted (drop it:
  once the coordinator's lock left the dead writer, it can never commit), or pending (its
  writer is alive: wait).

Every script is idempotent by operation id: a commit sent again (after a dropped connection)
finds its receipt and writes nothing. A commit whose reply never came is *settled*: its writer
asks the coordinator whether it was applied, and an operation found not applied is recorded
as aborted there, so that a copy of it still on its way can never apply. See
docs/redis_table.md ("Commits").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorkv.embedding.redis import lua
from tensorkv.embedding.redis.engine import (
    Buckets,
    RedisRowEngine,
    encode_fields,
    interleave,
    key_bytes,
)
from tensorkv.errors import (
    ReadOnlyError,
    RowLockError,
    StoreError,
    StoreRestartedError,
    StoreUnavailableError,
)
from tensorkv.kernels import resp
from tensorkv.stores import redis_raw
from tensorkv.stores.redis_raw import RawFallback

#: Times a commit is sent again after it met another operation's intent and resolved it.
_INTENT_RETRIES = 8


@dataclass
class OpState:
    """What it takes to settle an operation whose commit reply never came.

    Attributes
    ----------
    op
        The operation id.
    coordinator
        Its coordinator bucket (where its receipt is).
    vread
        The coordinator's version when the operation read it (-1: unknown).
    participants
        Its other buckets (a two-phase commit on a Cluster; empty otherwise).
    """

    op: bytes
    coordinator: int
    vread: int
    participants: list[int] = field(default_factory=list)


class OutcomeUnknown(Exception):  # noqa: N818 - a state, caught inside the package
    """A commit was sent and no reply says whether it was applied (``state`` settles it)."""

    def __init__(self, state: OpState, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.state = state
        self.cause = cause


def _lost_lock(engine: RedisRowEngine, what: str) -> RowLockError:
    o = engine.options
    return RowLockError(
        f"a bucket lock of table {o.table_name!r} at {o.url!r} expired (lock_ttl_seconds="
        f"{o.lock_ttl_seconds}) or the server restarted before the batch was written; {what}. "
        "Retry the step; raise lock_ttl_seconds if steps take longer")


def _raise_code(engine: RedisRowEngine, code: int, k: int) -> None:
    """Raise the error of a script's refusal ``code`` for bucket ``k`` (nothing written)."""
    b = engine.runtime
    if code == lua.LOST_LOCK:
        raise _lost_lock(engine, "nothing was written")
    if code == lua.WAS_ABORTED:
        raise RowLockError(
            f"the operation's commit on {engine.where()} was declared aborted (its locks had "
            "expired and another process settled it); nothing was written. Retry the step")
    if code == lua.LOST:
        engine.check_heads(b, engine.heads(b, [k]))  # raises the precise error
        raise engine.lost(b, [(k, "changed its epoch during the commit")])
    raise StoreError(f"unexpected reply {code} of a commit script on {engine.where()}")


# ----------------------------------------------------------------------------- commit
def commit(engine: RedisRowEngine, op: bytes, keys: np.ndarray, sealed: np.ndarray,
           deleted: np.ndarray, locked: np.ndarray, exact: bool) -> None:
    """Write ``keys``' sealed rows and delete ``deleted``, all or nothing; release ``locked``.

    ``exact``: the operation holds the locks of every bucket it writes (token ``op``);
    otherwise (last-writer-wins) it holds none, and a Cluster commit over several buckets
    takes them for the commit alone.

    Raises
    ------
    OutcomeUnknown
        The commit was sent and its outcome is unknown (see :func:`settle`).
    RowLockError, TableLostError, StoreUnavailableError
        Nothing was written.
    """
    b = engine.runtime
    engine.committed = None
    written = np.union1d(b.of(keys), b.of(deleted))
    if written.size == 0:
        if locked.size:
            engine.unlock(locked, op)
        return
    extra = np.setdiff1d(locked, written)
    if engine.store.mode == "cluster" and written.size > 1:
        engine.counters["two_phase_commits"] += 1
        _two_phase(engine, op, keys, sealed, deleted, written, extra, exact)
    else:
        res: list[int] | None = None
        for _ in range(_INTENT_RETRIES):
            res = None
            if engine.store.mode != "cluster":
                res = _commit_watched(engine, op, keys, sealed, deleted, written, extra, exact)
            if res is None:
                res = _commit_script(engine, op, keys, sealed, deleted, written, extra, exact,
                                     two_pc=False)
            if not _intent_in_the_way(engine, res, written):
                break
        assert res is not None
        _check_commit(engine, res, written)
    engine.counters["writes"] += int(keys.shape[0])
    engine.counters["deletes"] += int(deleted.shape[0])


def _intent_in_the_way(engine: RedisRowEngine, res: list[int], written: np.ndarray) -> bool:
    """Resolve the intent a commit script met (reply FOREIGN_INTENT); whether it did."""
    if res[0] != lua.FOREIGN_INTENT:
        return False
    k = int(written[res[1] - 1])
    resolve(engine, engine.runtime, engine.check_heads(engine.runtime,
                                                       engine.heads(engine.runtime, [k])))
    return True


def _check_commit(engine: RedisRowEngine, res: list[int], written: np.ndarray) -> None:
    code = res[0]
    if code == lua.OK:
        b = engine.runtime
        versions = np.asarray(res[1:], np.int64)
        b.seen[written] = np.maximum(b.seen[written], versions)
        engine.committed = (written.copy(), versions)
    elif code != lua.ALREADY:
        _raise_code(engine, code, int(written[res[1] - 1]) if len(res) > 1 else
                    int(written[0]))


def _commit_script(engine: RedisRowEngine, op: bytes, keys: np.ndarray, sealed: np.ndarray,
                   deleted: np.ndarray, written: np.ndarray, extra: np.ndarray, exact: bool,
                   two_pc: bool) -> list[int]:
    """Run :data:`.lua.COMMIT` over ``written`` (one slot, or one server); its reply.

    ``extra``: locks to release too (in the script on one server; by separate scripts on a
    Cluster). A reply that never comes raises :class:`OutcomeUnknown`.
    """
    b = engine.runtime
    cluster = engine.store.mode == "cluster"
    wl = written.tolist()
    bk, bd = b.of(keys), b.of(deleted)
    sk, sd = np.sort(bk), np.sort(bd)
    ns = np.searchsorted(sk, written, "right") - np.searchsorted(sk, written)
    nd = np.searchsorted(sd, written, "right") - np.searchsorted(sd, written)
    locks = [b.locks[k] for k in wl] if exact else []
    rel = [] if cluster else [b.locks[k] for k in extra.tolist()]
    keys_ = [b.names[k] for k in wl] + locks + rel
    head = [op, str(b.epoch).encode(), b"%d" % len(wl), b"1" if exact else b"0",
            b"1" if two_pc else b"0", b"%d" % len(rel)]
    counts = [b"%d" % v for pair in zip(ns.tolist(), nd.tolist(), strict=True) for v in pair]
    ko, do = np.argsort(bk, kind="stable"), np.argsort(bd, kind="stable")
    body = lua.COMMIT.encode()
    leading = [b"EVAL", body, b"%d" % len(keys_), *keys_, *head, *counts]
    n_args = len(leading) + 2 * keys.shape[0] + deleted.shape[0]
    releases = [(b.locks[k], (lua.RELEASE, [b.locks[k]], [op])) for k in extra.tolist()] \
        if cluster else []
    engine.counters["round_trips"] += 1
    state = OpState(op, wl[0], int(b.seen[wl[0]]))
    try:
        try:
            pieces: list[Any] = [resp.array_head(n_args, leading)]
            if keys.shape[0]:
                pieces.append(resp.frame_columns([key_bytes(keys), sealed], ko))
            if deleted.shape[0]:
                pieces.append(resp.frame_columns([key_bytes(deleted)], do))
            rel_raw = [(k, [resp.array_head(5, (b"EVAL", lua.RELEASE.encode(), b"1", k, op))])
                       for k, _ in releases]
            groups = engine.store.execute_raw(
                [b.names[wl[0]]] + [k for k, _ in rel_raw], [pieces] + [p for _, p in rel_raw],
                [len(wl) + 1] + [0] * len(rel_raw), [64 + 24 * len(wl)] + [16] * len(rel_raw))
            return _first_array(groups)
        except RawFallback:  # every script can run again: the op id makes it idempotent
            engine.counters["raw_fallbacks"] += 1
            fields = encode_fields(keys[ko])
            vals = sealed[ko].view(f"V{engine.width}").ravel().tolist()
            args = [*head, *counts, *interleave(fields, vals), *encode_fields(deleted[do])]
            res = engine.store.execute(
                [(b.names[wl[0]], ("EVAL", lua.COMMIT, len(keys_), *keys_, *args))]
                + [(k, ("EVAL", body_, 1, *ks, *a)) for k, (body_, ks, a) in releases])
            return [int(x) for x in res[0]]
    except StoreUnavailableError as exc:
        if isinstance(exc, (StoreRestartedError, RowLockError)):
            raise
        raise OutcomeUnknown(state, exc) from exc


def _has(ring: bytes | None, op: bytes) -> bool:
    r = ring or b""
    return any(r[i:i + lua.OP_CHARS] == op for i in range(0, len(r), lua.ENTRY_CHARS))


def _commit_watched(engine: RedisRowEngine, op: bytes, keys: np.ndarray, sealed: np.ndarray,
                    deleted: np.ndarray, written: np.ndarray, extra: np.ndarray,
                    exact: bool) -> list[int] | None:
    """:data:`.lua.COMMIT`'s work on one server, as WATCH + MULTI/EXEC (faster).

    First round trip: WATCH the locks and the written buckets, read the locks, the buckets'
    epoch and intent fields and the coordinator's receipts; the checks run here. Second:
    MULTI, the HSET/HDEL of the rows, the versions, the receipt, the lock releases, EXEC,
    which Redis aborts if anything watched changed since (nothing is written). Returns the
    reply :data:`.lua.COMMIT` would give, or None when the script must do it (a
    transaction aborted three times, a dropped connection, a reply of another shape): every
    step can run again.
    """
    b = engine.runtime
    wl = written.tolist()
    c = wl[0]
    locks = [b.locks[k] for k in np.union1d(written, extra).tolist()] if exact else []
    names = [b.names[k] for k in wl]
    nh = len(names)
    bk, bd = b.of(keys), b.of(deleted)
    epoch = str(b.epoch).encode()
    for _ in range(3):
        try:
            with redis_raw.session(engine.store) as call:
                watched = locks + names
                pieces = [resp.array_head(1 + len(watched), (b"WATCH", *watched))]
                if locks:
                    pieces.append(resp.array_head(1 + len(locks), (b"MGET", *locks)))
                pieces += [resp.array_head(4, (b"HMGET", name, lua.EPOCH, lua.MARK))
                           for name in names]
                pieces.append(resp.array_head(5, (b"HMGET", b.names[c], lua.VERSION,
                                                  lua.RECEIPTS, lua.ABORTED)))
                n1 = 2 + bool(locks) + nh
                r = call(pieces, n1, len(locks) + 2 * nh + 3,
                         256 + 64 * len(locks) + 64 * nh + 2 * lua.RING * lua.ENTRY_CHARS)
                redis_raw.check_errors(r)
                if r.rtype[0] != resp.SIMPLE or (r.rtype[1:] != resp.ARRAY).any():
                    raise RawFallback("WATCH/MGET/HMGET answered with other replies")
                vals = [None if ln < 0 else r.buf[o:o + ln].tobytes()
                        for o, ln in zip(r.eoff.tolist(), r.elen.tolist(), strict=True)]
                at = 0
                held = vals[at:at + len(locks)]
                at += len(locks)
                heads = [vals[at + 2 * i:at + 2 * i + 2] for i in range(nh)]
                at += 2 * nh
                version, ring, aborted = vals[at:at + 3]
                code = None
                if _has(ring, op):
                    code = [lua.ALREADY]
                elif _has(aborted, op):
                    code = [lua.WAS_ABORTED]
                elif any(h != op for h in held):
                    code = [lua.LOST_LOCK, 1]
                else:
                    for i, (e, m) in enumerate(heads):
                        if e != epoch:
                            code = [lua.LOST, i + 1]
                        elif m is not None and m[:lua.OP_CHARS] != op:
                            code = [lua.FOREIGN_INTENT, i + 1]
                        if code:
                            break
                if code is not None:
                    call([resp.array_head(1, (b"UNWATCH",))], 1)
                    return code
                entry = op + b"%016d" % (int(version or 0) + 1)
                new_ring = (entry + (ring or b""))[:lua.RING * lua.ENTRY_CHARS]
                cmds: list[Any] = [resp.array_head(1, (b"MULTI",))]
                n_cmds = 0
                ko, do = np.argsort(bk, kind="stable"), np.argsort(bd, kind="stable")
                if keys.shape[0]:
                    framed = resp.frame_columns([key_bytes(keys), sealed], ko)
                    sk = bk[ko]
                    for k, name in zip(wl, names, strict=True):
                        a, z = np.searchsorted(sk, k), np.searchsorted(sk, k, "right")
                        for a0 in range(int(a), int(z), engine.options.keys_sending_size):
                            z0 = min(int(z), a0 + engine.options.keys_sending_size)
                            cmds += [resp.array_head(2 + 2 * (z0 - a0), (b"HSET", name)),
                                     framed[a0:z0]]
                            n_cmds += 1
                if deleted.shape[0]:
                    framed = resp.frame_columns([key_bytes(deleted)], do)
                    sd = bd[do]
                    for k, name in zip(wl, names, strict=True):
                        a, z = np.searchsorted(sd, k), np.searchsorted(sd, k, "right")
                        if z > a:
                            cmds += [resp.array_head(2 + int(z - a), (b"HDEL", name)),
                                     framed[int(a):int(z)]]
                            n_cmds += 1
                first_version = n_cmds
                cmds += [resp.array_head(4, (b"HINCRBY", name, lua.VERSION, b"1"))
                         for name in names]
                cmds.append(resp.array_head(4, (b"HSET", b.names[c], lua.RECEIPTS, new_ring)))
                n_cmds += nh + 1
                if locks:
                    cmds.append(resp.array_head(1 + len(locks), (b"DEL", *locks)))
                    n_cmds += 1
                cmds.append(resp.array_head(1, (b"EXEC",)))
                engine.counters["round_trips"] += 2
                r = call(cmds, n_cmds + 2, n_cmds, 64 + 24 * n_cmds)
                redis_raw.check_errors(r)  # e.g. OOM while queueing: EXECABORT
                if r.rtype[-1] == resp.NIL:
                    continue  # something watched changed: look again
                redis_raw.element_errors(r)  # e.g. WRONGTYPE: a bucket that is not a hash
                if r.rtype[-1] != resp.ARRAY or r.rval[-1] != n_cmds or (
                        r.elen[:n_cmds] != -2).any():
                    raise RawFallback("EXEC answered with other replies")
                versions = r.eoff[first_version:first_version + nh].tolist()
                return [lua.OK, *[int(v) for v in versions]]
        except RawFallback:
            engine.counters["raw_fallbacks"] += 1
            return None
    return None


def _first_array(groups: list[Any]) -> list[int]:
    """The integers of the array reply of command 0 (the raw path's replies)."""
    for r in groups:
        for j, i in enumerate(r.commands):
            if i == 0:
                if r.rtype[j] != resp.ARRAY:
                    raise RawFallback("a commit script answered with another reply")
                e = int(r.roff[j])
                if (r.elen[e:e + int(r.rval[j])] != -2).any():
                    raise RawFallback("a commit script answered with another reply")
                return [int(v) for v in r.eoff[e:e + int(r.rval[j])].tolist()]
    raise RawFallback("no reply of the commit script")  # pragma: no cover


def _two_phase(engine: RedisRowEngine, op: bytes, keys: np.ndarray, sealed: np.ndarray,
               deleted: np.ndarray, written: np.ndarray, extra: np.ndarray,
               exact: bool) -> None:
    """The two-phase commit over several Cluster buckets (see the module docstring)."""
    b = engine.runtime
    if not exact:  # last-writer-wins: the buckets are locked for the commit alone
        engine.lock(written, op)
    wl = written.tolist()
    c, rest = wl[0], wl[1:]
    bk, bd = b.of(keys), b.of(deleted)
    epoch = str(b.epoch).encode()
    calls = []
    for k in rest:
        s, d = bk == k, bd == k
        blob = lua.intent_blob(engine.width, keys[s], sealed[s], deleted[d], rest)
        calls.append((lua.PREPARE, [b.names[k], b.locks[k]], [op, epoch, lua.mark_of(op, c),
                                                               blob]))
    calls += [(lua.RELEASE, [b.locks[k]], [op]) for k in extra.tolist()]
    for _ in range(_INTENT_RETRIES):
        engine.counters["round_trips"] += 1
        try:
            res = engine.scripts(calls)
        except BaseException:  # the commit point was not reached: nothing is applied
            _abort(engine, op, rest, wl)
            raise
        codes = [int(r[0]) for r in res[:len(rest)]]
        if all(x == lua.OK for x in codes):
            break
        blocked = [k for k, x in zip(rest, codes, strict=True) if x == lua.FOREIGN_INTENT]
        if len(blocked) != sum(x != lua.OK for x in codes):
            _abort(engine, op, rest, wl)
            bad = next((k, x) for k, x in zip(rest, codes, strict=True) if x != lua.OK)
            _raise_code(engine, bad[1], bad[0])
        resolve(engine, b, [(k, m) for k, m in engine.check_heads(b, engine.heads(b, blocked))
                            if not m.startswith(op)])
    else:
        _abort(engine, op, rest, wl)
        raise RowLockError(f"{engine.where()}: intents of other operations kept appearing in "
                           "the buckets of this commit; nothing was written. Retry the step")
    cs = keys[bk == c], sealed[bk == c], deleted[bd == c]
    state = OpState(op, c, int(b.seen[c]), rest)
    try:
        for _ in range(_INTENT_RETRIES):
            res = _commit_script(engine, op, *cs, written[:1], np.zeros(0, np.int64), True,
                                 two_pc=True)
            if not _intent_in_the_way(engine, res, written[:1]):
                break
        if res[0] not in (lua.OK, lua.ALREADY):
            _abort(engine, op, rest, wl)
        _check_commit(engine, res, written[:1])
    except OutcomeUnknown as exc:
        exc.state = state
        try:
            applied = settle(engine, state)
        except Exception:  # noqa: BLE001 - the commit stays unknown: its caller settles it
            raise exc from exc.cause
        if not applied:
            raise StoreUnavailableError(
                f"{engine.where()}: the connection failed during the commit; it was not "
                "applied (nothing was written). Retry the step") from exc.cause
        return
    moved = finish(engine, state, release=True)
    if engine.committed is not None and len(moved) == len(rest):
        # every bucket moved by this operation alone: the coordinator, then the participants
        engine.committed = (written.copy(), np.concatenate(
            [engine.committed[1], np.asarray([moved[k] for k in rest], np.int64)]))
    else:
        engine.committed = None


def _abort(engine: RedisRowEngine, op: bytes, prepared: list[int], locked: list[int]) -> None:
    """Drop ``op``'s intents and release its locks, as far as the servers answer."""
    b = engine.runtime
    calls = [(lua.ABORT, [b.names[k], b.locks[k]], [op, b"1"]) for k in prepared]
    calls += [(lua.RELEASE, [b.locks[k]], [op]) for k in locked if k not in prepared]
    with contextlib.suppress(Exception):  # others decide it aborted once its locks expire
        engine.scripts(calls)


def finish(engine: RedisRowEngine, state: OpState, release: bool) -> dict[int, int]:
    """Apply a committed two-phase operation's intents everywhere, then forget it.

    What a server does not answer stays for the next process that locks the bucket (it
    finds the intent and applies it); the operation is committed either way. Returns the
    version each participant moved to by this call's apply (none where it was applied
    already, or not answered).
    """
    b = engine.runtime
    op = state.op
    rel = b"1" if release else b"0"
    moved: dict[int, int] = {}
    try:
        res = engine.scripts([(lua.APPLY, [b.names[k], b.locks[k]], [op, rel])
                              for k in state.participants])
        for k, v in zip(state.participants, res, strict=True):
            if int(v) > 0:
                b.seen[k] = max(int(b.seen[k]), int(v))
                moved[k] = int(v)
        engine.script(lua.FINISH, b.names[state.coordinator], [b.names[state.coordinator]],
                      [op])
    except StoreError:
        engine.unfinished.append(state)
    return moved


def finish_unfinished(engine: RedisRowEngine) -> None:
    """Try again to finish the committed operations :func:`finish` could not (best effort)."""
    todo, engine.unfinished = engine.unfinished, []
    for state in todo:
        finish(engine, state, release=True)


# ----------------------------------------------------------------------------- settling
def settle(engine: RedisRowEngine, state: OpState) -> bool:
    """Whether the operation of ``state`` was applied; an operation not applied is aborted.

    Asked by the operation's own writer: if its receipt is not at the coordinator and it
    could still commit, it is recorded as aborted there (and its coordinator lock dropped),
    so it never applies later. A two-phase operation found committed is finished.

    Raises
    ------
    StoreUnavailableError
        The coordinator cannot be reached (the outcome stays unknown).
    StoreError
        The receipt may have left the coordinator's ring (more than
        :data:`~.lua.RING` later commits): the outcome cannot be told.
    """
    b = engine.runtime
    c = state.coordinator
    d = int(engine.script(lua.DECIDE, b.names[c], [b.names[c], b.locks[c]],
                          [state.op, b"1", b"%d" % state.vread]))
    engine.counters["settled"] += 1
    if d == lua.D_COMMITTED:
        if state.participants:
            finish(engine, state, release=True)
        return True
    if d == lua.D_ABORTED:
        if state.participants:
            _abort(engine, state.op, state.participants, state.participants)
        return False
    raise StoreError(
        f"{engine.where()}: cannot tell whether the operation {state.op.decode()} whose commit "
        f"got no reply was applied: more than {lua.RING} later commits passed through bucket "
        f"{b.names[c]!r} since. Check the rows it wrote before you retry it")


def resolve(engine: RedisRowEngine, b: Buckets, marks: list[tuple[int, bytes]]) -> None:
    """Finish or roll back the operations whose intents ``marks`` (``[(bucket, mark)]``) are.

    Called by a process that met another operation's intent (it holds the bucket's lock, or
    its commit found the intent). Waits while the intent's writer still holds its
    coordinator's lock, at most ``lock_wait_seconds``.
    """
    deadline = time.monotonic() + engine.options.lock_wait_seconds
    for k, mark in marks:
        op, c = lua.parse_mark(mark)
        pause = 0.001
        while True:
            d = int(engine.script(lua.DECIDE, b.names[c], [b.names[c], b.locks[c]],
                                  [op, b"0", b"-1"]))
            if d != lua.D_PENDING:
                break
            if time.monotonic() > deadline:
                raise RowLockError(
                    f"bucket {b.names[k]!r} of {engine.where(b)} holds an unfinished "
                    f"operation ({op.decode()}) whose writer still holds bucket "
                    f"{b.names[c]!r}; waited lock_wait_seconds="
                    f"{engine.options.lock_wait_seconds}. Retry")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        blob = engine.store.execute([(b.names[k], ("HGET", b.names[k], lua.INTENT))])[0]
        parts = [k] if blob is None else sorted(set(lua.parse_blob(bytes(blob))[3]) | {k})
        if d == lua.D_COMMITTED:
            finish(engine, OpState(op, c, -1, parts), release=True)
        else:
            _abort(engine, op, parts, [])
        engine.counters["resolved_intents"] += 1


def committed_intent(engine: RedisRowEngine, b: Buckets, mark: bytes) -> bool:
    """Whether the intent ``mark`` belongs to a committed operation (reads only)."""
    op, c = lua.parse_mark(mark)
    ring, pend = engine.store.execute(
        [(b.names[c], ("HMGET", b.names[c], lua.RECEIPTS, lua.COMMITTED))], read=engine.rd)[0]

    def has(r: Any) -> bool:
        r = bytes(r or b"")
        return any(r[i:i + lua.OP_CHARS] == op for i in range(0, len(r), lua.ENTRY_CHARS))

    return has(ring) or has(pend)


def overlay_found(engine: RedisRowEngine, b: Buckets, keys: np.ndarray, pos: np.ndarray,
                  recs: np.ndarray, marks: list[tuple[int, bytes]]
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """Lay the intents ``marks`` of committed operations over rows read (reads only).

    ``(pos, recs)`` is :meth:`~RedisRowEngine.get_found`'s answer for ``keys``. A reader
    that holds no lock sees a bucket whose writer committed an operation and died before
    applying it there as that operation left it. Returns None when an intent left its
    bucket since the rows were read (applied, or replaced): the rows read are older than
    the bucket then, so read them again.
    """
    n = keys.shape[0]
    full = np.zeros((n, engine.width), np.uint8)
    have = np.zeros(n, bool)
    full[pos], have[pos] = recs, True
    changed = False
    for k, mark in marks:
        if not committed_intent(engine, b, mark):
            continue
        now, blob = engine.store.execute([(b.names[k], ("HMGET", b.names[k], lua.MARK,
                                                         lua.INTENT))], read=engine.rd)[0]
        if now is None or bytes(now) != mark or blob is None:
            return None  # applied (or replaced) meanwhile: the rows read are older
        ikeys, irecs, dels, _ = lua.parse_blob(bytes(blob))
        engine.verify(np.ones(ikeys.shape[0], bool), irecs, ikeys, "an intent record")
        order = np.argsort(ikeys)
        sk = ikeys[order]
        j = np.minimum(np.searchsorted(sk, keys), max(sk.shape[0] - 1, 0))
        match = (sk[j] == keys) if sk.shape[0] else np.zeros(n, bool)
        full[match] = irecs[order][j[match]]
        have[match] = True
        have[np.isin(keys, dels)] = False
        changed = True
    if not changed:
        return pos, recs
    out = np.flatnonzero(have)
    return out, full[out]


# ----------------------------------------------------------------------------- whole buckets
def scan(engine: RedisRowEngine, b: Buckets | None = None,
         chunk_rows: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(keys, sealed records)`` chunks of every row, each bucket as of one moment.

    Each bucket is read atomically (:meth:`RedisRowEngine.read_bucket`); a bucket holding an
    intent of a committed operation is read as that operation leaves it (the intent laid
    over its rows), else as it is.
    """
    b = b or engine.runtime
    for i in range(b.n):
        keys, recs = bucket_rows(engine, b, i)
        for a in range(0, keys.size, chunk_rows):
            yield keys[a:a + chunk_rows], recs[a:a + chunk_rows]


def bucket_rows(engine: RedisRowEngine, b: Buckets, i: int) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, sealed records)`` of bucket ``i`` as of one moment (see :func:`scan`)."""
    keys, recs, meta = engine.read_bucket(b, i)
    mark = meta.get(lua.MARK)
    if mark is not None and lua.INTENT in meta and committed_intent(engine, b, mark):
        keys, recs = _overlay(engine, keys, recs, meta[lua.INTENT])
    return keys, recs


def _overlay(engine: RedisRowEngine, keys: np.ndarray, recs: np.ndarray,
             blob: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a bucket once the intent ``blob`` is applied."""
    ikeys, irecs, dels, _ = lua.parse_blob(blob)
    engine.verify(np.ones(ikeys.shape[0], bool), irecs, ikeys, "an intent record")
    keep = ~np.isin(keys, np.concatenate([ikeys, dels]))
    return (np.concatenate([keys[keep], ikeys]),
            np.concatenate([recs[keep], np.asarray(irecs, np.uint8)]))


def clear(engine: RedisRowEngine, op: bytes, exact: bool) -> None:
    """Empty every bucket (keeping the table's epoch; each bucket at once).

    In exact mode the locks of every bucket are taken first (writers finish their steps).
    Not atomic over several Cluster nodes; a clear that failed midway can be run again.
    """
    if engine.options.read_only:  # pragma: no cover - the table refuses it first
        raise ReadOnlyError(f"{engine.where()} is read_only")
    b = engine.runtime
    every = np.arange(b.n, dtype=np.int64)
    if exact:
        engine.lock(every, op)
    epoch = str(b.epoch).encode()
    try:
        res = engine.scripts([(lua.RESET, [b.names[k], b.locks[k]],
                               [epoch, op, epoch, b"1" if exact else b"0"]) for k in range(b.n)])
    except BaseException:
        if exact:
            engine.unlock(every, op)
        raise
    bad = [(k, int(r[0])) for k, r in enumerate(res) if int(r[0]) != lua.OK]
    if bad:
        if exact:
            engine.unlock(every, op)
        _raise_code(engine, bad[0][1], bad[0][0])


__all__ = ["OpState", "OutcomeUnknown", "bucket_rows", "clear", "commit", "committed_intent",
           "finish", "finish_unfinished", "overlay_found", "resolve", "scan", "settle"]
