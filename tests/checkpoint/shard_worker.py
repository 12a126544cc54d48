"""Subprocess used by the sharded-save tests: saves shard i of N of a deterministic table.

Usage: python shard_worker.py URL TAG SHARD NUM_SHARDS
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.checkpoint.helpers import make_table, rows_of  # noqa: E402

import tensorkv  # noqa: E402
import tensorkv.checkpoint.layout  # noqa: E402
from tensorkv.embedding.table import EmbeddingTable  # noqa: E402


def shard_table(shard: int, num_shards: int) -> EmbeddingTable:
    """The rows of the reference table that shard ``shard`` of ``num_shards`` owns."""
    keys, vals, slots, freq, ver = rows_of(make_table(30000, 8, "adagrad", seed=7))
    m = tensorkv.checkpoint.layout.shard_of_keys(keys, num_shards) == shard
    t = EmbeddingTable(8, optimizer="adagrad")
    t.import_([(keys[m], vals[m], slots[m], freq[m], ver[m])])
    return t


def main() -> None:
    url, tag, shard, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    t = shard_table(shard, n)
    dense = {"w": np.arange(1000, dtype=np.float32)}  # replicated: identical on every shard
    tensorkv.save({"emb": t, **dense}, url, tag, shard=shard, num_shards=n, block_rows=512)
    print("done", flush=True)


if __name__ == "__main__":
    main()
