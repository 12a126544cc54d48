"""Sharded saves from real processes at once, and restores onto other shard counts."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import tensorkv
import tensorkv.checkpoint.layout
from tensorkv.errors import CheckpointError, TagNotFoundError

from .helpers import make_table, rows_of

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shard_worker.py")


@pytest.fixture(params=["lmdb", "redis", "leveldb", "rocksdb"])
def proc_url(request, tmp_path):
    from .conftest import make_url

    return make_url(request.param, tmp_path, request)


@pytest.mark.timeout(300)
def test_parallel_sharded_save_and_reshard(proc_url):
    # LevelDB and RocksDB too: each process writes a stage and takes turns on the store
    n = 3
    procs = [subprocess.Popen([sys.executable, WORKER, proc_url, "sh", str(i), str(n)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0 and out.strip() == "done", out + err
    assert tensorkv.list_tags(proc_url) == ["sh"]
    info = tensorkv.checkpoint.tag_manifest(proc_url, "sh")
    assert info["num_shards"] == 3 and info["shards"] == [0, 1, 2]
    assert info["run"]["id"] is None and info["run"]["token"]
    tensorkv.save({"emb": make_table(30000, 8, "adagrad", seed=7),
                   "w": np.arange(1000, dtype=np.float32) + 7}, proc_url, "whole")
    whole = tensorkv.load(None, proc_url, "whole")
    got = tensorkv.load(None, proc_url, "sh")
    ref = rows_of(whole["emb"])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(ref, rows_of(got["emb"]), strict=True))
    assert got["w"].tobytes() == whole["w"].tobytes()
    rep = tensorkv.checkpoint.check(proc_url, verify=True)
    assert rep.ok and not rep.runs and not rep.pending and not rep.stages, rep.as_dict()
    if "://" in proc_url and proc_url.split("://")[0] in ("leveldb", "rocksdb"):
        assert not os.path.exists(proc_url.split("://", 1)[1] + ".stage")
    for m in (1, 2, 5):
        parts = [rows_of(tensorkv.load(None, proc_url, "sh", shard=j, num_shards=m)["emb"])
                 for j in range(m)]
        for j, p in enumerate(parts):
            assert (tensorkv.checkpoint.layout.shard_of_keys(p[0], m) == j).all()
        cat = [np.concatenate([p[i] for p in parts]) for i in range(5)]
        order = np.argsort(cat[0])
        assert all(a.tobytes() == b[order].tobytes() for a, b in zip(ref, cat, strict=True))
    w = tensorkv.load(None, proc_url, "sh", variables=["w"], shard=1, num_shards=2)["w"]
    assert np.array_equal(w, np.arange(1000, dtype=np.float32) + 7)


def test_tag_invisible_until_last_shard_and_explicit_merge(mem_url):
    t = make_table(1000, 4)
    tensorkv.save({"emb": t}, mem_url, "p", shard=0, num_shards=2)
    with pytest.raises(TagNotFoundError, match="in progress or was interrupted|does not exist"):
        tensorkv.load(None, mem_url, "p")
    assert tensorkv.list_tags(mem_url) == []
    assert tensorkv.checkpoint.check(mem_url).incomplete == ["p"]
    with pytest.raises(CheckpointError, match=r"shards \[1\] of 2 have not finished"):
        tensorkv.checkpoint.merge(mem_url, "p")
    tensorkv.checkpoint.merge(mem_url, "p", allow_missing=True)
    assert tensorkv.list_tags(mem_url) == ["p"]
    tensorkv.save({"emb": t}, mem_url, "q", shard=0, num_shards=2)
    with pytest.raises(CheckpointError, match="already saved"):
        tensorkv.save({"emb": t}, mem_url, "q", shard=0, num_shards=2)


def test_dense_conflict_between_shards(mem_url):
    tensorkv.save({"w": np.zeros(3)}, mem_url, "c", shard=0, num_shards=2)
    with pytest.raises(CheckpointError, match="'w' differs between shards"):
        tensorkv.save({"w": np.ones(3)}, mem_url, "c", shard=1, num_shards=2)
