"""A trainer process of the concurrency tests: SGD(lr=1) steps of integer gradients.

``python writer.py URL TAG CONSISTENCY SEED STEPS``: opens the shared table, then for each
step looks up a batch of keys and applies integer-valued gradients (exact in float32, so
the sum over every writer does not depend on the order). Prints ``done``.
"""

import sys

import numpy as np

import tensorkv


def main() -> None:
    url, tag, consistency, seed, steps = sys.argv[1:6]
    opt = tensorkv.StorageOption("REDIS", storage_path=url, redis_options={
        "model_tag_runtime": tag, "storage_slice": 4, "consistency": consistency,
        "keys_sending_size": 16})
    with tensorkv.EmbeddingTable(4, optimizer=tensorkv.SGD(lr=1.0), initializer="zeros",
                                 storage=opt) as table:
        for keys, grads in batches(int(seed), int(steps)):
            table.lookup(keys)
            table.apply_gradients(keys, grads)
    print("done", flush=True)


def batches(seed: int, steps: int):
    """The (keys, gradients) of one writer: overlapping keys, small integer gradients."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        keys = rng.integers(0, 40, 24)
        yield keys, rng.integers(-3, 4, (24, 4)).astype(np.float32)


if __name__ == "__main__":
    main()
