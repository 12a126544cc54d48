"""Run identity of sharded saves: the run record every shard joins and checks.

A sharded save (``save(..., shard=i, num_shards=N)`` from N processes) is one *run*. The
first shard to start creates the run record ``ckpt/r/<tag>`` with a compare-and-set; it
fixes what every shard must agree on: the run id (the caller's ``run=``, or none, when the
run is known by the token alone), ``num_shards``, ``step``, ``incremental`` and the parent
tag. It also draws a random token: the run writes its table records under the data tag
``<tag>~r<token>``, its markers under ``ckpt/p/<tag>~r<token>/<shard>`` and its shard
manifests under ``ckpt/s/<tag>/<token>/<shard>``, so two runs of one tag never share a key.

Every shard checks the record before it writes (:func:`join`) and again once it holds its
claim (:func:`confirm`); a shard whose saver died mid-save marks the run *broken*, and a
broken run never publishes. The rules and their outcomes are in "Atomic tags, incremental
saves, sharded saves" in ``docs/format.md``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tensorkv.checkpoint import claims, layout, manifest
from tensorkv.errors import CheckpointError, ShardRunError, TagExistsError
from tensorkv.stores.base import KVStore

OPEN = "open"
REMOVING = "removing"  # gc or delete_tag is removing the run


@dataclass(frozen=True)
class Run:
    """A run record as read from the store (see the module docstring)."""

    tag: str
    run: str | None  # the caller's run id, or None (the run is known by its token)
    token: str
    num_shards: int
    step: int | None
    incremental: bool
    parent: str | None
    created: float
    owner: dict[str, Any]
    state: str
    broken: dict[str, Any] | None
    raw: bytes

    @property
    def data_tag(self) -> str:
        """The data tag of the run's table records and markers."""
        return layout.run_data_tag(self.tag, self.token)

    @property
    def name(self) -> str:
        """``run 'job-42'`` or ``run ~r<token> (no run id)`` for messages."""
        if self.run is not None:
            return f"run {self.run!r}"
        return f"run {layout.RUN_MARK}{self.token} (no run id)"

    def identity(self) -> dict[str, Any]:
        """The ``run`` field of the run's manifests."""
        return {"id": self.run, "token": self.token}


def check_run_id(run: object) -> str | None:
    """Validate a caller's run id: None, or a non-empty printable str of at most 200 chars."""
    if run is None:
        return None
    if not isinstance(run, str) or not run or len(run) > 200 or not run.isprintable():
        raise CheckpointError(
            f"run={run!r} must be a non-empty printable str of at most 200 characters naming "
            "one attempt of a sharded save, e.g. run='job-42-attempt-3'"
        )
    return run


def _decode(tag: str, raw: bytes) -> Run:
    try:
        d = json.loads(raw)
        return Run(
            tag=tag, run=d["run"], token=d["token"], num_shards=int(d["num_shards"]),
            step=d.get("step"), incremental=bool(d.get("incremental")), parent=d.get("parent"),
            created=float(d.get("created", 0.0)), owner=d.get("owner") or {},
            state=d.get("state", OPEN), broken=d.get("broken"), raw=bytes(raw),
        )
    except (ValueError, KeyError, TypeError):
        from tensorkv.errors import CorruptRecordError

        raise CorruptRecordError(
            f"the run record of tag {tag!r} ({layout.run_key(tag)!r}) is unreadable; remove "
            f"it with tensorkv.delete_tag(url, {tag!r})"
        ) from None


def _encode(run: Run, **changes: Any) -> bytes:
    d = {
        "tag": run.tag, "run": run.run, "token": run.token, "num_shards": run.num_shards,
        "step": run.step, "incremental": run.incremental, "parent": run.parent,
        "created": run.created, "owner": run.owner, "state": run.state, "broken": run.broken,
    }
    d.update(changes)
    return json.dumps(d, sort_keys=True).encode()


def read(store: KVStore, tag: str) -> Run | None:
    """The run record of ``tag``, or None when no sharded save of it is in progress."""
    raw = store.get(layout.run_key(tag))
    return None if raw is None else _decode(tag, raw)


