"""Saves of a Redis-resident table that another process keeps training.

A trainer process updates every row of a table (standalone and Cluster) step after step
while this process saves it with ``tensorkv.save`` (``table_store_mode`` 0: the checkpoint
carries the rows). Each saved row is one state of that row (its values and its version agree)
and each bucket is one state of that bucket (its rows all carry the same step): the export
reads each bucket atomically.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import tensorkv

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import saver_trainer  # noqa: E402

SAVES = 6


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["standalone", "cluster"])
def test_save_while_another_process_trains(kind, request, tag, tmp_path):
    if kind == "standalone":
        srv = request.getfixturevalue("redis_server")
        url, client = f"redis://127.0.0.1:{srv.port}/0", srv.client
    else:
        cl = request.getfixturevalue("redis_cluster")
        from redis.cluster import RedisCluster

        url, client = cl.url, lambda: RedisCluster(host="127.0.0.1", port=cl.ports[0])
    t = saver_trainer.open_table(url, tag)
    t.upsert(saver_trainer.KEYS, np.zeros((saver_trainer.KEYS.size, 4)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "saver_trainer.py"), url, tag],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    store = f"lmdb://{tmp_path}/ck"
    try:
        c = client()
        try:  # the saves start once the trainer trains (no timing assumed)
            while not c.exists(f"{tag}:started"):
                assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
                time.sleep(0.05)
        finally:
            c.close()
        for i in range(SAVES):
            tensorkv.save({"emb": t}, store, tag=f"s{i}")
    finally:
        c = client()
        try:
            c.set(f"{tag}:stop", b"1")
        finally:
            c.close()
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.startswith(b"done"), err.decode()[-3000:]
    for i in range(SAVES):
        chunks = list(tensorkv.load(None, store, tag=f"s{i}")["emb"].export())
        keys = np.concatenate([c.keys for c in chunks])
        values = np.concatenate([c.values for c in chunks])
        version = np.concatenate([c.version for c in chunks])
        assert np.array_equal(np.sort(keys), saver_trainer.KEYS)
        # one state per row: the row's values are the step its version names
        np.testing.assert_array_equal(values, np.repeat(version[:, None], 4, 1).astype(
            np.float32))
        # one state per bucket: every row of a bucket carries the same step
        bucket = keys % saver_trainer.OPTIONS["storage_slice"]
        for b in range(saver_trainer.OPTIONS["storage_slice"]):
            assert np.unique(version[bucket == b]).size == 1, (i, b)
    t.close()
