"""A deleting process paused (SIGSTOP) at its most delicate points loses no put's data.

A paused process is alive: it keeps the reference-count lock and its tombstones however
long it sleeps, and a put meeting them waits. Only an owner that cannot be checked (another
host) loses its tombstones once they are old; the deleter then deletes nothing of the data
the put wrote when it resumes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tensorkv import Repository
from tensorkv.errors import RepositoryError
from tensorkv.repository import refs

ROOT = Path(__file__).resolve().parents[1]
GRAPH = {"nodes": [{"name": "x", "op": "input", "type": "input"}]}
STATE = {"w": np.arange(3000, dtype=np.float32)}


def _paused_deleter(url: str, mid: str, where: str, host: str = "") -> subprocess.Popen:
    """Start a process deleting ``mid``; return once it has stopped itself at ``where``."""
    p = subprocess.Popen([sys.executable, "-m", "repository.pause_worker", url, mid, where,
                          host], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    _, status = os.waitpid(p.pid, os.WUNTRACED)  # returns when it stops (or ends)
    if not os.WIFSTOPPED(status):
        p.returncode = -1
        pytest.fail(f"the deleter ended before stopping: {p.stderr.read() if p.stderr else ''}")
    return p


def _resume(p: subprocess.Popen) -> str:
    """Let a stopped deleter go on; return what it printed (the tensors it retired)."""
    os.kill(p.pid, signal.SIGCONT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return out.strip()


def _intact(url: str, mid: str) -> None:
    with Repository(url) as repo:
        np.testing.assert_array_equal(repo.read_tensor(mid, "w"), STATE["w"])
        report = repo.check(verify=True)
        assert report["ok"], report["problems"]


def test_a_put_waits_for_the_tombstones_of_a_paused_deleter(lmdb_url, monkeypatch):
    with Repository(lmdb_url) as repo:
        old = repo.put(GRAPH, STATE)
    p = _paused_deleter(lmdb_url, old, "data")  # its tensor's count is its tombstone now
    try:
        monkeypatch.setattr(refs, "STALE_TOMBSTONE_S", 0.0)  # however old they look
        monkeypatch.setattr(refs, "WAIT_S", 0.5)
        with Repository(lmdb_url) as repo, pytest.raises(
                RepositoryError, match=rf"being deleted .*pid {p.pid} .*\(running\)"):
            repo.put(GRAPH, STATE)
        assert _resume(p) == "1"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    with Repository(lmdb_url) as repo:
        new = repo.put(GRAPH, STATE)  # the tensor is written again
    _intact(lmdb_url, new)


def test_a_deleter_whose_tombstones_were_taken_over_deletes_no_data(lmdb_url, monkeypatch):
    with Repository(lmdb_url) as repo:
        old = repo.put(GRAPH, STATE)
    p = _paused_deleter(lmdb_url, old, "data", host="elsewhere")  # cannot be checked
    try:
        monkeypatch.setattr(refs, "STALE_TOMBSTONE_S", 0.0)  # its tombstones look abandoned
        with Repository(lmdb_url) as repo:
            new = repo.put(GRAPH, STATE)  # takes them over, writes the data again
        assert _resume(p) == "0"  # its fence saw the put's counts: it deleted nothing
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    _intact(lmdb_url, new)


def test_a_paused_lock_holder_keeps_the_lock(lmdb_url, monkeypatch):
    with Repository(lmdb_url) as repo:
        old = repo.put(GRAPH, STATE)
    p = _paused_deleter(lmdb_url, old, "lock")
    try:
        monkeypatch.setattr(refs, "LOCK_STALE_S", 0.0)  # however long it has held it
        monkeypatch.setattr(refs, "WAIT_S", 0.5)
        other = {"w": np.ones(10, np.float32)}
        with Repository(lmdb_url) as repo, pytest.raises(
                RepositoryError, match=rf"lock .*held .*pid {p.pid} .*\(running\)"):
            repo.put(GRAPH, other)
        assert _resume(p) == "1"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    with Repository(lmdb_url) as repo:
        new = repo.put(GRAPH, other)
        np.testing.assert_array_equal(repo.read_tensor(new, "w"), other["w"])
        assert repo.check(verify=True)["ok"]
