"""A trainer process that SIGKILLs itself in the middle of one operation.

``python crash_writer.py URL TAG KILL_STEP KILL_CALL WHEN``: trains :func:`batches` (a lookup
then an apply per step) on the table :func:`open_table` opens; during step ``KILL_STEP`` it
sends SIGKILL to itself before (``WHEN=before``) or after (``after``) its ``KILL_CALL``-th call
to the Redis store (reads, lock, prepare, commit, apply: wherever that lands). Prints ``done``
if it survives.
"""

import os
import signal
import sys

import numpy as np

import tensorkv

STEPS = 5
# The next process waits up to lock_ttl_seconds for the locks the killed one held; a shorter
# TTL expires the live writer's own locks when a loaded machine stalls it for a second.
OPTIONS = {"storage_slice": 6, "lock_ttl_seconds": 10, "keys_sending_size": 8}
TABLE = {"optimizer": "adagrad", "seed": 9}


def open_table(url: str, tag: str, **extra) -> tensorkv.EmbeddingTable:
    opt = tensorkv.StorageOption("REDIS", storage_path=url, redis_options={
        "model_tag_runtime": tag, **OPTIONS, **extra})
    return tensorkv.EmbeddingTable(4, storage=opt, **TABLE)


def batches():
    """Each step's keys (22 of 60) and gradients."""
    rng = np.random.default_rng(5)
    for _ in range(STEPS):
        yield (rng.choice(60, 22, replace=False).astype(np.int64),
               rng.normal(size=(22, 4)).astype(np.float32))


def arm(store, at: int, when: str, fault) -> None:
    """Run ``fault()`` before or after the ``at``-th call to ``store`` from now."""
    calls = [0]

    def wrap(real):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == at and when == "before":
                fault()
            out = real(*args, **kwargs)
            if calls[0] == at and when == "after":
                fault()
            return out
        return call

    store.execute = wrap(store.execute)
    store.execute_raw = wrap(store.execute_raw)


def main() -> None:
    url, tag, kill_step, kill_call, when = sys.argv[1:6]
    t = open_table(url, tag)
    for i, (keys, grads) in enumerate(batches()):
        if i == int(kill_step):
            arm(t._rows.engine.store, int(kill_call), when,
                lambda: os.kill(os.getpid(), signal.SIGKILL))
        t.lookup(keys)
        t.apply_gradients(keys, grads)
    print("done", flush=True)


if __name__ == "__main__":
    main()
