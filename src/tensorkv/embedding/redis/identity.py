"""The identity of a Redis-resident table: created, checked, adopted or reset when it opens.

A table's layout record (``<model_tag>:<table>:layout``) holds its *epoch*, a random id, and
every bucket holds the same epoch in its ``~e`` field (:mod:`.lua`). Opening a table
reads the record and every bucket's identity fields in one round trip:

* no record and no bucket: a new table. It is created (the record is claimed with SET NX,
  then each bucket receives the epoch), unless the table is read-only or ``must_exist``;
* a record whose epoch every bucket holds: the table as it was;
* a bucket without the epoch, or buckets without a record: rows were lost. Refused with
  :class:`~tensorkv.errors.TableLostError`, or with ``on_lost="start_empty"`` emptied under a
  new epoch;
* a record without an epoch: rows written by a tensorkv that did not record one; a writable
  process adopts them (each bucket receives a new epoch).

After that every read and commit checks the epoch of the buckets it touches (see
:meth:`~tensorkv.embedding.redis.engine.RedisRowEngine.check_heads`).
"""

from __future__ import annotations

import json
from typing import Any

from tensorkv.embedding.redis import lua
from tensorkv.embedding.redis.engine import RedisRowEngine
from tensorkv.errors import ConfigError, RowLockError, TableLostError


def _text(x: Any) -> str | None:
    return None if x is None else bytes(x).decode()


def establish(engine: RedisRowEngine) -> None:
    """Check or create the identity of ``engine``'s runtime tag (see the module docstring).

    Sets the runtime buckets' epoch and the versions seen.
    """
    o, rt = engine.options, engine.runtime
    raw = engine.store.execute([(rt.meta_key, ("GET", rt.meta_key))], read=engine.rd)[0]
    meta = None if raw is None else json.loads(raw)
    engine.check_meta(rt, meta, "this table's options")
    res = engine.scripts([(lua.COUNT, [name], []) for name in rt.names], read=engine.rd)
    rows = [int(r[0]) for r in res]
    epochs = [_text(r[1]) for r in res]
    versions = [-1 if r[2] is None else int(r[2]) for r in res]
    state = None if meta is None else meta.get("state", "ready")
    if meta is None:
        if any(rows) or any(e is not None for e in epochs):
            problems = [(k, "holds rows but the table's layout record is gone")
                        for k in range(rt.n) if rows[k] or epochs[k] is not None]
            _lost(engine, problems)
            return
        if o.read_only or o.must_exist:
            raise TableLostError(
                f"{engine.where()} holds no table (no layout record, no bucket): a typo in "
                "the options, a table never created, or a server that lost everything (a "
                "restart without persistence, FLUSHALL, which leave no trace). "
                + ("A read-only table never creates one; open it from a trainer first"
                   if o.read_only else "must_exist=True refuses to create it; drop "
                   "must_exist to start a new table"))
        _create(engine, None)
        return
    if state == "creating":
        if o.read_only:
            raise RowLockError(f"{engine.where()} is being created or emptied by another "
                               "process; retry")
        _create(engine, meta)
        return
    if "epoch" not in meta or state == "adopting":
        if o.read_only:
            raise ConfigError(f"{engine.where()} was written by a tensorkv that did not record "
                              "its identity; open it once from a writable process (it adopts "
                              "the rows), then retry")
        _adopt(engine, meta, raw)
        return
    rt.epoch = str(meta["epoch"])
    problems = [(k, "holds no epoch" if e is None else f"holds epoch {e}")
                for k, e in enumerate(epochs) if e != rt.epoch]
    if problems:
        _lost(engine, problems)
        return
    rt.seen[:] = versions


def _lost(engine: RedisRowEngine, problems: list[tuple[int, str]]) -> None:
    """Refuse the lost rows, or empty the table under ``on_lost="start_empty"``."""
    o = engine.options
    if o.on_lost == "start_empty" and not o.read_only:
        reset(engine)
        return
    raise engine.lost(engine.runtime, problems)


def _create(engine: RedisRowEngine, meta: dict[str, Any] | None) -> None:
    rt = engine.runtime
    if meta is None:
        epoch = lua.new_epoch()
        claim = json.dumps({**engine.layout_meta(rt), "epoch": epoch, "state": "creating"})
        if not engine.store.execute([(rt.meta_key, ("SET", rt.meta_key, claim, "NX"))])[0]:
            establish(engine)  # another process created it first
            return
    else:
        epoch = str(meta["epoch"])
    _give_epoch(engine, epoch, lua.INIT)


def _give_epoch(engine: RedisRowEngine, epoch: str, script: str) -> None:
    """Run ``script`` (INIT or ADOPT) on every bucket, then record the table as ready."""
    rt = engine.runtime
    engine.scripts([(script, [name], [epoch]) for name in rt.names])
    rt.epoch = epoch
    rt.seen[:] = -1
    engine.check_heads(rt, engine.heads(rt, list(range(rt.n))))
    engine.write_meta(rt, epoch=epoch, state="ready")


def reset(engine: RedisRowEngine) -> None:
    """Empty every bucket of the runtime tag under a new epoch (``on_lost="start_empty"``).

    Processes that have the table open fail their next operation (the epoch changed) and
    must reopen it.
    """
    rt = engine.runtime
    epoch = lua.new_epoch()
    engine.write_meta(rt, epoch=epoch, state="creating")
    engine.store.execute([(rt.marker_key, ("DEL", rt.marker_key))])
    _give_epoch(engine, epoch, lua.INIT)


def _adopt(engine: RedisRowEngine, meta: dict[str, Any], raw: Any) -> None:
    """Give the rows of a table without an identity a new epoch (keeping them)."""
    rt = engine.runtime
    if meta.get("state") == "adopting":
        epoch = str(meta["epoch"])
    else:
        epoch = lua.new_epoch()
        new = json.dumps({**meta, **engine.layout_meta(rt), "epoch": epoch,
                          "state": "adopting"})
        if not int(engine.script(lua.SWAP, rt.meta_key, [rt.meta_key], [raw, new])):
            establish(engine)  # another process adopted them first
            return
    _give_epoch(engine, epoch, lua.ADOPT)


__all__ = ["establish", "reset"]
