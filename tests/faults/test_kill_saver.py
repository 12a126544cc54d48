"""SIGKILL a saving process at store writes spread over the save, on every backend.

The store holds ``t0`` (full) and ``t1`` (incremental); a forked child saves ``t2``
(incremental, dense tensors and an EmbeddingTable) and kills itself at its N-th store write
or flush, before or after the backend ran it (see ``saver.py``). After each kill: ``t0`` and
``t1`` load bit-identical, ``t2`` is absent or loads bit-identical, ``check`` finds no damage
in a visible tag, and ``gc`` with no grace leaves exactly the records of the visible tags.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

import tensorkv

from .conftest import SEED, rng_for
from .model import assert_loads_as, expected

SAVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "saver.py")
POINTS = 20  # kill points per backend


class Saver:
    """The ``saver.py`` process of one store: saves t0 and t1, then t2 once per command."""

    def __init__(self, url: str, log: str) -> None:
        self.log = log
        self._err = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, SAVER, url], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True)
        assert self._readline() == "ready", self.stderr()

    def _readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def stderr(self) -> str:
        """The tail of the process's stderr."""
        self._err.flush()
        with open(self.log, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def save(self, kill_at: int, mode: str = "before") -> dict[str, Any]:
        """Save t2 in a child killed at store event ``kill_at`` (0: never); its report."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"kill_at": kill_at, "mode": mode}) + "\n")
        self.proc.stdin.flush()
        line = self._readline()
        assert line, f"saver.py died: {self.stderr()}"
        out = json.loads(line)
        assert out["status"] in ("killed", "completed"), f"{out}: {self.stderr()}"
        return out

    def close(self) -> None:
        """End the process (stdin closed: it exits)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._err.close()


def store_keys(url: str) -> set[bytes]:
    """Every key of the store."""
    with tensorkv.open_store(url) as store:
        return {bytes(k) for k in store.scan(keys_only=True)}


def kill_points(case: str, events: int, n: int) -> list[tuple[int, str]]:
    """``n`` (event, mode) pairs: one event drawn from each of ``n`` equal spans of the save."""
    rng = rng_for(case)
    out = []
    for i in range(n):
        lo = 1 + (i * events) // n
        hi = max(lo, ((i + 1) * events) // n)
        out.append((rng.randint(lo, hi), rng.choice(("before", "after"))))
    return out


def check_store(url: str, want: dict[str, Any], baseline: set[bytes], what: str) -> None:
    """The rule after a crash: visible tags load bit-identical, check and gc agree."""
    tags = tensorkv.list_tags(url)
    assert tags[:2] == ["t0", "t1"] and set(tags) <= {"t0", "t1", "t2"}, f"{what}: tags {tags}"
    for tag in tags:
        assert_loads_as(tensorkv.load(None, url, tag), want[tag], f"{what}: tag {tag}")
    rep = tensorkv.check(url, verify=True)
    assert rep.tags == tags and not rep.corrupt, f"{what}: check found {rep.as_dict()}"
    tensorkv.gc(url, grace=0)
    rep = tensorkv.check(url, grace=0)
    assert rep.ok and not rep.pending, f"{what}: after gc, check found {rep.as_dict()}"
    keys = store_keys(url)
    if "t2" in tags:  # a finished save: its records are what the rest holds beyond baseline
        assert keys >= baseline, f"{what}: gc removed {sorted(baseline - keys)[:5]}"
        tensorkv.delete_tag(url, "t2")
        tensorkv.gc(url, grace=0)
        keys = store_keys(url)
    assert keys == baseline, (
        f"{what}: after gc the store holds {sorted(keys - baseline)[:5]} beyond the records "
        f"of t0 and t1, and lacks {sorted(baseline - keys)[:5]}"
    )


@pytest.mark.parametrize("seed", [SEED], ids=lambda s: f"seed{s}")
def test_sigkill_during_an_incremental_save(backend, url, seed, tmp_path):
    want = expected()
    saver = Saver(url, str(tmp_path / "saver.log"))
    try:
        tensorkv.gc(url, grace=0)
        baseline = store_keys(url)
        full = saver.save(0)  # unkilled: how many store events a save of t2 makes
        assert full["status"] == "completed"
        events = full["events"]
        assert events >= POINTS, f"a save of t2 made only {events} store writes and flushes"
        check_store(url, want, baseline, f"{backend}, unkilled save")
        for n, mode in kill_points(f"kill:{backend}", events, POINTS):
            what = f"{backend}, seed {seed}: SIGKILL {mode} store event {n} of {events}"
            out = saver.save(n, mode)
            assert out["status"] == "killed", f"{what}: the save finished after {out['events']}"
            check_store(url, want, baseline, what)
    finally:
        saver.close()