def read_all(store: KVStore) -> dict[str, Run]:
    """Every run record in the store, by tag."""
    out = {}
    for k, v in manifest.scan_items(store, layout.RUN):
        tag = bytes(k[len(layout.RUN) :]).decode()
        out[tag] = _decode(tag, v)
    return out


def parts(store: KVStore, tag: str, token: str | None) -> dict[int, dict[str, Any]]:
    """The manifests of the finished shards of run ``token`` of ``tag`` (None: the old layout)."""
    out: dict[int, dict[str, Any]] = {}
    prefix = layout.SHARD_MANIFEST + tag.encode() + b"/"
    if token is not None:
        prefix = layout.run_parts_prefix(tag, token)
    for k, v in manifest.scan_items(store, prefix):
        ptag, ptoken, shard = layout.parse_part_key(k)
        if ptag == tag and ptoken == token:
            out[shard] = manifest.decode_manifest(v, f"shard {shard} of tag {tag!r}")
    return out


def finished(store: KVStore, tag: str, token: str) -> list[int]:
    """The shards of run ``token`` of ``tag`` that have finished (keys only: nothing decoded)."""
    return sorted(layout.parse_part_key(k)[2]
                  for k in manifest.scan_keys(store, layout.run_parts_prefix(tag, token)))


def markers(store: KVStore, data_tag: str) -> dict[int, dict[str, Any]]:
    """The pending markers under ``data_tag``, by shard (decoded owner records)."""
    prefix = layout.PENDING + data_tag.encode() + b"/"
    return {
        int(bytes(k[len(prefix) :])): claims.parse_marker(v)
        for k, v in manifest.scan_items(store, prefix)
    }


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def describe(store: KVStore, run: Run) -> str:
    """The run, its shards and their owners, for messages."""
    done = finished(store, run.tag, run.token)
    marks = markers(store, run.data_tag)
    saving = [f"shard {i} by {claims.describe_owner(marks[i])}" for i in sorted(marks)
              if i not in done]
    idle = sorted(set(range(run.num_shards)) - set(done) - set(marks))
    step = "" if run.step is None else f", step {run.step}"
    own = run.owner
    text = (f"{run.name} of {run.num_shards} shards{step}, begun {_when(run.created)} by pid "
            f"{own.get('pid', '?')} on host {own.get('host', '?')}; finished shards: {done}")
    if saving:
        text += "; saving: " + ", ".join(saving)
    if idle:
        text += f"; not started: {idle}"
    if run.broken:
        text += "; broken: " + "; ".join(run.broken.get("why", []))
    return text


def _remedy(tag: str) -> str:
    return (f"If that run is abandoned, remove its shards with tensorkv.delete_tag(url, {tag!r}) "
            "or `tensorkv gc URL` (which removes it once its savers are gone, or after the "
            "grace period), then save every shard again")


def _removing_error(store: KVStore, run: Run) -> ShardRunError:
    return ShardRunError(
        f"tag {run.tag!r}: {run.name} is being removed (by gc or delete_tag) in {store.url!r}; "
        "save again once it is gone. If that removal was interrupted, finish it with "
        f"`tensorkv gc URL` or tensorkv.delete_tag(url, {run.tag!r})"
    )


def broken_error(store: KVStore, run: Run) -> ShardRunError:
    """The error for a shard, or a merge, of a run that can never finish."""
    why = "; ".join((run.broken or {}).get("why", [])) or "one of its savers died"
    return ShardRunError(
        f"tag {run.tag!r}: {run.name} cannot be completed in {store.url!r}: {why}. Saving that "
        "shard again would mix two runs in one tag. Remove the run with "
        f"tensorkv.delete_tag(url, {run.tag!r}) or `tensorkv gc URL`, then save every shard "
        "again (with a new run= if you give one)"
    )


def _differences(run: Run, want: dict[str, Any]) -> list[str]:
    out = []
    if run.run != want["run"]:
        mine = "no run id" if want["run"] is None else f"run={want['run']!r}"
        theirs = "no run id" if run.run is None else f"run={run.run!r}"
        out.append(f"this shard has {mine}, that save has {theirs}")
    if run.num_shards != want["num_shards"]:
        out.append(f"this shard has num_shards={want['num_shards']}, that save "
                   f"num_shards={run.num_shards}")
    if run.step != want["step"]:
        out.append(f"this shard has step={want['step']!r}, that save step={run.step!r}")
    if run.incremental != want["incremental"]:
        out.append(f"this shard has incremental={want['incremental']}, that save "
                   f"incremental={run.incremental}")
    if want["parent"] is not None and want["parent"] != run.parent:
        out.append(f"this shard has parent={want['parent']!r}, that save parent={run.parent!r}")
    return out


