"""Manifests: the JSON document that makes a tag visible, and its checksummed envelope.

A manifest value is ``b"TKVM" + xxh3-64 (uint64 little-endian) + UTF-8 JSON``; the checksum
covers the JSON bytes. The JSON fields are listed in ``docs/format.md``.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable
from typing import Any

from tensorkv.checkpoint import layout
from tensorkv.codec import checksum
from tensorkv.errors import CheckpointError, CorruptRecordError, TagNotFoundError
from tensorkv.stores.base import KVStore

MAGIC = b"TKVM"
FORMAT = "tensorkv.checkpoint"
FORMAT_VERSION = 2  # 2: incremental tags store key-list deltas (docs/format.md)
_HEAD = struct.Struct("<4sQ")


def encode_manifest(doc: dict[str, Any]) -> bytes:
    """Serialise a manifest document into its checksummed envelope."""
    body = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    return _HEAD.pack(MAGIC, checksum(body)) + body


def decode_manifest(buf: bytes | memoryview, what: str) -> dict[str, Any]:
    """Parse and verify a manifest envelope; ``what`` names it in errors."""
    mv = memoryview(buf)
    if mv.nbytes < _HEAD.size:
        raise CorruptRecordError(f"manifest of {what} is truncated ({mv.nbytes} bytes)")
    magic, digest = _HEAD.unpack_from(mv, 0)
    body = mv[_HEAD.size :]
    if magic != MAGIC:
        raise CorruptRecordError(f"manifest of {what} does not start with {MAGIC!r}")
    if checksum(body) != digest:
        raise CorruptRecordError(
            f"manifest of {what} fails its checksum; the store is corrupted "
            "(delete the tag with tensorkv.delete_tag and save it again)"
        )
    doc = json.loads(bytes(body))
    if doc.get("format") != FORMAT:
        raise CorruptRecordError(f"manifest of {what} is not a {FORMAT} document")
    if int(doc.get("version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{what} was written with checkpoint format {doc['version']}; this tensorkv reads "
            f"up to {FORMAT_VERSION}: upgrade tensorkv"
        )
    return doc


def new_manifest(
    tag: str,
    *,
    step: int | None,
    parent: str | None,
    metadata: dict[str, Any] | None,
    num_shards: int,
    ttl: float | None,
) -> dict[str, Any]:
    """A fresh manifest document with no variables yet."""
    now = time.time()
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tag": tag,
        "step": step,
        "created": now,
        "expires": None if ttl is None else now + float(ttl),
        "parent": parent,
        "metadata": metadata or {},
        "num_shards": num_shards,
        "shards": [],
        "dense": {},
        "tables": {},
    }


def is_expired(doc: dict[str, Any], now: float | None = None) -> bool:
    """Whether the tag's expiry time has passed."""
    exp = doc.get("expires")
    return exp is not None and (time.time() if now is None else now) >= float(exp)


def scan_keys(store: KVStore, prefix: bytes) -> list[bytes]:
    """Every key under ``prefix``.

    Ordered stores are read in pages that start small and double: a store may read a whole
    page of keys before it cuts at the prefix's end, and after the few manifest keys come the
    table records, each of which costs LMDB a page fault on its value when it is stepped over
    (13 ms for a 5M-row table's blocks, more than the rest of a small incremental save's
    bookkeeping).
    """
    if not store.capabilities.ordered_scans:
        return [bytes(k) for k in store.keys(prefix)]
    out: list[bytes] = []
    start = None
    page = 8
    while True:
        page_keys = store.scan(prefix, start=start, keys_only=True, limit=page)
        got = [bytes(k) for k in page_keys]
        out += got
        if len(got) < page:
            return out
        start = got[-1] + b"\x00"  # the smallest key after the last one read
        page = min(2 * page, 1024)


