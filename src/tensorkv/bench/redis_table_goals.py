"""The goal workloads of ``tensorkv bench redis-table``, and what bounds them.

On one local ``redis-server`` (no persistence), ``n_keys`` keys (200,000), dim 64, batches
of 16,384:

* ``SGD upsert`` / ``SGD lookup`` (uniform random keys) in last-writer-wins and exact mode,
  each against its goal; the note gives the server's time per key from ``INFO
  commandstats`` and the bytes per key the server received and sent (``INFO stats``).
* ``Zipf 1.05 lookup, near-cache``: a read-only table with a near-cache reads batches of
  Zipf(1.05)-distributed ids while a second process (this module run as a script) trains the
  same table with the same distribution; then ``stale`` reads are counted: each of
  ``check_batches`` cached reads is bracketed by two reads without a cache, and since the
  trainer only ever adds to a row's values, a row read smaller than Redis held when the
  read began is stale (must be 0). The same reads with the trainer stopped come beside it.

Run as a script (``python -m tensorkv.bench.redis_table_goals URL TAG N_KEYS``) it is the
trainer: it trains until the Redis key ``<TAG>:stop`` exists.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from tensorkv.bench.common import Report, measure
from tensorkv.bench.redis_server import RedisServer
from tensorkv.errors import BenchmarkError

DIM = 64
BATCH = 16_384
#: Goals on the development machine (keys per second).
GOALS = {"upsert, last_writer_wins": 1.3e6, "lookup, last_writer_wins": 1.2e6,
         "upsert, exact": 0.8e6, "lookup, exact": 1.2e6, "zipf": 5e6}
ZIPF = 1.05


def _table(url: str, tag: str, **options: Any) -> Any:
    import tensorkv

    return tensorkv.EmbeddingTable(DIM, optimizer=tensorkv.SGD(lr=1.0), storage=(
        tensorkv.StorageOption("REDIS", storage_path=url,
                               redis_options={"model_tag_runtime": tag, **options})))


def zipf_ids(rng: np.random.Generator, perm: np.ndarray, size: int) -> np.ndarray:
    """``size`` ids drawn Zipf(1.05) over the ids ``perm`` (rank r has weight r**-1.05).

    The hottest id is ``perm[0]``.
    """
    cdf = _zipf_cdf(perm.size)
    return perm[np.minimum(np.searchsorted(cdf, rng.random(size)), perm.size - 1)]


@functools.lru_cache(maxsize=4)
def _zipf_cdf(n: int) -> np.ndarray:
    w = np.arange(1, n + 1, dtype=np.float64) ** -ZIPF
    return np.cumsum(w) / w.sum()


@contextlib.contextmanager
def server_cost(url: str) -> Iterator[dict[str, float]]:
    """The server's command time (µs) and bytes in/out over the block (``INFO``)."""
    import redis

    c = redis.Redis.from_url(url)

    def snap() -> tuple[float, float, float]:
        cs = c.info("commandstats")
        us = sum(float(v["usec"]) for v in cs.values())
        st = c.info("stats")
        return us, float(st["total_net_input_bytes"]), float(st["total_net_output_bytes"])

    out: dict[str, float] = {}
    a = snap()
    try:
        yield out
    finally:
        b = snap()
        out.update(us=b[0] - a[0], bytes_in=b[1] - a[1], bytes_out=b[2] - a[2])
        c.close()


def _note(cost: dict[str, float], keys: int, seconds: float) -> str:
    return (f"server {cost['us'] / keys:.2f} us/key ({100 * cost['us'] / 1e6 / seconds:.0f}% "
            f"busy), {cost['bytes_in'] / keys:.0f} B/key in, "
            f"{cost['bytes_out'] / keys:.0f} B/key out")


