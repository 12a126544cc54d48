"""Claims: who is writing a tag, and the checks that let a tag become visible only when true.

A save first *claims* its tag: it creates the pending marker with a compare-and-set, so of
two processes saving one tag exactly one goes on and the other gets
:class:`~tensorkv.errors.TagExistsError` before it writes anything. The marker records the
owner (pid, host, process start time, a random token); a claim whose owner is provably dead
(same host, process gone or pid reused), or older than the gc grace period, is taken over.

Before the manifest is written, :func:`publish` proves the data is still there: for stores
backed by a server, the server's identity (run id) is the one seen when the claim was made,
the marker still holds this claim, and every record the manifest references exists. The
manifest is created with a compare-and-set too, and the identity is read once more after it,
so a server restart or failover at any point fails the save with
:class:`~tensorkv.errors.StoreRestartedError` (retryable) and publishes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorkv import config
from tensorkv.errors import StoreRestartedError, TagExistsError
from tensorkv.stores.base import KVStore

_ACTIVE: set[str] = set()  # tokens of the claims this process holds now


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ")"
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])  # field 22 of the whole line


def owner_record(what: str) -> dict[str, Any]:
    """The marker contents naming this process as the owner of a claim."""
    pid = os.getpid()
    return {
        "started": time.time(),
        "pid": pid,
        "host": socket.gethostname(),
        "proc_start": process_start(pid),
        "token": uuid.uuid4().hex,
        "what": what,
    }


def owner_alive(info: dict[str, Any]) -> bool | None:
    """Whether the process that wrote a marker still runs: True, False, or None (cannot tell).

    Only owners on this host can be checked; a pid that now names another process (its
    start time differs) counts as dead.
    """
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return None
    if pid == os.getpid() and info.get("proc_start") == process_start(pid):
        return info.get("token") in _ACTIVE  # ours: a claim whose release failed is dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by another user
    start = info.get("proc_start")
    now = process_start(pid)
    return start is None or now is None or start == now


def parse_marker(raw: bytes | memoryview) -> dict[str, Any]:
    """Decode a marker; an unreadable one becomes ``{}`` (treated as old)."""
    try:
        info = json.loads(bytes(raw))
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def is_stale(info: dict[str, Any], grace: float | None = None, now: float | None = None) -> bool:
    """Whether a marker's owner is dead, or (when that cannot be told) older than ``grace``."""
    alive = owner_alive(info)
    if alive is not None:
        return not alive
    g = config.CHECKPOINT_GC_GRACE_SECONDS if grace is None else grace
    started = info.get("started")
    age = (time.time() if now is None else now) - (
        float(started) if isinstance(started, (int, float)) else 0.0
    )
    return age >= g


def describe_owner(info: dict[str, Any]) -> str:
    """``pid 123 on host h since 2026-11-24 10:00:00 UTC (running)`` for messages."""
    started = info.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(started)))
        if isinstance(started, (int, float)) else "an unknown time"
    )
    alive = owner_alive(info)
    state = {True: "running", False: "dead", None: "on another host"}[alive]
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} since {when} ({state})"


@dataclass
class Claim:
    """A pending marker this process created; see :func:`claim`."""

    store: KVStore
    key: bytes
    value: bytes
    identity: str | None
    #: the marker of a dead owner this claim replaced, or None
    took_over: dict[str, Any] | None = None
    #: what :func:`holding` runs (best effort) when the block fails, e.g. remove written data
    on_failure: Callable[[], object] | None = None


def claim(store: KVStore, key: bytes, what: str) -> Claim:
    """Create the pending marker ``key`` for this process, atomically.

    Parameters
    ----------
    store
        The store.
    key
        The marker key (``layout.pending_key(tag, shard)``).
    what
        What is being written, for messages (``"tag 'v1'"``).

    Raises
    ------
    TagExistsError
        Another live process holds the marker.
    """
    identity = store.identity()
    record = owner_record(what)
    value = json.dumps(record).encode()
    _ACTIVE.add(record["token"])
    try:
        return _claim(store, key, what, value, identity)
    except BaseException:
        _ACTIVE.discard(record["token"])
        raise


