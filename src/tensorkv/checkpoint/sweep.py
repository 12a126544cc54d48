"""Sharded saves left behind: listing runs, removing stale ones, checking published shards.

:func:`list_runs` finds every sharded save that has not published its tag (from the run
records, the shard manifests and the markers, see :mod:`tensorkv.checkpoint.runs`) and says
whether it is still saving, waiting for shards, or stale; ``tensorkv check`` lists them,
``gc`` and ``delete_tag`` remove them with :func:`remove`. :func:`shard_disagreements` is
what ``check --verify`` asks of every published sharded tag.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tensorkv import config
from tensorkv.checkpoint import claims, layout, manifest, refs, runs
from tensorkv.stores.base import KVStore

SAVING = "saving"  # a shard's saver runs
WAITING = "waiting"  # no saver runs; shards may still come (within the grace period)
STALE = "stale"  # it can never publish: gc removes it
COMPLETE = "complete"  # every shard finished but none published the tag (its saver died)
PUBLISHED = "published"  # the tag is published; only its run record was left


@dataclass
class RunStatus:
    """One sharded save that has not published its tag (see :func:`list_runs`)."""

    tag: str
    token: str | None  # None: shards saved before run ids existed
    record: runs.Run | None
    parts: dict[int, dict[str, Any]] = field(default_factory=dict)
    marks: dict[int, dict[str, Any]] = field(default_factory=dict)
    state: str = WAITING
    reason: str = ""
    age: float = 0.0

    def public(self) -> dict[str, Any]:
        """JSON-friendly form (what ``tensorkv check`` prints)."""
        first = self.parts[min(self.parts)] if self.parts else {}
        rec = self.record
        n = rec.num_shards if rec is not None else first.get("num_shards")
        finished = sorted(self.parts)
        return {
            "tag": self.tag,
            "run": rec.run if rec is not None else (first.get("run") or {}).get("id"),
            "token": self.token,
            "num_shards": n,
            "step": rec.step if rec is not None else first.get("step"),
            "finished": finished,
            "saving": sorted(i for i, m in self.marks.items()
                             if i not in self.parts and not claims.is_stale(m)),
            "owners": {str(i): claims.describe_owner(m) for i, m in sorted(self.marks.items())},
            "missing": sorted(set(range(n)) - set(finished)) if isinstance(n, int) else [],
            "state": self.state,
            "reason": self.reason,
            "age": self.age,
        }


def _groups(store: KVStore) -> tuple[dict[tuple[str, str | None], dict[int, dict[str, Any]]],
                                     dict[tuple[str, str], dict[int, dict[str, Any]]]]:
    parts: dict[tuple[str, str | None], dict[int, dict[str, Any]]] = {}
    for k, v in manifest.scan_items(store, layout.SHARD_MANIFEST):
        tag, token, shard = layout.parse_part_key(k)
        parts.setdefault((tag, token), {})[shard] = manifest.decode_manifest(
            v, f"shard {shard} of tag {tag!r}")
    marks: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for k, v in manifest.scan_items(store, layout.PENDING):
        data_tag, _, index = bytes(k[len(layout.PENDING) :]).decode().rpartition("/")
        tag, token = layout.split_data_tag(data_tag)
        if token is not None:
            marks.setdefault((tag, token), {})[int(index)] = claims.parse_marker(v)
    return parts, marks


def list_runs(store: KVStore, grace: float | None = None) -> list[RunStatus]:
    """Every sharded save in ``store`` that has not published its tag, with its state.

    A run is *saving* while a marker of it is live (see
    :func:`tensorkv.checkpoint.claims.is_stale`), else *stale* when it can never publish
    (it is broken, a saver of it died, another save published the tag, its record is gone,
    or it is being removed) or when nothing happened to it for ``grace`` seconds (default
    ``config.CHECKPOINT_GC_GRACE_SECONDS``), *complete* when every shard finished but the
    last one's saver died before it published the tag (:func:`~tensorkv.checkpoint.merge`
    publishes it; gc leaves it), else *waiting* (for shards not started yet).
    A published tag whose run record was left is listed as *published*.
    """
    now = time.time()
    g = config.CHECKPOINT_GC_GRACE_SECONDS if grace is None else grace
    published = {t: (d.get("run") or {}).get("token")
                 for t, d in manifest.read_all(store, include_expired=True).items()}
    recs = runs.read_all(store)
    parts, marks = _groups(store)
    keys: set[tuple[str, str | None]] = set(parts) | set(marks)
    keys |= {(t, r.token) for t, r in recs.items()}
    out = []
    for tag, token in sorted(keys, key=lambda k: (k[0], k[1] or "")):
        rec = recs.get(tag)
        rec = rec if rec is not None and rec.token == token else None
        st = RunStatus(tag, token, rec, parts.get((tag, token), {}),
                       marks.get((tag, token), {}) if token is not None else {})
        if tag in published and published[tag] == token:
            if rec is None:
                continue  # the kept shard manifests of a published tag
            st.state, st.reason = PUBLISHED, "the tag is published; its run record was left"
            out.append(st)
            continue
        times = [p.get("created", 0.0) for p in st.parts.values()]
        times += [float(m.get("started") or 0.0) for m in st.marks.values()]
        if rec is not None:
            times.append(rec.created)
        st.age = now - max(times, default=0.0)
        dead = sorted(i for i, m in st.marks.items()
                      if i not in st.parts and claims.owner_alive(m) is False)
        if any(not claims.is_stale(m, grace, now) for m in st.marks.values()):
            st.state = SAVING
        elif tag in published:
            st.state, st.reason = STALE, "another save published the tag"
        elif rec is None and token is not None:
            st.state, st.reason = STALE, "its run record is gone (an interrupted removal)"
        elif rec is not None and rec.state == runs.REMOVING:
            st.state, st.reason = STALE, "its removal was interrupted"
        elif rec is not None and rec.broken:
            st.state, st.reason = STALE, "; ".join(rec.broken.get("why", [])) or "broken"
        elif rec is not None and len(st.parts) >= rec.num_shards:
            st.state = COMPLETE
            st.reason = (f"publish it with tensorkv.checkpoint.merge(url, {tag!r}), or delete "
                         "it with tensorkv.delete_tag")
        elif dead:
            st.state = STALE
            st.reason = "; ".join(f"shard {i}'s saver ({claims.describe_owner(st.marks[i])}) "
                                  "died before its shard was saved" for i in dead)
        elif st.age >= g:
            st.state = STALE
            st.reason = f"nothing happened to it for {st.age:.0f} s (grace period {g:.0f} s)"
        else:
            st.state = WAITING
        if token is None and st.state == STALE:
            st.reason = "saved before run ids existed; " + st.reason
        out.append(st)
    return out


def remove(
    store: KVStore, st: RunStatus, grace: float | None = None
) -> tuple[int, int] | None:
    """Remove a run that is not saving: its shard manifests, markers, records and record.

    The run record is first marked as being removed, so no shard joins meanwhile; a shard
    that joined before and still runs makes this give up (returning None) and puts the
    record back. Dense chunks only the run referenced are removed unless a save runs.

    Returns
    -------
    tuple of int, or None
        The table records and dense chunks removed, and their bytes; None when it gave up.
    """
    rec = st.record
    if st.state == PUBLISHED:
        if rec is not None:
            runs.finish(store, rec)
        return 0, 0
    removing = None
    if rec is not None:
        removing = rec if rec.state == runs.REMOVING else runs.begin_removal(store, rec)
        if removing is None:
            return None  # the record changed meanwhile
        if rec.state != runs.REMOVING and any(
            not claims.is_stale(m, grace) for m in runs.markers(store, rec.data_tag).values()
        ):
            runs.undo_removal(store, rec, removing)
            return None
    docs = list(st.parts.values())
    doomed: list[bytes] = []
    if st.token is not None:
        store.delete_prefix(layout.run_parts_prefix(st.tag, st.token))
        for k, v in manifest.scan_items(
            store, layout.PENDING + layout.run_data_tag(st.tag, st.token).encode() + b"/"
        ):
            store.compare_and_set(k, v, None)  # only if unchanged
        data_tag = layout.run_data_tag(st.tag, st.token)
        hash_tags = {None, "table"}
        hash_tags |= {e.get("hash_tag") for d in docs for e in d["tables"].values()}
        for ht in hash_tags:  # records of unfinished shards too (other hash tags: gc's scan)
            doomed += manifest.scan_keys(store, layout.tag_table_prefix(data_tag, ht))
    else:
        store.delete_many([layout.shard_manifest_key(st.tag, i) for i in st.parts])
        if not any(not claims.is_stale(claims.parse_marker(v), grace) for _, v in
                   manifest.scan_items(store, layout.PENDING + st.tag.encode() + b"/")):
            owned = {k for d in manifest.read_all(store, include_expired=True).values()
                     for k in refs.table_data_keys(d)}  # an unsharded tag may use the keys
            doomed += [k for d in docs for k in refs.table_data_keys(d) if k not in owned]
    doomed += _unused_chunks(store, docs)
    total = 0
    for i in range(0, len(doomed), 4096):
        batch = doomed[i : i + 4096]
        sizes = store.value_sizes(batch)
        total += int(sizes[sizes > 0].sum())
        store.delete_many(batch)
    if removing is not None:
        runs.end_removal(store, removing)
    return len(doomed), total


def _unused_chunks(store: KVStore, docs: list[dict[str, Any]]) -> list[bytes]:
    """Keys of the dense chunks of ``docs`` that no other manifest references.

    None while a save runs (it may reuse them): gc removes what is left later.
    """
    mine = {d for doc in docs for e in doc["dense"].values() for d in e["chunks"]}
    if not mine or refs.live_pending(store):
        return []
    return [layout.chunk_key(d) for d in sorted(mine - refs.referenced_chunks_all(store))]


def shard_disagreements(store: KVStore, doc: dict[str, Any]) -> list[str]:
    """What is wrong with a published sharded tag's shards (empty when nothing is).

    Every shard below ``num_shards`` must be present unless the manifest lists it in
    ``missing_shards`` (a merge with ``allow_missing``), no table may hold rows of a shard the
    tag does not list, and every kept shard manifest must name the tag's run, shard count,
    step and parent.
    """
    n = doc.get("num_shards", 1)
    present = set(doc.get("shards") or [])
    if n <= 1 and present <= {0}:
        return []
    tag = doc["tag"]
    out = []
    missing = sorted(set(range(n)) - present - set(doc.get("missing_shards") or []))
    if missing:
        out.append(f"shards {missing} of {n} are missing")
    out += [f"shard {i} is out of range for {n} shards" for i in sorted(present)
            if not 0 <= i < n]
    for name, ent in doc["tables"].items():
        extra = sorted(int(s) for s in ent["shards"] if int(s) not in present)
        if extra:
            out.append(f"table {name!r} holds rows of shards {extra}, which the tag does not list")
    ident = doc.get("run") or {}
    for i, p in sorted(runs.parts(store, tag, ident.get("token")).items()):
        pid = p.get("run") or {}
        if (pid.get("token"), pid.get("id")) != (ident.get("token"), ident.get("id")):
            out.append(f"shard {i} was saved by run {pid.get('id')!r} "
                       f"({pid.get('token')}), the tag by run {ident.get('id')!r} "
                       f"({ident.get('token')})")
        if p.get("num_shards") != n:
            out.append(f"shard {i} was saved as one of {p.get('num_shards')} shards, the tag "
                       f"has {n}")
        if p.get("step") != doc.get("step"):
            out.append(f"shard {i} has step {p.get('step')!r}, the tag {doc.get('step')!r}")
        if p.get("parent") != doc.get("parent"):
            out.append(f"shard {i} builds on {p.get('parent')!r}, the tag on "
                       f"{doc.get('parent')!r}")
    return out
