"""Tags: list, latest, delete, expiry, copy (within or across stores), compact, dump/restore.

Copies, compaction and dumps fold incremental chains into full tags (:func:`write_copy`);
deletion keeps dense chunks other tags use (``refs.py``). The manifest fields, ``compact``'s
data tags and the dump file format are in ``docs/format.md``.
"""

from __future__ import annotations

import os
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal, overload

from tensorkv.checkpoint import claims, layout, manifest, refs, runs, sweep, tables
from tensorkv.checkpoint.access import using_store
from tensorkv.checkpoint.load import build_table, stage_table
from tensorkv.checkpoint.save import save_table
from tensorkv.codec import checksum
from tensorkv.errors import CheckpointError, CorruptRecordError, TagExistsError
from tensorkv.stores.base import KVStore
from tensorkv.stores.memory import MemoryStore

COPY_BATCH_BYTES = 64 * 1024 * 1024


@overload
def list_tags(
    url: str | KVStore, *, details: Literal[False] = False, include_expired: bool = False
) -> list[str]: ...


@overload
def list_tags(
    url: str | KVStore, *, details: Literal[True], include_expired: bool = False
) -> list[dict[str, Any]]: ...


@overload
def list_tags(
    url: str | KVStore, *, details: bool, include_expired: bool = False
) -> list[str] | list[dict[str, Any]]: ...


def list_tags(
    url: str | KVStore, *, details: bool = False, include_expired: bool = False
) -> list[str] | list[dict[str, Any]]:
    """Visible tags, oldest first.

    Parameters
    ----------
    details
        Return dicts (tag, step, created, expires, parent, incremental, num_shards, variables,
        tables, dense_bytes, table_rows) instead of names.
    include_expired
        Also list expired tags (not yet removed by gc).
    """
    with using_store(url, create=False) as store:
        docs = manifest.read_all(store, include_expired=include_expired)
    names = manifest.sorted_tags(docs)
    if not details:
        return names
    return [summary(docs[t]) for t in names]


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """A short description of a manifest."""
    return {
        "tag": doc["tag"],
        "step": doc.get("step"),
        "created": doc.get("created"),
        "expires": doc.get("expires"),
        "parent": doc.get("parent"),
        "incremental": bool(doc.get("incremental")),
        "num_shards": doc.get("num_shards", 1),
        "dense": len(doc["dense"]),
        "tables": len(doc["tables"]),
        "dense_bytes": sum(e["nbytes"] for e in doc["dense"].values()),
        "table_rows": sum(
            i["rows"] for e in doc["tables"].values() for i in e["shards"].values()
        ),
        "metadata": doc.get("metadata", {}),
    }


def latest_tag(url: str | KVStore) -> str | None:
    """The newest visible tag, or None when there is none."""
    names = list_tags(url)
    return names[-1] if names else None


def tag_manifest(url: str | KVStore, tag: str = "latest") -> dict[str, Any]:
    """The manifest of a tag (a dict; see docs/format.md)."""
    with using_store(url, create=False) as store:
        return manifest.read(store, tag)


def _children(docs: dict[str, dict[str, Any]], tag: str) -> list[str]:
    return sorted(
        t for t, d in docs.items()
        if d.get("parent") == tag and d.get("incremental") and t != tag
    )


def delete_tag(url: str | KVStore, tag: str, *, force: bool = False) -> None:
    """Delete a tag and the data no other tag uses.

    A tag that incremental tags build on is refused unless ``force=True`` (which compacts
    those children first, so they stay loadable). Unpublished sharded saves of the tag (the
    shards a crashed or abandoned run left) are removed too, at once; one whose saver still
    runs is refused.
    """
    layout.check_tag(tag)
    with using_store(url, create=False) as store:
        left = [st for st in sweep.list_runs(store) if st.tag == tag]
        if store.get(layout.manifest_key(tag)) is None and left:
            busy = [st for st in left if st.state == sweep.SAVING]
            if busy:
                rec = busy[0].record
                what = runs.describe(store, rec) if rec is not None else "a sharded save"
                raise CheckpointError(
                    f"tag {tag!r} is being saved in {store.url!r}: {what}. Wait for its "
                    "shards to finish (or stop them), then delete the tag"
                )
            for st in left:
                if sweep.remove(store, st) is None:
                    raise CheckpointError(f"tag {tag!r}: a shard joined its sharded save "
                                          "while it was deleted; retry")
            return
        doc = manifest.read(store, tag, include_expired=True)  # or TagNotFoundError
        for st in left:  # shards another run left beside the published tag
            if st.state != sweep.SAVING:
                sweep.remove(store, st)
        docs = manifest.read_all(store, include_expired=True)
        kids = _children(docs, tag)
        if kids and not force:
            raise CheckpointError(
                f"tag {tag!r} is the parent of incremental tags {kids}; compact them first "
                f"(tensorkv compact URL TAG) or pass force=True to compact them and delete {tag!r}"
            )
        for k in kids:
            compact(store, k)
        refs.delete_doc(store, doc)


