"""Several threads and processes putting, reading and deleting at once."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tensorkv import Repository

from .conftest import make_url
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
        report = repo.check(deep=True)
        assert report["ok"], report["problems"]
        s = repo.stats()
        assert s["tensors"] == 3  # ones (a.w, and b.w of i % 3 == 1), zeros, twos
        for row in repo.list():
            repo.delete(row["id"])
        s = repo.stats()
        assert (s["models"], s["tensors"], s["bytes_stored"]) == (0, 0, 0)
