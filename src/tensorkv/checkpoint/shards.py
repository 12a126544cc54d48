"""Sharded saves: combining the per-shard manifests of one run into the tag's manifest.

Each process of a sharded save writes ``ckpt/s/<tag>/<token>/<shard>`` (its run's token, see
:mod:`tensorkv.checkpoint.runs`); the last one to finish (or :func:`merge`, by hand) checks
that every shard belongs to the run, writes the combined manifest and removes the run record
(see "Atomic tags, incremental saves, sharded saves" in ``docs/format.md``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from tensorkv.checkpoint import layout, manifest, runs
from tensorkv.checkpoint.staging import main_store
from tensorkv.errors import CheckpointError, ShardRunError, TagExistsError
from tensorkv.stores.base import KVStore


def _who(part: dict[str, Any]) -> str:
    ident = part.get("run") or {}
    if ident.get("token") is None:
        return "no run (saved before run ids existed)"
    if ident.get("id") is None:
        return f"run {layout.RUN_MARK}{ident['token']} (no run id)"
    return f"run {ident['id']!r} ({layout.RUN_MARK}{ident['token']})"


def check_parts(tag: str, parts: dict[int, dict[str, Any]], run: runs.Run | None) -> None:
    """Refuse shard manifests that do not all belong to ``run`` (or, without it, together).

    Every shard must name the same run (id and token), ``num_shards``, step and parent, and
    its index must be below ``num_shards``.

    Raises
    ------
    ShardRunError
        Naming each disagreeing shard, what it says and what the others say.
    """
    if not parts:
        return
    first = parts[min(parts)]
    if run is not None:
        ref = {"who": run.name, "num_shards": run.num_shards, "step": run.step,
               "token": run.token, "id": run.run}
    else:
        ident = first.get("run") or {}
        ref = {"who": _who(first), "num_shards": first.get("num_shards"),
               "step": first.get("step"), "token": ident.get("token"), "id": ident.get("id")}
    problems = []
    for i, p in sorted(parts.items()):
        ident = p.get("run") or {}
        if (ident.get("token"), ident.get("id")) != (ref["token"], ref["id"]):
            problems.append(f"shard {i} was saved by {_who(p)}, the tag's save is {ref['who']}")
        if p.get("num_shards") != ref["num_shards"]:
            problems.append(f"shard {i} was saved as one of {p.get('num_shards')} shards, the "
                            f"tag's save has {ref['num_shards']}")
        if p.get("step") != ref["step"]:
            problems.append(f"shard {i} has step {p.get('step')!r}, the tag's save step "
                            f"{ref['step']!r}")
        if p.get("parent") != first.get("parent"):
            problems.append(f"shard {i} builds on tag {p.get('parent')!r}, shard {min(parts)} "
                            f"on {first.get('parent')!r}")
        if not isinstance(ref["num_shards"], int) or not 0 <= i < ref["num_shards"]:
            problems.append(f"shard {i} is out of range for {ref['num_shards']} shards")
    if problems:
        raise ShardRunError(
            f"tag {tag!r}: its shards do not belong to one save: {'; '.join(problems)}. A tag "
            "made of them would mix two runs, so nothing was published. Remove the shards with "
            f"tensorkv.delete_tag(url, {tag!r}) and save every shard again"
        )


def combine(
    tag: str, parts: dict[int, dict[str, Any]], run: runs.Run | None = None
) -> dict[str, Any]:
    """Combine the manifests of one run's shards into one (dense tensors must agree).

    Raises
    ------
    ShardRunError
        The shards do not all belong to ``run`` (see :func:`check_parts`).
    CheckpointError
        A dense tensor or a table's dim differs between shards.
    """
    check_parts(tag, parts, run)
    first = parts[min(parts)]
    doc = dict(first)
    doc["shards"] = sorted(parts)
    doc["dense"] = {}
    doc["tables"] = {}
    doc["created"] = max(p["created"] for p in parts.values())
    doc["incremental"] = any(p.get("incremental") for p in parts.values())
    if run is not None:
        doc["run"] = run.identity()
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
            if prev.get("data_tag") != ent.get("data_tag"):
                raise ShardRunError(
                    f"tag {tag!r}: table {name!r} of shard {i} lies under data tag "
                    f"{ent.get('data_tag')!r}, the other shards' under {prev.get('data_tag')!r}"
                )
            prev["shards"].update(ent["shards"])
            prev["full"] = prev["full"] and ent["full"]
    return doc


def _published(store: KVStore, tag: str, run: runs.Run) -> bool:
    """Whether ``tag``'s manifest exists and is this run's (raise when another save's)."""
    raw = store.get(layout.manifest_key(tag))
    if raw is None:
        return False
    doc = manifest.decode_manifest(raw, f"tag {tag!r}")
    if (doc.get("run") or {}).get("token") == run.token:
        return True
    raise TagExistsError(
        f"tag {tag!r} was published in {store.url!r} by another save while {run.name} saved "
        "its shards; this run's shards are not part of it and stay behind until `tensorkv gc "
        "URL` removes them. Save the run again under another tag"
    )


def _publish(store: KVStore, tag: str, run: runs.Run, doc: dict[str, Any]) -> dict[str, Any]:
    raw = manifest.encode_manifest(doc)
    if not store.put_if_absent(layout.manifest_key(tag), raw):
        _published(store, tag, run)  # raises unless a sibling shard published this run
        got = store.get(layout.manifest_key(tag))
        return doc if got is None else manifest.decode_manifest(got, f"tag {tag!r}")
    with contextlib.suppress(Exception):
        store.flush()
    runs.finish(store, run)
    return doc


def merge_if_complete(store: KVStore, run: runs.Run) -> bool:
    """Publish the tag of ``run`` if all its shards have finished; return whether it is.

    Called by every shard once its own manifest is written (while it still holds its claim).

    Raises
    ------
    ShardRunError
        The run was removed or is broken, or a shard manifest under the run does not belong
        to it.
    TagExistsError
        Another save published the tag meanwhile.
    """
    tag = run.tag
    if _published(store, tag, run):
        return True
    cur = runs.read(store, tag)
    if cur is None or cur.token != run.token or cur.state == runs.REMOVING:
        if _published(store, tag, run):  # a sibling shard published it and removed the record
            return True
        raise ShardRunError(
            f"tag {tag!r}: {run.name} was removed (by gc or delete_tag) in {store.url!r} "
            "before it could be published; save every shard again"
        )
    if cur.broken:
        raise runs.broken_error(store, cur)
    if len(runs.finished(store, tag, run.token)) < run.num_shards:
        return False  # (counted from the keys: each shard does not read all the others)
    parts = runs.parts(store, tag, run.token)
    _publish(store, tag, cur, combine(tag, parts, cur))  # combine checks every shard
    return True


def merge(
    url: str | KVStore, tag: str, *, allow_missing: bool = False, run: str | None = None
) -> dict[str, Any]:
    """Write the combined manifest of a sharded save from its finished shards.

    Called automatically when the last shard finishes; call it yourself after a crash (with
    ``allow_missing=True`` to publish the shards that finished).

    Parameters
    ----------
    url
        Store URL or open KVStore.
    tag
        The tag of the sharded save.
    allow_missing
        Publish the tag even if some shards never finished (their rows will be absent; the
        manifest lists them as ``missing_shards``).
    run
        The run id the save was given (``save(..., run=...)``); refused when the tag's save
        is another run.

    Returns
    -------
    dict
        The combined manifest.

    Raises
    ------
    ShardRunError
        The shards found belong to another run, or disagree with each other.
    """
    layout.check_tag(tag)
    run = runs.check_run_id(run)
    with main_store(url, create=False) as store:
        raw = store.get(layout.manifest_key(tag))
        if raw is not None:
            doc = manifest.decode_manifest(raw, f"tag {tag!r}")
            got = (doc.get("run") or {}).get("id")
            if run is not None and got != run:
                raise ShardRunError(
                    f"tag {tag!r} in {store.url!r} was saved by run {got!r}, not run {run!r}")
            return doc
        cur = runs.read(store, tag)
        if cur is None:
            return _merge_old_layout(store, tag, allow_missing, run)
        if run is not None and cur.run != run:
            raise ShardRunError(
                f"tag {tag!r} is being saved in {store.url!r} by {runs.describe(store, cur)}, "
                f"not by run {run!r}; merge it without run= or with run={cur.run!r}"
            )
        if cur.state == runs.REMOVING:
            raise ShardRunError(f"tag {tag!r}: {cur.name} is being removed; nothing to merge")
        if cur.broken and not allow_missing:
            raise runs.broken_error(store, cur)
        parts = runs.parts(store, tag, cur.token)
        if not parts:
            raise CheckpointError(f"no shard of tag {tag!r} has finished in {store.url!r}")
        doc = _combine_checked(tag, parts, cur.num_shards, allow_missing, cur)
        return _publish(store, tag, cur, doc)


def _combine_checked(
    tag: str, parts: dict[int, dict[str, Any]], n: int, allow_missing: bool,
    run: runs.Run | None,
) -> dict[str, Any]:
    doc = combine(tag, parts, run)
    missing = sorted(set(range(n)) - set(parts))
    if missing and not allow_missing:
        raise CheckpointError(
            f"tag {tag!r}: shards {missing} of {n} have not finished; wait for them, or "
            "pass allow_missing=True to publish the tag without them"
        )
    if missing:
        doc["missing_shards"] = missing
    return doc


def _merge_old_layout(
    store: KVStore, tag: str, allow_missing: bool, run: str | None
) -> dict[str, Any]:
    """Merge shards saved before run ids existed (``ckpt/s/<tag>/<shard>``)."""
    found = {t for t in (layout.parse_part_key(k)[1] for k in manifest.scan_keys(
        store, layout.SHARD_MANIFEST + tag.encode() + b"/")) if t is not None}
    if found:
        raise ShardRunError(
            f"tag {tag!r}: the shards in {store.url!r} belong to runs that were removed "
            f"({', '.join(layout.RUN_MARK + t for t in sorted(found))}); "
            f"nothing to merge. Remove them with tensorkv.delete_tag(url, {tag!r})"
        )
    parts = runs.parts(store, tag, None)
    if not parts:
        raise CheckpointError(f"no shard of tag {tag!r} has finished in {store.url!r}")
    if run is not None:
        raise ShardRunError(f"tag {tag!r}: its shards were saved without a run id, not by "
                            f"run {run!r}")
    n = parts[min(parts)]["num_shards"]
    doc = _combine_checked(tag, parts, n, allow_missing, None)
    raw = manifest.encode_manifest(doc)
    if not store.put_if_absent(layout.manifest_key(tag), raw):  # merged meanwhile
        got = store.get(layout.manifest_key(tag))
        return doc if got is None else manifest.decode_manifest(got, f"tag {tag!r}")
    store.flush()
    return doc
