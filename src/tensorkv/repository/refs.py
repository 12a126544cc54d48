"""Reference counts of content-addressed tensors, changed under one short-lived lock.

``repo/r/<tensor id>`` on the metadata provider holds the number of live (or being-written)
models that use the tensor, as ASCII digits. Every change of counts happens while holding
``repo/lock/refs`` (taken with ``put_if_absent``, released with ``compare_and_set``), so a
put changes all its counts with one read and one batch write, whatever the number of its
tensors.

A delete that takes a count to zero swaps it for a tombstone (``-`` and its owner record),
releases the lock, deletes the data, then removes the tombstone; a put that finds a tombstone
waits for it to go. Before each destructive step the deleter reads its tombstones again and
deletes the data only of those still its own (a fence). So data is never deleted while a
model that uses it is visible, and a put never counts on data a delete is removing.

The lock and the tombstones name their owner as checkpoint claims do (host, pid, process
start time, a random token, :func:`tensorkv.checkpoint.claims.owner_record`), and follow the
claims' liveness rules: an owner on this host is alive exactly as long as its process runs
(a paused or slow process keeps what it holds, however long), a dead one's is taken over at
once; an owner on another host, which cannot be checked, is presumed alive for
:data:`LOCK_STALE_S` (the lock) or :data:`STALE_TOMBSTONE_S` (a tombstone).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from tensorkv.checkpoint import claims
from tensorkv.errors import RepositoryError
from tensorkv.stores.base import KVStore

REFS = b"repo/r/"
LOCK = b"repo/lock/refs"
#: A lock held by a process on another host is taken over once it is this old (seconds).
LOCK_STALE_S = 30.0
#: A tombstone of a deleter on another host is taken over once it is this old (seconds).
STALE_TOMBSTONE_S = 3600.0
#: Longest a caller waits for the lock or for a live tombstone to go (seconds).
WAIT_S = 60.0

#: ``fence(tids)``: those of ``tids`` whose data may still be deleted (their tombstones are
#: still the caller's); a data deleter calls it right before each destructive step.
Fence = Callable[[list[str]], list[str]]
#: ``delete_data(tids, fence)``: delete the chunks of tensors, asking ``fence`` before each
#: destructive step.
DeleteData = Callable[[list[str], Fence], None]

_HELD: set[str] = set()  # tokens of the locks and tombstones this process holds now
_HELD_LOCK = threading.Lock()


def ref_key(tid: str) -> bytes:
    """Key of the reference count of tensor ``tid``."""
    return REFS + tid.encode()


def _owner(what: str) -> tuple[dict[str, Any], bytes]:
    """A new owner record of this process (held until :func:`_drop`), and its JSON."""
    info = claims.owner_record(what)
    with _HELD_LOCK:
        _HELD.add(info["token"])
    return info, json.dumps(info, separators=(",", ":")).encode()


def _drop(info: dict[str, Any]) -> None:
    with _HELD_LOCK:
        _HELD.discard(info["token"])


def _gone(info: dict[str, Any], grace: float) -> bool:
    """Whether the owner of a lock or tombstone is gone (claims' rules, see the docstring)."""
    pid = info.get("pid")
    if (pid == os.getpid() and info.get("host") == socket.gethostname()
            and info.get("proc_start") == claims.process_start(os.getpid())):
        return info.get("token") not in _HELD  # ours: alive while this process holds it
    return claims.is_stale(info, grace)


def _parse(raw: bytes) -> dict[str, Any] | None:
    """The owner record in a lock token or a tombstone (after its ``-``), or None (legacy)."""
    if raw[:1] != b"{":
        return None
    info = claims.parse_marker(raw)
    return info or {}


def _lock_gone(token: bytes) -> bool:
    """Whether the holder of the lock token ``token`` is gone."""
    info = _parse(token)
    if info is not None:
        return _gone(info, LOCK_STALE_S)
    try:  # host:pid:uuid:time, written by earlier versions
        host, pid, _, when = token.decode().split(":")
    except ValueError:
        return True
    if host != socket.gethostname():
        return time.time() - float(when) > LOCK_STALE_S
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _tombstone_gone(v: bytes) -> bool:
    """Whether the deleter that wrote tombstone ``v`` is gone (its tombstone may be taken)."""
    info = _parse(v[1:])
    if info is not None:
        return _gone(info, STALE_TOMBSTONE_S)
    try:  # -<unix time>, written by earlier versions
        return time.time() - float(v[1:] or b"0") > STALE_TOMBSTONE_S
    except ValueError:
        return True


def _holder(raw: bytes | None) -> str:
    """Who holds a lock or a tombstone, for messages."""
    info = _parse(raw) if raw else None
    return claims.describe_owner(info) if info else "a process of an earlier version"


@contextmanager
def locked(meta: KVStore) -> Iterator[None]:
    """Hold the reference-count lock of the repository whose metadata is ``meta``.

    Raises
    ------
    RepositoryError
        The lock stayed held by a live process for :data:`WAIT_S` seconds (the message names
        it).
    """
    info, token = _owner("the reference-count lock")
    try:
        deadline = time.monotonic() + WAIT_S
        pause = 0.0002
        while not meta.put_if_absent(LOCK, token):
            cur = meta.get(LOCK)
            if cur is not None and _lock_gone(cur):
                meta.compare_and_set(LOCK, cur, None)  # its holder was killed
                continue
            if time.monotonic() > deadline:
                raise RepositoryError(
                    f"the reference-count lock {LOCK.decode()} of {meta.url!r} stayed held for "
                    f"{WAIT_S} s by {_holder(cur)}; let it finish (or end that process), then "
                    "retry")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        try:
            yield
        finally:
            meta.compare_and_set(LOCK, token, None)
    finally:
        _drop(info)


def _count(v: bytes | None) -> int | None:
    """The count a value holds, None for a live tombstone, 0 for an absent key or a dead one."""
    if v is None:
        return 0
    if v[:1] == b"-":
        return 0 if _tombstone_gone(v) else None  # a killed deleter's: the put rewrites
    return int(v)


def incref(meta: KVStore, tids: Sequence[str], done: list[str] | None = None,
           first: Sequence[tuple[bytes, bytes]] = ()) -> list[int]:
    """Add one reference to each tensor; return each count before (0: the tensor is new).

    ``done`` is extended with the tensors counted (what to undo after a failure). ``first``:
    records written ahead of the first counts, in the same batch (a put's intent).
    """
    before: dict[str, int] = {}
    left = list(tids)
    lead = list(first)
    deadline = time.monotonic() + WAIT_S
    while left:
        with locked(meta):
            cur = meta.get_many([ref_key(t) for t in left])
            writes = []
            wait = []
            for t, v in zip(left, cur, strict=True):
                n = _count(v)
                if n is None:
                    wait.append(t)
                else:
                    before[t] = n
                    writes.append((ref_key(t), b"%d" % (n + 1)))
            if writes:
                meta.put_many(lead + writes)
                lead = []
                if done is not None:
                    done.extend(k[len(REFS):].decode() for k, _ in writes)
        left = wait
        if left:
            if time.monotonic() > deadline:
                v = meta.get(ref_key(left[0]))
                raise RepositoryError(
                    f"{len(left)} tensors stayed being deleted for {WAIT_S} s (e.g. "
                    f"{ref_key(left[0]).decode()}, by {_holder(v[1:] if v else None)}); retry "
                    "the put once that delete is done")
            time.sleep(0.002)
    return [before[t] for t in tids]


def _fence(meta: KVStore, tombs: dict[str, bytes]) -> Fence:
    """A fence over tombstones ``tid -> value`` this process wrote (see :data:`Fence`)."""
    def still_ours(tids: list[str]) -> list[str]:
        cur = meta.get_many([ref_key(t) for t in tids])
        return [t for t, v in zip(tids, cur, strict=True) if v == tombs[t]]
    return still_ours


def _retire(meta: KVStore, tombs: dict[str, bytes], delete_data: DeleteData) -> int:
    """Delete the data under this process's tombstones ``tombs``, then the tombstones.

    Returns how many tombstones were still this process's at the end (tensors retired);
    the others were taken over by a put, which rewrote their data.
    """
    delete_data(sorted(tombs), _fence(meta, tombs))
    with locked(meta):
        keys = [ref_key(t) for t in tombs]
        cur = meta.get_many(keys)
        gone = [k for k, t, v in zip(keys, tombs, cur, strict=True) if v == tombs[t]]
        if gone:
            meta.delete_many(gone)
    return len(gone)


def decref(meta: KVStore, tids: Sequence[str], delete_data: DeleteData) -> int:
    """Drop one reference to each tensor; delete the data of those no model uses any more.

    Returns the number of tensors retired.
    """
    info, owner = _owner("a delete")
    try:
        tombs: dict[str, bytes] = {}
        with locked(meta):
            cur = meta.get_many([ref_key(t) for t in tids])
            writes = []
            tomb = b"-" + owner
            for t, v in zip(tids, cur, strict=True):
                n = _count(v)
                if not n:
                    continue  # already retired, or being retired by someone else
                if n > 1:
                    writes.append((ref_key(t), b"%d" % (n - 1)))
                else:
                    writes.append((ref_key(t), tomb))
                    tombs[t] = tomb
            if writes:
                meta.put_many(writes)
        return _retire(meta, tombs, delete_data) if tombs else 0
    finally:
        _drop(info)


def set_count(meta: KVStore, tid: str, expected: bytes | None, count: int,
              delete_data: DeleteData) -> bool:
    """Set a count from ``expected`` to ``count`` (0 retires the tensor); False if it moved."""
    key = ref_key(tid)
    info, owner = _owner("a repository gc")
    try:
        with locked(meta):
            if meta.get(key) != expected:
                return False
            if count > 0:
                meta.put(key, b"%d" % count)
                return True
            meta.put(key, b"-" + owner)
        _retire(meta, {tid: b"-" + owner}, delete_data)
        return True
    finally:
        _drop(info)
