"""SIGKILL a saving process at random moments: earlier tags stay loadable, no half tag shows."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tensorkv
from tensorkv.checkpoint import layout

from .crash_worker import dense

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_worker.py")


def _run_and_kill(url: str, first: int, delay: float) -> list[str]:
    proc = subprocess.Popen([sys.executable, WORKER, url, str(first)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    return [line.split()[1] for line in out.splitlines() if line.startswith("saved ")]


@pytest.mark.timeout(300)
def test_sigkill_during_saves(shared_url):
    rng = random.Random(hash(shared_url) & 0xFFFF)
    saved: list[str] = []
    tables: dict[str, int] = {}
    for round_ in range(4):
        first = 1_000_000 * round_  # tag ranges of different rounds never meet
        done = _run_and_kill(shared_url, first, rng.uniform(1.5, 4.0))
        saved += done
        visible = tensorkv.list_tags(shared_url)
        # every reported tag is visible; a visible tag was either reported or finished just
        # before the kill (its manifest was written, the print was not)
        assert set(done) <= set(visible)
        for tag in visible:
            i = int(tag[1:])
            got = tensorkv.load(None, shared_url, tag)
            exp = dense(i)
            assert np.array_equal(got["w"], exp["w"]) and np.array_equal(got["b"], exp["b"])
            tables[tag] = len(got["emb"])
            assert tables[tag] == 40000
    # pending markers of the killed saves are what check() reports, with their orphaned data
    rep = tensorkv.checkpoint.check(shared_url, grace=0)
    assert rep.tags == tensorkv.list_tags(shared_url)
    tensorkv.checkpoint.gc(shared_url, grace=0)
    rep = tensorkv.checkpoint.check(shared_url, grace=0)
    assert rep.ok and not rep.pending
    with tensorkv.open_store(shared_url) as store:
        assert store.count(layout.PENDING) == 0
    for tag in tensorkv.list_tags(shared_url):  # gc kept everything the tags need
        tensorkv.load(None, shared_url, tag)


@pytest.fixture(params=["lmdb", "redis"])
def multi_url(request, tmp_path):
    from .conftest import make_url

    return make_url(request.param, tmp_path, request)


@pytest.mark.timeout(300)
def test_gc_and_loads_beside_a_running_save(multi_url):
    proc = subprocess.Popen([sys.executable, WORKER, multi_url, "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 8
        loads = 0
        while time.time() < deadline:
            tensorkv.checkpoint.gc(multi_url)  # default grace: the running save is protected
            for tag in tensorkv.list_tags(multi_url)[-2:]:
                got = tensorkv.load(None, multi_url, tag)
                assert np.array_equal(got["w"], dense(int(tag[1:]))["w"])
                loads += 1
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    tags = tensorkv.list_tags(multi_url)
    assert tags, err
    for tag in tags:
        got = tensorkv.load(None, multi_url, tag)
        assert np.array_equal(got["b"], dense(int(tag[1:]))["b"]) and len(got["emb"]) == 40000
