"""A writer or deleter killed at every store call leaves a consistent repository."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from tensorkv import Repository

from .kill_worker import graph, state

ROOT = Path(__file__).resolve().parents[1]


def _run(url: str, what: str, k: int) -> bool:
    """Run the worker; return whether it finished (False: killed at call k)."""
    p = subprocess.run([sys.executable, "-m", "repository.kill_worker", url, what, str(k)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode in (0, -9), p.stderr
    return p.returncode == 0


def _consistent(url: str, keep: str, victim_alive: bool | None) -> None:
    with Repository(url) as repo:
        names = [r["name"] for r in repo.list()]
        if victim_alive is not None:
            assert ("victim" in names) == victim_alive
        got = repo.get(keep)
        for k, v in state(4, 0).items():
            np.testing.assert_array_equal(got[k], v)
        repo.gc(grace=0)
        report = repo.check(verify=True)
        assert report["ok"], report["problems"]
        want = {e["id"] for r in repo.list() for e in repo.manifest(r["id"])["tensors"].values()}
        assert repo.stats()["tensors"] == len(want)  # no leaked tensor


def test_killed_put_at_every_call(tmp_path):
    """Every other store call (odd k) is a kill point: half the processes, same coverage."""
    k = 1
    while True:
        url = f"lmdb://{tmp_path}/put{k}"
        with Repository(url) as repo:
            keep = repo.put(graph(4), state(4, 0), name="keep")
        finished = _run(url, "put", k)
        _consistent(url, keep, True if finished else None)
        if finished:
            break
        k += 2
    assert k > 5  # the put made several store calls, each a kill point


def test_killed_delete_at_every_call(tmp_path):
    k = 1
    while True:
        url = f"lmdb://{tmp_path}/del{k}"
        with Repository(url) as repo:
            keep = repo.put(graph(4), state(4, 0), name="keep")
            repo.put(graph(4), state(4, 1), name="victim")
        finished = _run(url, "delete", k)
        _consistent(url, keep, False if finished else None)
        if finished:
            break
        k += 2
    assert k > 3
