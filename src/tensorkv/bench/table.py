"""``tensorkv bench table``: EmbeddingTable lookups, inserts, Adagrad updates and memory.

For each table size (full: 1M and 10M keys; quick: 100k and 1M), dim 64, batches of 65,536
keys, Adagrad, keys drawn uniformly or Zipf(1.1)-distributed over keys already in the table:

* ``lookup``: ``EmbeddingTable.lookup`` vs ``np.take`` of the same rows of a dense array by
  precomputed row numbers (no hashing at all: the upper bound), and vs a Python ``dict``
  key -> row followed by the same ``np.take``.
* ``insert``: building the table from empty with ``lookup`` of new keys (hash insert + value
  initialisation + slot initialisation), M keys/s, vs inserting the same keys into a ``dict``.
* ``apply_gradients``: Adagrad on the batch (duplicate keys summed) vs
  ``torch.nn.Embedding(sparse=True)`` + ``torch.optim.Adagrad`` on the same rows and gradients
  (the sparse gradient built from precomputed row numbers, then ``opt.step()``), with torch on
  1 thread (the table's kernels run on one thread per call) and on all cores.
* ``lookup, N threads``: the same uniform lookups from ``os.cpu_count()`` threads at once vs
  one after another on one thread (the kernels release the GIL).
* ``memory``: bytes per key of the largest table vs the raw row + Adagrad slot bytes
  (``bytes/key``: lower is better; the ratio is the overhead factor).
"""

from __future__ import annotations

import gc
import os
import time

import numpy as np

from tensorkv.bench.common import Report, measure

DIM = 64
BATCH = 65_536


def _draws(rng: np.random.Generator, n_keys: int, batch: int, dist: str) -> np.ndarray:
    """Indices into the key array: uniform, or Zipf(1.1) ranks scattered by a permutation."""
    if dist == "uniform":
        return rng.integers(0, n_keys, batch)
    ranks = (rng.zipf(1.1, batch) - 1) % n_keys
    perm_seed = int(rng.integers(0, 2**31))
    # a fixed pseudo-random bijection rank -> index, without materialising a permutation
    return (ranks * 2_654_435_761 + perm_seed) % n_keys


def _best_time(fn, repeat: int) -> float:
    return measure(fn, repeat=repeat, warmup=1).median


def _paired(fns: list, repeat: int) -> list[float]:
    """Median seconds of each function, timed in alternation (A B C A B C ...).

    On a shared machine the load changes over seconds; alternating the runs gives every
    contender the same conditions, so the ratios are fair even when absolute figures move.
    """
    for fn in fns:
        fn()  # warm-up
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            samples[i].append(time.perf_counter() - t0)
    return [float(np.median(s)) for s in samples]


def run(
    quick: bool,
    report: Report,
    *,
    sizes: tuple[int, ...] | None = None,
    batch: int = BATCH,
    dim: int = DIM,
    repeat: int | None = None,
    torch_baseline: bool = True,
) -> None:
    """Run the workload (see the module docstring); extra arguments shrink it for tests."""
    if sizes is None:
        sizes = (100_000, 1_000_000) if quick else (1_000_000, 10_000_000)
    if repeat is None:
        repeat = 7 if quick else 11
    report.params.update({"sizes": list(sizes), "batch": batch, "dim": dim,
                          "optimizer": "Adagrad(lr=0.01)", "draws": ["uniform", "zipf1.1"],
                          "cpus": os.cpu_count()})
    rng = np.random.default_rng(0)
    for n in sizes:
        _run_size(report, rng, n, batch, dim, repeat, torch_baseline, n == max(sizes))
        gc.collect()


