"""Subprocess used by the crash tests: saves tags in a loop until it is killed.

Usage: python crash_worker.py URL FIRST_INDEX. Prints ``saved <tag>`` after each save returns.
Tag ``k<i>`` holds content that depends only on ``i`` (see :func:`content`), alternating full
and incremental table saves.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.checkpoint.helpers import make_table  # noqa: E402

import tensorkv  # noqa: E402


def dense(i: int) -> dict[str, np.ndarray]:
    """Dense tensors of tag ``k<i>``."""
    rng = np.random.default_rng(i)
    return {"w": rng.standard_normal((200, 1000)).astype(np.float32),
            "b": np.full(10, i, np.int64)}


def main() -> None:
    url, first = sys.argv[1], int(sys.argv[2])
    table = make_table(40000, 16, "adagrad", seed=first)
    i = first
    while True:
        d = dense(i)
        table.apply_gradients(table.keys()[: 100 * (i % 7 + 1)],
                              np.ones((100 * (i % 7 + 1), 16), np.float32), step=i)
        tensorkv.save({**d, "emb": table}, url, f"k{i}", step=i, incremental=bool(i % 2),
                      chunk_bytes=64 * 1024, block_rows=1024)
        # record the expected table content next to the store for the checker
        print(f"saved k{i}", flush=True)
        i += 1


if __name__ == "__main__":
    main()
