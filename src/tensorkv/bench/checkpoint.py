"""``tensorkv bench checkpoint``: save and restore a model with a large embedding table.

The model (an Adagrad EmbeddingTable of ``rows x dim`` plus ``dense_mb`` MB of dense tensors)
goes through ``tensorkv.save`` / ``load`` on LMDB, RocksDB, LevelDB and Redis, and through
``torch.save``, safetensors and ``np.save`` of the same arrays and a raw sequential write and
read, in the same run; also incremental against full saves, a tiered table's save and
restore, table block sizes, and saves while the demo's model trains (blocking against
``blocking=False``, :mod:`tensorkv.bench.save_training`). MB/s of model bytes, best of
``repeat`` runs. ``-p`` options: ``rows``, ``dim``, ``dense_mb``, ``backends``,
``block_sizes``, ``repeat``, ``root``, ``tiered``, ``training``. What it measures and the
current figures: docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from tensorkv import pages
from tensorkv.bench.common import Report

MB = 1e6


def _build(rows: int, dim: int, dense_mb: float, seed: int = 0) -> dict[str, Any]:
    from tensorkv.embedding.table import EmbeddingTable

    rng = np.random.default_rng(seed)
    table = EmbeddingTable(dim, optimizer="adagrad", seed=seed)
    step = 1 << 20
    for lo in range(0, rows, step):
        n = min(step, rows - lo)
        keys = np.arange(lo, lo + n, dtype=np.int64) * 1_000_003 + 17
        vals = rng.standard_normal((n, dim), dtype=np.float32)
        slots = rng.random((n, dim), dtype=np.float32)
        table.import_([(keys, vals, slots, rng.integers(0, 100, n), rng.integers(0, 1000, n))])
    n_dense = max(1, int(dense_mb * MB / (4 * 1_000_000)))
    per = int(dense_mb * MB / 4 / n_dense)
    dense = {
        f"layer{i}.weight": rng.standard_normal(per, dtype=np.float32).reshape(-1, 100)
        if per % 100 == 0 else rng.standard_normal(per, dtype=np.float32)
        for i in range(n_dense)
    }
    return {"emb": table, **dense}


def _flat_arrays(model: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {k: v for k, v in model.items() if isinstance(v, np.ndarray)}
    chunks = list(model["emb"].export(chunk_rows=1 << 40))
    ch = chunks[0]
    for f in ("keys", "values", "slots", "freq", "version"):
        out[f"emb.{f}"] = np.ascontiguousarray(getattr(ch, f))
    return out


def _time(fn: Callable[[], Any]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _best(fn: Callable[[], Any], repeat: int, setup: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        times.append(_time(fn))
    return min(times)


def _baselines(
    arrays: dict[str, np.ndarray], root: str, repeat: int
) -> dict[str, tuple[float, float]]:
    """Seconds to write and read the arrays with each baseline: name -> (write, read)."""
    import torch
    from safetensors.numpy import load_file, save_file

    out: dict[str, tuple[float, float]] = {}
    total = sum(a.nbytes for a in arrays.values())
    # raw sequential write + fsync, and read, of the same byte count
    raw = os.path.join(root, "raw.bin")
    bufs = [a.reshape(-1).view(np.uint8).data for a in arrays.values()]

    def raw_write() -> None:
        with open(raw, "wb", buffering=0) as f:
            for b in bufs:
                for off in range(0, b.nbytes, 64 << 20):
                    f.write(b[off : off + (64 << 20)])
            os.fsync(f.fileno())

    buf = bytearray(64 << 20)

    def raw_read() -> None:
        n = 0
        with open(raw, "rb", buffering=0) as f:
            while True:
                k = f.readinto(buf)
                if not k:
                    break
                n += k
        assert n == total

    out["raw write+fsync / read"] = (_best(raw_write, repeat), _best(raw_read, repeat))
    os.remove(raw)

    tpath = os.path.join(root, "model.pt")
    tens = {k: torch.from_numpy(v) for k, v in arrays.items()}
    out["torch.save / torch.load"] = (
        _best(lambda: torch.save(tens, tpath), repeat),
        _best(lambda: torch.load(tpath, weights_only=True), repeat),
    )

    def torch_save_fsync() -> None:
        torch.save(tens, tpath)
        pages.fsync_path(tpath)

    out["torch.save+fsync"] = (_best(torch_save_fsync, repeat), float("nan"))
    os.remove(tpath)
    spath = os.path.join(root, "model.safetensors")
    out["safetensors"] = (
        _best(lambda: save_file(arrays, spath), repeat),
        _best(lambda: load_file(spath), repeat),
    )
    os.remove(spath)
    ndir = os.path.join(root, "npy")
    os.makedirs(ndir, exist_ok=True)

    def np_save() -> None:
        for k, v in arrays.items():
            np.save(os.path.join(ndir, k + ".npy"), v)

    def np_load() -> None:
        for k in arrays:
            np.load(os.path.join(ndir, k + ".npy"))

    out["np.save / np.load"] = (_best(np_save, repeat), _best(np_load, repeat))
    shutil.rmtree(ndir)
    return out


def _store_urls(root: str, backends: list[str], notes: dict[str, str]) -> dict[str, Any]:
    from tensorkv.stores.registry import backend_class

    out: dict[str, Any] = {}
    for b in backends:
        try:
            backend_class(b)
        except ImportError as exc:
            notes[b] = f"skipped: {exc}"
            continue
        if b == "redis":
            from tensorkv.bench.redis_server import RedisServer, redis_server_path

            if redis_server_path() is None:
                notes[b] = "skipped: redis-server is not on PATH"
                continue
            out[b] = RedisServer()
        else:
            out[b] = os.path.join(root, f"{b}-store")
    return out


def run(
    quick: bool,
    report: Report,
    *,
    rows: int | None = None,
    dim: int = 64,
    dense_mb: float | None = None,
    backends: list[str] | str | None = None,
    block_sizes: tuple[int, ...] | str | int = (1024, 16384),
    repeat: int | None = None,
    root: str | None = None,
    tiered: bool = True,
    training: bool = True,
) -> None:
    """Run the checkpoint workload (see the module docstring).

    ``tiered=False`` skips the DRAM_SSDHASH table case; ``training=False`` the saves while
    training (which need torch).
    """
    import tensorkv
    from tensorkv.bench.kv import bench_root

    rows = rows if rows is not None else (200_000 if quick else 5_000_000)
    dense_mb = dense_mb if dense_mb is not None else (10.0 if quick else 100.0)
    backends = _names(backends) or ["lmdb", "rocksdb", "leveldb", "redis"]
    block_sizes = tuple(int(b) for b in _names(block_sizes))
    # best of 2 by default: the first touch of fresh memory on this kind of VM makes single
    # runs (baselines included) move by tens of percent
    repeat = repeat if repeat is not None else 2
    root = tempfile.mkdtemp(prefix="tensorkv-bench-ckpt-", dir=bench_root(root))
    report.params.update(rows=rows, dim=dim, dense_mb=dense_mb, optimizer="adagrad",
                         repeat=repeat, root=root, backends=backends)
    try:
        _warm_up(dim, root)
        model = _build(rows, dim, dense_mb)
        arrays = _flat_arrays(model)
        total = sum(a.nbytes for a in arrays.values())
        report.params["model_bytes"] = total
        base = _baselines(arrays, root, repeat)
        del arrays
        gc.collect()
        w_raw, r_raw = base["raw write+fsync / read"]
        w_torch, r_torch = base["torch.save / torch.load"]
        notes: dict[str, str] = {}
        targets = _store_urls(root, backends, notes)
        full_times: dict[str, float] = {}
        for b, target in targets.items():
            try:
                def fresh(b: str = b, target: Any = target) -> None:
                    if b == "redis":
                        target.flushall()
                    else:
                        shutil.rmtree(target, ignore_errors=True)

                def url_of(b: str = b, target: Any = target) -> str:
                    return target.url if b == "redis" else f"{b}://{target}"

                def save(url_of: Callable[[], str] = url_of) -> None:
                    tensorkv.save(model, url_of(), "full", progress=False)

                ts = _best(save, repeat, fresh)
                full_times[b] = ts

                def load(url_of: Callable[[], str] = url_of) -> None:
                    tensorkv.load(None, url_of(), "full", progress=False)

                tl = _best(load, max(repeat, 2))
                for label, (bw, br) in base.items():
                    fsyncs = label.startswith("raw") or "fsync" in label
                    note = "" if fsyncs else "baseline does not fsync"
                    report.add(f"save {b}", "MB/s", total / ts / MB, label.split(" / ")[0],
                               total / bw / MB, note=note)
                    if br == br:  # not NaN: the baseline has a read side
                        report.add(f"restore {b}", "MB/s", total / tl / MB,
                                   label.split(" / ")[-1] if "/" in label else label,
                                   total / br / MB)
                if b == "lmdb":
                    _incremental(model, url_of(), ts, tl, total, report)
            finally:
                if b == "redis":
                    target.stop()
                else:
                    shutil.rmtree(target, ignore_errors=True)
        for b, note in notes.items():
            report.add(f"save {b}", "MB/s", float("nan"), "torch.save", total / w_torch / MB,
                       note=note)
        if "lmdb" in targets and tiered:
            _tiered(model, root, total, base, repeat, report)
        if "lmdb" in targets and block_sizes:
            _block_sizes(model, root, total, block_sizes, repeat, report)
        if "lmdb" in targets and training:
            del model
            gc.collect()
            from tensorkv.bench import save_training

            save_training.run(quick, report, root)
        report.params["raw_write_MBps"] = total / w_raw / MB
        report.params["raw_read_MBps"] = total / r_raw / MB
        report.params["torch_load_MBps"] = total / r_torch / MB
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _names(value: Any) -> list[Any]:
    """A list from a list, or from ``-p`` text: comma-separated, empty for none."""
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (int, float)):
        return [value]
    return list(value)


def _warm_up(dim: int, root: str) -> None:
    """Compile the numba kernels of the save and load paths before anything is timed."""
    import tensorkv

    small = _build(2000, dim, 0.1, seed=1)
    path = os.path.join(root, "warm-up-tiers")
    t = _tiered_table(small["emb"], 2000, path)
    try:  # a tiered table's rows take the export path
        t.import_(small["emb"].export())
        tensorkv.save({"emb": t}, "memory://", "w", progress=False)
    finally:
        t.close()
        shutil.rmtree(path, ignore_errors=True)
    tensorkv.save(small, "memory://", "w", progress=False)  # private store, dropped at once
    from tensorkv.stores.memory import MemoryStore

    with MemoryStore() as store:
        tensorkv.save(small, store, "w", progress=False)
        small["emb"].apply_gradients(small["emb"].keys()[:10], np.ones((10, dim), np.float32))
        tensorkv.save(small, store, "w2", incremental=True, progress=False)
        tensorkv.load(None, store, "w2", progress=False)


def _incremental(model: dict[str, Any], url: str, full_s: float, full_load_s: float,
                 total: int, report: Report) -> None:
    import tensorkv

    table = model["emb"]
    keys = table.keys()
    rng = np.random.default_rng(1)
    changed = rng.choice(keys, max(1, len(keys) // 100), replace=False)
    grads = rng.standard_normal((len(changed), table.dim), dtype=np.float32)
    table.apply_gradients(changed, grads, step=1)
    ti = _time(lambda: tensorkv.save(model, url, "inc1", incremental=True, progress=False))
    report.add("incremental save, 1% rows changed (lmdb)", "saves/s", 1 / ti,
               "full save (lmdb)", 1 / full_s, note=f"{ti:.3f} s vs {full_s:.3f} s")
    tl = _time(lambda: tensorkv.load(None, url, "inc1", progress=False))
    report.add("restore incremental chain (lmdb)", "MB/s", total / tl / MB,
               "restore of the full tag (lmdb)", total / full_load_s / MB,
               note="full tag + 1% delta, first load")
    # A trainer restarted from the chain: its table did not save the parent, so the
    # incremental save rebuilds the parent's key set from the key lists in the store.
    from tensorkv.embedding.table import EmbeddingTable

    resumed = EmbeddingTable(table.dim, optimizer="adagrad", seed=0)
    tensorkv.load({"emb": resumed}, url, "inc1", progress=False)
    changed = rng.choice(keys, max(1, len(keys) // 100), replace=False)
    resumed.apply_gradients(changed, grads, step=2)
    resumed_model = {**model, "emb": resumed}
    ti2 = _time(lambda: tensorkv.save(resumed_model, url, "inc2", incremental=True,
                                      progress=False))
    report.add("incremental save after a restore, 1% rows changed (lmdb)", "saves/s", 1 / ti2,
               "full save (lmdb)", 1 / full_s,
               note=f"{ti2:.3f} s vs {full_s:.3f} s; parent's key set read from the store")


def _tiered_table(like: Any, rows: int, path: str) -> Any:
    """An empty DRAM_SSDHASH table like ``like`` whose tier 0 holds a tenth of ``rows``."""
    from tensorkv.embedding.table import EmbeddingTable
    from tensorkv.embedding.tiers.base import RecordLayout

    tier0 = RecordLayout(like.dim, "float32", like.num_slots).record_bytes * max(1, rows // 10)
    return EmbeddingTable(like.dim, optimizer="adagrad", seed=0, storage="DRAM_SSDHASH",
                          storage_path=path, storage_size=[tier0], cache_strategy="lru")


def _tiered(model: dict[str, Any], root: str, total: int,
            base: dict[str, tuple[float, float]], repeat: int, report: Report) -> None:
    """Save and restore the model with its table in DRAM_SSDHASH tiers, into LMDB."""
    import tensorkv

    plain = model["emb"]
    rows = len(plain)
    src_path = os.path.join(root, "tiers-src")
    table = _tiered_table(plain, rows, src_path)
    try:
        table.import_(plain.export(chunk_rows=1 << 18))  # the same rows, 90% of them on SSD
        table.wait_writes()
        tiered_model = {**model, "emb": table}
        store = os.path.join(root, "tiered-lmdb")
        url = f"lmdb://{store}"
        ts = _best(lambda: tensorkv.save(tiered_model, url, "full", progress=False), repeat,
                   lambda: shutil.rmtree(store, ignore_errors=True))
        times = []
        for i in range(max(repeat, 2)):
            path = os.path.join(root, f"tiers-dst{i}")
            target = _tiered_table(plain, rows, path)
            try:
                gc.collect()
                t0 = time.perf_counter()
                tensorkv.load({"emb": target}, url, "full", progress=False)
                target.wait_writes()  # every row in its tier (no fsync, like torch.load)
                times.append(time.perf_counter() - t0)
                if len(target) != rows:
                    raise AssertionError(f"restored {len(target)} rows of {rows}")
            finally:
                target.close()
                shutil.rmtree(path, ignore_errors=True)
        tl = min(times)
    finally:
        table.close()
        shutil.rmtree(src_path, ignore_errors=True)
        shutil.rmtree(os.path.join(root, "tiered-lmdb"), ignore_errors=True)
    case = "dram_ssdhash table -> lmdb"
    for label, (bw, br) in base.items():
        fsyncs = label.startswith("raw") or "fsync" in label
        report.add(f"save {case}", "MB/s", total / ts / MB, label.split(" / ")[0],
                   total / bw / MB, note="" if fsyncs else "baseline does not fsync")
        if br == br:
            report.add(f"restore {case}", "MB/s", total / tl / MB,
                       label.split(" / ")[-1] if "/" in label else label, total / br / MB,
                       note="into a DRAM_SSDHASH table, rows landed in their tiers")


def _block_sizes(model: dict[str, Any], root: str, total: int, sizes: tuple[int, ...],
                 repeat: int, report: Report) -> None:
    import tensorkv

    path = os.path.join(root, "blocks")
    results = {}
    for rows in sizes:
        def fresh() -> None:
            shutil.rmtree(path, ignore_errors=True)

        url = f"lmdb://{path}"
        ts = _best(partial(tensorkv.save, model, url, "b", block_rows=rows, progress=False),
                   repeat, fresh)
        tl = _best(partial(tensorkv.load, None, url, "b", progress=False), repeat)
        results[rows] = (ts, tl)
        shutil.rmtree(path, ignore_errors=True)
    ref = sizes[0]
    for rows, (ts, tl) in results.items():
        report.add(f"save lmdb, block_rows={rows}", "MB/s", total / ts / MB,
                   f"block_rows={ref}", total / results[ref][0] / MB)
        report.add(f"restore lmdb, block_rows={rows}", "MB/s", total / tl / MB,
                   f"block_rows={ref}", total / results[ref][1] / MB)
