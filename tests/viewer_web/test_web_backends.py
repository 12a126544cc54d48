"""The viewer over other backends than LMDB: a real redis-server and the memory store."""

from __future__ import annotations

import os

import numpy as np
import pytest
from starlette.testclient import TestClient
from tests.checkpoint.helpers import make_table, rows_of


@pytest.fixture(params=["memory", "redis"])
def url(request):
    if request.param == "memory":
        return f"memory://viewer-web-{os.getpid()}"
    pytest.importorskip("redis", reason='redis-py is not installed: pip install "tensorkv[redis]"')
    server = request.getfixturevalue("redis_server")
    return f"redis://127.0.0.1:{server.port}/0?prefix=viewer-web-{os.getpid()}/"


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
        assert c.post("/api/rows").status_code == 405
    if keep is not None:
        keep.close()
