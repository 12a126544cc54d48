"""SIGKILL a process while its background save (``blocking=False``) writes and training goes on.

``bg_saver.py`` saves ``t0``, then, in forked children, starts the save of ``t1`` in the
background and keeps training a tiered table, killing itself at seeded store events of that
save. After each kill: ``t0`` loads as it was saved, ``t1`` is absent or loads as the unkilled
run saved it (a snapshot of the moment the save was called, not of the training after it),
``check`` finds no damage and ``gc`` leaves exactly ``t0``'s records. A process that exits
with a background save still writing waits for it (default) or abandons it
(``TENSORKV_SAVE_AT_EXIT=abandon``): then no ``t1`` appears and nothing of it is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

import tensorkv
from tensorkv.testing.tablecheck import assert_same_rows, table_rows

from .conftest import make_url, rng_for
from .test_kill_saver import kill_points, store_keys

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bg_saver.py")
POINTS = 8


class Worker:
    """The ``bg_saver.py`` process of some stores."""

    def __init__(self, urls: list[str], log: str) -> None:
        self.log = log
        self._err = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, WORKER, *urls], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True)
        assert self._readline() == "ready", self.stderr()

    def _readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def stderr(self) -> str:
        self._err.flush()
        with open(self.log, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def save(self, url: str, kill_at: int, mode: str = "before") -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"url": url, "kill_at": kill_at, "mode": mode}) + "\n")
        self.proc.stdin.flush()
        line = self._readline()
        assert line, f"bg_saver.py died: {self.stderr()}"
        out = json.loads(line)
        assert out["status"] in ("killed", "completed"), f"{out}: {self.stderr()}"
        return out

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._err.close()


def contents(url: str, tag: str) -> dict[str, Any]:
    got = tensorkv.load(None, url, tag)
    return {"t": table_rows(got["t"], chunk_rows=1 << 30), "w": got["w"]}


def same(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert_same_rows(got["t"], want["t"], what, seq=False)
    assert got["w"].tobytes() == want["w"].tobytes(), f"{what}: the dense tensor differs"


def check_store(url: str, want: dict[str, Any], baseline: set[bytes], what: str) -> None:
    tags = tensorkv.list_tags(url)
    assert tags[:1] == ["t0"] and set(tags) <= {"t0", "t1"}, f"{what}: tags {tags}"
    for tag in tags:
        same(contents(url, tag), want[tag], f"{what}: tag {tag}")
    rep = tensorkv.check(url, verify=True)
    assert rep.tags == tags and not rep.corrupt, f"{what}: check found {rep.as_dict()}"
    tensorkv.gc(url, grace=0)
    if "t1" in tags:
        tensorkv.delete_tag(url, "t1")
        tensorkv.gc(url, grace=0)
    rep = tensorkv.check(url, grace=0)
    assert rep.ok and not rep.pending, f"{what}: after gc, check found {rep.as_dict()}"
    assert store_keys(url) == baseline, f"{what}: records beyond t0's are left"


@pytest.mark.slow  # about 8 s: nine forked children per backend
@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_sigkill_while_a_background_save_writes(backend, tmp_path, request):
    ref_url = make_url("lmdb", tmp_path, request)
    url = make_url(backend, tmp_path, request)
    worker = Worker([ref_url, url], str(tmp_path / "bg_saver.log"))
    try:
        full = worker.save(ref_url, 0)  # unkilled: the reference t1, and how many events
        assert full["status"] == "completed"
        events = full["events"]
        assert events >= POINTS, f"a background save made only {events} store events"
        want = {tag: contents(ref_url, tag) for tag in ("t0", "t1")}
        tensorkv.gc(url, grace=0)
        baseline = store_keys(url)
        # A background save writes as many blocks as the training after it leaves rows
        # copied aside (a few events more or less): the points are drawn from its first 3/4,
        # and a save that finishes first must have saved t1 as the reference did.
        killed = 0
        for n, mode in kill_points(f"bgkill:{backend}", events * 3 // 4, POINTS):
            what = f"{backend}: SIGKILL {mode} store event {n} of about {events}"
            out = worker.save(url, n, mode)
            killed += out["status"] == "killed"
            check_store(url, want, baseline, what)
        assert killed >= POINTS - 1, f"only {killed} of {POINTS} saves were killed"
    finally:
        worker.close()
    assert rng_for("bgkill")  # the seeded choice of kill points (conftest.SEED)


@pytest.mark.parametrize("policy", ["wait", "abandon"])
def test_an_exiting_process_waits_for_or_abandons_its_background_save(policy, tmp_path,
                                                                       request):
    url = make_url("lmdb", tmp_path, request)
    env = {**os.environ, "TENSORKV_SAVE_AT_EXIT": policy}
    proc = subprocess.run([sys.executable, WORKER, "exit", url], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "exiting" in proc.stdout, proc.stderr[-3000:]
    tags = tensorkv.list_tags(url)
    rep = tensorkv.check(url, verify=True)
    assert not rep.corrupt and not rep.pending, rep.as_dict()
    if policy == "wait":
        assert tags == ["t0", "t1"]
        return
    assert tags == ["t0"]
    baseline = store_keys(url)
    tensorkv.gc(url, grace=0)
    assert store_keys(url) == baseline, "the abandoned save left records behind"
