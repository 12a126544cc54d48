"""Failing backends: a full LMDB, read-only stores, permission denied."""

from __future__ import annotations

import os

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


def test_permission_denied(tmp_path):
    if os.getuid() == 0:  # root ignores file modes; sysfs refuses directories even to root
        where, dump_dir = "/sys/tensorkv-ckpt-test", "/sys"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        os.chmod(locked, 0o500)
        where, dump_dir = str(locked / "sub"), str(locked)
    url = f"lmdb://{where}/db"
    with pytest.raises(PermissionError, match=where):
        tensorkv.save({"a": np.ones(2)}, url, "t")
    ok = f"lmdb://{tmp_path}/ok"
    tensorkv.save({"a": np.ones(2)}, ok, "t")
    with pytest.raises(PermissionError):
        tensorkv.dump_tag(ok, "t", f"{dump_dir}/x.tkv")
    assert tensorkv.list_tags(ok) == ["t"]
