"""Opening a Redis-resident table: import from an older tag or bucket layout, dump files.

:func:`prepare` runs on every open: it checks the layout record of the runtime tag, copies
(``model_tag_import``) or rehashes (``storage_slice_import``) the imported rows into the
runtime buckets once (resumable: a marker in Redis records the buckets done), expires the
old tag if asked, and restores an empty tag from mode-1 dump files. :func:`dump` writes those
files. See docs/redis_table.md ("Model tags and rehashing", "Table store modes").
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import numpy as np

from tensorkv.embedding.tiers.redis_rows import RedisRowEngine, dump_path
from tensorkv.errors import ConfigError, CorruptRecordError, RowLockError

MIGRATION_CHUNK = 8192  # rows per step of a migration


def _source_id(engine: RedisRowEngine) -> str:
    return json.dumps(engine.source.describe(), sort_keys=True)


def prepare(engine: RedisRowEngine) -> None:
    """Check, migrate and restore the runtime tag of ``engine`` (see the module docstring)."""
    o = engine.options
    rt = engine.runtime
    meta = engine.read_meta(rt)
    if o.migrates:
        marker = _marker(engine)
        if marker is None or not marker.get("done") or marker.get("source") != _source_id(
                engine):
            if o.read_only:
                raise RowLockError(
                    f"table {o.table_name!r} under {o.model_tag_runtime!r} has not imported "
                    f"{o.model_tag_import!r} yet and this table is read_only; open it once "
                    "writable (a trainer) first, then retry")
            migrate(engine)
            return
    engine.check_meta(rt, meta, "this table's options")
    if meta is None and not o.read_only:
        engine.write_meta(rt)
    if o.table_store_mode == 1 and not o.read_only and len(engine) == 0:
        restore(engine)


def _marker(engine: RedisRowEngine) -> dict[str, Any] | None:
    key = engine.runtime.marker_key
    raw = engine.store.execute([(key, ("GET", key))])[0]
    return None if raw is None else json.loads(raw)


def migrate(engine: RedisRowEngine) -> int:
    """Copy (or rehash in place) the imported rows into the runtime buckets; resumable.

    One process migrates (it holds ``<runtime>:migration:lock``); others wait for it. Rows
    the runtime tag already holds are kept (HSETNX). Returns rows copied by this call.
    """
    o, src, rt, store = engine.options, engine.source, engine.runtime, engine.store
    lock = rt.marker_key + b":lock"
    token = uuid.uuid4().hex.encode()
    ttl = int(o.lock_ttl_seconds * 1000)
    deadline = time.monotonic() + o.lock_wait_seconds
    while not store.execute([(lock, ("SET", lock, token, "NX", "PX", ttl))])[0]:
        m = _marker(engine)
        if m is not None and m.get("done") and m.get("source") == _source_id(engine):
            return 0  # another process finished it
        if time.monotonic() > deadline:
            raise RowLockError(f"another process has been importing {o.model_tag_import!r} "
                               f"into {o.model_tag_runtime!r} for lock_wait_seconds="
                               f"{o.lock_wait_seconds}; retry when it is done")
        time.sleep(0.05)
    try:
        src_meta = engine.read_meta(src)
        if src_meta is None and src.model_tag != rt.model_tag:
            raise ConfigError(
                f"model_tag_import={src.model_tag!r} holds no table {o.table_name!r} at "
                f"{o.url!r} (no layout record {src.meta_key!r}); check the tag and table_name, "
                "or drop model_tag_import to start empty")
        engine.check_meta(src, src_meta, "the import options")
        m = _marker(engine)
        start = 0
        if m is not None and m.get("source") == _source_id(engine) and not m.get("done"):
            start = int(m.get("next", 0))  # resume
        rt_meta = engine.read_meta(rt)
        if rt_meta is not None and rt_meta.get("model_tag") == rt.model_tag and (
                src.model_tag != rt.model_tag):
            engine.check_meta(rt, rt_meta, "this table's options")
        in_place = src.model_tag == rt.model_tag
        copied = 0
        for i in range(start, src.n):
            elsewhere = np.asarray([name != src.names[i] for name in rt.names], bool)
            for keys, recs in engine.scan_bucket(src, i, MIGRATION_CHUNK):
                copied += engine.put_absent(rt, keys, recs)
                if in_place:  # rows that belong to another bucket leave this one
                    away = elsewhere[rt.of(keys)]
                    if away.any():
                        gone = keys[away]
                        store.execute([(src.names[i], ("HDEL", src.names[i],
                                                       *gone.astype("<i8").view("V8").tolist()))])
            _set_marker(engine, {"source": _source_id(engine), "next": i + 1, "done": False})
            store.execute([(lock, ("PEXPIRE", lock, ttl))])
        engine.write_meta(rt)
        _set_marker(engine, {"source": _source_id(engine), "next": src.n, "done": True})
        if o.expire_model_tag_in_seconds and not in_place:
            secs = int(o.expire_model_tag_in_seconds)
            store.execute([(k, ("EXPIRE", k, secs)) for k in [*src.names, src.meta_key]])
        engine.counters["migrated"] += copied
        return copied
    finally:
        store.execute([(lock, ("EVAL", "if redis.call('GET', KEYS[1]) == ARGV[1] then "
                                       "return redis.call('DEL', KEYS[1]) end return 0",
                               1, lock, token))])


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
            for _, recs in engine.scan_bucket(engine.runtime, i, chunk_rows):
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