def expire_tag(url: str | KVStore, tag: str, ttl: float | None) -> None:
    """Set (seconds from now) or clear (None) the expiry of a tag."""
    with using_store(url, create=False) as store:
        mk = layout.manifest_key(tag)
        for _ in range(8):  # compare-and-set: a concurrent compact or expire is not undone
            doc = manifest.read(store, tag)
            raw = store.get(mk)
            doc["expires"] = None if ttl is None else time.time() + float(ttl)
            if raw is not None and store.compare_and_set(mk, raw, manifest.encode_manifest(doc)):
                return
        raise CheckpointError(f"tag {tag!r} kept changing while its expiry was set; retry")


def _copy_records(src: KVStore, dst: KVStore, pairs: list[tuple[bytes, bytes]], what: str) -> None:
    batch: list[tuple[bytes, bytes]] = []
    size = 0
    for lo in range(0, len(pairs), 256):
        group = pairs[lo : lo + 256]
        for (sk, dk), v in zip(group, src.get_many([p[0] for p in group]), strict=True):
            if v is None:
                raise CorruptRecordError(f"{what}: record {sk!r} is missing from the source store")
            batch.append((dk, v))
            size += len(v)
            if size >= COPY_BATCH_BYTES:
                dst.put_many(batch)
                batch, size = [], 0
    if batch:
        dst.put_many(batch)


def _materialize_table(src: KVStore, doc: dict[str, Any], name: str, saved_shard: str) -> Any:
    rows, removed, _ = stage_table(src, doc, name, None, None, None, saved_shard)
    return build_table(doc["tables"][name]["meta"], rows, removed)


def write_copy(
    src: KVStore, doc: dict[str, Any], dst: KVStore, dst_tag: str, *, data_tag: str | None = None
) -> dict[str, Any]:
    """Copy a tag's data into ``dst`` as a full tag and return the new manifest (not written).

    Full tables are copied record by record; incremental chains are folded first.
    """
    data_tag = data_tag or dst_tag
    new = dict(doc)
    new.update(tag=dst_tag, parent=None, incremental=False, tables={}, created=time.time())
    # dense chunks: content-addressed, copy only what dst lacks
    digests = sorted({d for e in doc["dense"].values() for d in e["chunks"]})
    if src is not dst:
        have = dst.get_many([layout.chunk_key(d) for d in digests]) if digests else []
        need = [layout.chunk_key(d) for d, h in zip(digests, have, strict=True) if h is None]
        _copy_records(src, dst, [(k, k) for k in need], f"tag {doc['tag']!r}")
    for name, ent in doc["tables"].items():
        full = all(i.get("full", True) for i in ent["shards"].values())
        hash_tag = ent.get("hash_tag")
        if full:
            pairs = []
            for s, info in ent["shards"].items():
                sp = layout.table_prefix(ent.get("data_tag", doc["tag"]), name, int(s), hash_tag)
                dp = layout.table_prefix(data_tag, name, int(s), hash_tag)
                pairs += list(zip(
                    tables.record_keys(sp, info, hash_tag),
                    tables.record_keys(dp, info, hash_tag), strict=True,
                ))
            _copy_records(src, dst, pairs, f"table {name!r} of tag {doc['tag']!r}")
            new["tables"][name] = {**ent, "data_tag": data_tag}
        else:
            opts = {"hash_tag": hash_tag, "bucket_bits": ent.get("bucket_bits", 4),
                    "block_rows": tables.DEFAULT_BLOCK_ROWS}
            nent = None
            for s in ent["shards"]:  # fold each saved shard's chain on its own
                table = _materialize_table(src, doc, name, s)
                part = save_table(dst, data_tag, name, table, int(s), 1, None, opts, None)
                if nent is None:
                    nent = part
                else:
                    nent["shards"].update(part["shards"])
            assert nent is not None
            for s, info in ent["shards"].items():  # same content: the trainers may go on
                nent["shards"][s]["state"] = info.get("state")
                nent["shards"][s]["seq"] = info.get("seq")
            nent["meta"] = ent["meta"]
            nent["data_tag"] = data_tag
            new["tables"][name] = nent
    return new


