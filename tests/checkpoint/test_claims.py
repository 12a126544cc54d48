"""Claims: owner liveness, stale markers, take-over, and publish's refusals."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tensorkv.checkpoint import claims
from tensorkv.errors import StoreRestartedError, TagExistsError
from tensorkv.stores.memory import MemoryStore


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_process_start_of_this_and_of_no_process():
    assert isinstance(claims.process_start(os.getpid()), int)
    assert claims.process_start(_dead_pid()) is None


def test_owner_alive():
    me = claims.owner_record("x")
    assert claims.owner_alive({**me, "host": "elsewhere"}) is None
    assert claims.owner_alive({**me, "pid": "nope"}) is None
    assert claims.owner_alive({**me, "pid": _dead_pid()}) is False
    assert claims.owner_alive(me) is False  # ours, but no live claim holds its token
    parent = {"host": socket.gethostname(), "pid": os.getppid(),
              "proc_start": claims.process_start(os.getppid())}
    assert claims.owner_alive(parent) is True
    assert claims.owner_alive({**parent, "proc_start": -1}) is False  # the pid was reused


def test_parse_and_describe_markers():
    assert claims.parse_marker(b"not json") == {}
    assert claims.parse_marker(b"[1, 2]") == {}
    far = {"host": "elsewhere", "pid": 7, "started": 0.0}
    want = "pid 7 on host elsewhere since 1970-01-01 00:00:00 UTC (on another host)"
    assert claims.describe_owner(far) == want
    assert "an unknown time" in claims.describe_owner({})
    assert claims.is_stale(far, grace=60)  # older than the grace period
    assert not claims.is_stale({**far, "started": time.time()}, grace=60)


def test_an_old_claim_from_another_host_is_taken_over():
    store = MemoryStore()
    old = {"host": "elsewhere", "pid": 7, "started": time.time() - 7200, "token": "t"}
    store.put(b"ckpt/p/a/0", json.dumps(old).encode())
    c = claims.claim(store, b"ckpt/p/a/0", "tag 'a'")
    assert c.took_over == old
    claims.release(c)
    assert store.get(b"ckpt/p/a/0") is None


def test_a_young_claim_from_another_host_is_respected():
    store = MemoryStore()
    young = {"host": "elsewhere", "pid": 7, "started": time.time(), "token": "t"}
    store.put(b"ckpt/p/a/0", json.dumps(young).encode())
    with pytest.raises(TagExistsError, match="pid 7 on host elsewhere .*on another host"):
        claims.claim(store, b"ckpt/p/a/0", "tag 'a'")


class _Moving(MemoryStore):
    """A memory store whose server identity changes after ``after`` reads of it."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after, self.reads = after, 0

    def identity(self) -> str | None:
        self.reads += 1
        return "one" if self.reads <= self.after else "two"


def test_publish_removes_a_manifest_written_to_a_changed_server():
    store = _Moving(after=2)  # the claim and verify see "one", the check after sees "two"
    c = claims.claim(store, b"p", "tag 'a'")
    with pytest.raises(StoreRestartedError, match="run id changed to two"):
        claims.publish(c, "tag 'a'", b"m", b"doc", [])
    assert store.get(b"m") is None


def test_publish_never_overwrites_a_manifest():
    store = MemoryStore()
    c = claims.claim(store, b"p", "tag 'a'")
    store.put(b"m", b"someone else's")
    with pytest.raises(TagExistsError, match="already exists"):
        claims.publish(c, "tag 'a'", b"m", b"mine", [])
    assert store.get(b"m") == b"someone else's"
