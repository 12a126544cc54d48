"""Several threads and processes putting, reading and deleting at once."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tensorkv import Repository

from .conftest import make_url
from .models import mlp
from .worker import run


@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_threads_and_processes_keep_counts_exact(backend, tmp_path, request):
    url = make_url(backend, tmp_path, request)
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-m", "repository.worker", url, str(w), "8"],
                              cwd=root, stderr=subprocess.PIPE, text=True) for w in (10, 11)]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda w: run(url, w, 8), range(3)))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    with Repository(url) as repo:
        assert len(repo.list()) == 5 * 4
        report = repo.check(verify=True)
        assert report["ok"], report["problems"]
        s = repo.stats()
        assert s["tensors"] == 3  # ones (a.w, and b.w of i % 3 == 1), zeros, twos
        for row in repo.list():
            repo.delete(row["id"])
        s = repo.stats()
        assert (s["models"], s["tensors"], s["bytes_stored"]) == (0, 0, 0)


@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_a_put_racing_a_delete_of_the_same_content_keeps_its_data(backend, tmp_path, request):
    """A put meets the live tombstones of a delete retiring the same tensors.

    The deleter stops once its counts are tombstones. The put counts its tensors before it
    writes them, so it must wait for the tombstones to go: the deleter goes on deleting only
    once the put has read the counts a second time (it is waiting). The put's model must stay
    whole: it writes the data after the delete removed it.
    """
    url = make_url(backend, tmp_path, request)
    model = mlp((4, 8, 2))
    with Repository(url) as deleter, Repository(url) as putter:
        old = deleter.put(model)
        tombstoned, go = threading.Event(), threading.Event()
        delete_data = deleter.delete_data
        get_many, count_reads = putter.meta.get_many, []

        def delete_when_told(*args):
            tombstoned.set()
            assert go.wait(60)
            delete_data(*args)

        def read_counts(keys):
            if tombstoned.is_set() and keys and keys[0].startswith(b"repo/r/"):
                count_reads.append(len(keys))
                if len(count_reads) == 2:  # the put is waiting for the tombstones
                    go.set()
            return get_many(keys)

        deleter.delete_data = delete_when_told  # type: ignore[method-assign]
        putter.meta.get_many = read_counts  # type: ignore[method-assign]
        retired: list[int] = []
        t = threading.Thread(target=lambda: retired.append(deleter.delete(old)))
        t.start()
        try:
            assert tombstoned.wait(60)  # every count of the model is a live tombstone now
            new = putter.put(model)
        finally:
            go.set()
            t.join(120)
        assert retired == [4]
        got = putter.get(new)
        for k, v in model.state_dict().items():
            assert torch.equal(got[k], v), k
        report = putter.check(verify=True)
        assert report["ok"], report["problems"]
        assert putter.stats()["tensors"] == 4
