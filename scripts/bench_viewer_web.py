"""Latency of the web viewer's API on a large LMDB checkpoint, and the server's memory.

Builds (once) a checkpoint of one embedding table (``--rows`` keys of ``--dim`` float32 values
with Adagrad slots, frequencies spread by a Zipf sample of lookups) in ``--store``, starts
``tensorkv view`` on it in a subprocess, sends each endpoint ``--requests`` requests one after
another (random offsets, keys and sample sizes, so no answer comes from a cache unless said)
and prints p50/p95/max per endpoint, then the server's resident memory::

    python scripts/bench_viewer_web.py --store /tmp/viewer-bench --rows 10000000 --dim 64
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def build(url: str, rows: int, dim: int) -> None:
    """Save tag ``bench`` of a ``rows`` x ``dim`` table into ``url`` (skipped if present)."""
    import tensorkv
    from tensorkv.errors import StoreNotFoundError

    try:
        if tensorkv.list_tags(url):
            return
    except StoreNotFoundError:
        pass
    t0 = time.perf_counter()
    table = tensorkv.EmbeddingTable(dim, optimizer="adagrad", seed=1, capacity=rows)
    rng = np.random.default_rng(0)
    step = 1_000_000
    for lo in range(0, rows, step):
        keys = np.arange(lo, min(lo + step, rows), dtype=np.int64) * 2654435761 + 17
        table.lookup(keys)
        hot = keys[rng.zipf(1.3, len(keys) // 10) % len(keys)]
        table.apply_gradients(hot, rng.standard_normal((len(hot), dim)).astype(np.float32),
                              step=1 + lo // step)
    print(f"built {rows:,} rows in {time.perf_counter() - t0:.0f} s", flush=True)
    tensorkv.save({"emb": table}, url, tag="bench", step=1, progress=False)
    print(f"saved in {time.perf_counter() - t0:.0f} s", flush=True)


def get(base: str, path: str, **params: object) -> tuple[float, dict]:
    """(seconds, JSON body) of one GET."""
    url = f"{base}api/{path}?{urllib.parse.urlencode(params)}"
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as resp:
        body = json.loads(resp.read())
    return time.perf_counter() - t0, body


def memory(pid: int) -> dict[str, float]:
    """The server's resident memory (MB): total, anonymous (its own), file pages, peak."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[name] = int(value.split()[0]) / 1024
    return out


def main() -> None:
    """Build the store if needed, start the viewer, time the endpoints."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="/tmp/viewer-bench")
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args()
    url = f"lmdb://{os.path.abspath(args.store)}"
    build(url, args.rows, args.dim)
    if args.build_only:
        return
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "tensorkv.cli.main", "view", url, "--port",
                             "0"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        m = re.search(r"at (http://\S+/)", proc.stdout.readline())
        assert m, "the viewer did not start"
        base = m.group(1)
        rng = np.random.default_rng(1)
        n = args.requests
        total = get(base, "variables")[1]["variables"][0]["rows"]
        # one request of each kind first: numba compiles (or loads from its cache) the
        # kernels a query uses on its first call in a process; timings are of steady state
        first = get(base, "rows", var="emb", limit=50)[1]["rows"]["key"]
        for path, params in (("search", {"keys": first[0]}), ("row", {"key": first[1]}),
                             ("pca", {"n": 500})):
            get(base, path, var="emb", **params)
        keys: list[str] = []

        def timed_round() -> dict[str, list[float]]:
            times: dict[str, list[float]] = {}

            def time_it(name: str, path: str, **params: object) -> dict:
                dt, body = get(base, path, **params)
                times.setdefault(name, []).append(dt)
                return body

            for _ in range(n):
                time_it("list tags", "tags")
                time_it("list variables", "variables")
                page = time_it("page of 50 rows", "rows", var="emb", limit=50,
                               offset=int(rng.integers(0, total - 50)))
                keys.extend(page["rows"]["key"][:5])
            for _ in range(n):
                pick = rng.choice(len(keys), 5, replace=False)
                time_it("key search (5 keys)", "search", var="emb",
                        keys=",".join(keys[i] for i in pick))
                time_it("row detail", "row", var="emb", key=keys[int(rng.integers(len(keys)))])
                time_it("PCA sample (1000-3000 rows, uncached)", "pca", var="emb",
                        n=int(rng.integers(1000, 3000)))
            return times

        # first with the page cache as the machine left it, then after one full pass over
        # the file (the histograms' first request), the server's steady state
        cold = timed_round()
        mem_cold = memory(proc.pid)
        t_stats, _ = get(base, "stats", var="emb")
        mem_stats = memory(proc.pid)
        warm = timed_round()
        for _ in range(n):
            dt, _ = get(base, "stats", var="emb")
            warm.setdefault("histograms (cached)", []).append(dt)
        mem_before_nn = memory(proc.pid)
        for _ in range(5):
            dt, _ = get(base, "nearest", var="emb", key=keys[int(rng.integers(len(keys)))], k=10)
            warm.setdefault("nearest k=10 cosine, full scan", []).append(dt)
        mem = memory(proc.pid)
        print(f"\n{total:,} rows, dim {args.dim}; {n} requests per endpoint (nearest: 5)")
        for title, times in (("page cache as the machine left it", cold),
                             ("after one full pass (steady state)", warm)):
            print(f"\n{title}\n{'endpoint':40} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
            for name, ts in times.items():
                a = np.array(ts) * 1000
                print(f"{name:40} {np.percentile(a, 50):8.1f} {np.percentile(a, 95):8.1f} "
                      f"{a.max():8.1f}")
        print(f"{'histograms, first request (full pass)':40} {t_stats * 1000:8.0f}")
        print("server memory (MB) after the first round: " + ", ".join(
            f"{k} {v:.0f}" for k, v in mem_cold.items()))
        print("server memory (MB) after the full pass:   " + ", ".join(
            f"{k} {v:.0f}" for k, v in mem_stats.items()))
        print("server memory (MB) before nearest: " + ", ".join(
            f"{k} {v:.0f}" for k, v in mem_before_nn.items()))
        print("server memory (MB) at the end:     " + ", ".join(
            f"{k} {v:.0f}" for k, v in mem.items()))
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
