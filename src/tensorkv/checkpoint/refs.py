"""Reference bookkeeping of checkpoints: which records a tag owns, which saves are running.

Every manifest (complete, expired or per shard) references dense chunks, shared by content,
and owns the table records under its data tag; a pending-save marker protects the data of a
save still in progress. ``delete_tag``, ``compact``, ``gc`` and ``check`` decide from these
what may be deleted. The rules are in the "Atomic tags, incremental saves, sharded saves"
section of ``docs/format.md``.
"""

from __future__ import annotations

import time
from typing import Any

from tensorkv.checkpoint import claims, layout, manifest, tables
from tensorkv.stores.base import KVStore


# ----------------------------------------------------------------------------- pending saves
def pending_markers(store: KVStore, grace: float | None = None) -> list[dict[str, Any]]:
    """Pending-save markers: tag, shard, start time, age, owner, and whether it is stale.

    A marker is stale when its owner is provably dead (a process of this host that is gone)
    or, when that cannot be told, older than ``grace`` seconds (default
    ``config.CHECKPOINT_GC_GRACE_SECONDS``); see :func:`tensorkv.checkpoint.claims.is_stale`.
    """
    out = []
    now = time.time()
    for k, v in manifest.scan_items(store, layout.PENDING):
        rest = bytes(k[len(layout.PENDING) :]).decode()
        tag, _, shard = rest.rpartition("/")
        info = claims.parse_marker(v)
        started = info.get("started")
        started = float(started) if isinstance(started, (int, float)) else 0.0
        alive = claims.owner_alive(info)
        out.append({
            "tag": tag, "shard": int(shard), "started": started, "age": now - started,
            "pid": info.get("pid"), "host": info.get("host"),
            "owner": {True: "running", False: "dead", None: "unknown"}[alive],
            "stale": claims.is_stale(info, grace, now), "key": bytes(k), "raw": bytes(v),
        })
    return out


def live_pending(store: KVStore, grace: float | None = None) -> list[dict[str, Any]]:
    """Markers of saves presumed still running (not stale, see :func:`pending_markers`)."""
    return [p for p in pending_markers(store, grace) if not p["stale"]]


# ----------------------------------------------------------------------------- references
def all_docs(store: KVStore) -> list[dict[str, Any]]:
    """Every manifest in the store: complete tags (expired ones too), then per-shard ones."""
    docs = list(manifest.read_all(store, include_expired=True).values())
    for k, v in manifest.scan_items(store, layout.SHARD_MANIFEST):
        docs.append(manifest.decode_manifest(v, bytes(k).decode()))
    return docs


def referenced_chunks(
    store: KVStore, docs: dict[str, dict[str, Any]] | None = None
) -> set[str]:
    """Digests of the dense chunks referenced by every manifest (complete or per shard).

    Parameters
    ----------
    store
        The store holding the manifests.
    docs
        The complete tags' manifests (expired ones included), when already read.

    Returns
    -------
    set of str
        The xxh3-128 hex digests of the chunks.
    """
    out: set[str] = set()
    parts = [manifest.decode_manifest(v, bytes(k).decode())
             for k, v in manifest.scan_items(store, layout.SHARD_MANIFEST)]
    if docs is None:
        docs = manifest.read_all(store, include_expired=True)
    for doc in [*docs.values(), *parts]:
        for ent in doc.get("dense", {}).values():
            out.update(ent["chunks"])
    return out


def referenced_chunks_all(store: KVStore) -> set[str]:
    """Digests referenced by any manifest, complete, expired or per shard (see :func:`all_docs`)."""
    return {d for doc in all_docs(store) for e in doc["dense"].values() for d in e["chunks"]}


def table_data_keys(doc: dict[str, Any]) -> list[bytes]:
    """Every table record key a manifest owns."""
    out: list[bytes] = []
    for name, ent in doc["tables"].items():
        for s, info in ent["shards"].items():
            prefix = layout.table_prefix(
                ent.get("data_tag", doc["tag"]), name, int(s), ent.get("hash_tag")
            )
            out += tables.record_keys(prefix, info, ent.get("hash_tag"))
    return out


def record_keys(doc: dict[str, Any]) -> list[bytes]:
    """Every record a manifest references: its dense chunks, then the table records it owns."""
    digests = dict.fromkeys(d for e in doc["dense"].values() for d in e["chunks"])
    return [layout.chunk_key(d) for d in digests] + table_data_keys(doc)


def key_tag(key: bytes) -> str:
    """The (data) tag a table record key belongs to."""
    rest = key[len(layout.TABLE) :]
    if rest.startswith(b"{"):
        inner, _, after = rest[1:].partition(b"}")
        if b"/" in inner:
            return inner.split(b"/", 1)[0].decode()
        return after.lstrip(b"/").split(b"/", 1)[0].decode()
    return rest.split(b"/", 1)[0].decode()


# ----------------------------------------------------------------------------- deletion
def delete_doc(store: KVStore, doc: dict[str, Any], *,
               measure: bool = False) -> tuple[int, int]:
    """Delete a tag: manifest first (invisible at once), then its data.

    Its table records go at once; its dense chunks only where no other manifest references
    them and no save is running (a new save may write the same chunks again: gc removes what
    is left once no save runs).

    Parameters
    ----------
    store
        The store holding the tag.
    doc
        The tag's manifest.
    measure
        Count what is deleted (one more batched size query per batch of records).

    Returns
    -------
    (records, bytes)
        With ``measure``, the records deleted (manifests included) and their bytes; else
        ``(0, 0)``.
    """
    tag = doc["tag"]
    counted = [0, 0]

    def delete(keys: list[bytes]) -> None:
        if measure and keys:
            sizes = store.value_sizes(keys)
            counted[0] += int((sizes >= 0).sum())
            counted[1] += int(sizes[sizes > 0].sum())
        store.delete_many(keys)

    delete([layout.manifest_key(tag)])
    token = (doc.get("run") or {}).get("token")
    if token is not None:  # the kept shard manifests of its run (another run's are not its)
        prefix = layout.run_parts_prefix(tag, token)
        if measure:
            delete([bytes(k) for k in store.keys(prefix)])
        else:
            store.delete_prefix(prefix)
    else:  # a tag merged before run ids existed
        delete([layout.shard_manifest_key(tag, i) for i in doc.get("shards") or []])
    keys = table_data_keys(doc)
    for i in range(0, len(keys), 4096):
        delete(keys[i : i + 4096])
    if not live_pending(store):
        referenced = referenced_chunks_all(store)
        mine = {d for e in doc["dense"].values() for d in e["chunks"]}
        doomed = [layout.chunk_key(d) for d in sorted(mine - referenced)]
        for i in range(0, len(doomed), 4096):
            if live_pending(store):  # a save started: it may write these chunks again
                break  # gc removes what is left once no save runs
            delete(doomed[i : i + 4096])
    return counted[0], counted[1]
