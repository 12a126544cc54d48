"""Opening a Redis-resident table: its identity, imports from another tag or layout, dumps.

:func:`prepare` runs on every open: it refuses a table whose migration is unfinished unless
the options resume it, copies (``model_tag_import``) or rehashes (``storage_slice_import``)
the imported rows into the runtime buckets once (resumable: a marker in Redis records the
buckets done), expires the old tag if asked, checks the table's identity
(:mod:`.identity`) and restores an empty tag from mode-1 dump files. :func:`dump`
writes those files. See docs/redis_table.md ("Model tags and rehashing", "Table store
modes").
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import numpy as np

from tensorkv.embedding.redis import commit as redis_commit
from tensorkv.embedding.redis import identity as redis_identity
from tensorkv.embedding.redis import lua
from tensorkv.embedding.redis.engine import Buckets, RedisRowEngine, dump_path
from tensorkv.errors import (
    ConfigError,
    CorruptRecordError,
    MigrationUnfinishedError,
    RowLockError,
)

MIGRATION_CHUNK = 8192  # rows per command of a migration


def _layout_id(b: Buckets) -> str:
    return json.dumps(b.describe(), sort_keys=True)


def _source_id(engine: RedisRowEngine) -> str:
    return _layout_id(engine.source)


def _same_migration(engine: RedisRowEngine, marker: dict[str, Any]) -> bool:
    """Whether ``marker`` is the migration these options ask for (so they resume it)."""
    return (engine.options.migrates and marker.get("source") == _source_id(engine)
            and marker.get("target", _layout_id(engine.runtime)) == _layout_id(engine.runtime))


def prepare(engine: RedisRowEngine) -> None:
    """Check, migrate and restore the runtime tag of ``engine`` (see the module docstring)."""
    o = engine.options
    try:
        engine.run_ids = engine.store.identity()
    except Exception:  # noqa: BLE001 - only for messages; INFO may be refused by an ACL
        engine.run_ids = None
    marker = _marker(engine)
    if marker is not None and not marker.get("done") and not _same_migration(engine, marker):
        if o.on_lost == "start_empty" and marker.get("copy") and not o.read_only:
            engine.store.execute([(engine.runtime.marker_key,
                                   ("DEL", engine.runtime.marker_key))])  # abandon the copy
        else:
            raise MigrationUnfinishedError(_unfinished(engine, marker))
    if o.migrates and (marker is None or not marker.get("done")
                       or marker.get("source") != _source_id(engine)):
        if o.read_only:
            raise MigrationUnfinishedError(
                f"table {o.table_name!r} under {o.model_tag_runtime!r} has not imported "
                f"{o.model_tag_import!r} (or its layout) yet and this table is read_only; open "
                "it once writable (a trainer) first, then retry")
        migrate(engine)
        return
    redis_identity.establish(engine)
    if o.table_store_mode == 1 and not o.read_only and len(engine) == 0:
        restore(engine)


def _describe(d: Any) -> str:
    try:
        x = json.loads(d)
    except (TypeError, ValueError):
        return str(d)
    return (f"model tag {x.get('model_tag')!r}, storage_slice={x.get('storage_slice')}, "
            f"using_hash_storage_slice={x.get('using_hash_storage_slice')}")


def _unfinished(engine: RedisRowEngine, marker: dict[str, Any]) -> str:
    """The message refusing to open a table whose migration is unfinished."""
    o = engine.options
    src, dst = json.loads(marker["source"]), json.loads(marker.get("target") or "{}")
    msg = (f"table {o.table_name!r} under {o.model_tag_runtime!r} at {o.url!r} is being "
           f"migrated from {_describe(marker['source'])} to {_describe(marker.get('target'))} "
           f"and the migration stopped after bucket {marker.get('next', 0)} of "
           f"{src.get('storage_slice')}: opening it with other options would see only part "
           f"of its rows. Finish it: open it with storage_slice={dst.get('storage_slice')}, "
           f"storage_slice_import={src.get('storage_slice')}")
    if src.get("model_tag") != dst.get("model_tag"):
        msg += (f", model_tag_import={src.get('model_tag')!r} (it resumes where it stopped). "
                f"Or abandon it: the tag {src.get('model_tag')!r} is unchanged; open this tag "
                "with on_lost='start_empty' to drop the partial copy")
    else:
        msg += (" (it resumes where it stopped; one process migrates, the others wait). To "
                f"return to storage_slice={src.get('storage_slice')} afterwards, rehash back "
                f"(storage_slice={src.get('storage_slice')}, storage_slice_import="
                f"{dst.get('storage_slice')}); an unfinished rehash cannot be abandoned "
                "without losing rows")
    return msg


def _marker(engine: RedisRowEngine) -> dict[str, Any] | None:
    key = engine.runtime.marker_key
    raw = engine.store.execute([(key, ("GET", key))], read=engine.rd)[0]
    return None if raw is None else json.loads(raw)


def migrate(engine: RedisRowEngine) -> int:
    """Copy (or rehash in place) the imported rows into the runtime buckets; resumable.

    One process migrates (it holds ``<runtime>:migration:lock``); others wait for it. Rows
    the runtime tag already holds are kept (HSETNX). The runtime buckets receive the epoch
    of the migrated table; with a rehash in place, each old bucket is marked moved before any
    row moves (processes that have the old layout open fail their next operation) and is
    deleted once empty. Returns rows copied by this call.
    """
    o, rt, store = engine.options, engine.runtime, engine.store
    lock = rt.marker_key + b":lock"
    token = uuid.uuid4().hex.encode()
    ttl = int(o.lock_ttl_seconds * 1000)
    deadline = time.monotonic() + o.lock_wait_seconds
    while not store.execute([(lock, ("SET", lock, token, "NX", "PX", ttl))])[0]:
        m = _marker(engine)
        if m is not None and m.get("done") and m.get("source") == _source_id(engine):
            redis_identity.establish(engine)  # another process finished it
            return 0
        if time.monotonic() > deadline:
            raise RowLockError(f"another process has been importing {o.model_tag_import!r} "
                               f"into {o.model_tag_runtime!r} for lock_wait_seconds="
                               f"{o.lock_wait_seconds}; retry when it is done")
        time.sleep(0.05)
    try:
        return _migrate_locked(engine, lock, ttl)
    finally:
        engine.script(lua.RELEASE, lock, [lock], [token])


def _migrate_locked(engine: RedisRowEngine, lock: bytes, ttl: int) -> int:
    o, src, rt, store = engine.options, engine.source, engine.runtime, engine.store
    src_meta = engine.read_meta(src)
    if src_meta is None and src.model_tag != rt.model_tag:
        raise ConfigError(
            f"model_tag_import={src.model_tag!r} holds no table {o.table_name!r} at "
            f"{o.url!r} (no layout record {src.meta_key!r}); check the tag and table_name, "
            "or drop model_tag_import to start empty")
    engine.check_meta(src, src_meta, "the import options")
    in_place = src.model_tag == rt.model_tag
    m = _marker(engine)
    if m is not None and not m.get("done") and _same_migration(engine, m) and "epoch" in m:
        start, epoch = int(m.get("next", 0)), str(m["epoch"])  # resume
    else:
        start = 0
        rt_meta = engine.read_meta(rt)
        epoch = lua.new_epoch()
        if not in_place and rt_meta is not None:
            engine.check_meta(rt, rt_meta, "this table's options")
            epoch = str(rt_meta.get("epoch") or epoch)  # merged into a table: keep its epoch
        if src_meta is not None and src_meta.get("epoch"):  # finish the source's operations
            src.epoch = str(src_meta["epoch"])
            marks = engine.check_heads(src, engine.heads(src, list(range(src.n))))
            redis_commit.resolve(engine, src, marks)
        _set_marker(engine, {"source": _source_id(engine), "target": _layout_id(rt),
                             "epoch": epoch, "next": 0, "done": False, "copy": not in_place})
    src.epoch = None  # read the source as it is (its buckets are being relabelled)
    src.seen[:] = -1
    moved = [name for name in src.names if name not in rt.names] if in_place else []
    calls: list[tuple[str, list[bytes], list[Any]]] = [
        (lua.RELABEL, [name], [b"moved:" + epoch.encode()]) for name in moved]
    calls += [(lua.RELABEL, [name], [epoch.encode()]) for name in rt.names]
    engine.scripts(calls)
    copied = 0
    for i in range(start, src.n):
        keys, recs, _ = engine.read_bucket(src, i)
        for a in range(0, keys.size, MIGRATION_CHUNK):
            copied += engine.put_absent(rt, keys[a:a + MIGRATION_CHUNK],
                                        recs[a:a + MIGRATION_CHUNK])
        if in_place:  # rows that belong to another bucket leave this one
            elsewhere = np.asarray([name != src.names[i] for name in rt.names], bool)
            gone = keys[elsewhere[rt.of(keys)]]
            for a in range(0, gone.size, MIGRATION_CHUNK):
                part = gone[a:a + MIGRATION_CHUNK]
                store.execute([(src.names[i], ("HDEL", src.names[i],
                                               *part.astype("<i8").view("V8").tolist()))])
        _set_marker(engine, {"source": _source_id(engine), "target": _layout_id(rt),
                             "epoch": epoch, "next": i + 1, "done": False,
                             "copy": not in_place})
        store.execute([(lock, ("PEXPIRE", lock, ttl))])
    if moved:
        store.execute([(name, ("DEL", name)) for name in moved])
    if in_place:  # intents and receipts of the old layout name its buckets by number
        store.execute([(name, ("HDEL", name, lua.MARK, lua.INTENT, lua.COMMITTED))
                       for name in rt.names if name in src.names])
    rt.epoch = epoch
    rt.seen[:] = -1
    engine.check_heads(rt, engine.heads(rt, list(range(rt.n))))
    engine.write_meta(rt, epoch=epoch, state="ready")
    _set_marker(engine, {"source": _source_id(engine), "target": _layout_id(rt),
                         "epoch": epoch, "next": src.n, "done": True, "copy": not in_place})
    if o.expire_model_tag_in_seconds and not in_place:
        secs = int(o.expire_model_tag_in_seconds)
        store.execute([(k, ("EXPIRE", k, secs)) for k in [*src.names, src.meta_key]])
    engine.counters["migrated"] += copied
    return copied


def _set_marker(engine: RedisRowEngine, marker: dict[str, Any]) -> None:
    key = engine.runtime.marker_key
    engine.store.execute([(key, ("SET", key, json.dumps(marker)))])


# --------------------------------------------------------------------------- dump files
def dump(engine: RedisRowEngine, chunk_rows: int = 65536) -> int:
    """Write every row of the runtime tag to files under ``model_lib_abs_dir``; returns rows.

    One file of sealed records per bucket plus ``manifest.json`` (written last, after the
    row files are complete and renamed into place).
    """
    d = dump_path(engine.options)
    os.makedirs(d, exist_ok=True)
    total = 0
    files = []
    for i in range(engine.runtime.n):
        name = f"bucket-{i:05d}.rows"
        tmp = os.path.join(d, name + ".tmp")
        n = 0
        with open(tmp, "wb") as fh:
            _, recs = redis_commit.bucket_rows(engine, engine.runtime, i)
            fh.write(recs.tobytes())
            n += recs.shape[0]
        os.replace(tmp, os.path.join(d, name))
        files.append({"file": name, "rows": n})
        total += n
    manifest = {**engine.layout_meta(engine.runtime), "files": files, "rows": total}
    tmp = os.path.join(d, "manifest.json.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh)
    os.replace(tmp, os.path.join(d, "manifest.json"))
    return total


def restore(engine: RedisRowEngine) -> int:
    """Write the rows of the mode-1 dump files (if any) into the runtime tag; returns rows."""
    d = dump_path(engine.options)
    path = os.path.join(d, "manifest.json")
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as fh:
        manifest = json.load(fh)
    if manifest.get("layout") != engine.layout.to_dict():
        raise CorruptRecordError(f"dump {d!r} holds rows of layout {manifest.get('layout')}; "
                                 f"this table has {engine.layout.to_dict()}")
    total = 0
    for f in manifest["files"]:
        raw = np.fromfile(os.path.join(d, f["file"]), np.uint8)
        if raw.size != f["rows"] * engine.width:
            raise CorruptRecordError(f"dump file {f['file']!r} in {d!r} holds {raw.size} bytes,"
                                     f" not {f['rows']} rows of {engine.width}: truncated")
        recs = raw.reshape(-1, engine.width)
        keys = recs[:, :8].copy().view(np.int64)[:, 0]
        replies = recs.view(f"V{engine.width}").ravel().tolist()
        engine.decode(replies, keys, f"dump file {f['file']!r}")  # checksums
        for a in range(0, keys.size, MIGRATION_CHUNK):
            total += engine.put_absent(engine.runtime, keys[a:a + MIGRATION_CHUNK],
                                       recs[a:a + MIGRATION_CHUNK])
    return total


__all__ = ["dump", "migrate", "prepare", "restore"]