def run_goals(quick: bool, report: Report, *, n_keys: int | None = None,
              batch: int = BATCH, repeat: int | None = None,
              check_batches: int | None = None) -> None:
    """Run the goal workloads (see the module docstring); the arguments shrink them."""
    n = int(n_keys or 200_000)
    repeat = int(repeat or (2 if quick else 3))
    n_batches = max(1, min(8, n // batch))
    rng = np.random.default_rng(1)
    perm = rng.permutation(n).astype(np.int64)
    values = rng.standard_normal((n, DIM)).astype(np.float32)
    uniform = [rng.integers(0, n, batch) for _ in range(n_batches)]
    zipf = [zipf_ids(rng, perm, batch) for _ in range(n_batches)]
    timed = n_batches * batch
    report.params.update({"goals_n_keys": n, "goals_optimizer": "SGD", "zipf": ZIPF})
    with RedisServer() as srv:
        for mode in ("last_writer_wins", "exact"):
            t = _table(srv.url, f"sgd-{mode}", consistency=mode)
            for s in range(0, n, batch):
                t.upsert(perm[s:s + batch], values[perm[s:s + batch]])
            for what in ("upsert", "lookup"):
                fn = (functools.partial(_upserts, t, uniform, values) if what == "upsert"
                      else functools.partial(_lookups, t, uniform))
                with server_cost(srv.url) as cost:
                    best = measure(fn, repeat=repeat, warmup=0).best
                note = _note(cost, timed * repeat, best * repeat)
                report.add(f"SGD {what}, {mode}", "keys/s", timed / best, "goal",
                           GOALS[f"{what}, {mode}"], note)
            t.close()
        _zipf_case(srv.url, report, n, zipf, perm, repeat, timed,
                   int(check_batches or (20 if quick else 50)))


def _upserts(t: Any, batches: list[np.ndarray], values: np.ndarray) -> None:
    for k in batches:
        t.upsert(k, values[k])


def _lookups(t: Any, batches: list[np.ndarray]) -> None:
    for k in batches:
        t.lookup(k, insert=False)


def _zipf_case(url: str, report: Report, n: int, zipf: list[np.ndarray], perm: np.ndarray,
               repeat: int, timed: int, checks: int) -> None:
    import redis

    tag = "sgd-exact"  # filled above; trained now by a second process (exact mode)
    rows = min(n, 65_536)
    reader = _table(url, tag, read_only=True, near_cache_rows=rows)
    plain = _table(url, tag, read_only=True)
    for k in zipf:  # fill the cache
        reader.lookup(k, insert=False)
    quiet = timed / measure(functools.partial(_lookups, reader, zipf), repeat=repeat,
                            warmup=0).best
    trainer = subprocess.Popen([sys.executable, "-m", "tensorkv.bench.redis_table_goals", url,
                                tag, str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    admin = redis.Redis.from_url(url)
    try:
        while not admin.exists(f"{tag}:training"):  # the trainer is running
            if trainer.poll() is not None:
                raise BenchmarkError(f"the trainer process failed: {trainer.communicate()[1]!r}")
            time.sleep(0.05)
        before = dict(reader.stats()["redis"]["near_cache"])
        busy = timed / measure(functools.partial(_lookups, reader, zipf), repeat=repeat,
                               warmup=0).best
        after = reader.stats()["redis"]["near_cache"]
        hits = after["hits"] - before["hits"]
        share = hits / max(1, hits + after["misses"] - before["misses"])
        stale = reads = 0
        rng = np.random.default_rng(2)
        for _ in range(checks):
            k = zipf_ids(rng, perm, zipf[0].size)
            lo = plain.lookup(k, insert=False)
            got = reader.lookup(k, insert=False)
            stale += int(np.count_nonzero((got < lo).any(axis=1)))
            reads += k.size
    finally:
        admin.set(f"{tag}:stop", b"1")
        with contextlib.suppress(subprocess.TimeoutExpired):
            trainer.wait(timeout=60)
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        steps = int(admin.get(f"{tag}:steps") or 0)
        admin.delete(f"{tag}:stop", f"{tag}:training", f"{tag}:steps")
        admin.close()
        reader.close(), plain.close()
    report.params.update({"zipf_stale_reads": stale, "zipf_checked_reads": reads,
                          "zipf_trainer_steps": steps})
    report.add(f"Zipf {ZIPF} lookup, near-cache, 2nd process training", "keys/s", busy,
               "goal", GOALS["zipf"],
               f"{100 * share:.0f}% hits; stale reads {stale} of {reads} checked")
    report.add(f"Zipf {ZIPF} lookup, near-cache, no writer", "keys/s", quiet, "goal",
               GOALS["zipf"])


def _train(url: str, tag: str, n: int) -> None:
    """The second process of the Zipf case: train until ``<tag>:stop`` exists."""
    import redis

    admin = redis.Redis.from_url(url)
    t = _table(url, tag)
    rng = np.random.default_rng(3)
    perm = np.random.default_rng(1).permutation(n).astype(np.int64)
    grads = -np.ones((4096, DIM), np.float32)  # lr 1: every update adds 1
    steps = 0
    admin.set(f"{tag}:training", b"1")
    while not admin.exists(f"{tag}:stop"):
        k = zipf_ids(rng, perm, 4096)
        t.lookup(k)
        t.apply_gradients(k, grads)
        steps += 1
    admin.set(f"{tag}:steps", steps)
    t.close()
    admin.close()


if __name__ == "__main__":
    _train(sys.argv[1], sys.argv[2], int(sys.argv[3]))