def _latest(store: KVStore) -> str | None:
    docs = manifest.read_all(store)
    return manifest.sorted_tags(docs)[-1] if docs else None


def join(
    store: KVStore, tag: str, *, run: str | None, shard: int, num_shards: int,
    step: int | None, incremental: bool, parent: str | None,
) -> Run:
    """The run this shard belongs to: the one saving ``tag``, or a new one it begins.

    Parameters
    ----------
    store
        The store.
    tag
        The tag of the sharded save.
    run
        The caller's run id, or None.
    shard, num_shards
        Which shard this is.
    step, incremental, parent
        As given to :func:`tensorkv.save`; the run's first shard fixes them (``parent``:
        the given one, else the latest tag when ``incremental``, else None).

    Raises
    ------
    ShardRunError
        Another run saves ``tag`` (another run id, shard count, step, ``incremental`` or
        parent), or it cannot finish, or shards of an earlier save are left.
    TagExistsError
        The tag exists.
    """
    want = {"run": run, "num_shards": num_shards, "step": step, "incremental": incremental,
            "parent": parent}
    key = layout.run_key(tag)
    this = f"shard {shard} of {num_shards} of tag {tag!r}" + (
        "" if run is None else f" (run {run!r})")
    for _ in range(8):
        cur = read(store, tag)
        if cur is None:
            if store.get(layout.manifest_key(tag)) is not None:
                raise TagExistsError(
                    f"tag {tag!r} already exists in {store.url!r}; choose another tag or delete "
                    "it first with tensorkv.delete_tag"
                )
            _refuse_leftovers(store, tag, this)
            own = claims.owner_record(f"sharded save of tag {tag!r}")
            rec = {
                "tag": tag, "run": run, "token": uuid.uuid4().hex[:16], "num_shards": num_shards,
                "step": step, "incremental": bool(incremental),
                "parent": parent if parent is not None else (
                    _latest(store) if incremental else None),
                "created": time.time(), "state": OPEN, "broken": None,
                "owner": {k: own[k] for k in ("pid", "host", "proc_start")},
            }
            raw = json.dumps(rec, sort_keys=True).encode()
            if store.put_if_absent(key, raw):
                return _decode(tag, raw)
            continue
        if cur.state == REMOVING:
            raise _removing_error(store, cur)
        diff = _differences(cur, want)
        if diff:
            raise ShardRunError(
                f"{this} cannot join the sharded save of that tag in progress in "
                f"{store.url!r}: {describe(store, cur)}. The two differ: {'; '.join(diff)}. "
                f"Give every shard of one save the same run=, num_shards=, step=, incremental= "
                f"and parent=, or save under another tag. {_remedy(tag)}"
            )
        if cur.broken:
            raise broken_error(store, cur)
        return cur
    raise CheckpointError(f"{this}: the run record {key!r} keeps changing; retry the save")


def _refuse_leftovers(store: KVStore, tag: str, this: str) -> None:
    """Refuse to begin a run of ``tag`` while shard manifests of an earlier save are there."""
    found: dict[str | None, dict[int, dict[str, Any]]] = {}
    for k, v in manifest.scan_items(store, layout.SHARD_MANIFEST + tag.encode() + b"/"):
        ptag, token, shard = layout.parse_part_key(k)
        if ptag == tag:
            found.setdefault(token, {})[shard] = manifest.decode_manifest(
                v, f"shard {shard} of tag {tag!r}")
    if not found:
        return
    what = []
    for token, ps in found.items():
        first = ps[min(ps)]
        who = ("saved before run ids existed" if token is None
               else f"of removed run {layout.RUN_MARK}{token}")
        what.append(f"shards {sorted(ps)} of {first.get('num_shards')} ({who}, "
                    f"finished {_when(max(p.get('created', 0.0) for p in ps.values()))})")
    raise ShardRunError(
        f"{this}: the store {store.url!r} holds shards of an earlier save of that tag that "
        f"never finished: {', '.join(what)}; they must not be mixed with this save. "
        f"{_remedy(tag)}"
    )


