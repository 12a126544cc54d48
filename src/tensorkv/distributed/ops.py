"""Operations over several shards, all or nothing: staged parts, outcomes and their resolution.

A change that spans several shards (a push, a lookup that inserts, an upsert, ...) is one
*operation* ``(worker, op)`` in two phases. The client first *stages* each shard's part: the
shard keeps the part (keys, gradients ...) without applying it and acknowledges. Once every
shard has its part, the operation is decided: the client sends *commit* to each shard, which
applies its part then. A shard that refuses its part (a save is taking its snapshot) makes the
client *abort* the operation everywhere and run it again afterwards.

A client that dies between two of these messages leaves parts staged and never committed.
Every staged part names the operation's shards, so the survivors can finish it: the
*resolution* asks each shard what became of the operation, then

- commits it on every shard if any shard has committed it or every shard has it staged (the
  client had decided, or could have);
- if not, and the client is gone (Ray reports its lease lost) or a save barrier needs the
  shards settled, asks again, marking the operation refused on a shard that never got its part
  (a *tombstone*: the part can no longer be staged there), and aborts it (drops the staged
  parts) everywhere if a shard refused it or never got its part;
- waits otherwise: a live client finishes its own operation, and a shard that restarted from a
  checkpoint since cannot tell until the client sends it its requests again (a dead client's
  part is gone there: abort).

The decision depends only on what the shards hold, so resolutions running at once (or with a
client finishing its own operation) decide alike, and committing or aborting twice changes
nothing (the outcome of each operation is kept per shard). Each shard's :class:`Janitor`
resolves operations staged longer than ``resolve_after`` seconds; :func:`settle` resolves every
operation at once (a save's barrier). :class:`Ledger` is a shard's bookkeeping of it all.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from tensorkv.distributed.wire import REFUSED, REREAD, STAGED
from tensorkv.errors import ShardUnavailableError, import_optional

log = logging.getLogger(__name__)

COMMITTED = "committed"  #: the shard applied its part
ABORTED = "aborted"  #: the shard dropped its part, or refuses it (a tombstone)
NONE = "none"  #: the shard never got its part (yet)
UNKNOWN = "unknown"  #: the shard restarted since; the client has not caught it up yet

#: Outcomes kept per client on a shard (older operations are resolved on every shard long ago).
KEEP_OUTCOMES = 256
#: Most operations a client may have in flight (``staleness``): far fewer than are kept.
MAX_IN_FLIGHT = 64
#: Ray namespace of the parameter servers' actors.
NAMESPACE = "tensorkv"


def shard_actor_name(ps_name: str, generation: int, index: int) -> str:
    """Name of shard ``index`` of generation ``generation`` of parameter server ``ps_name``."""
    return f"tensorkv-ps-{ps_name}-g{generation}-s{index}"


def _ray() -> Any:
    return import_optional("ray", "the parameter server (tensorkv.distributed)", "ray")


class Part(NamedTuple):
    """One shard's staged part of an operation."""

    method: str  #: ``pull``, ``push`` or ``call``
    name: str  #: the table
    args: tuple  #: the arguments the request would have had
    parts: tuple[int, ...]  #: every shard of the operation
    seq: int  #: sequence number of the stage request (see :meth:`Ledger.low_water`)
    since: float  #: ``time.monotonic()`` when staged
    would: bool  #: a push that would change rows here (the step is counted everywhere then)
    framed: bool  #: answer the commit as a frame (:mod:`~tensorkv.distributed.wire`)


