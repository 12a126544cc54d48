"""Several trainer processes update one Redis-resident table at once.

Exact mode loses no update: four writer processes (``writer.py``) leave the table equal, bit
for bit, to one DRAM table that applied every writer's batches once; frequencies count every
lookup. Gradients are small integers and SGD's lr is 1, so float32 sums are exact in any
order and the comparison can be exact.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from tests.redis_table.helpers import redis_table

import tensorkv

WRITERS = 4
STEPS = 25
HERE = os.path.dirname(os.path.abspath(__file__))


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


def serial_reference() -> tensorkv.EmbeddingTable:
    sys.path.insert(0, HERE)
    from writer import batches

    ref = tensorkv.EmbeddingTable(4, optimizer=tensorkv.SGD(lr=1.0), initializer="zeros")
    for seed in range(WRITERS):
        for keys, grads in batches(seed, STEPS):
            ref.lookup(keys)
            ref.apply_gradients(keys, grads)
    return ref


def test_four_writers_lose_no_update(redis_server, tag):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    run_writers(url, tag, "exact")
    ref = serial_reference()
    with redis_table(url, 4, model_tag_runtime=tag, storage_slice=4,
                     table_kwargs={"optimizer": tensorkv.SGD(lr=1.0),
                                   "initializer": "zeros"}) as t:
        keys = np.sort(ref.keys())
        assert np.array_equal(np.sort(t.keys()), keys)
        np.testing.assert_array_equal(t.lookup(keys, insert=False),
                                      ref.lookup(keys, insert=False))
        np.testing.assert_array_equal(t.frequency(keys), ref.frequency(keys))
        assert t.stats()["redis"]["lock_waits"] >= 0