def mark_broken(store: KVStore, run: Run, why: list[str], shards: list[int]) -> Run:
    """Record in the run record that the run cannot finish; return the record now."""
    key = layout.run_key(run.tag)
    for _ in range(8):
        cur = read(store, run.tag)
        if cur is None or cur.token != run.token:
            return run
        old = cur.broken or {}
        broken = {
            "why": list(dict.fromkeys([*old.get("why", []), *why])),
            "shards": sorted({*old.get("shards", []), *shards}),
            "at": old.get("at", time.time()),
        }
        raw = _encode(cur, broken=broken)
        if store.compare_and_set(key, cur.raw, raw):
            return _decode(run.tag, raw)
    return run


def confirm(store: KVStore, run: Run, shard: int, claim: claims.Claim) -> Run:
    """Check, once this shard holds its claim, that it may save into ``run``.

    The record must still be the one joined, this shard must not be saved already, and no
    shard of the run may have been left by a dead saver (this shard's claim replaced one,
    or another shard's marker names a process that is gone): then the run is marked broken.

    Raises
    ------
    ShardRunError
        The run was removed meanwhile, or it is broken.
    TagExistsError
        This shard of the run is saved already.
    """
    cur = read(store, run.tag)
    if cur is None or cur.token != run.token:
        raise ShardRunError(
            f"tag {run.tag!r}: {run.name} was removed (by gc or delete_tag) in {store.url!r} "
            f"while shard {shard} joined it; save again"
        )
    if cur.state == REMOVING:
        raise _removing_error(store, cur)
    done = finished(store, run.tag, run.token)
    why, dead = [], []
    if claim.took_over is not None and shard not in done:
        dead.append(shard)
        why.append(f"shard {shard}'s saver ({claims.describe_owner(claim.took_over)}) died "
                   "before its shard was saved")
    for j, info in markers(store, run.data_tag).items():
        if j != shard and j not in done and claims.owner_alive(info) is False:
            dead.append(j)
            why.append(f"shard {j}'s saver ({claims.describe_owner(info)}) died before its "
                       "shard was saved")
    if dead:
        why[-1] += f"; shards {sorted(done)} of {run.num_shards} had finished"
        cur = mark_broken(store, cur, why, dead)
    if cur.broken:
        raise broken_error(store, cur)
    if shard in done:
        raise TagExistsError(
            f"shard {shard} of tag {run.tag!r} is already saved by {run.name} in "
            f"{store.url!r}; each shard is saved once"
        )
    return cur


def refuse_running(store: KVStore, tag: str) -> None:
    """Refuse an unsharded save (or copy) of ``tag`` while a sharded save of it exists."""
    cur = read(store, tag)
    if cur is not None:
        raise TagExistsError(
            f"tag {tag!r} is being saved as {cur.num_shards} shards in {store.url!r} "
            f"({describe(store, cur)}); choose another tag. {_remedy(tag)}"
        )


def finish(store: KVStore, run: Run) -> None:
    """Remove the run record of a published run (if it is still this run's)."""
    cur = read(store, run.tag)
    if cur is not None and cur.token == run.token:
        store.compare_and_set(layout.run_key(run.tag), cur.raw, None)


def begin_removal(store: KVStore, run: Run) -> Run | None:
    """Mark ``run`` as being removed; None when its record changed meanwhile."""
    raw = _encode(run, state=REMOVING)
    if store.compare_and_set(layout.run_key(run.tag), run.raw, raw):
        return _decode(run.tag, raw)
    return None


def undo_removal(store: KVStore, run: Run, removing: Run) -> None:
    """Put back the record that :func:`begin_removal` replaced (a shard is still saving)."""
    store.compare_and_set(layout.run_key(run.tag), removing.raw, run.raw)


def end_removal(store: KVStore, removing: Run) -> None:
    """Delete the record of a removed run."""
    store.compare_and_set(layout.run_key(removing.tag), removing.raw, None)
