"""A trainer process of the near-cache tests.

``python near_writer.py URL TAG CONSISTENCY SEED STEPS NEAR``: opens the shared SGD table
(lr 1, zeros) under ``TAG`` and, for each step, looks up a batch of keys and applies a
gradient of -1 to each, so every update adds 1 to each value of its row: a row's values only
grow (in last-writer-wins mode each writer owns the keys of its seed's parity, so no update
is lost there either). ``NEAR`` 1: the writer reads through a near-cache, and each step
also reads the keys next to its batch's (the other writer's, in last-writer-wins mode)
through it, bracketed by reads without a cache: a row older than Redis held exits with
``stale``. Prints ``done`` and the number of updates of each key.
"""

import json
import sys

import numpy as np

import tensorkv

KEYS = 96
DIM = 4


def open_table(url: str, tag: str, consistency: str, near: bool,
               **extra) -> tensorkv.EmbeddingTable:
    options = {"model_tag_runtime": tag, "storage_slice": 6, "consistency": consistency,
               "keys_sending_size": 16, **extra}
    if near:
        options["near_cache_rows"] = 48
    opt = tensorkv.StorageOption("REDIS", storage_path=url, redis_options=options)
    return tensorkv.EmbeddingTable(DIM, optimizer=tensorkv.SGD(lr=1.0), initializer="zeros",
                                   storage=opt)


def batches(seed: int, steps: int, consistency: str):
    """Keys of each step: Zipf-like (hot keys come back), owned by parity in LWW mode."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        keys = np.minimum(rng.zipf(1.3, 12) - 1, KEYS - 1).astype(np.int64)
        if consistency != "exact":
            keys = keys - keys % 2 + seed % 2
        yield keys


def main() -> None:
    url, tag, consistency, seed, steps, near = sys.argv[1:7]
    counts = np.zeros(KEYS, np.int64)
    plain = open_table(url, tag, consistency, False)
    with open_table(url, tag, consistency, near == "1") as table:
        for keys in batches(int(seed), int(steps), consistency):
            table.lookup(keys)
            table.apply_gradients(keys, -np.ones((keys.size, DIM), np.float32))
            np.add.at(counts, keys, 1)
            if near == "1":
                probe = keys ^ 1
                before = plain.lookup(probe, insert=False)
                got = table.lookup(probe, insert=False)
                if (got < before).any():
                    print("stale", probe.tolist(), got[:, 0].tolist(), before[:, 0].tolist(),
                          flush=True)
                    sys.exit(1)
    plain.close()
    print("done", json.dumps(counts.tolist()), flush=True)


if __name__ == "__main__":
    main()
