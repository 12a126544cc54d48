"""``tensorkv bench viewer``: the viewer's queries over a large table in an LMDB checkpoint.

A table of ``rows x dim`` (SGD: no optimizer slots; a tenth of the rows trained so that
frequency and version vary) is saved once into LMDB at ``path`` (kept there and reused by
later runs with the same ``rows`` and ``dim``; a temporary directory, removed at the end, when
no path is given). Then, best of ``repeat`` runs each: exact nearest neighbours of a key
(cosine, l2) streaming the table (``tensorkv.viewer.search.nearest``), the one-pass statistics
(``tensorkv.viewer.stats.table_stats``, also of a 100,000-row sample), a page of rows, the
rows of 10 keys, and the ``tensorkv search --nearest`` command end to end (a new process).
Baselines, same run: ``tensorkv.load`` of the whole table followed by the numpy computation of
the same answer; the cosine search again with ``Catalog(release_pages=True)`` (what the
commands use).
``-p`` options: ``rows``, ``dim``, ``path``, ``repeat``, ``k``. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorkv.bench.common import Report, measure


def _best(fn: Callable[[], Any], repeat: int) -> float:
    """Fastest of ``repeat`` runs of ``fn``, in seconds (no untimed run first)."""
    return measure(fn, repeat=repeat, warmup=0).best


def ensure_checkpoint(url: str, rows: int, dim: int) -> None:
    """Save the benchmark's table into ``url`` unless a tag there already holds it."""
    import tensorkv
    from tensorkv.errors import TensorKVError
    from tensorkv.viewer import Catalog

    try:
        with Catalog(url) as cat:
            v = cat.variable("emb")
            if (v.rows, v.dim) == (rows, dim):
                return
    except TensorKVError:
        pass
    path = url.split("://", 1)[1]
    shutil.rmtree(path, ignore_errors=True)
    t = tensorkv.EmbeddingTable(dim, optimizer="sgd", seed=0)
    keys = np.random.default_rng(0).permutation(rows * 4)[:rows].astype(np.int64)
    step = 1 << 20
    for lo in range(0, rows, step):
        t.lookup(keys[lo:lo + step])
    hot = keys[: rows // 10]
    rng = np.random.default_rng(1)
    for lo in range(0, len(hot), step):
        k = hot[lo:lo + step]
        t.apply_gradients(k, rng.standard_normal((len(k), dim), dtype=np.float32), step=5)
        t.lookup(k)
    tensorkv.save({"emb": t}, url, "bench", step=5)
    del t
    gc.collect()


def run(
    quick: bool,
    report: Report,
    *,
    rows: int | None = None,
    dim: int = 64,
    path: str | None = None,
    repeat: int | None = None,
    k: int = 10,
) -> None:
    """Run the viewer workload (see the module docstring)."""
    from tensorkv.bench.kv import bench_root
    from tensorkv.viewer import Catalog, search, stats

    rows = rows if rows is not None else (200_000 if quick else 10_000_000)
    repeat = repeat if repeat is not None else (2 if quick else 3)
    own = path is None
    root = tempfile.mkdtemp(prefix="tensorkv-bench-viewer-", dir=bench_root(None)) if own \
        else None
    store = os.path.abspath(path) if path is not None else os.path.join(str(root), "store")
    url = f"lmdb://{store}"
    report.params.update(rows=rows, dim=dim, path=store, repeat=repeat, k=k, optimizer="sgd")
    try:
        t0 = time.perf_counter()
        ensure_checkpoint(url, rows, dim)
        report.params["setup_s"] = round(time.perf_counter() - t0, 1)
        s_cos = 0.0
        with Catalog(url) as cat:
            view = cat.table("emb")
            key = int(view.page(rows // 2, 1).keys[0])
            probe = view.page(0, 4096).keys[::409][:10]
            for metric in ("cosine", "l2"):
                got: list[Any] = []

                def scan(metric: str = metric, got: list[Any] = got) -> None:
                    got.append(search.nearest(view, key=key, k=k, metric=metric))

                s = _best(scan, repeat)
                if metric == "cosine":
                    s_cos = s
                nn = got[-1]
                t0 = time.perf_counter()
                want = _load_and_scan(cat.store, key, k, metric)
                base = time.perf_counter() - t0
                note = "same keys" if np.array_equal(nn.keys, want) else "KEYS DIFFER"
                report.add(f"nearest k={k} {metric}, {rows:,} rows", "s", s,
                           "load + numpy", base, note)
            with Catalog(url, release_pages=True) as lean:
                lv = lean.table("emb")
                rel = _best(lambda: search.nearest(lv, key=key, k=k, metric="cosine"), repeat)
            report.add(f"nearest k={k} cosine, release_pages=True", "s", rel,
                       "release_pages=False", s_cos, "RSS: one read group, not the file")
            st_s = _best(lambda: stats.table_stats(view), repeat)
            report.add(f"stats (histograms, never-updated), {rows:,} rows", "s", st_s,
                       "load + numpy", _best(lambda: _load_and_stats(cat.store), 1))
            fast = _best(lambda: stats.table_stats(view, never_updated=False), repeat)
            report.add("stats without never-updated", "s", fast, "load + numpy",
                       _best(lambda: _load_and_stats(cat.store), 1))
            smp = _best(lambda: stats.table_stats(view, sample=100_000), repeat)
            report.add("stats of a 100,000-row sample", "s", smp, "stats of every row", st_s)
            page = _best(lambda: view.page(rows // 2, 50), repeat)
            report.add("page of 50 rows at the middle", "s", page, "nearest (full scan)", s)
            look = _best(lambda: view.lookup(probe), repeat)
            report.add("rows of 10 keys", "s", look, "nearest (full scan)", s)
        cmd = [sys.executable, "-m", "tensorkv.cli.main", "search", url, "emb", "--nearest",
               str(key), "--k", str(k), "--json"]
        cli = _best(lambda: subprocess.run(cmd, check=True, capture_output=True), repeat)
        report.add("`tensorkv search --nearest` (new process)", "s", cli, "in process", s)
    finally:
        if own and root is not None:
            shutil.rmtree(root, ignore_errors=True)


def _load_values(url: Any) -> Any:
    import tensorkv

    table = tensorkv.load(None, url, variables=["emb"], progress=False)["emb"]
    ch = next(iter(table.export(chunk_rows=1 << 40)))
    return table, ch


def _load_and_scan(url: Any, key: int, k: int, metric: str) -> np.ndarray:
    """The baseline: load the whole table, then numpy over every row."""
    table, ch = _load_values(url)
    v = np.asarray(ch.values)
    keys = np.asarray(ch.keys)
    q = v[np.flatnonzero(keys == key)[0]]
    if metric == "l2":
        s = -np.einsum("ij,ij->i", v, v) + 2 * (v @ q)
    else:
        s = (v @ q) / np.sqrt(np.einsum("ij,ij->i", v, v))
    s[keys == key] = -np.inf
    top = np.argpartition(-s, k)[:k]
    top = top[np.lexsort((keys[top], -s[top]))]
    out = keys[top].copy()
    del table, ch, v
    gc.collect()
    return out


def _load_and_stats(url: Any) -> None:
    table, ch = _load_values(url)
    v = np.asarray(ch.values)
    norms = np.sqrt(np.einsum("ij,ij->i", v, v))
    np.histogram(norms, 20)
    np.histogram(np.asarray(ch.freq), 20)
    np.histogram(np.asarray(ch.version), 20)
    int((~np.isfinite(v)).any(axis=1).sum())
    del table, ch, v
    gc.collect()
