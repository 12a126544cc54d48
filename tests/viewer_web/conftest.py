"""Fixtures of the web viewer's tests: a small LMDB checkpoint with two tags, the app."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("starlette", reason='the web viewer needs "tensorkv[view]"')

from tests.checkpoint.helpers import make_table  # noqa: E402

#: A variable name that is markup: pages must show it as text.
EVIL = "<script>window.tkvPwned=1</script><img src=x onerror=alert(1)>"
DIM = 8
ROWS = 600


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """An LMDB store with tags t1, t2: a table ``emb`` and dense tensors (one named EVIL).

    t2 trains some rows of t1 further and adds keys, so the two tags differ.
    """
    import tensorkv

    url = f"lmdb://{tmp_path_factory.mktemp('viewer-web')}/store"
    table = make_table(ROWS, DIM)
    rng = np.random.default_rng(1)
    dense = {
        "mlp.weight": rng.standard_normal((40, 24)).astype(np.float32),
        "mlp.bias": np.arange(24, dtype=np.float32),
        "cube": rng.standard_normal((6, 5, 4)).astype(np.float32),
        EVIL: np.ones((2, 2), np.float32),
    }
    tensorkv.save({"emb": table, **dense}, url, tag="t1", step=1)
    keys = np.sort(table.export(chunk_rows=1 << 20).__next__().keys)
    changed = keys[:20]
    table.apply_gradients(changed, rng.standard_normal((20, DIM)).astype(np.float32), step=5)
    table.lookup(np.arange(10**6, 10**6 + 30, dtype=np.int64))
    dense["mlp.weight"] = dense["mlp.weight"] * 2
    tensorkv.save({"emb": table, **dense}, url, tag="t2", step=2)
    return {"url": url, "table": table, "dense": dense, "changed": changed}


@pytest.fixture(scope="session")
def client(ckpt):
    """A TestClient of the app over ``ckpt`` (the host a loopback viewer answers)."""
    from starlette.testclient import TestClient

    from tensorkv.viewer.web.app import create_app

    with TestClient(create_app(ckpt["url"]), base_url="http://127.0.0.1:8737") as c:
        yield c
