"""Sharded saves: combining the per-shard manifests into the tag's manifest.

Each process of a sharded save writes ``ckpt/s/<tag>/<shard>``; the last one to finish (or
:func:`merge`, by hand) writes the combined manifest (see "Atomic tags, incremental saves,
sharded saves" in ``docs/format.md``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from tensorkv.checkpoint import layout, manifest
from tensorkv.checkpoint.access import using_store
from tensorkv.errors import CheckpointError
from tensorkv.stores.base import KVStore


def shard_manifests(store: KVStore, tag: str) -> dict[int, dict[str, Any]]:
    """The manifests of the finished shards of ``tag``, by shard index."""
    prefix = layout.SHARD_MANIFEST + tag.encode() + b"/"
    out = {}
    for k, v in manifest.scan_items(store, prefix):
        i = int(bytes(k[len(prefix) :]))
        out[i] = manifest.decode_manifest(v, f"shard {i} of tag {tag!r}")
    return out


def combine(tag: str, parts: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Combine per-shard manifests into one (dense tensors must agree across shards)."""
    first = parts[min(parts)]
    doc = dict(first)
    doc["shards"] = sorted(parts)
    doc["dense"] = {}
    doc["tables"] = {}
    doc["created"] = max(p["created"] for p in parts.values())
    doc["incremental"] = any(p.get("incremental") for p in parts.values())
    for i in sorted(parts):
        p = parts[i]
        for name, ent in p["dense"].items():
            prev = doc["dense"].get(name)
            if prev is not None and prev["chunks"] != ent["chunks"]:
                raise CheckpointError(
                    f"tag {tag!r}: dense tensor {name!r} differs between shards; dense tensors "
                    "saved by several shards must be identical (save them from one shard only)"
                )
            doc["dense"][name] = ent
        for name, ent in p["tables"].items():
            prev = doc["tables"].get(name)
            if prev is None:
                doc["tables"][name] = {**ent, "shards": dict(ent["shards"])}
                continue
            if prev["dim"] != ent["dim"]:
                raise CheckpointError(
                    f"tag {tag!r}: table {name!r} has dim {prev['dim']} in one shard and "
                    f"{ent['dim']} in shard {i}"
                )
            prev["shards"].update(ent["shards"])
            prev["full"] = prev["full"] and ent["full"]
    return doc


def merge_if_complete(store: KVStore, tag: str, num_shards: int) -> bool:
    """Write the tag's manifest if every shard has finished; return whether it exists now."""
    if store.get(layout.manifest_key(tag)) is not None:
        return True
    parts = shard_manifests(store, tag)
    if len(parts) < num_shards:
        return False
    doc = combine(tag, parts)
    # created once: of shards finishing together, one writes it (the others find it there)
    store.put_if_absent(layout.manifest_key(tag), manifest.encode_manifest(doc))
    with contextlib.suppress(Exception):
        store.flush()
    return True


def merge(url: str | KVStore, tag: str, *, allow_missing: bool = False) -> dict[str, Any]:
    """Write the combined manifest of a sharded save from its finished shards.

    Called automatically when the last shard finishes; call it yourself after a crash.

    Parameters
    ----------
    url
        Store URL or open KVStore.
    tag
        The tag of the sharded save.
    allow_missing
        Publish the tag even if some shards never finished (their rows will be absent).

    Returns
    -------
    dict
        The combined manifest.
    """
    layout.check_tag(tag)
    with using_store(url, create=False) as store:
        raw = store.get(layout.manifest_key(tag))
        if raw is not None:
            return manifest.decode_manifest(raw, f"tag {tag!r}")
        parts = shard_manifests(store, tag)
        if not parts:
            raise CheckpointError(f"no shard of tag {tag!r} has finished in {store.url!r}")
        n = parts[min(parts)]["num_shards"]
        missing = sorted(set(range(n)) - set(parts))
        if missing and not allow_missing:
            raise CheckpointError(
                f"tag {tag!r}: shards {missing} of {n} have not finished; wait for them, or "
                "pass allow_missing=True to publish the tag without them"
            )
        doc = combine(tag, parts)
        raw = manifest.encode_manifest(doc)
        if not store.put_if_absent(layout.manifest_key(tag), raw):  # merged meanwhile
            got = store.get(layout.manifest_key(tag))
            return doc if got is None else manifest.decode_manifest(got, f"tag {tag!r}")
        store.flush()
        return doc
