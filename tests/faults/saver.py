"""A saving process that SIGKILLs itself at a chosen store write (run as a script).

The fault tests start ``python saver.py URL`` once per store. It saves the states ``t0``
(full) and ``t1`` (incremental) of :mod:`model`, prints ``ready``, then answers one JSON
command per stdin line:

- ``{"kill_at": N, "mode": "before" | "after"}``: fork a child that loads ``t1`` into the
  model, updates it to the state ``t2`` and saves ``t2`` (incremental on ``t1``), killing
  itself with SIGKILL at its N-th store event (a ``_write`` or ``_flush`` call of the
  store's class), before or after the backend runs it; ``N = 0`` never kills. Answers
  ``{"status": "killed" | "completed", "events": n}``, ``n`` the events of a finished save.

``t0`` and ``t1`` are saved by a forked child too: this process never opens the store and
forks with no other thread running (RocksDB's background threads would not survive a
fork), so every child starts from the same state and children differ only in where they
die. Record batches are made small (``writer.WRITE_BATCH_BYTES``) so a small model's save
makes dozens of store writes, as a large model's does with the default batch size.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

if __name__ == "__main__":  # run as a script: make the ``faults`` package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH_BYTES = 4096


def store_class(url: str) -> type:
    """The KVStore class that serves ``url``."""
    from tensorkv.stores.registry import parse_url

    scheme = parse_url(url).scheme
    if scheme == "lmdb":
        from tensorkv.stores.lmdb import LMDBStore

        return LMDBStore
    if scheme == "rocksdb":
        from tensorkv.stores.rocksdb import RocksDBStore

        return RocksDBStore
    if scheme == "leveldb":
        from tensorkv.stores.leveldb import LevelDBStore

        return LevelDBStore
    from tensorkv.stores.redis import RedisStore

    return RedisStore


def arm_kill(cls: type, kill_at: int, mode: str) -> Callable[[], int]:
    """Make every ``cls`` store SIGKILL this process at its ``kill_at``-th write or flush.

    Counts calls of ``cls._write`` and ``cls._flush`` (from any thread) and kills at call
    ``kill_at`` before the backend runs it (``mode="before"``) or after it returned
    (``"after"``); ``kill_at=0`` never kills. Returns a function giving the count so far.
    """
    if mode not in ("before", "after"):
        raise ValueError(f"mode={mode!r}: use 'before' or 'after'")
    counter = itertools.count(1)
    seen = [0]
    lock = threading.Lock()

    def event(run: Callable[[], Any]) -> Any:
        with lock:
            n = seen[0] = next(counter)
        if n == kill_at and mode == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = run()
        if n == kill_at and mode == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    write, flush = cls._write, cls._flush

    def _write(self: Any, ops: Any, *, atomic: bool) -> None:
        event(lambda: write(self, ops, atomic=atomic))

    def _flush(self: Any) -> None:
        event(lambda: flush(self))

    cls._write = _write  # type: ignore[attr-defined]
    cls._flush = _flush  # type: ignore[attr-defined]
    return lambda: seen[0]


def _fork(work: Callable[[int], None]) -> tuple[str, int]:
    """Run ``work(fd)`` in a forked child; ``(status, n)``, ``n`` the number it wrote to fd."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            work(w)
        except BaseException as exc:  # noqa: BLE001 - reported through the exit code
            print(f"save failed: {exc!r}", file=sys.stderr, flush=True)
            os._exit(3)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        reported = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed", 0
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return "completed", int(reported or b"0")
    return "failed", status


def main() -> None:
    url = sys.argv[1]
    import tensorkv
    from faults.model import SAVE_OPTIONS, stages
    from tensorkv.checkpoint import writer

    writer.WRITE_BATCH_BYTES = BATCH_BYTES
    it = stages()
    _, first = next(it)

    def setup(out: int) -> None:
        # in a child: a store's native threads (RocksDB's) must not exist when we fork
        tensorkv.save(first, url, "t0", step=1, **SAVE_OPTIONS)
        _, second = next(it)
        tensorkv.save(second, url, "t1", step=2, incremental=True, **SAVE_OPTIONS)

    status, _ = _fork(setup)
    if status != "completed":
        sys.exit(f"saving t0 and t1 failed: {status}")
    _, model = next(it)  # the state of t1, in memory (this process never opens the store)
    assert threading.active_count() == 1, threading.enumerate()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)

        def save_t2(out: int, kill_at: int = int(cmd["kill_at"]), mode: str = cmd["mode"]
                    ) -> None:
            tensorkv.load(model, url, "t1")  # the table knows t1: the save is incremental
            _, last = next(it)
            events = arm_kill(store_class(url), kill_at, mode)
            tensorkv.save(last, url, "t2", step=3, incremental=True, parent="t1",
                          **SAVE_OPTIONS)
            os.write(out, b"%d" % events())

        status, events = _fork(save_t2)
        print(json.dumps({"status": status, "events": events}), flush=True)


if __name__ == "__main__":
    main()