def copy_tag(
    url: str | KVStore, src_tag: str, dst_tag: str | None = None, *,
    dst_url: str | KVStore | None = None,
) -> str:
    """Copy a tag to a new tag in the same store or into another store.

    Parameters
    ----------
    url
        Source store.
    src_tag
        Tag to copy (``"latest"`` works).
    dst_tag
        New tag name (default: the source tag's name; required when copying within a store).
    dst_url
        Destination store (default: the source store).

    Returns
    -------
    str
        The new tag. Incremental tags are folded into a full tag on the way.
    """
    with using_store(url, create=False) as src:
        doc = manifest.read(src, src_tag)
        dst_tag = layout.check_tag(dst_tag or doc["tag"])
        if dst_url is None:
            if dst_tag == doc["tag"]:
                raise CheckpointError(f"copying tag {dst_tag!r} onto itself; give dst_tag=")
            _copy_into(src, doc, src, dst_tag)
        else:
            with using_store(dst_url) as dst:
                _copy_into(src, doc, dst, dst_tag)
    return dst_tag


def _copy_into(src: KVStore, doc: dict[str, Any], dst: KVStore, dst_tag: str) -> None:
    _write_new_tag(dst, dst_tag, lambda: write_copy(src, doc, dst, dst_tag))


def _write_new_tag(
    store: KVStore, tag: str, write: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """Claim ``tag``, run ``write()`` (the data; it returns the manifest), then publish it.

    The tag becomes visible only once its records are proven to be on the store (see
    :mod:`tensorkv.checkpoint.claims`); on failure its table records are removed.
    """
    what = f"tag {tag!r}"
    with claims.holding(store, layout.pending_key(tag, 0), what) as c:
        if store.get(layout.manifest_key(tag)) is not None:
            raise TagExistsError(f"{what} already exists in {store.url!r}; delete it first")
        runs.refuse_running(store, tag)
        c.on_failure = lambda: store.delete_prefix(layout.tag_table_prefix(tag))
        new = write()
        store.flush()
        claims.publish(
            c, what, layout.manifest_key(tag), manifest.encode_manifest(new),
            refs.record_keys(new),
        )
    return new


def compact(url: str | KVStore, tag: str) -> dict[str, Any]:
    """Fold an incremental chain into a full tag (same name); the parents stay untouched.

    Returns the new manifest. A full tag is left as it is.
    """
    with using_store(url, create=False) as store:
        doc = manifest.read(store, tag)
        if not doc.get("incremental"):
            return doc
        mk = layout.manifest_key(doc["tag"])
        old_raw = store.get(mk)
        data_tag = f"{doc['tag']}~{uuid.uuid4().hex[:8]}"
        what = f"compaction of tag {doc['tag']!r}"
        with claims.holding(store, layout.pending_key(data_tag, 0), what) as c:
            c.on_failure = lambda: store.delete_prefix(layout.tag_table_prefix(data_tag))
            new = write_copy(store, doc, store, doc["tag"], data_tag=data_tag)
            new["compacted_from"] = doc.get("parent")
            new["created"] = doc["created"]  # keep its place in the tag order
            store.flush()
            claims.verify(c, what, refs.record_keys(new))
            # replace the manifest only if nobody changed it meanwhile
            if old_raw is None or not store.compare_and_set(
                mk, old_raw, manifest.encode_manifest(new)
            ):
                raise CheckpointError(
                    f"tag {doc['tag']!r} changed (deleted, expired or compacted) while it was "
                    "compacted; nothing was replaced: retry"
                )
            store.flush()
        keys = refs.table_data_keys(doc)
        for i in range(0, len(keys), 4096):
            store.delete_many(keys[i : i + 4096])
        return new


# ----------------------------------------------------------------------------- dump files
DUMP_MAGIC = b"TKVDUMP\x00"
DUMP_VERSION = 1
_REC = struct.Struct("<IQQ")  # key length, value length, xxh3-64 of the value


def dump_tag(url: str | KVStore, tag: str, path: str) -> int:
    r"""Write one tag (folded into a full tag) to a single file; return bytes written.

    The file is ``b"TKVDUMP\\0"``, a uint32 version, then records ``(uint32 key length,
    uint64 value length, uint64 xxh3-64 of the value, key, value)``; the last record is the
    manifest, followed by a record with key length 0 (end marker). Works for every backend.
    """
    with using_store(url, create=False) as store:
        doc = manifest.read(store, tag)
        tmp = MemoryStore()
        if doc.get("incremental"):
            new = write_copy(store, doc, tmp, doc["tag"])
            src: KVStore = tmp
        else:
            new, src = doc, store
        written = 0
        part = path + ".partial"
        with open(part, "wb") as f:
            f.write(DUMP_MAGIC + struct.pack("<I", DUMP_VERSION))
            keys = [layout.chunk_key(d) for d in
                    sorted({d for e in new["dense"].values() for d in e["chunks"]})]
            keys += refs.table_data_keys(new)
            for lo in range(0, len(keys), 64):
                group = keys[lo : lo + 64]
                for k, v in zip(group, src.get_many(group), strict=True):
                    if v is None:
                        raise CorruptRecordError(f"tag {tag!r}: record {k!r} is missing")
                    f.write(_REC.pack(len(k), len(v), checksum(v)))
                    f.write(k)
                    f.write(v)
                    written += len(v)
            m = manifest.encode_manifest(new)
            mk = layout.manifest_key(new["tag"])
            f.write(_REC.pack(len(mk), len(m), checksum(m)) + mk + m)
            f.write(_REC.pack(0, 0, 0))
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)  # the file appears complete or not at all
        tmp.close()
    return written


