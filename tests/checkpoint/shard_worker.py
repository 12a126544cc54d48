"""Subprocess used by the sharded-save tests: saves shard i of N of a deterministic table.

Usage: ``python shard_worker.py URL TAG SHARD NUM_SHARDS [--run R] [--seed S] [--die]``.
The table is the part of :func:`reference` ``(S)`` that shard ``SHARD`` of ``NUM_SHARDS``
owns, saved with the replicated dense tensor ``w``. Prints ``done``, or ``refused:
<error class>: <message>`` for a checkpoint error (exit status 0 either way). ``--die``
SIGKILLs the process at its first write of a table record (into the store, or into its
stage for LevelDB and RocksDB), after it claimed its shard; ``--die-moving`` (LevelDB,
RocksDB) at the first table record moved from its stage into the store;
``--die-before-publish`` once its shard is saved, before it looks for the other shards.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.checkpoint.helpers import make_table, rows_of  # noqa: E402

import tensorkv  # noqa: E402
import tensorkv.checkpoint.layout  # noqa: E402
from tensorkv.embedding.table import EmbeddingTable  # noqa: E402
from tensorkv.errors import CheckpointError  # noqa: E402

ROWS = 30000


def reference(seed: int = 7) -> EmbeddingTable:
    """The whole table the shards of a save with ``seed`` hold between them."""
    return make_table(ROWS, 8, "adagrad", seed=seed)


def shard_table(shard: int, num_shards: int, seed: int = 7) -> EmbeddingTable:
    """The rows of the reference table that shard ``shard`` of ``num_shards`` owns."""
    keys, vals, slots, freq, ver = rows_of(reference(seed))
    m = tensorkv.checkpoint.layout.shard_of_keys(keys, num_shards) == shard
    t = EmbeddingTable(8, optimizer="adagrad")
    t.import_([(keys[m], vals[m], slots[m], freq[m], ver[m])])
    return t


def die_at_first_table_write(url: str) -> None:
    """SIGKILL this process when a store first writes a table record (``ckpt/t/...``)."""
    from tests.faults.saver import store_class

    cls = store_class(url)
    orig = cls._write

    def _write(self, ops, *, atomic):
        if any(bytes(k).startswith(b"ckpt/t/") for k, v in ops if v is not None):
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(self, ops, atomic=atomic)

    cls._write = _write


def die_moving_stage(url: str) -> None:
    """SIGKILL this process when its stage starts moving into the (main) store."""
    from tests.faults.saver import store_class

    cls = store_class(url)
    orig = cls._write

    def _write(self, ops, *, atomic):
        if ".stage" not in self.path and any(
                bytes(k).startswith(b"ckpt/t/") for k, v in ops if v is not None):
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(self, ops, atomic=atomic)

    cls._write = _write
    if hasattr(cls, "ingest_files"):
        def ingest_files(self, paths):
            os.kill(os.getpid(), signal.SIGKILL)

        cls.ingest_files = ingest_files


def main() -> None:
    url, tag, shard, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rest = sys.argv[5:]
    run = rest[rest.index("--run") + 1] if "--run" in rest else None
    seed = int(rest[rest.index("--seed") + 1]) if "--seed" in rest else 7
    t = shard_table(shard, n, seed)
    if "--die" in rest:
        die_at_first_table_write(url)
    if "--die-moving" in rest:
        die_moving_stage(url)
    if "--die-before-publish" in rest:
        save_module = sys.modules["tensorkv.checkpoint.save"]  # the name `save` is the function
        save_module.merge_if_complete = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    dense = {"w": np.arange(1000, dtype=np.float32) + seed}  # replicated: same on every shard
    try:
        tensorkv.save({"emb": t, **dense}, url, tag, shard=shard, num_shards=n, run=run,
                      block_rows=512)
    except CheckpointError as exc:
        print(f"refused: {type(exc).__name__}: {exc}", flush=True)
        return
    print("done", flush=True)


if __name__ == "__main__":
    main()
