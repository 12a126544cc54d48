"""A process whose background saves (``blocking=False``) die while training goes on.

``python bg_saver.py URL...`` forks one child that saves ``t0`` (a tiered table trained a few
steps, and a dense tensor) into every URL, prints ``ready``, then answers one JSON command
per stdin line: ``{"url": URL, "kill_at": N, "mode": "before" | "after"}`` forks a child that
loads ``t0``, trains 10 more steps, starts ``save(..., "t1", blocking=False)`` and trains 30
steps more while the save writes, SIGKILLing itself at the save's N-th store event
(``faults.saver.arm_kill``); ``N = 0`` never kills. Answers ``{"status": "killed" |
"completed", "events": n}``. Every child computes the same states (seeded), so an unkilled
run's tags are the reference of the killed ones.

``python bg_saver.py exit URL`` saves ``t0``, starts the save of ``t1`` in the background and
exits at once: what happens to ``t1`` is the exit policy's (``TENSORKV_SAVE_AT_EXIT``). With
``abandon`` the save's first store write waits until it has been cancelled, so it cannot
finish before the process exits.
"""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":  # run as a script: make the ``faults`` package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

DIM = 4
BATCH = 64
IDS = 4000


def build():
    """The model: a DRAM_SSDHASH table (tier 0 of 50 rows, a temporary spill directory)."""
    import tensorkv

    rb = tensorkv.embedding.tiers.base.RecordLayout(DIM, "float32", 1).record_bytes
    table = tensorkv.EmbeddingTable(DIM, optimizer="adagrad", seed=1, storage="DRAM_SSDHASH",
                                    storage_size=[50 * rb])
    return {"t": table, "w": np.zeros((16, 16), np.float32)}


def train(model, first: int, steps: int) -> None:
    """Steps ``first .. first + steps - 1`` (each seeded by its number)."""
    for s in range(first, first + steps):
        rng = np.random.default_rng([7, s])
        keys = rng.integers(0, IDS, BATCH)
        model["t"].lookup(keys)
        model["t"].apply_gradients(keys, rng.standard_normal((BATCH, DIM)).astype(np.float32))
        model["w"] += np.float32(1.0)


OPTIONS = {"block_rows": 32, "bucket_bits": 0, "chunk_bytes": 4096}


def main() -> None:
    import tensorkv
    from faults.saver import _fork, arm_kill, store_class
    from tensorkv.checkpoint import writer

    writer.WRITE_BATCH_BYTES = 4096  # a small model's save still makes dozens of writes
    if sys.argv[1] == "exit":
        exit_run(sys.argv[2])
        return
    urls = sys.argv[1:]

    def setup(out: int) -> None:
        model = build()
        train(model, 0, 30)
        for url in urls:
            tensorkv.save(model, url, "t0", **OPTIONS)
        model["t"].close()

    status, _ = _fork(setup)
    if status != "completed":
        sys.exit(f"saving t0 failed: {status}")
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)

        def work(out: int, url: str = cmd["url"], kill_at: int = int(cmd["kill_at"]),
                 mode: str = cmd["mode"]) -> None:
            model = build()
            tensorkv.load(model, url, "t0")
            train(model, 30, 10)
            events = arm_kill(store_class(url), kill_at, mode)
            handle = tensorkv.save(model, url, "t1", blocking=False, **OPTIONS)
            train(model, 40, 30)  # while the save writes
            handle.result()
            os.write(out, b"%d" % events())
            model["t"].close()

        status, events = _fork(work)
        print(json.dumps({"status": status, "events": events}), flush=True)


def exit_run(url: str) -> None:
    """Save t0, start t1 in the background and return (the process exits)."""
    import tensorkv
    from tensorkv.stores.registry import parse_url

    model = build()
    train(model, 0, 30)
    tensorkv.save(model, url, "t0", **OPTIONS)
    handle = None
    if os.environ.get("TENSORKV_SAVE_AT_EXIT") == "abandon":
        from faults.saver import store_class

        cls = store_class(url)
        cas = cls.compare_and_set

        def after_cancel(self, key, expected, value):  # the save's claim waits for cancel()
            while handle is None or not handle.cancelled():
                time.sleep(0.005)
            return cas(self, key, expected, value)

        cls.compare_and_set = after_cancel
    assert parse_url(url).scheme
    handle = tensorkv.save(model, url, "t1", blocking=False, **OPTIONS)
    train(model, 30, 5)
    print("exiting", flush=True)


if __name__ == "__main__":
    main()