def import_dump(path: str, url: str | KVStore, tag: str | None = None) -> str:
    """Import a tag from a file :func:`dump_tag` wrote into a store (optionally renamed).

    The whole file is verified (checksums, end marker) before the manifest is written.
    """
    with open(path, "rb") as f:
        head = f.read(len(DUMP_MAGIC) + 4)
        if head[: len(DUMP_MAGIC)] != DUMP_MAGIC:
            raise CorruptRecordError(f"{path!r} is not a tensorkv tag dump")
        (version,) = struct.unpack("<I", head[len(DUMP_MAGIC):])
        if version != DUMP_VERSION:
            raise CheckpointError(f"{path!r} has dump version {version}; upgrade tensorkv")
        records: list[tuple[bytes, bytes]] = []
        while True:
            rh = f.read(_REC.size)
            if len(rh) < _REC.size:
                raise CorruptRecordError(f"{path!r} is truncated (no end marker)")
            kl, vl, digest = _REC.unpack(rh)
            if kl == 0:
                break
            k = f.read(kl)
            v = f.read(vl)
            if len(k) != kl or len(v) != vl:
                raise CorruptRecordError(f"{path!r} is truncated inside record {k!r}")
            if checksum(v) != digest:
                raise CorruptRecordError(f"{path!r}: record {k!r} fails its checksum")
            records.append((k, v))
    if not records or not records[-1][0].startswith(layout.MANIFEST):
        raise CorruptRecordError(f"{path!r} does not end with a manifest")
    doc = manifest.decode_manifest(records[-1][1], f"the dump {path!r}")
    new_tag = layout.check_tag(tag or doc["tag"])
    with MemoryStore() as data:  # the dump's records (the bytes read, not copies)
        data.put_many(records[:-1])

        def write() -> dict[str, Any]:
            new = write_copy(data, doc, store, new_tag)
            new["restored_from"] = path
            return new

        with using_store(url) as store:
            _write_new_tag(store, new_tag, write)
    return new_tag
