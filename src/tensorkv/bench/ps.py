"""``tensorkv bench ps``: pull + push throughput of a parameter server on Ray vs one process.

Each step pulls the rows of a batch of keys (``lookup``) and pushes one gradient per key
(``apply_gradients``, Adagrad), dim 64, on a table filled beforehand (the keys of the timed
batches all have rows; ids drawn uniformly from ``vocab``). Cases: 1, 2 and 4 shards with one
worker (this process), and 2 shards with 2 workers (two Ray actors, each its own client, at
once), against the in-process :class:`~tensorkv.EmbeddingTable` on the same batches in the
same run, timed again right before each case (the machine's load drifts). The per-call
overhead is a pull of one key (one request to one shard) against a bare Ray actor call; a pull
of an empty batch sends no request at all. The latency of a small step (256 keys, 2 shards:
the lookup and the push each staged on both shards, then committed) is the median over many
steps against the in-process table's.
Starts a local Ray (``num_cpus`` = the machine's, loopback only) unless one runs.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import numpy as np

from tensorkv.bench.common import Report

DIM = 64


def _batches(n_batches: int, batch: int, vocab: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, batch) for _ in range(n_batches)]


def _steps(table: Any, batches: list[np.ndarray], grads: np.ndarray) -> float:
    """Seconds of lookup + apply_gradients of every batch."""
    t0 = time.perf_counter()
    for k in batches:
        table.lookup(k)
        table.apply_gradients(k, grads)
    return time.perf_counter() - t0


class _Worker:
    """A client in its own process (a Ray actor) for the several-workers case."""

    def __init__(self, ps_name: str) -> None:
        from tensorkv.distributed import ParameterServer

        self.table = ParameterServer(name=ps_name).table("t")

    def run(self, batches: list[np.ndarray], grads: np.ndarray, start: float) -> float:
        while time.time() < start:  # all workers begin together
            time.sleep(0.001)
        return _steps(self.table, [np.array(b) for b in batches], np.array(grads))


def _fill(table: Any, vocab: int, chunk: int = 1 << 18) -> None:
    for lo in range(0, vocab, chunk):
        table.lookup(np.arange(lo, min(lo + chunk, vocab), dtype=np.int64))


def _median_step(table: Any, batches: list[np.ndarray], grads: np.ndarray) -> float:
    """Median seconds of one lookup + apply_gradients over ``batches``."""
    times = []
    for k in batches:
        t0 = time.perf_counter()
        table.lookup(k)
        table.apply_gradients(k, grads)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run(quick: bool, report: Report, *, batch: int = 65536, steps: int | None = None,
        vocab: int | None = None, shards: str | None = None, calls: int | None = None,
        workers: int = 2, small: int = 256) -> None:
    """Run the workload (see the module docstring).

    Parameters
    ----------
    batch
        Keys per pull and per push (default 65,536).
    steps
        Timed steps per case (default 20; quick 4).
    vocab
        Distinct ids (default 1,000,000; quick 200,000).
    shards
        Shard counts of the one-worker cases, comma-separated (default ``1,2,4``; quick
        ``1,2``).
    calls
        Timed one-key pulls and bare actor calls (default 2000; quick 300).
    workers
        Worker actors of the several-workers case, on 2 shards (0 leaves the case out).
    small
        Keys per step of the latency case on 2 shards (0 leaves it out).
    """
    import ray

    from tensorkv import Adagrad, EmbeddingTable
    from tensorkv.distributed import ParameterServer, start_local_ray

    steps = steps or (4 if quick else 20)
    vocab = vocab or (200_000 if quick else 1_000_000)
    calls = calls or (300 if quick else 2000)
    counts = [int(x) for x in str(shards or ("1,2" if quick else "1,2,4")).split(",")]
    if batch < 1 or steps < 1 or vocab < 1 or calls < 1 or min(counts) < 1 or workers < 0 \
            or small < 0:
        raise ValueError(f"batch={batch}, steps={steps}, vocab={vocab}, calls={calls}, "
                         f"shards={counts}, workers={workers}, small={small}: all must be >= 1 "
                         "(workers and small >= 0)")
    report.params.update(batch=batch, steps=steps, vocab=vocab, dim=DIM, shards=counts)
    batches = _batches(steps + 1, batch, vocab, 0)
    grads = np.random.default_rng(1).standard_normal((batch, DIM)).astype(np.float32)
    local = EmbeddingTable(DIM, optimizer=Adagrad(lr=0.05))
    _fill(local, vocab)
    _steps(local, batches[:1], grads)  # warm up (numba, page faults)

    def base_rate() -> float:
        """The in-process table's keys/s, timed again right before each case (drift)."""
        return batch * steps / _steps(local, batches[1:], grads)
    started = not ray.is_initialized()
    if started:
        start_local_ray(num_cpus=os.cpu_count() or 2)
    try:
        for n in counts:
            with ParameterServer(n, name=f"bench-{uuid.uuid4().hex[:8]}") as ps:
                t = ps.table("t", DIM, optimizer=Adagrad(lr=0.05))
                _fill(t, vocab)
                _steps(t, batches[:1], grads)
                base = base_rate()
                sec = _steps(t, batches[1:], grads)
                report.add(f"pull+push, {n} shard{'s' * (n > 1)}, 1 worker", "keys/s",
                           batch * steps / sec, "in-process table", base,
                           note="goal >= 0.4 with 2 shards" if n == 2 else "")
                if n == 2 and small:
                    few = _batches(calls // 3 + 1, small, vocab, 2)
                    g = grads[:small]
                    _steps(t, few[:1], g)
                    _steps(local, few[:1], g)
                    report.add(f"step of {small} keys, 2 shards (latency)", "ms",
                               _median_step(t, few[1:], g) * 1e3, "in-process table",
                               _median_step(local, few[1:], g) * 1e3,
                               note="lookup and push: staged, then committed")
                if n == 1:
                    one = np.array([7], np.int64)
                    t.lookup(one)
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        t.lookup(one)
                    pull1 = (time.perf_counter() - t0) / calls
                    actor = ps.actors[0]
                    ray.get(actor.ping.remote())
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        ray.get(actor.ping.remote())
                    ping = (time.perf_counter() - t0) / calls
                    report.add("pull of 1 key (per-call overhead)", "ms", pull1 * 1e3,
                               "bare Ray actor call", ping * 1e3, note="goal < 1 ms")
                    empty = np.empty(0, np.int64)
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        t.lookup(empty)
                    report.add("pull of an empty batch", "ms",
                               (time.perf_counter() - t0) / calls * 1e3, "bare Ray actor call",
                               ping * 1e3, note="no request is sent")
        if workers > 0:
            with ParameterServer(2, name=f"bench-{uuid.uuid4().hex[:8]}") as ps:
                t = ps.table("t", DIM, optimizer=Adagrad(lr=0.05))
                _fill(t, vocab)
                cls: Any = ray.remote(num_cpus=0)(_Worker)
                actors = [cls.remote(ps.name) for _ in range(workers)]
                ray.get([w.run.remote(batches[:1], grads, 0.0) for w in actors])
                base = base_rate()
                start = time.time() + 0.5
                secs = ray.get([w.run.remote(batches[1:], grads, start) for w in actors])
                report.add(f"pull+push, 2 shards, {workers} workers", "keys/s",
                           workers * batch * steps / max(secs), "in-process table", base)
                for w in actors:
                    ray.kill(w)
    finally:
        if started:
            ray.shutdown()
