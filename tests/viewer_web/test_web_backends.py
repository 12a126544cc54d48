"""The viewer over other backends than LMDB: RocksDB, LevelDB, a real redis-server, a real
Redis Cluster, and the memory store."""

from __future__ import annotations

import os

import numpy as np
import pytest
from starlette.testclient import TestClient
from tests import servers
from tests.checkpoint.helpers import make_table, rows_of


@pytest.fixture(params=["memory", "rocksdb", "leveldb", "redis", "redis-cluster"])
def url(request, tmp_path):
    if request.param == "memory":
        return f"memory://viewer-web-{os.getpid()}"
    if request.param in ("rocksdb", "leveldb"):
        pytest.importorskip({"rocksdb": "rocksdict", "leveldb": "plyvel"}[request.param])
        return f"{request.param}://{tmp_path}/store"
    pytest.importorskip("redis", reason='redis-py is not installed: pip install "tensorkv[redis]"')
    prefix = servers.prefix("viewer-web")
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        return f"redis://127.0.0.1:{server.port}/0?prefix={prefix}"
    cluster = request.getfixturevalue("redis_cluster")
    return f"{cluster.url}?prefix={prefix}"


def test_pages_search_and_slices_over_the_backend(url):
    import tensorkv
    from tensorkv.viewer.web.app import create_app

    table = make_table(300, 4)
    w = np.arange(60, dtype=np.float32).reshape(10, 6)
    keep = tensorkv.open_store(url) if url.startswith("memory") else None  # keep it alive
    tensorkv.save({"emb": table, "w": w}, keep or url, tag="a")
    ref = rows_of(table)
    with TestClient(create_app(keep or url), base_url="http://127.0.0.1") as c:
        page = c.get("/api/rows", params={"var": "emb", "limit": 500}).json()
        keys = np.array([int(k) for k in page["rows"]["key"]], np.int64)
        np.testing.assert_array_equal(np.sort(keys), ref[0])
        row = c.get("/api/row", params={"var": "emb", "key": str(ref[0][9])}).json()
        np.testing.assert_array_equal(np.array(row["value"], np.float32), ref[1][9])
        s = c.get("/api/slice", params={"var": "w", "slice": "2:4, 1:3"}).json()
        np.testing.assert_array_equal(np.array(s["values"], np.float32), w[2:4, 1:3])
        found = c.get("/api/search", params={"var": "emb", "keys": f"{ref[0][3]},7"}).json()
        assert found["rows"]["key"] == [str(ref[0][3])] and found["missing"] == ["7"]
        hot = c.get("/api/rows", params={"var": "emb", "where": "freq >= 2",
                                         "limit": 500}).json()
        assert sorted(int(k) for k in hot["rows"]["key"]) == ref[0][ref[3] >= 2].tolist()
        nn = c.get("/api/nearest", params={"var": "emb", "key": str(ref[0][5]), "k": 3}).json()
        assert len(nn["rows"]["key"]) == 3 and nn["scanned"] == len(ref[0]) - 1
        assert c.get("/api/stats", params={"var": "emb"}).json()["count"] == len(ref[0])
        assert c.get("/api/pca", params={"var": "emb", "n": 50}).json()["sampled"] > 0
        d = c.get("/api/diff", params={"a": "a", "b": "a"}).json()
        assert {v["status"] for v in d["variables"]} == {"unchanged"}
        assert c.post("/api/rows").status_code == 405
    if keep is not None:
        keep.close()
