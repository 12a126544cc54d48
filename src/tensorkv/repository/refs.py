"""Reference counts of content-addressed tensors, changed under one short-lived lock.

``repo/r/<tensor id>`` on the metadata provider holds the number of live (or being-written)
models that use the tensor, as ASCII digits. Every change of counts happens while holding
``repo/lock/refs`` (taken with ``put_if_absent``, released with ``compare_and_set``), so a
put changes all its counts with one read and one batch write, whatever the number of its
tensors. A lock whose holder is gone (a dead pid on this host, or held longer than
:data:`LOCK_STALE_S`) was left by a killed process and is taken over.

A delete that takes a count to zero swaps it for a tombstone (``-<unix time>``), releases
the lock, deletes the data, then removes the tombstone; a put that finds a tombstone waits
for it to go (or takes over one older than :data:`STALE_TOMBSTONE_S`, left by a killed
deleter). So data is never deleted while a model that uses it is visible, and a put never
counts on data a delete is removing.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from tensorkv.errors import RepositoryError
from tensorkv.stores.base import KVStore

REFS = b"repo/r/"
LOCK = b"repo/lock/refs"
#: A lock held longer than this (seconds) was left by a killed process and is taken over.
LOCK_STALE_S = 30.0
#: A tombstone older than this (seconds) was left by a killed deleter and may be taken over.
STALE_TOMBSTONE_S = 60.0
#: Longest a caller waits for the lock or for a live tombstone to go (seconds).
WAIT_S = 60.0


def ref_key(tid: str) -> bytes:
    """Key of the reference count of tensor ``tid``."""
    return REFS + tid.encode()


def _dead_holder(token: bytes) -> bool:
    """Whether a lock token names a process that is gone (stale, or dead on this host)."""
    try:
        host, pid, _, when = token.decode().split(":")
    except ValueError:
        return True
    if time.time() - float(when) > LOCK_STALE_S:
        return True
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


@contextmanager
def locked(meta: KVStore) -> Iterator[None]:
    """Hold the reference-count lock of the repository whose metadata is ``meta``."""
    token = (f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}:"
             f"{time.time():.3f}").encode()
    deadline = time.monotonic() + WAIT_S
    pause = 0.0002
    while not meta.put_if_absent(LOCK, token):
        cur = meta.get(LOCK)
        if cur is not None and _dead_holder(cur):
            meta.compare_and_set(LOCK, cur, None)  # its holder was killed
            continue
        if time.monotonic() > deadline:
            raise RepositoryError(f"the reference-count lock {LOCK.decode()} of {meta.url!r} "
                                  f"stayed taken for {WAIT_S} s; retry")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    try:
        yield
    finally:
        meta.compare_and_set(LOCK, token, None)


def _count(v: bytes | None) -> int | None:
    """The count a value holds, None for a live tombstone, 0 for an absent key."""
    if v is None:
        return 0
    if v[:1] == b"-":
        if time.time() - float(v[1:] or b"0") > STALE_TOMBSTONE_S:
            return 0  # a killed deleter's: its data may be gone, the put rewrites it
        return None
    return int(v)


def incref(meta: KVStore, tids: Sequence[str], done: list[str] | None = None) -> list[int]:
    """Add one reference to each tensor; return each count before (0: the tensor is new).

    ``done`` is extended with the tensors counted (what to undo after a failure).
    """
    before: dict[str, int] = {}
    left = list(tids)
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
                meta.put_many(writes)
                if done is not None:
                    done.extend(k[len(REFS):].decode() for k, _ in writes)
        left = wait
        if left:
            if time.monotonic() > deadline:
                raise RepositoryError(f"{len(left)} tensors stayed being deleted for {WAIT_S} s "
                                      f"(e.g. {ref_key(left[0]).decode()}); retry the put")
            time.sleep(0.002)
    return [before[t] for t in tids]


def decref(meta: KVStore, tids: Sequence[str], delete_data: Callable[[list[str]], None]) -> int:
    """Drop one reference to each tensor; delete the data of those no model uses any more.

    Returns the number of tensors retired.
    """
    dead: list[tuple[bytes, str, bytes]] = []
    with locked(meta):
        cur = meta.get_many([ref_key(t) for t in tids])
        writes = []
        tomb = b"-%.3f" % time.time()
        for t, v in zip(tids, cur, strict=True):
            n = _count(v)
            if not n:
                continue  # already retired, or being retired by someone else
            if n > 1:
                writes.append((ref_key(t), b"%d" % (n - 1)))
            else:
                writes.append((ref_key(t), tomb))
                dead.append((ref_key(t), t, tomb))
        if writes:
            meta.put_many(writes)
    if dead:
        delete_data([t for _, t, _ in dead])
        with locked(meta):
            cur = meta.get_many([k for k, _, _ in dead])
            gone = [k for (k, _, tb), v in zip(dead, cur, strict=True) if v == tb]
            if gone:
                meta.delete_many(gone)
    return len(dead)


def set_count(meta: KVStore, tid: str, expected: bytes | None, count: int,
              delete_data: Callable[[list[str]], None]) -> bool:
    """Set a count from ``expected`` to ``count`` (0 retires the tensor); False if it moved."""
    key = ref_key(tid)
    tomb = b"-%.3f" % time.time()
    with locked(meta):
        if meta.get(key) != expected:
            return False
        if count > 0:
            meta.put(key, b"%d" % count)
            return True
        meta.put(key, tomb)
    delete_data([tid])
    with locked(meta):
        if meta.get(key) == tomb:
            meta.delete(key)
    return True
