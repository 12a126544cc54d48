"""A trainer that keeps updating every row while another process saves the table.

``python saver_trainer.py URL TAG``: SGD (lr 1) from zeros with gradient -1 on every key of
:data:`KEYS` each step, so after step ``s`` every row holds ``s`` in each value and as its
version; sets the Redis key ``<TAG>:started`` after its first step and stops when the key
``<TAG>:stop`` exists, then prints ``done <steps>``.
"""

import sys

import numpy as np

import tensorkv

KEYS = np.arange(600)
OPTIONS = {"storage_slice": 6}
TABLE = {"optimizer": tensorkv.SGD(lr=1.0), "initializer": "zeros"}


def open_table(url: str, tag: str) -> tensorkv.EmbeddingTable:
    opt = tensorkv.StorageOption("REDIS", storage_path=url, redis_options={
        "model_tag_runtime": tag, **OPTIONS})
    return tensorkv.EmbeddingTable(4, storage=opt, **TABLE)


def main() -> None:
    url, tag = sys.argv[1:3]
    t = open_table(url, tag)
    grads = -np.ones((KEYS.size, 4), np.float32)
    stop, started = f"{tag}:stop".encode(), f"{tag}:started".encode()
    store = t._rows.engine.store
    t.apply_gradients(KEYS, grads)
    store.execute([(started, ("SET", started, b"1"))])
    while not store.execute([(stop, ("EXISTS", stop))])[0]:
        t.apply_gradients(KEYS, grads)
    print("done", t.step, flush=True)


if __name__ == "__main__":
    main()
