"""``tensorkv bench redis-table``: a table whose rows live in Redis, on a local redis-server.

The benchmark starts its own ``redis-server`` processes on loopback (one standalone server,
then Redis Clusters of 1 and 3 masters) and removes them at the end. Rows of dim 64 with one
Adagrad slot (552 bytes with the checksum), ``n_keys`` keys, batches of 16,384 random keys:

* ``upsert``: ``table.upsert`` (exact mode) vs the Redis store holding one string key per
  row (``RedisStore.put_many`` of the same records) and vs the DRAM table; then in
  last-writer-wins mode (no locks, no fenced writes).
* ``lookup``: a read-only (serving) table's ``lookup`` vs ``RedisStore.get_many`` of the
  records decoded into rows, and vs the DRAM table.
* ``lookup+apply``: a training step (lookup, then Adagrad) in exact mode and in
  last-writer-wins mode vs the DRAM table.
* ``cluster``: upsert and lookup on Clusters of 2 and 3 masters vs a Cluster of 1.
* the goal workloads (SGD rows, both consistency modes, Zipf lookups through a near-cache
  while another process trains): :mod:`tensorkv.bench.redis_table_goals`.

Figures are keys per second (best of ``repeat`` passes). ``-p`` options: ``n_keys``,
``batch``, ``repeat``, ``cluster`` (false: skip the Clusters), ``goals`` (false: skip the
goal workloads). Current figures:
docs/benchmarks.md ("bench redis-table").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np

from tensorkv.bench.common import Report, measure
from tensorkv.bench.redis_server import RedisServer, free_port, redis_server_path
from tensorkv.errors import BenchmarkError

DIM = 64
BATCH = 16_384




@contextlib.contextmanager
def _cluster(masters: int) -> Iterator[str]:
    """A throwaway Redis Cluster of ``masters`` nodes on loopback; yields its URL."""
    exe, cli = redis_server_path(), shutil.which("redis-cli")
    if exe is None or cli is None:
        raise BenchmarkError("redis-server and redis-cli must be on PATH for the Cluster cases")
    d = tempfile.mkdtemp(prefix="tensorkv-cluster-")
    procs, ports = [], []
    try:
        for i in range(masters):
            port = free_port()
            while port + 10000 > 65535:  # pragma: no cover - the bus port must exist
                port = free_port()
            nd = os.path.join(d, str(i))
            os.makedirs(nd)
            procs.append(subprocess.Popen(
                [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", nd, "--save", "",
                 "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file",
                 "nodes.conf", "--loglevel", "warning"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            ports.append(port)
        for port in ports:
            _wait_port(port)
        if masters < 3:  # redis-cli --cluster create wants 3 masters: assign the slots
            cuts = [16384 * i // masters for i in range(masters + 1)]
            cmds = [[cli, "-p", str(p), "cluster", "addslotsrange", str(a), str(b - 1)]
                    for p, a, b in zip(ports, cuts[:-1], cuts[1:], strict=True)]
            cmds += [[cli, "-p", str(ports[0]), "cluster", "meet", "127.0.0.1", str(p)]
                     for p in ports[1:]]
        else:
            cmds = [[cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                     "--cluster-yes"]]
        for cmd in cmds:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            if r.returncode != 0 or "ERR" in r.stdout:
                raise BenchmarkError(f"creating the Cluster failed: {r.stdout}{r.stderr}")
        deadline = time.monotonic() + 30
        while not all(b"cluster_state:ok" in subprocess.run(
                [cli, "-p", str(p), "cluster", "info"], capture_output=True).stdout
                for p in ports):
            if time.monotonic() > deadline:
                raise BenchmarkError("the benchmark's Redis Cluster did not become ready")
            time.sleep(0.1)
        yield "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        shutil.rmtree(d, ignore_errors=True)


def _wait_port(port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise BenchmarkError(f"redis-server on port {port} did not start")


def _table(url: str, **options: Any) -> Any:
    import tensorkv

    return tensorkv.EmbeddingTable(DIM, optimizer="adagrad", storage=tensorkv.StorageOption(
        "REDIS", storage_path=url, redis_options=options))


def run(quick: bool, report: Report, *, n_keys: int | None = None, batch: int = BATCH,
        repeat: int | None = None, cluster: bool = True, goals: bool = True) -> None:
    """Run the workload (see the module docstring); the arguments shrink it for tests."""
    import tensorkv
    from tensorkv.embedding.tiers.base import RecordLayout

    if redis_server_path() is None:
        raise BenchmarkError("redis-server is not on PATH; install it (apt-get install "
                             "redis-server, or `make redis-server`)")
    n = int(n_keys or (200_000 if quick else 1_000_000))
    repeat = int(repeat or (3 if quick else 5))
    n_batches = max(1, min(8, n // batch))
    report.params.update({"n_keys": n, "batch": batch, "dim": DIM, "optimizer": "Adagrad",
                          "timed_batches": n_batches, "repeat": repeat})
    rng = np.random.default_rng(0)
    keys = rng.permutation(n).astype(np.int64)
    values = rng.standard_normal((n, DIM)).astype(np.float32)
    batches = [rng.integers(0, n, batch) for _ in range(n_batches)]
    grads = rng.standard_normal((batch, DIM)).astype(np.float32)
    up_keys = [keys[s:s + batch] for s in range(0, n_batches * batch, batch)]
    timed = n_batches * batch

    def upsert(t: Any) -> Callable[[], object]:
        return lambda: [t.upsert(k, values[k]) for k in up_keys]

    def fill(t: Any) -> None:
        for s in range(0, n, batch):
            t.upsert(keys[s:s + batch], values[keys[s:s + batch]])

    def lookup(t: Any) -> Callable[[], object]:
        return lambda: [t.lookup(b, insert=False) for b in batches]

    def train(t: Any) -> Callable[[], object]:
        return lambda: [(t.lookup(b), t.apply_gradients(b, grads)) for b in batches]

    dram = tensorkv.EmbeddingTable(DIM, optimizer="adagrad")
    fill(dram)
    base = {"upsert": timed / measure(upsert(dram), repeat=repeat, warmup=0).best,
            "lookup": timed / measure(lookup(dram), repeat=repeat, warmup=0).best,
            "train": timed / measure(train(dram), repeat=repeat, warmup=0).best}
    layout = RecordLayout(DIM, "float32", 1)
    with RedisServer() as srv:
        table = _table(srv.url, model_tag_runtime="bench")
        fill(table)
        up = timed / measure(upsert(table), repeat=repeat, warmup=0).best
        server = _table(srv.url, model_tag_runtime="bench", read_only=True)
        lk = timed / measure(lookup(server), repeat=repeat, warmup=0).best
        store = tensorkv.open_store(srv.url, prefix="kv/")
        recs = [layout.pack(k, values[k], np.zeros((k.size, DIM), np.float32))
                for k in up_keys]
        names = [[b"%d" % x for x in k.tolist()] for k in up_keys]
        look_names = [[b"%d" % x for x in b.tolist()] for b in batches]
        def store_upsert() -> None:
            for nm, r in zip(names, recs, strict=True):
                store.put_many(zip(nm, r.view(f"V{layout.record_bytes}").ravel().tolist(),
                                   strict=True))

        store_up = timed / measure(store_upsert, repeat=repeat, warmup=0).best
        fill_names = [b"%d" % x for x in range(n)]
        blank = bytes(layout.record_bytes)
        for s in range(0, n, batch):
            store.put_many((k, blank) for k in fill_names[s:s + batch])

        def store_lookup() -> None:
            for nm in look_names:
                got = store.get_many(nm)
                blob = b"".join(cast("list[bytes]", got))  # every key is there
                np.frombuffer(blob, np.uint8).reshape(len(nm), -1)

        store_lk = timed / measure(store_lookup, repeat=repeat, warmup=0).best
        report.add("upsert", "keys/s", up, "Redis store, 1 key per row", store_up)
        report.add("upsert", "keys/s", up, "DRAM table", base["upsert"])
        report.add("lookup (read-only table)", "keys/s", lk, "Redis store, 1 key per row",
                   store_lk)
        report.add("lookup (read-only table)", "keys/s", lk, "DRAM table", base["lookup"])
        tr_exact = timed / measure(train(table), repeat=repeat, warmup=0).best
        lww = _table(srv.url, model_tag_runtime="bench", consistency="last_writer_wins")
        up_lww = timed / measure(upsert(lww), repeat=repeat, warmup=0).best
        tr_lww = timed / measure(train(lww), repeat=repeat, warmup=0).best
        report.add("upsert, last_writer_wins", "keys/s", up_lww, "DRAM table", base["upsert"])
        report.add("lookup+apply, exact", "keys/s", tr_exact, "last_writer_wins", tr_lww)
        report.add("lookup+apply, exact", "keys/s", tr_exact, "DRAM table", base["train"])
        report.add("lookup+apply, last_writer_wins", "keys/s", tr_lww, "DRAM table",
                   base["train"])
        for t in (table, server, lww):
            t.close()
        store.close()
    if goals:
        from tensorkv.bench.redis_table_goals import run_goals

        run_goals(quick, report, n_keys=n_keys, batch=batch, repeat=repeat)
    if not cluster:
        return
    figures = {}
    for masters in (1, 2, 3):
        with _cluster(masters) as url:
            t = _table(url, model_tag_runtime="bench", storage_slice=48)
            fill(t)
            ro = _table(url, model_tag_runtime="bench", storage_slice=48, read_only=True)
            figures[masters] = (timed / measure(upsert(t), repeat=repeat, warmup=0).best,
                                timed / measure(lookup(ro), repeat=repeat, warmup=0).best)
            t.close(), ro.close()
    for masters in (2, 3):
        report.add(f"Cluster {masters} masters: upsert", "keys/s", figures[masters][0],
                   "Cluster 1 master", figures[1][0])
        report.add(f"Cluster {masters} masters: lookup", "keys/s", figures[masters][1],
                   "Cluster 1 master", figures[1][1])
