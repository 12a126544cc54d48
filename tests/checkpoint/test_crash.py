"""SIGKILL a process that saves tag after tag: earlier tags stay bit-identical, no half tag.

The worker (``crash_worker.py``) kills itself at a store write or flush drawn from a seeded
generator (the seed is in the test id; ``TENSORKV_FAULT_SEED`` overrides it), so a failure
is reproduced by running the same test id again. Every visible tag is compared bit for bit:
dense tensors and every table row field (keys, values, optimizer slots, frequency, version).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

import tensorkv
from tensorkv.checkpoint import layout
from tensorkv.errors import StoreNotFoundError
from tensorkv.testing.tablecheck import assert_bits_equal, assert_same_rows, table_rows

from .crash_worker import dense, tables_from

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_worker.py")
SEED = int(os.environ.get("TENSORKV_FAULT_SEED", "20240611"))


def _run_until_killed(url: str, first: int, kill_at: int, mode: str) -> list[str]:
    """Run the worker until it kills itself; the tags it reported saved."""
    proc = subprocess.run([sys.executable, WORKER, url, str(first), str(kill_at), mode],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("saved ")]


class Expected:
    """The content of tag ``k<i>``, rebuilt by replaying the worker's updates."""

    def __init__(self) -> None:
        self._rows: dict[int, dict] = {}
        self._replays: dict[int, Iterator[tuple[int, Any]]] = {}

    def _fill(self, first: int, last: int) -> None:
        replay = self._replays.setdefault(first, tables_from(first))
        for i, table in replay:
            self._rows[i] = table_rows(table, chunk_rows=1 << 20)
            if i >= last:
                return

    def assert_tag(self, got: dict, tag: str, first: int, what: str) -> None:
        """Assert that a loaded tag holds what the worker saved under it."""
        i = int(tag[1:])
        if i not in self._rows:
            self._fill(first, i)
        want = dense(i)
        for name in ("w", "b"):
            assert_bits_equal(got[name], want[name], f"{what}: tag {tag}: {name}")
        assert_same_rows(table_rows(got["emb"], chunk_rows=1 << 20), self._rows[i],
                         what=f"{what}: tag {tag}: table", seq=False)


@pytest.mark.parametrize("seed", [SEED], ids=lambda s: f"seed{s}")
@pytest.mark.timeout(300)
def test_sigkill_during_saves(shared_url, seed):
    rng = random.Random(f"{seed}:{shared_url.split(':', 1)[0]}")
    expected = Expected()
    for round_ in range(4):
        first = 1_000_000 * round_  # tag ranges of different rounds never meet
        kill_at, mode = rng.randint(1, 60), rng.choice(("before", "after"))
        what = f"seed {seed}, round {round_}: SIGKILL {mode} store event {kill_at}"
        done = _run_until_killed(shared_url, first, kill_at, mode)
        visible = tensorkv.list_tags(shared_url)
        # every reported tag is visible; a visible tag was either reported or finished just
        # before the kill (its manifest was written, the print was not)
        assert set(done) <= set(visible), what
        for tag in visible:
            start = int(tag[1:]) // 1_000_000 * 1_000_000
            expected.assert_tag(tensorkv.load(None, shared_url, tag), tag, start, what)
        rep = tensorkv.checkpoint.check(shared_url)
        assert rep.tags == visible and not rep.corrupt, f"{what}: {rep.as_dict()}"
    # pending markers of the killed saves are what check() reports, with their orphaned data
    tensorkv.checkpoint.gc(shared_url, grace=0)
    rep = tensorkv.checkpoint.check(shared_url, grace=0)
    assert rep.ok and not rep.pending
    with tensorkv.open_store(shared_url) as store:
        assert store.count(layout.PENDING) == 0
    for tag in tensorkv.list_tags(shared_url):  # gc kept everything the tags need
        start = int(tag[1:]) // 1_000_000 * 1_000_000
        expected.assert_tag(tensorkv.load(None, shared_url, tag), tag, start, "after gc")


@pytest.fixture(params=["lmdb", "redis"])
def multi_url(request, tmp_path):
    from .conftest import make_url

    return make_url(request.param, tmp_path, request)


@pytest.mark.timeout(300)
def test_gc_and_loads_beside_a_running_save(multi_url):
    proc = subprocess.Popen([sys.executable, WORKER, multi_url, "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    expected = Expected()
    try:
        deadline = time.time() + 8
        while time.time() < deadline:
            try:
                tensorkv.checkpoint.gc(multi_url)  # default grace: the running save is protected
            except StoreNotFoundError:  # gc never creates a store: the worker has not yet
                time.sleep(0.1)
                continue
            for tag in tensorkv.list_tags(multi_url)[-2:]:
                expected.assert_tag(tensorkv.load(None, multi_url, tag), tag, 0, "while saving")
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    tags = tensorkv.list_tags(multi_url)
    assert tags, err
    for tag in tags:
        expected.assert_tag(tensorkv.load(None, multi_url, tag), tag, 0, "after the kill")
