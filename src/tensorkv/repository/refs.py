"""Reference counts of content-addressed tensors, updated with compare-and-set.

``repo/r/<tensor id>`` on the metadata provider holds the number of live (or being-written)
models that use the tensor, as ASCII digits. A delete that takes a count to zero first swaps
it for a tombstone (``-<unix time>``), deletes the data, then removes the tombstone; a put
that finds a tombstone waits for it to go (or takes over one older than
:data:`STALE_TOMBSTONE_S`, left by a killed deleter). So data is never deleted while a model
that uses it is visible, and a put never counts on data a delete is removing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from tensorkv.errors import RepositoryError
from tensorkv.stores.base import KVStore

REFS = b"repo/r/"
#: A tombstone older than this (seconds) was left by a killed deleter and may be taken over.
STALE_TOMBSTONE_S = 60.0
#: Longest a put waits for a live tombstone to go (seconds).
WAIT_S = 30.0


def ref_key(tid: str) -> bytes:
    """Key of the reference count of tensor ``tid``."""
    return REFS + tid.encode()


def _count(v: bytes | None) -> int | None:
    """The count a value holds, None for a tombstone, 0 for an absent key."""
    if v is None:
        return 0
    if v[:1] == b"-":
        return None
    return int(v)


def _stale(v: bytes) -> bool:
    return time.time() - float(v[1:] or b"0") > STALE_TOMBSTONE_S


def incref(meta: KVStore, tids: Sequence[str], done: list[str] | None = None) -> list[int]:
    """Add one reference to each tensor; return each count before (0: the tensor is new).

    ``done`` is extended with each tensor as it is counted (what to undo after a failure).
    """
    keys = [ref_key(t) for t in tids]
    cur = meta.get_many(keys)
    before = []
    for key, v in zip(keys, cur, strict=True):
        deadline = time.monotonic() + WAIT_S
        while True:
            n = _count(v)
            if n is None and v is not None and _stale(v):
                n = 0  # a killed deleter's tombstone: its data may be gone; rewrite it
            if n is not None and meta.compare_and_set(key, v, b"%d" % (n + 1)):
                before.append(n)
                if done is not None:
                    done.append(key[len(REFS):].decode())
                break
            if n is None:
                if time.monotonic() > deadline:
                    raise RepositoryError(f"tensor {key.decode()} stayed being deleted for "
                                          f"{WAIT_S} s; retry the put")
                time.sleep(0.002)
            v = meta.get(key)
    return before


def decref(meta: KVStore, tids: Sequence[str], delete_data: Callable[[list[str]], None]) -> int:
    """Drop one reference to each tensor; delete the data of those no model uses any more.

    Returns the number of tensors retired.
    """
    keys = [ref_key(t) for t in tids]
    cur = meta.get_many(keys)
    dead: list[tuple[bytes, str, bytes]] = []
    for key, tid, v in zip(keys, tids, cur, strict=True):
        while True:
            n = _count(v)
            if n is None or n == 0:
                break  # already retired (or being retired by someone else)
            if n > 1:
                if meta.compare_and_set(key, v, b"%d" % (n - 1)):
                    break
            else:
                tomb = b"-%.3f" % time.time()
                if meta.compare_and_set(key, v, tomb):
                    dead.append((key, tid, tomb))
                    break
            v = meta.get(key)
    if dead:
        delete_data([t for _, t, _ in dead])
        for key, _, tomb in dead:
            meta.compare_and_set(key, tomb, None)
    return len(dead)


def set_count(meta: KVStore, tid: str, expected: bytes | None, count: int,
              delete_data: Callable[[list[str]], None]) -> bool:
    """Set a count from ``expected`` to ``count`` (0 retires the tensor); False if it moved."""
    key = ref_key(tid)
    if count > 0:
        return meta.compare_and_set(key, expected, b"%d" % count)
    tomb = b"-%.3f" % time.time()
    if expected is not None and not meta.compare_and_set(key, expected, tomb):
        return False
    delete_data([tid])
    if expected is not None:
        meta.compare_and_set(key, tomb, None)
    return True