def scan_items(store: KVStore, prefix: bytes) -> list[tuple[bytes, bytes]]:
    """(key, value) of every key under ``prefix``: keys first, then one batched read.

    Scanning keys only keeps backends that read ahead in chunks (LMDB, LevelDB) from copying
    the large values stored after the prefix.
    """
    keys = scan_keys(store, prefix)
    out = []
    for lo in range(0, len(keys), 256):
        group = keys[lo : lo + 256]
        out += [(k, v) for k, v in zip(group, store.get_many(group), strict=True) if v is not None]
    return out


def read_all(store: KVStore, *, include_expired: bool = False) -> dict[str, dict[str, Any]]:
    """Every complete tag's manifest, by tag name (expired ones only if asked)."""
    out: dict[str, dict[str, Any]] = {}
    now = time.time()
    for k, v in scan_items(store, layout.MANIFEST):
        tag = bytes(k[len(layout.MANIFEST) :]).decode()
        doc = decode_manifest(v, f"tag {tag!r}")
        if include_expired or not is_expired(doc, now):
            out[tag] = doc
    return out


def _order(doc: dict[str, Any]) -> tuple[float, float]:
    step = doc.get("step")
    return (float(doc.get("created", 0.0)), -1.0 if step is None else float(step))


def sorted_tags(docs: dict[str, dict[str, Any]]) -> list[str]:
    """Tag names oldest first (by creation time, then step)."""
    return sorted(docs, key=lambda t: (_order(docs[t]), t))


def read(store: KVStore, tag: str, *, include_expired: bool = False) -> dict[str, Any]:
    """The manifest of ``tag`` (``"latest"``: the newest tag).

    An expired tag counts as missing unless ``include_expired``.

    Raises
    ------
    TagNotFoundError
        No such visible tag; the message lists the available ones.
    """
    if tag == "latest":
        docs = read_all(store, include_expired=include_expired)
        if not docs:
            raise TagNotFoundError(
                f"store {store.url!r} holds no checkpoint tags; save one with tensorkv.save"
            )
        return docs[sorted_tags(docs)[-1]]
    layout.check_tag(tag)
    raw = store.get(layout.manifest_key(tag))
    doc = None if raw is None else decode_manifest(raw, f"tag {tag!r}")
    if doc is None or (not include_expired and is_expired(doc)):
        docs = read_all(store)
        avail = ", ".join(repr(t) for t in sorted_tags(docs)) or "none"
        why = "has expired" if doc is not None else "does not exist"
        pend = [
            bytes(k).decode().split("/")[2]
            for k in store.keys(layout.PENDING + tag.encode() + b"/")
        ]
        if store.get(layout.run_key(tag)) is not None:  # a sharded save of it
            pend.append("run")
        extra = " (a save of it is in progress or was interrupted)" if pend else ""
        raise TagNotFoundError(
            f"tag {tag!r} {why} in store {store.url!r}{extra}; available tags: {avail}"
        )
    return doc


def getter(store: KVStore) -> Callable[[str], dict[str, Any] | None]:
    """``tag -> manifest`` over ``store``: any tag, expired or not; None when it is missing."""

    def get(tag: str) -> dict[str, Any] | None:
        raw = store.get(layout.manifest_key(tag))
        return None if raw is None else decode_manifest(raw, f"tag {tag!r}")

    return get


def chain(store: KVStore, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifests from the newest full ancestor down to ``doc`` (oldest first)."""
    out = [doc]
    seen = {doc["tag"]}
    while out[-1].get("incremental") and out[-1].get("parent"):
        parent = out[-1]["parent"]
        if parent in seen:
            raise CorruptRecordError(f"tag {doc['tag']!r} has a cycle in its parent chain")
        seen.add(parent)
        raw = store.get(layout.manifest_key(parent))
        if raw is None:
            raise CheckpointError(
                f"tag {doc['tag']!r} is incremental on {parent!r}, which is missing; "
                "the chain is broken (tensorkv compact would have kept it loadable)"
            )
        out.append(decode_manifest(raw, f"tag {parent!r}"))
    return out[::-1]