def _claim(store: KVStore, key: bytes, what: str, value: bytes, identity: str | None) -> Claim:
    for _ in range(8):
        if store.put_if_absent(key, value):
            return Claim(store, key, value, identity)
        cur = store.get(key)
        if cur is None:
            continue  # released meanwhile: try again
        if cur == value:  # our own write, whose reply was lost and retried
            return Claim(store, key, value, identity)
        other = parse_marker(cur)
        if is_stale(other):
            if store.compare_and_set(key, cur, value):
                return Claim(store, key, value, identity, took_over=other)
            continue
        raise TagExistsError(
            f"{what} is being saved by {describe_owner(other)}; wait for that save to finish "
            "and choose another tag, or, if that process is gone, run `tensorkv gc URL` "
            "(it collects saves of dead processes) and save again"
        )
    raise TagExistsError(f"{what}: the pending marker {key!r} keeps changing; retry the save")


def _restarted(store: KVStore, what: str, detail: str) -> StoreRestartedError:
    return StoreRestartedError(
        f"{what} was not published: {detail}. The server {store.url!r} restarted, failed over "
        "or lost writes during the save; nothing is visible. Retry the save (and make the "
        "server persistent: appendonly yes, or wait_replicas=N in the URL)"
    )


def verify(c: Claim, what: str, keys: list[bytes]) -> None:
    """Prove the claim still holds and the records ``keys`` exist on the same server.

    A no-op for local stores (``identity() is None``): their data was flushed to files this
    process wrote.
    """
    if c.identity is None:
        return
    store = c.store
    now = store.identity()
    if now != c.identity:
        raise _restarted(store, what, f"the server's run id changed from {c.identity} to {now}")
    if store.get(c.key) != c.value:
        raise _restarted(store, what, f"its pending marker {c.key!r} is gone")
    sizes = store.value_sizes(keys)  # the backend batches its requests
    if (sizes < 0).any():
        miss = np.flatnonzero(sizes < 0)
        raise _restarted(
            store, what, f"{miss.size} records it wrote are missing (first: {keys[miss[0]]!r})"
        )


def publish(c: Claim, what: str, key: bytes, value: bytes, keys: list[bytes]) -> None:
    """Create the manifest ``key`` once :func:`verify` passes; never overwrite one.

    Raises
    ------
    TagExistsError
        A manifest is there already.
    StoreRestartedError
        The server changed before or while the manifest was written (then it is removed).
    """
    store = c.store
    verify(c, what, keys)
    if not store.put_if_absent(key, value) and store.get(key) != value:
        raise TagExistsError(f"{what} already exists in {store.url!r}; choose another tag")
    if c.identity is not None:
        now = store.identity()
        if now != c.identity:
            with contextlib.suppress(Exception):
                store.compare_and_set(key, value, None)
            raise _restarted(store, what, f"the server's run id changed to {now}")
    store.flush()


@contextmanager
def holding(store: KVStore, key: bytes, what: str) -> Iterator[Claim]:
    """:func:`claim` ``key`` for the ``with`` block; :func:`release` it afterwards.

    Should the block fail, the claim's ``on_failure`` (set by the block once it has written
    something of its own) runs first, errors suppressed: the failure that ended the block is
    the one raised.
    """
    c = claim(store, key, what)
    try:
        yield c
    except BaseException:
        if c.on_failure is not None:
            with contextlib.suppress(Exception):
                c.on_failure()
        release(c)
        raise
    release(c)


def release(c: Claim) -> None:
    """Remove the pending marker if it is still this claim's (best effort).

    Should that fail (the store is unreachable), the marker stays, and counts as the marker
    of a dead save from now on (see :func:`owner_alive`).
    """
    _ACTIVE.discard(json.loads(c.value)["token"])
    with contextlib.suppress(Exception):
        c.store.compare_and_set(c.key, c.value, None)