class Ledger:
    """A shard's staged parts and what became of each client's recent operations.

    Outcome codes: 0 aborted, 1 committed, 2 committed with the optimizer step counted.
    """

    def __init__(self) -> None:
        self.staged: dict[tuple[str, int], Part] = {}
        self.outcomes: dict[str, dict[int, int]] = {}
        self.floor: dict[str, int] = {}  # worker -> outcomes up to here were forgotten
        self.freezes: dict[str, tuple[str, float]] = {}  # token -> (worker, since)
        self.leases: dict[str, Any] = {}  # worker -> object ref owned by its process
        self.restarted = False  # restored from a checkpoint: parts staged since may be lost
        self.synced: set[str] = set()  # clients that sent requests in order since
        self.answers: dict[str, tuple[int, Any]] = {}  # worker -> (op, its commit's answer)

    def status(self, worker: str, op: int) -> tuple[str, int]:
        """``(state, code)`` of operation ``op`` of ``worker`` here.

        ``code``: the outcome code of a committed operation, ``would`` of a staged part.
        """
        part = self.staged.get((worker, op))
        if part is not None:
            return STAGED, int(part.would)
        code = self.outcomes.get(worker, {}).get(op)
        if code is not None:
            return (COMMITTED, code) if code else (ABORTED, 0)
        if op <= self.floor.get(worker, 0):
            return UNKNOWN, 0
        if self.restarted and worker not in self.synced:
            return UNKNOWN, 0
        return NONE, 0

    def record(self, worker: str, op: int, code: int) -> None:
        """Keep the outcome of operation ``op`` of ``worker`` (forgetting the oldest ones)."""
        mine = self.outcomes.setdefault(worker, {})
        mine[op] = code
        if len(mine) > 2 * KEEP_OUTCOMES:
            for old in sorted(mine)[:len(mine) - KEEP_OUTCOMES]:
                del mine[old]
                self.floor[worker] = max(self.floor.get(worker, 0), old)

    def low_water(self, worker: str, applied: int) -> int:
        """The last request of ``worker`` whose effect a checkpoint taken now holds.

        Staged parts are not saved in checkpoints: a restored shard counts the client's
        requests only up to before its oldest part still staged, so the client sends the
        stage again (the requests after it are parts of operations too, and each operation's
        outcome is in the checkpoint: none is applied twice).
        """
        seqs = [p.seq for (w, _), p in list(self.staged.items()) if w == worker]
        return min([applied, *(s - 1 for s in seqs)])

    def stale(self, age: float) -> list[tuple[str, int, tuple[int, ...], float]]:
        """``(worker, op, parts, age)`` of parts staged ``age`` seconds or more, oldest first."""
        now = time.monotonic()
        items = sorted(list(self.staged.items()), key=lambda kv: kv[1].since)
        return [(w, op, p.parts, now - p.since) for (w, op), p in items
                if now - p.since >= age]

    def to_meta(self) -> dict[str, Any]:
        """The outcomes as a checkpoint's metadata keeps them (JSON)."""
        return {"outcomes": {w: [[op, c] for op, c in sorted(o.items())]
                             for w, o in self.outcomes.items()},
                "floor": dict(self.floor)}

    def load_meta(self, meta: dict[str, Any] | None) -> None:
        """Take the outcomes of a checkpoint (restoring a shard: parts since may be lost)."""
        meta = meta or {}
        self.outcomes = {str(w): {int(op): int(c) for op, c in pairs}
                         for w, pairs in (meta.get("outcomes") or {}).items()}
        self.floor = {str(w): int(v) for w, v in (meta.get("floor") or {}).items()}
        self.restarted = True
        self.synced = set()


def owner_dead(lease: Any, timeout: float = 2.0) -> bool:
    """Whether the process owning ``lease`` (an object ref it put) is gone.

    Ray raises ``OwnerDiedError`` for an object whose owner died; a live owner answers (an
    answer that is late, or a client never seen, counts as alive: nothing is decided on it).
    """
    if lease is None:
        return False
    ray = _ray()
    try:
        ray.get(lease, timeout=timeout)
    except (ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError):
        return True
    except Exception:
        return False
    return False


def resolve(handles: dict[int, Any], worker: str, op: int, parts: tuple[int, ...],
            lease: Any = None, force: bool = False) -> bool:
    """Commit or abort operation ``op`` of ``worker`` on its shards ``parts``.

    ``handles``: the shard actors by number; ``lease``: the client's lease (see
    :func:`owner_dead`). An operation not every shard has is aborted only if its client is
    gone, or with ``force`` (a save barrier: its missing parts would be refused anyway).
    Returns whether the operation is decided now (False: wait for its live client).
    """
    ray = _ray()
    states = ray.get([handles[s].op_status.remote(worker, op, False) for s in parts])
    kinds = {st for st, _ in states}
    dead = False
    if COMMITTED not in kinds and kinds != {STAGED}:
        dead = owner_dead(lease)
        if not (force or dead):
            return False
        states = ray.get([handles[s].op_status.remote(worker, op, True) for s in parts])
        kinds = {st for st, _ in states}
    committed = [code for st, code in states if st == COMMITTED]
    tick = False
    if committed:
        commit, tick = True, max(committed) == 2
        if ABORTED in kinds or UNKNOWN in kinds:
            log.warning("operation %s of client %s is committed on some shards and lost on "
                        "others (%s): a shard restarted from an older checkpoint after its "
                        "client died", op, worker, states)
    elif ABORTED in kinds:
        commit = False
    elif kinds == {STAGED}:
        commit, tick = True, any(code for _, code in states)
    elif dead:  # a restarted shard lost the part of a client that cannot send it again
        commit = False
    else:
        return False
    ray.get([handles[s].decide.remote(worker, op, commit, tick) for s in parts])
    return True


