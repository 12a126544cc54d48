"""Subprocess used by the crash tests: saves tags in a loop until it is killed.

Usage: ``python crash_worker.py URL FIRST_INDEX [KILL_AT MODE]``. Prints ``saved <tag>`` after
each save returns. Tag ``k<i>`` holds the dense tensors :func:`dense` ``(i)`` and the table
:func:`table_at` ``(FIRST_INDEX, i)``, alternating full and incremental table saves. With
``KILL_AT`` the process SIGKILLs itself at its ``KILL_AT``-th store write or flush, before
or after the backend runs it (``MODE``; see ``tests/faults/saver.py``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.checkpoint.helpers import make_table  # noqa: E402

import tensorkv  # noqa: E402

ROWS, DIM = 40000, 16


def dense(i: int) -> dict[str, np.ndarray]:
    """Dense tensors of tag ``k<i>``."""
    rng = np.random.default_rng(i)
    return {"w": rng.standard_normal((200, 1000)).astype(np.float32),
            "b": np.full(10, i, np.int64)}


def step(table: Any, i: int) -> None:
    """The update made before saving tag ``k<i>``."""
    n = 100 * (i % 7 + 1)
    table.apply_gradients(table.keys()[:n], np.ones((n, DIM), np.float32), step=i)


def tables_from(first: int) -> Iterator[tuple[int, Any]]:
    """Yield ``(i, table)`` for ``i = first, first + 1, ...``: the table as tag ``k<i>`` holds it.

    The same table object is updated in place between items.
    """
    table = make_table(ROWS, DIM, "adagrad", seed=first)
    i = first
    while True:
        step(table, i)
        yield i, table
        i += 1


def main() -> None:
    url, first = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:
        from tests.faults.saver import arm_kill, store_class

        arm_kill(store_class(url), int(sys.argv[3]), sys.argv[4])
    for i, table in tables_from(first):
        tensorkv.save({**dense(i), "emb": table}, url, f"k{i}", step=i,
                      incremental=bool(i % 2), chunk_bytes=64 * 1024, block_rows=1024)
        print(f"saved k{i}", flush=True)


if __name__ == "__main__":
    main()
