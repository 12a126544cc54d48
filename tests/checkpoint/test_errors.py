"""Failing backends: a full LMDB, read-only stores, permission denied."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import tensorkv
from tensorkv.errors import ReadOnlyError, StoreFullError

from .helpers import make_table


def test_full_lmdb_keeps_earlier_tags(tmp_path):
    url = f"lmdb://{tmp_path}/db?map_size=2MiB&max_map_size=4MiB"
    tensorkv.save({"a": np.arange(1000.0)}, url, "small")
    big = {"a": np.random.default_rng(0).standard_normal(2_000_000), "e": make_table(2000)}
    with pytest.raises(StoreFullError):
        tensorkv.save(big, url, "big")
    assert tensorkv.list_tags(url) == ["small"]
    assert np.array_equal(tensorkv.load(None, url, "small")["a"], np.arange(1000.0))
    tensorkv.checkpoint.gc(url, grace=0)
    assert tensorkv.checkpoint.check(url, grace=0).ok
    tensorkv.save({"a": np.arange(10.0)}, url, "after")  # room again after gc
    assert tensorkv.list_tags(url) == ["small", "after"]


def test_readonly_store_refuses_and_changes_nothing(tmp_path):
    url = f"lmdb://{tmp_path}/db"
    tensorkv.save({"a": np.ones(3)}, url, "x")
    with tensorkv.open_store(url, readonly=True) as store:
        with pytest.raises(ReadOnlyError, match="read-only"):
            tensorkv.save({"a": np.zeros(3)}, store, "y")
        with pytest.raises(PermissionError):
            tensorkv.delete_tag(store, "x")
        assert tensorkv.load(None, store, "x")["a"].tolist() == [1, 1, 1]
    assert tensorkv.list_tags(url) == ["x"]


@pytest.mark.skipif(not hasattr(os, "setuid"), reason="needs POSIX users")
def test_permission_denied(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    code = (
        "import numpy as np, tensorkv\n"
        "from tensorkv.errors import TensorKVError\n"
        f"try:\n    tensorkv.save({{'a': np.ones(2)}}, 'lmdb://{locked}/db', 't')\n"
        "except PermissionError as e:\n    print('PERM', type(e).__name__, e)\n"
    )

    def drop() -> None:  # run the child as an unprivileged user
        os.setgid(65534)
        os.setuid(65534)

    if os.getuid() != 0:
        pytest.skip("needs root to drop privileges in the child")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       preexec_fn=drop, timeout=120, env={**os.environ, "HOME": "/tmp"})
    assert "PERM" in r.stdout, r.stderr
    assert str(locked) in r.stdout