def settle(handles: dict[int, Any], timeout: float, force: bool = False,
           poll: float = 0.005) -> int:
    """Resolve every operation staged on the shards now; how many were decided here.

    ``force``: abort the operations live clients have not staged everywhere yet (a save
    barrier); else those wait for their clients. Raises
    :class:`~tensorkv.errors.ShardUnavailableError` after ``timeout`` seconds with some still
    undecided.
    """
    ray = _ray()
    deadline = time.monotonic() + timeout
    first: set[tuple[str, int]] | None = None
    n = 0
    while True:
        seen: dict[tuple[str, int], tuple[tuple[int, ...], float, Any]] = {}
        for pend in ray.get([h.pending.remote() for h in handles.values()]):
            for worker, op, parts, age, lease in pend:
                seen.setdefault((worker, op), (tuple(parts), age, lease))
        if first is None:
            first = set(seen)
        todo = {k: v for k, v in seen.items() if k in first}
        if not todo:
            return n
        decided = 0
        for (worker, op), (parts, _age, lease) in sorted(todo.items()):
            if resolve(handles, worker, op, parts, lease[0] if lease else None, force):
                decided += 1
        n += decided
        if time.monotonic() > deadline:
            raise ShardUnavailableError(
                f"{len(todo)} operations of other clients stayed half-done on the shards for "
                f"{timeout:g} s (e.g. {sorted(todo)[0]}): a client is catching a restarted "
                "shard up, or a shard does not answer; check the Ray cluster (ray status)")
        if not decided:
            time.sleep(poll)
            poll = min(poll * 2, 0.1)


class Janitor(threading.Thread):
    """A shard's thread resolving operations staged too long, and thawing dead savers' freezes.

    Each shard resolves the parts it holds (:func:`resolve`, never aborting a live client's
    operation): the ``r``-th shard of an operation once its part is ``(r + 1) *
    resolve_after`` seconds old (so the first usually does it alone; the others still do when
    the first committed its part already). Runs inside the shard actor's process; it changes
    the shard only through calls to the actor itself.
    """

    def __init__(self, ledger: Ledger, index: int, names: Callable[[], list[str]],
                 resolve_after: float) -> None:
        super().__init__(name=f"tensorkv-ps-janitor-{index}", daemon=True)
        self.ledger = ledger
        self.index = index
        self.names = names
        self.resolve_after = float(resolve_after)
        self.stopped = threading.Event()
        self._handles: dict[int, Any] = {}

    def handles(self) -> dict[int, Any]:
        """The shard actors, by number (looked up by name once)."""
        if not self._handles:
            ray = _ray()
            self._handles = {i: ray.get_actor(n, namespace=NAMESPACE)
                             for i, n in enumerate(self.names())}
        return self._handles

    def run(self) -> None:  # pragma: no cover - runs in the shard actor's process
        """Sweep every ``resolve_after / 2`` seconds (at most 1 s) until stopped."""
        period = max(0.05, min(1.0, self.resolve_after / 2))
        while not self.stopped.wait(period):
            try:
                self.sweep()
            except Exception as exc:
                self._handles = {}
                log.debug("janitor of shard %s: %s", self.index, exc)

    def sweep(self) -> int:
        """One pass: resolve the stale operations this shard leads; how many were decided."""
        n = 0
        ledger = self.ledger
        for worker, op, parts, age in ledger.stale(self.resolve_after):
            rank = parts.index(self.index) if self.index in parts else 0
            if age >= (rank + 1) * self.resolve_after and \
                    resolve(self.handles(), worker, op, parts, ledger.leases.get(worker)):
                n += 1
        now = time.monotonic()
        for token, (worker, since) in list(ledger.freezes.items()):
            if now - since >= self.resolve_after and owner_dead(ledger.leases.get(worker)):
                with contextlib.suppress(Exception):
                    _ray().get(self.handles()[self.index].thaw.remote(token))
        return n


__all__ = ["ABORTED", "COMMITTED", "KEEP_OUTCOMES", "MAX_IN_FLIGHT", "NAMESPACE", "NONE",
           "REFUSED", "REREAD", "STAGED", "UNKNOWN", "Janitor", "Ledger", "Part", "owner_dead",
           "resolve", "settle", "shard_actor_name"]
