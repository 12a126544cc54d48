"""``tensorkv check`` and ``tensorkv gc``: find and remove data no manifest references.

:func:`check` reports orphaned records, expired and incomplete tags and pending saves (and
with ``verify`` reads every tag in full); :func:`gc` removes expired tags, orphaned records
and stale pending markers, leaving alone the data of saves still running. Why that is safe
beside running saves is told in the "Atomic tags" section of ``docs/format.md``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tensorkv.checkpoint import dense, keylists, layout, manifest, refs, staging, sweep
from tensorkv.checkpoint.access import using_store
from tensorkv.checkpoint.load import stage_table
from tensorkv.checkpoint.tags import compact
from tensorkv.errors import CheckpointError, CorruptRecordError
from tensorkv.stores.base import KVStore


@dataclass
class CheckReport:
    """What :func:`check` found (and, for :func:`gc`, what was removed)."""

    tags: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)  # sharded saves without a manifest
    runs: list[dict[str, Any]] = field(default_factory=list)  # those saves: saving/waiting/stale
    pending: list[dict[str, Any]] = field(default_factory=list)  # saves in progress or dead
    stages: list[dict[str, Any]] = field(default_factory=list)  # LevelDB/RocksDB shard stages
    orphan_keys: list[bytes] = field(default_factory=list)
    orphan_bytes: int = 0
    corrupt: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # tags whose records are not all there
    removed_keys: int = 0
    removed_bytes: int = 0
    removed_tags: list[str] = field(default_factory=list)
    removed_runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def stale_runs(self) -> list[dict[str, Any]]:
        """The sharded saves that can never publish their tag (gc removes them)."""
        return [r for r in self.runs if r["state"] == sweep.STALE]

    @property
    def ok(self) -> bool:
        """No corruption, no missing records, no orphaned data and no stale sharded saves."""
        return (not self.corrupt and not self.missing and not self.orphan_keys
                and not self.stale_runs)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "ok": self.ok,
            "tags": self.tags,
            "expired": self.expired,
            "incomplete": self.incomplete,
            "runs": self.runs,
            "pending": self.pending,
            "stages": self.stages,
            "orphan_keys": len(self.orphan_keys),
            "orphan_bytes": self.orphan_bytes,
            "corrupt": self.corrupt,
            "missing": self.missing,
            "removed_keys": self.removed_keys,
            "removed_bytes": self.removed_bytes,
            "removed_tags": self.removed_tags,
            "removed_runs": self.removed_runs,
        }


def _scan_orphans(store: KVStore, grace: float | None) -> tuple[CheckReport, list[bytes]]:
    rep = CheckReport()
    docs = manifest.read_all(store, include_expired=True)
    now = time.time()
    rep.tags = manifest.sorted_tags({t: d for t, d in docs.items()
                                      if not manifest.is_expired(d, now)})
    rep.expired = sorted(t for t, d in docs.items() if manifest.is_expired(d, now))
    all_docs = refs.all_docs(store)
    rep.runs = [st.public() for st in sweep.list_runs(store, grace)
                if st.state != sweep.PUBLISHED]
    rep.incomplete = sorted({r["tag"] for r in rep.runs})
    rep.stages = staging.stage_dirs(store, grace)
    marks = refs.pending_markers(store, grace)
    rep.pending = [_public(m) for m in marks]
    live_tags = {m["tag"] for m in marks if not m["stale"]}
    records = [refs.record_keys(d) for d in all_docs]
    owned = {k for r in records for k in r if k.startswith(layout.TABLE)}
    chunks = {d for doc in all_docs for e in doc["dense"].values() for d in e["chunks"]}
    protected: list[bytes] = []
    seen: set[bytes] = set()  # the referenced records the scans met
    for k in store.keys(layout.TABLE):
        k = bytes(k)
        if k in owned:
            seen.add(k)
            continue
        if refs.key_tag(k) in live_tags:
            protected.append(k)
        else:
            rep.orphan_keys.append(k)
    for k in store.keys(layout.CHUNK):
        k = bytes(k)
        if k[len(layout.CHUNK) :].decode() in chunks:
            seen.add(k)
        elif live_tags:
            protected.append(k)
        else:
            rep.orphan_keys.append(k)
    rep.missing = _missing_records(store, all_docs, records, seen)
    return rep, protected


def _still_orphaned(store: KVStore, candidates: list[bytes], grace: float | None) -> list[bytes]:
    """Second look at orphan candidates, after the data scan.

    A save writes its marker, then data, then its manifest, and only then drops its marker,
    so data of a save that started or finished while gc scanned is referenced by a manifest
    or covered by a marker now.
    """
    # Markers first, manifests second: a save writes its manifest before it drops its
    # marker, so a save missing from the markers read here has its manifest in the docs.
    live = {m["tag"] for m in refs.live_pending(store, grace)}
    all_docs = refs.all_docs(store)
    owned = {k for d in all_docs for k in refs.table_data_keys(d)}
    chunks = {d for doc in all_docs for e in doc["dense"].values() for d in e["chunks"]}
    out = []
    for k in candidates:
        if k.startswith(layout.CHUNK):
            if not live and k[len(layout.CHUNK) :].decode() not in chunks:
                out.append(k)
        elif k not in owned and refs.key_tag(k) not in live:
            out.append(k)
    return out


def _public(marker: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in marker.items() if k not in ("key", "raw")}
    tag, token = layout.split_data_tag(out["tag"])
    if token is not None:  # a shard of a sharded save: its tag, and its run's token
        out["tag"], out["run"] = tag, layout.RUN_MARK + token
    return out


def _bytes_of(store: KVStore, keys: list[bytes]) -> int:
    sizes = store.value_sizes(keys)
    return int(sizes[sizes > 0].sum())


def _still_there(store: KVStore, tag: str) -> bool:
    """Whether a manifest of ``tag`` (complete or of a shard) is in the store."""
    return store.get(layout.manifest_key(tag)) is not None or bool(
        store.count(layout.SHARD_MANIFEST + tag.encode() + b"/")
    )


def _missing_records(
    store: KVStore, docs: list[dict[str, Any]], records: list[list[bytes]], seen: set[bytes]
) -> list[str]:
    """Every manifest (``records[i]``: what ``docs[i]`` references) the scans did not fully meet.

    The scans that look for orphans list every record key anyway, so finding what is missing
    costs no extra read. A manifest deleted during the scan is not reported.
    """
    out = []
    for doc, keys in zip(docs, records, strict=True):
        lost = [k for k in keys if k not in seen]
        if lost and _still_there(store, doc["tag"]):
            out.append(
                f"{doc['tag']}: {len(lost)} of {len(keys)} records are missing (first: "
                f"{lost[0]!r}); restore the store from a backup, or delete the tag"
            )
    return out


def check(url: str | KVStore, *, verify: bool = False, grace: float | None = None) -> CheckReport:
    """Find orphaned data (records no manifest references), expired and incomplete tags.

    Parameters
    ----------
    verify
        Also read every visible tag in full (rows and key lists) and verify all checksums
        and key counts.
    grace
        Seconds a pending save is presumed alive (default ``config.CHECKPOINT_GC_GRACE_SECONDS``);
        data of live saves is not reported as orphaned.
    """
    with using_store(url, create=False) as store:
        rep, _ = _scan_orphans(store, grace)
        rep.orphan_bytes = _bytes_of(store, rep.orphan_keys)
        if verify:
            for t in rep.tags:
                doc = manifest.read(store, t)
                rep.corrupt += [f"{t}: its shards disagree: {p}; delete the tag and save it "
                                "again" for p in sweep.shard_disagreements(store, doc)]
                try:
                    for n, e in doc["dense"].items():
                        dense.read_full(store, n, e)
                    for n, ent in doc["tables"].items():
                        stage_table(store, doc, n, None, None, None)
                        for s in ent["shards"]:  # key lists, rebuilt along the chain
                            keylists.chain_key_set(store, doc, n, s, manifest.getter(store))
                except (CorruptRecordError, CheckpointError) as exc:
                    rep.corrupt.append(f"{t}: {exc}")
        return rep


def gc(url: str | KVStore, *, grace: float | None = None, dry_run: bool = False) -> CheckReport:
    """Remove expired tags, orphaned data and stale pending markers.

    Data of a save that is still running is left alone, so gc is safe to run while other
    processes save: a save counts as running unless its process is provably gone (one of
    this host) or, where that cannot be told, it started ``grace`` seconds ago or more.
    Candidates are checked twice (before and after the data scan), and unreferenced dense
    chunks are kept while any save is in progress, since a new save may reuse them.
    """
    with using_store(url, create=False) as store:
        rep, _ = _scan_orphans(store, grace)
        if dry_run:
            return rep
        for st in sweep.list_runs(store, grace):  # their data goes with the orphans below
            if st.state not in (sweep.STALE, sweep.PUBLISHED):
                continue
            gone = sweep.remove(store, st, grace)
            if gone is not None and st.state == sweep.STALE:
                rep.removed_runs.append(st.public())
                rep.removed_keys += gone[0]
                rep.removed_bytes += gone[1]
        staging.remove_stale_stages(store, grace)
        docs = manifest.read_all(store, include_expired=True)
        for t in rep.expired:
            for child, d in docs.items():  # keep live children loadable
                if d.get("parent") == t and d.get("incremental") and child not in rep.expired:
                    compact(store, child)
            n, nbytes = refs.delete_doc(store, docs[t], measure=True)
            rep.removed_keys += n
            rep.removed_bytes += nbytes
            rep.removed_tags.append(t)
        rep2, _ = _scan_orphans(store, grace)
        keys = _still_orphaned(store, rep2.orphan_keys, grace)
        orphan_bytes = 0
        for i in range(0, len(keys), 4096):
            batch = keys[i : i + 4096]
            if refs.live_pending(store, grace):  # a save started meanwhile: it may reuse chunks
                batch = [k for k in batch if not k.startswith(layout.CHUNK)]
            orphan_bytes += _bytes_of(store, batch)
            store.delete_many(batch)
            rep.removed_keys += len(batch)
        rep.removed_bytes += orphan_bytes
        for m in refs.pending_markers(store, grace):
            if m["stale"]:  # only if unchanged: a new save may have claimed the tag since
                store.compare_and_set(m["key"], m["raw"], None)
        rep.orphan_keys = keys
        rep.orphan_bytes = orphan_bytes
        rep.pending = [
            _public(m) for m in refs.pending_markers(store, grace)
        ]
        rep.runs = [st.public() for st in sweep.list_runs(store, grace)
                    if st.state != sweep.PUBLISHED]
        rep.incomplete = sorted({r["tag"] for r in rep.runs})
        rep.stages = staging.stage_dirs(store, grace)
        return rep
