"""Several trainer processes update one Redis-resident table at once.

Exact mode loses no update. SGD: four writer processes (``writer.py``) leave the table equal,
bit for bit, to one DRAM table that applied every writer's batches once (gradients are small
integers and lr is 1, so float32 sums are exact in any order); frequencies count every
lookup. Adagrad (order-dependent): four writers commit through one bucket lock and record
their commit order; one DRAM table replaying the batches in that order ends bit-identical.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from tests.redis_table.helpers import redis_table

import tensorkv

WRITERS = 4
STEPS = 12
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import writer  # noqa: E402


def run_writers(url: str, tag: str, consistency: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p])
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "writer.py"), url, tag,
                               consistency, str(seed), str(STEPS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
             for seed in range(WRITERS)]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0 and b"done" in out, err.decode()[-3000:]


@pytest.fixture(scope="module")
def written(redis_server) -> tuple[str, str]:
    """``(url, tag)`` after four writer processes trained an SGD and an Adagrad table."""
    url, tag = f"redis://127.0.0.1:{redis_server.port}/0", f"conc{os.getpid()}"
    run_writers(url, tag, "exact")
    return url, tag


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_four_writers_lose_no_update(written, redis_server, optimizer):
    url, tag = written
    tag += optimizer
    work = {seed: list(writer.batches(seed, STEPS, optimizer)) for seed in range(WRITERS)}
    ref = tensorkv.EmbeddingTable(4, **writer.table_kwargs(optimizer))
    if optimizer == "sgd":
        order = [(s, i) for s in range(WRITERS) for i in range(STEPS)]
    else:
        c = redis_server.client()
        try:
            order = [tuple(map(int, x.split(b":"))) for x in c.lrange(f"{tag}:order", 0, -1)]
        finally:
            c.close()
        assert sorted(order) == [(s, i) for s in range(WRITERS) for i in range(STEPS)]
    for s in range(WRITERS):  # lookups only count frequencies and insert initial rows
        for keys, _ in work[s]:
            ref.lookup(keys)
    for s, i in order:
        keys, grads = work[s][i]
        ref.apply_gradients(keys, grads)
    with redis_table(url, 4, model_tag_runtime=tag, storage_slice=4 if optimizer == "sgd" else 1,
                     table_kwargs=writer.table_kwargs(optimizer)) as t:
        keys = np.sort(ref.keys())
        assert np.array_equal(np.sort(t.keys()), keys)
        np.testing.assert_array_equal(t.lookup(keys, insert=False),
                                      ref.lookup(keys, insert=False))
        np.testing.assert_array_equal(t.frequency(keys), ref.frequency(keys))
        if optimizer == "adagrad":
            chunks = {n: np.concatenate([getattr(c, n) for c in t.export()]) for n in
                      ("keys", "slots")}
            ref_chunks = {n: np.concatenate([getattr(c, n) for c in ref.export()]) for n in
                          ("keys", "slots")}
            np.testing.assert_array_equal(chunks["slots"][np.argsort(chunks["keys"])],
                                          ref_chunks["slots"][np.argsort(ref_chunks["keys"])])