def _run_size(report: Report, rng: np.random.Generator, n: int, batch: int, dim: int,
              repeat: int, torch_baseline: bool, report_memory: bool) -> None:
    from tensorkv.embedding.optimizers import Adagrad
    from tensorkv.embedding.table import EmbeddingTable

    keys = np.unique(rng.integers(-(2**62), 2**62, int(n * 1.01) + 16))[:n]
    rng.shuffle(keys)
    label = f"{n // 1000}k" if n < 1_000_000 else f"{n // 1_000_000}M"

    # --- insert: build the table from empty ---------------------------------------------------
    table = EmbeddingTable(dim, optimizer=Adagrad(lr=0.01), initializer="truncated_normal")
    table.lookup(keys[:1])  # compile / load the kernels
    table.clear()
    gc.collect()
    t0 = time.perf_counter()
    for s in range(0, n, batch):
        table.lookup(keys[s:s + batch])
    t_insert = time.perf_counter() - t0
    d: dict[int, int] = {}
    kl = keys.tolist()
    t0 = time.perf_counter()
    for s in range(0, n, batch):
        d.update(zip(kl[s:s + batch], range(s, min(n, s + batch)), strict=True))
    t_dict = time.perf_counter() - t0
    report.add(f"insert {label} new keys (init+slots)", "Mkeys/s", n / t_insert / 1e6,
               "dict insert", n / t_dict / 1e6, note="table from empty, truncated normal")

    if report_memory:
        st = table.stats()
        raw = 4 * dim * 2  # value + Adagrad accumulator
        report.add(f"memory {label} keys", "bytes/key", st["bytes_per_key"],
                   "raw row+slot bytes", raw,
                   note=f"lower is better; goal <= 1.3; index slots {st['index_slots']}, "
                        f"row capacity {st['capacity']}")

    a = table.arena
    dense = a.values  # the same rows, addressed by precomputed row numbers
    mk = batch / 1e6
    draws = {dist: keys[_draws(rng, n, batch, dist)] for dist in ("uniform", "zipf1.1")}
    for dist, q in draws.items():
        rows = a.find(q)
        t_lookup, t_take = _paired([lambda q=q: table.lookup(q),
                                    lambda rows=rows: np.take(dense, rows, axis=0)], 2 * repeat)

        def dict_lookup(q=q):
            r = np.fromiter(map(d.__getitem__, q.tolist()), np.int64, q.shape[0])
            return np.take(dense, r, axis=0)

        t_lookup2, t_dict_l = _paired([lambda q=q: table.lookup(q), dict_lookup],
                                      max(3, repeat // 2))
        report.add(f"lookup {label} {dist}", "Mkeys/s", mk / t_lookup, "np.take by row",
                   mk / t_take, note="goal >= 0.6 at 10M uniform")
        report.add(f"lookup {label} {dist}", "Mkeys/s", mk / t_lookup2, "dict + np.take",
                   mk / t_dict_l, note="goal >= 5x")
    threads = os.cpu_count() or 1
    if threads > 1:
        qs = [keys[_draws(rng, n, batch, "uniform")] for _ in range(threads)]
        t_one, t_par = _paired([lambda: [table.lookup(q) for q in qs],
                                lambda: _in_threads(table.lookup, qs)], max(3, repeat // 2))
        report.add(f"lookup {label} uniform, {threads} threads", "Mkeys/s",
                   threads * mk / t_par, "same batches on 1 thread", threads * mk / t_one,
                   note="kernels release the GIL; shared lock for present keys")
    d.clear()
    del kl
    gc.collect()  # free the dict before torch allocates its embedding + Adagrad state

    if not torch_baseline:
        return
    for dist, q in draws.items():
        rows = a.find(q)
        g = np.random.default_rng(1).standard_normal((batch, dim)).astype(np.float32)

        def apply(q=q, g=g):
            return table.apply_gradients(q, g)

        one, many = _torch_adagrad_steps(n, dim, rows, g)
        t_apply, t_one, t_many = _paired([apply, one, many], repeat)
        for tlabel, t_torch in (("1 thread", t_one), ("all cores", t_many)):
            report.add(f"apply_gradients {label} {dist}", "Mkeys/s", mk / t_apply,
                       f"torch sparse Adagrad {tlabel}", mk / t_torch, note="goal >= 1.5x")
        del one, many
        gc.collect()


def _in_threads(fn, args: list) -> None:
    import threading

    workers = [threading.Thread(target=fn, args=(x,)) for x in args]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _torch_adagrad_steps(n: int, dim: int, rows: np.ndarray, g: np.ndarray):
    """Two step functions over one torch Embedding + Adagrad: on 1 thread and on all cores."""
    import torch

    emb = torch.nn.Embedding(n, dim, sparse=True)
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.01)
    idx = torch.from_numpy(rows).unsqueeze(0)
    gt = torch.from_numpy(g)
    default = torch.get_num_threads()

    def step(threads: int) -> None:
        torch.set_num_threads(threads)
        try:
            # explicit opt-out of torch's sparse invariant checks (the baseline's fast path)
            with torch.sparse.check_sparse_tensor_invariants(enable=False):
                emb.weight.grad = torch.sparse_coo_tensor(idx, gt, (n, dim))
                opt.step()
        finally:
            torch.set_num_threads(default)

    return (lambda: step(1)), (lambda: step(os.cpu_count() or 1))
