"""``tensorkv bench tiers``: a tiered EmbeddingTable against the DRAM-only table.

A table of ``n_keys`` keys (dim 64, Adagrad) is filled, then trained with ``lookup`` +
``apply_gradients`` on Zipf-distributed batches of 65,536 keys, with tier 0 at a share of the
rows and the rest in SSDHASH, LevelDB, RocksDB, LMDB (or HBM chains on a GPU). Per case:
keys/s against the DRAM-only table on the same trace (best of 3 passes), the tier-0 hit rate
against an exact LRU simulation, and SSDHASH against LevelDB. ``-p`` options: ``n_keys``,
``steps``, ``fractions``, ``zipfs``, ``backends``, ``device``, ``prefetch``, ``model_ms``,
``data_dir``. What it measures and the current figures: docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorkv.bench.common import Report
from tensorkv.embedding.table import EmbeddingTable
from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.errors import ConfigError, import_optional
from tensorkv.kernels.cache import lru_hits

DIM = 64
BATCH = 65_536
BACKENDS = ("DRAM_SSDHASH", "DRAM_LEVELDB", "DRAM_ROCKSDB", "DRAM_LMDB")
FRACTIONS = (0.05, 0.10, 0.25, 0.50)
ZIPFS = (1.05, 1.2)


def zipf_trace(rng: np.random.Generator, n_keys: int, a: float, n: int,
               perm: np.ndarray) -> np.ndarray:
    """``n`` keys drawn Zipf(``a``) over ranks ``1..n_keys`` (truncated), scattered by ``perm``."""
    ranks = np.arange(1, n_keys + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -a)
    cdf /= cdf[-1]
    r = np.minimum(np.searchsorted(cdf, rng.random(n)), n_keys - 1)
    return perm[r].astype(np.int64)


def _fill(table, n_keys: int, dim: int, num_slots: int, chunk: int) -> None:
    rng = np.random.default_rng(1)
    for start in range(0, n_keys, chunk):
        keys = np.arange(start, min(n_keys, start + chunk), dtype=np.int64)
        m = keys.size
        values = rng.standard_normal((m, dim), dtype=np.float32) * np.float32(0.05)
        slots = np.full((m, num_slots * dim), 0.1, np.float32)
        z = np.zeros(m, np.int64)
        table.import_([(keys, values, slots, z, z)])


def _steps(table, batches: list[np.ndarray], grads: np.ndarray, prefetch: bool,
           model_s: float = 0.0, lookup: Callable | None = None) -> None:
    """Lookup + apply each batch; with ``prefetch`` the next batch is announced in between.

    ``model_s``: seconds the training thread waits between lookup and apply, standing for the
    dense model's forward and backward pass on an accelerator. ``lookup``: the call that reads
    a batch (default ``table.lookup``).
    """
    lookup = lookup or table.lookup
    for i, b in enumerate(batches):
        lookup(b)
        if prefetch and i + 1 < len(batches):
            table.prefetch(batches[i + 1])
        if model_s:
            time.sleep(model_s)
        table.apply_gradients(b, grads)


def _train(table, batches: list[np.ndarray], grads: np.ndarray, warmup: int,
           stats: list | None = None, passes: int = 1, prefetch: bool = False,
           model_s: float = 0.0, lookup: Callable | None = None,
           sync: Callable | None = None) -> float:
    """Seconds of the timed batches (after ``warmup`` untimed ones), final flush included.

    With ``stats`` (a list), the tiered table's per-tier counters (``stats()["tiers"]``)
    before and after the timed batches are appended to it. ``passes`` > 1 runs the timed
    batches that many times and returns the fastest pass (for the DRAM-only baseline, whose
    cost does not depend on what ran before). ``prefetch``: announce each next batch with
    ``table.prefetch`` between its lookup and apply (a pipelined training loop); ``model_s``
    and ``lookup`` as in :func:`_steps`; ``sync`` waits for queued device work (CUDA) before
    the clock stops.
    """
    _steps(table, batches[:warmup], grads, prefetch, model_s, lookup)
    if hasattr(table, "wait_writes"):
        table.wait_writes()
    if stats is not None:
        stats.append(table.stats()["tiers"])
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        _steps(table, batches[warmup:], grads, prefetch, model_s, lookup)
        if hasattr(table, "wait_writes"):
            table.wait_writes()  # every evicted row has landed in its tier
        if sync is not None:
            sync()
        best = min(best, time.perf_counter() - t0)
    if stats is not None:
        stats.append(table.stats()["tiers"])
    return best


def _as_tuple(value, cast) -> tuple:
    """A tuple from a tuple/list, one value, or a comma-separated string (``-p x=a,b``)."""
    if isinstance(value, str):
        return tuple(cast(v.strip()) for v in value.split(",") if v.strip())
    if isinstance(value, (list, tuple)):
        return tuple(cast(v) for v in value)
    return (cast(value),)


def _device_io(device: str) -> tuple[Callable[[np.ndarray], Any], Callable[[], None]]:
    """``(to_device, sync)`` for the HBM cases: copy a host array to ``device``; wait for it.

    Raises a clear error where torch, or the CUDA device, is missing.
    """
    torch = import_optional("torch", "HBM backends", "torch")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device={device!r} is not a torch device; use 'cuda' or 'cpu'"
                         ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}: the HBM backends need a CUDA device, which this "
                         "machine lacks; run them on a GPU machine, or with -p device=cpu")

    def to_device(a: np.ndarray) -> Any:
        return torch.from_numpy(a).to(dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    return to_device, sync


def _storage_size(name: str, rows0: int, n_keys: int, record_bytes: int) -> list[int] | None:
    """Tier sizes of storage type ``name``: tier 0 ``rows0`` rows, a middle tier 4x that."""
    n_tiers = name.count("_") + 1
    if n_tiers == 1:
        return None  # HBM / DRAM alone: every row in tier 0
    mid = min(4 * rows0, n_keys)
    return [rows0 * record_bytes] + [mid * record_bytes] * (n_tiers - 2)


def _warm_up(root: str, dim: int) -> None:
    """Compile every kernel once (untimed) with a tiny tiered table."""
    path = os.path.join(root, "warm-up")
    lay = RecordLayout(dim, num_slots=1)
    with EmbeddingTable(dim, optimizer="adagrad", storage="DRAM_SSDHASH",
                              storage_path=path, storage_size=[64 * lay.record_bytes],
                              cache_strategy="lru") as t:
        rng = np.random.default_rng(0)
        _fill(t, 512, dim, 1, 128)
        for _ in range(3):
            keys = rng.integers(0, 1024, 256)
            t.lookup(keys)
            t.apply_gradients(keys, np.zeros((256, dim), np.float32))
    shutil.rmtree(path, ignore_errors=True)


def run(
    quick: bool,
    report: Report,
    *,
    n_keys: int | None = None,
    batch: int = BATCH,
    dim: int = DIM,
    steps: int | None = None,
    warmup: int = 3,
    baseline_passes: int = 3,
    fractions: tuple[float, ...] = FRACTIONS,
    zipfs: tuple[float, ...] = ZIPFS,
    backends: tuple[str, ...] = BACKENDS,
    data_dir: str | None = None,
    prefetch: bool = False,
    model_ms: float = 0.0,
    device: str = "cuda",
) -> None:
    """Run the workload (see the module docstring).

    Keyword arguments shrink it for tests or pick cases: ``fractions``, ``zipfs`` and
    ``backends`` also take comma-separated strings (``tensorkv bench tiers -p
    fractions=0.1 -p backends=DRAM_SSDHASH,DRAM_LEVELDB``). ``prefetch=true`` runs the
    tiered tables as a pipelined loop (``prefetch`` of batch ``i + 1`` after the lookup of
    batch ``i``); ``model_ms`` makes every step (baseline too) wait that long between
    lookup and apply, standing for the dense model's pass on an accelerator. ``device``: the
    torch device of the ``HBM*`` backends' tier 0.
    """
    model_s = float(model_ms) / 1000.0
    if model_s < 0:
        raise ConfigError(f"model_ms={model_ms!r} must be >= 0")
    fractions = _as_tuple(fractions, float)
    zipfs = _as_tuple(zipfs, float)
    backends = _as_tuple(backends, lambda b: str(b).upper())
    hbm = any(b.startswith("HBM") for b in backends)
    to_device, sync = _device_io(device) if hbm else (None, None)
    n_keys = n_keys or (200_000 if quick else 5_000_000)
    steps = steps or (8 if quick else 40)
    lay = RecordLayout(dim, num_slots=1)
    report.params.update({
        "n_keys": n_keys, "dim": dim, "batch": batch, "optimizer": "adagrad",
        "timed_steps": steps, "warmup_steps": warmup, "baseline_passes": baseline_passes,
        "fractions": list(fractions),
        "zipf": list(zipfs), "backends": list(backends), "cache_strategy": "lru",
        "record_bytes": lay.record_bytes, "prefetch": bool(prefetch), "model_ms": float(model_ms),
        **({"device": str(device)} if hbm else {}),
        "note": "default full size is 5M keys (20M with -p n_keys=20000000); hit % counts a "
                "key missing twice in a batch as one miss",
    })
    base = data_dir or os.environ.get("TENSORKV_BENCH_DIR") or tempfile.gettempdir()
    root = tempfile.mkdtemp(prefix="tensorkv-bench-tiers-", dir=base)
    report.params["data_dir"] = root
    rng = np.random.default_rng(0)
    perm = rng.permutation(n_keys)
    grads = (rng.standard_normal((batch, dim), dtype=np.float32) * np.float32(1e-3))
    mode = (" prefetch" if prefetch else "") + (f" model={model_ms:g}ms" if model_s else "")
    try:
        _warm_up(root, dim)
        for a in zipfs:
            trace = zipf_trace(rng, n_keys, a, batch * (warmup + steps), perm)
            batches = [trace[i * batch:(i + 1) * batch] for i in range(warmup + steps)]
            timed = trace[warmup * batch:]
            ref = EmbeddingTable(dim, optimizer="adagrad", capacity=n_keys)
            _fill(ref, n_keys, dim, 1, batch)
            t_ref = _train(ref, batches, grads, warmup, passes=baseline_passes,
                           model_s=model_s)
            dram = timed.size / t_ref / 1e6
            if hbm:  # the HBM cases' baseline: DRAM lookups copied to the device
                assert to_device is not None
                t_dev = _train(ref, batches, grads, warmup, passes=baseline_passes,
                               model_s=model_s, lookup=lambda b, r=ref: to_device(r.lookup(b)),
                               sync=sync)
                dram_dev = timed.size / t_dev / 1e6
            del ref
            gc.collect()
            distinct = int(np.mean([np.unique(b).size for b in batches]))
            by_backend: dict[tuple[str, float], float] = {}
            for frac in fractions:
                rows0 = max(1, int(n_keys * frac))
                # the fill touched every key once, in key order: the cache starts in that state
                sim = lru_hits(np.concatenate([np.arange(n_keys, dtype=np.int64), trace]), rows0)
                sim_hit = sim[n_keys + warmup * batch:].mean() * 100
                for name in backends:
                    sizes = _storage_size(name, rows0, n_keys, lay.record_bytes)
                    if sizes is None and frac != fractions[0]:
                        continue  # one case holds every row in tier 0
                    on_device = name.startswith("HBM")
                    path = os.path.join(root, f"{name}-{frac}-{a}")
                    os.makedirs(path)
                    t = EmbeddingTable(
                        dim, optimizer="adagrad", storage=name, storage_path=path,
                        storage_size=sizes, cache_strategy="lru", device=device,
                    )
                    try:
                        _fill(t, n_keys, dim, 1, batch)
                        t.flush()
                        snaps: list = []
                        secs = _train(t, batches, grads, warmup, snaps, prefetch=prefetch,
                                      model_s=model_s,
                                      lookup=t.lookup_torch if on_device else None,
                                      sync=sync if on_device else None)
                        before, after = snaps
                    finally:
                        t.close()
                        del t
                        shutil.rmtree(path, ignore_errors=True)
                        gc.collect()
                    share = frac if sizes is not None else 1.0
                    case = f"{name} tier0={share:.0%} zipf={a}{mode}"
                    mk = timed.size / secs / 1e6
                    by_backend[(name, frac)] = mk
                    compactions = sum(x.get("compactions", 0) for x in after[1:]) - sum(
                        x.get("compactions", 0) for x in before[1:])
                    # lookups only: the chain counts hits/misses of lookup batches
                    hits = after[0]["hits"] - before[0]["hits"]
                    misses = after[0]["misses"] - before[0]["misses"]
                    fetched = after[0]["prefetched"] - before[0]["prefetched"]
                    report.add(case, "Mkeys/s", mk,
                               f"DRAM-only table + copy to {device}" if on_device
                               else "DRAM-only table", dram_dev if on_device else dram,
                               note=("lookup_torch" if on_device else "lookup")
                                    + "+apply, incl. landing all write-backs; baseline: "
                                    f"best of {baseline_passes} passes"
                                    + (f"; {compactions} compactions" if "SSDHASH" in name
                                       else "")
                                    + (f"; {100.0 * fetched / max(misses, 1):.0f}% of misses "
                                       "prefetched" if prefetch else ""))
                    hit = 100.0 * hits / max(hits + misses, 1)
                    if sizes is None:
                        report.add(case, "tier0 hit %", hit, "every row in tier 0", 100.0,
                                   note=f"tier0={n_keys} rows")
                        continue
                    over = " (< one batch: tier 0 holds the batch while it runs)" \
                        if rows0 < distinct else ""
                    report.add(case, "tier0 hit %", hit, "LRU simulation", sim_hit,
                               note=f"tier0={rows0} rows, batch ~{distinct} distinct{over}")
                if ("DRAM_SSDHASH", frac) in by_backend and ("DRAM_LEVELDB", frac) in by_backend:
                    report.add(f"SSDHASH vs LEVELDB tier0={frac:.0%} zipf={a}{mode}", "Mkeys/s",
                               by_backend[("DRAM_SSDHASH", frac)], "DRAM_LEVELDB",
                               by_backend[("DRAM_LEVELDB", frac)])
    finally:
        shutil.rmtree(root, ignore_errors=True)


__all__ = ["run", "zipf_trace"]
