"""A process that SIGKILLs itself at its k-th store call inside a put or a delete."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

from tensorkv import Repository

#: Store methods a put or delete calls (the kill point counts every call of these).
CALLS = ("get", "get_many", "put", "put_many", "delete", "delete_many", "compare_and_set",
         "put_if_absent", "value_sizes")


def graph(n: int) -> dict:
    """A chain of ``n`` layers, each with one (8, 8) weight."""
    nodes = [{"name": "x", "op": "input", "type": "input"}]
    for i in range(n):
        nodes.append({"name": f"l{i}", "type": "D", "inputs": [nodes[-1]["name"]],
                      "params": {"w": {"shape": [8, 8], "dtype": "float32"}}})
    return {"nodes": nodes}


def state(n: int, seed: int) -> dict:
    """Weights for :func:`graph`: layer 0 the same for every seed, the rest random."""
    rng = np.random.default_rng(seed)
    out = {f"l{i}.w": rng.random((8, 8), dtype=np.float32) for i in range(n)}
    out["l0.w"] = np.ones((8, 8), np.float32)
    return out


def arm(store, k: int) -> None:
    """SIGKILL this process at the k-th call of one of :data:`CALLS` on ``store``."""
    count = [0]
    for name in CALLS:
        real = getattr(store, name)

        def wrapper(*a, _real=real, **kw):
            count[0] += 1
            if count[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(*a, **kw)

        setattr(store, name, wrapper)


if __name__ == "__main__":
    url, what, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
    repo = Repository(url)
    if what == "put":
        arm(repo.meta, k)
        repo.put(graph(4), state(4, 1), name="victim")
    else:
        mid = repo.list(where={"name": "victim"})[0]["id"]
        arm(repo.meta, k)
        repo.delete(mid)
    print("finished")
