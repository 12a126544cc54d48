"""A process that puts, reads and deletes models in a shared repository (concurrency tests)."""

from __future__ import annotations

import sys

import numpy as np

from tensorkv import Repository


def shared_graph(width: int) -> dict:
    """A two-layer graph; layer ``a`` is the same in every model of the same width."""
    p = {"w": {"shape": [width, width], "dtype": "float32"}}
    return {"nodes": [{"name": "x", "op": "input", "type": "input"},
                      {"name": "a", "type": "D", "params": p, "inputs": ["x"]},
                      {"name": "b", "type": "D", "params": p, "inputs": ["a"]}]}


def state(i: int, width: int = 64) -> dict[str, np.ndarray]:
    """Tensors of model ``i``: ``a.w`` shared by all, ``b.w`` by models with the same i % 3."""
    return {"a.w": np.ones((width, width), np.float32),
            "b.w": np.full((width, width), i % 3, np.float32)}


def run(url: str, wid: int, n: int) -> None:
    """Put ``n`` models, read each back exactly, delete every other one."""
    with Repository(url, chunk_bytes=4096) as repo:
        for i in range(n):
            mid = repo.put(shared_graph(64), state(i), name=f"w{wid}-{i}")
            got = repo.get(mid)
            for k, v in state(i).items():
                np.testing.assert_array_equal(got[k], v)
            if i % 2:
                repo.delete(mid)


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
