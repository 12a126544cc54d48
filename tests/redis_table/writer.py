"""A trainer process of the concurrency tests.

``python writer.py URL TAG CONSISTENCY SEED STEPS``: for each optimizer (``sgd``, then
``adagrad``) opens the shared table under the model tag ``<TAG><optimizer>``, then for each
step looks up a batch of keys and applies gradients. With ``sgd`` (lr 1) the
gradients are small integers (exact in float32, so the sum over every writer does not depend
on the order); with ``adagrad`` the table has one bucket (one lock, so commits are totally
ordered) and each apply's commit appends ``SEED:STEP`` to the Redis list ``<TAG>:order``
before its write, while the lock is held: the test replays the batches in that order. Prints
``done``.
"""

import sys

import numpy as np

import tensorkv
from tensorkv.embedding.redis import commit as redis_commit


def open_table(url: str, tag: str, consistency: str, optimizer: str) -> tensorkv.EmbeddingTable:
    opt = tensorkv.StorageOption("REDIS", storage_path=url, redis_options={
        "model_tag_runtime": tag, "storage_slice": 4 if optimizer == "sgd" else 1,
        "consistency": consistency, "keys_sending_size": 16})
    return tensorkv.EmbeddingTable(4, **table_kwargs(optimizer), storage=opt)


def table_kwargs(optimizer: str) -> dict:
    if optimizer == "sgd":
        return {"optimizer": tensorkv.SGD(lr=1.0), "initializer": "zeros"}
    return {"optimizer": tensorkv.Adagrad(lr=0.1), "seed": 4}


def main() -> None:
    url, tag, consistency, seed, steps = sys.argv[1:6]
    current: list[str] = []
    real_commit = redis_commit.commit

    def logged_commit(engine, op, keys, sealed, deleted, locked, exact):
        if current and keys.size:  # under the bucket locks (the commit releases them)
            key = f"{current[1]}:order".encode()
            engine.store.execute([(key, ("RPUSH", key, current[0].encode()))])
        return real_commit(engine, op, keys, sealed, deleted, locked, exact)

    redis_commit.commit = logged_commit
    for optimizer in ("sgd", "adagrad"):
        with open_table(url, tag + optimizer, consistency, optimizer) as table:
            for i, (keys, grads) in enumerate(batches(int(seed), int(steps), optimizer)):
                table.lookup(keys)
                current[:] = [f"{seed}:{i}", tag + optimizer]
                table.apply_gradients(keys, grads)
                current.clear()
    print("done", flush=True)


def batches(seed: int, steps: int, optimizer: str = "sgd"):
    """The (keys, gradients) of one writer: overlapping keys."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        keys = rng.integers(0, 40, 24)
        if optimizer == "sgd":
            yield keys, rng.integers(-3, 4, (24, 4)).astype(np.float32)
        else:
            yield keys, rng.standard_normal((24, 4)).astype(np.float32)


if __name__ == "__main__":
    main()
