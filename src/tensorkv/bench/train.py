"""``tensorkv bench train``: training samples/s of the demo's DLRM model, dynamic vs static tables.

The model and data of ``tensorkv demo`` (:mod:`tensorkv.bench.dlrm`: 13 dense and 26
categorical features, Zipf ids over 10^8 values, bottom MLP, dot interaction, top MLP), dense
Adam, tables Adagrad, in four forms trained on the same batches, one step of each in turn so
that all see the same machine load:

* ``DRAM``: one ``DynamicEmbeddingBag`` on a DRAM table (new ids inserted as they come).
* ``DRAM fused``: the same with ``Optimizer(fused=True)`` (table updates inside backward).
* ``static``: ``nn.EmbeddingBag(sparse=True)`` sized to the run's distinct ids, the ids
  pre-mapped to compact rows, ``torch.optim.Adagrad`` on it.
* ``dense only``: the embedding lookups replaced by a constant tensor; a form's embedding cost
  is its step time minus this one's.
* ``DRAM+SSDHASH``: the DRAM form with tier 0 holding 10% of the run's distinct rows, timed
  in a pass of its own after the others (its background writes to the SSDHASH tier would
  otherwise run during the other forms' steps).

Then the DRAM form's step is split: table lookups (gather + inserts of new ids), the rest of
the embedding forward (dedup, copies into torch, pooling), the whole backward, and the optimizer
step (tables + dense); the insert share is the lookup time minus a lookup of the same keys
once they all exist.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import numpy as np

from tensorkv.bench import train_features as tf
from tensorkv.bench.common import Report
from tensorkv.bench.dlrm import DLRM, N_CAT, SyntheticCTR, constant_embedding

DIM = 16
TABLE_LR = 0.05
DENSE_LR = 1e-3


def _steps(forms: dict[str, Any], batches: list[Any], warmup: int) -> dict[str, float]:
    """Train every form on ``batches``, one step of each in turn; median seconds per step."""
    import torch

    f = torch.nn.functional.binary_cross_entropy_with_logits
    times: dict[str, list[float]] = {name: [] for name in forms}
    for i, (dense, keys, rows, labels, *frows) in enumerate(batches):
        for name, (model, opt, use_rows) in forms.items():
            ids = frows[0] if use_rows == "frows" else rows if use_rows else keys
            t0 = time.perf_counter()
            out = model(dense, ids)
            loss = f(out, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


class _StaticOptimizer:
    """Adam on the dense parameters and Adagrad on the sparse embedding weight."""

    def __init__(self, model: Any, emb: Any) -> None:
        import torch

        dense = [p for n, p in model.named_parameters() if not n.startswith("embedding.")]
        self.opts: list[Any] = [torch.optim.Adam(dense, lr=DENSE_LR)]
        if emb is not None:
            self.opts.append(torch.optim.Adagrad([emb.weight], lr=TABLE_LR))

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad()

    def step(self) -> None:
        for o in self.opts:
            o.step()


def _dynamic(storage: Any = None, fused: bool = False) -> tuple[Any, Any]:
    import torch

    from tensorkv.embedding.optimizers import Adagrad
    from tensorkv.torch import DynamicEmbeddingBag, Optimizer

    emb = DynamicEmbeddingBag(DIM, mode="sum", storage=storage, optimizer=Adagrad(lr=TABLE_LR))
    model = DLRM(emb, dim=DIM)
    return model, Optimizer(model, dense=torch.optim.Adam(model.parameters(), lr=DENSE_LR),
                            fused=fused)


def _phases(batches: list[Any], warmup: int) -> dict[str, float]:
    """Median seconds per step of the DRAM form's parts (see the module docstring)."""
    import torch

    model, opt = _dynamic()
    table = model.embedding.table
    names = ("lookup", "embedding forward", "forward", "backward", "optimizer")
    spent: dict[str, list[float]] = {k: [] for k in names}
    cur = dict.fromkeys(names, 0.0)  # this step's
    seen: list[np.ndarray] = []
    real_lookup = table.lookup

    def timed_lookup(keys: Any, *args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real_lookup(keys, *args, **kw)
        finally:
            cur["lookup"] += time.perf_counter() - t0
            seen.append(np.array(keys, copy=True))

    emb_t0 = [0.0]

    def pre(*_: Any) -> None:
        emb_t0[0] = time.perf_counter()

    def post(*_: Any) -> None:
        cur["embedding forward"] += time.perf_counter() - emb_t0[0]

    table.lookup = timed_lookup
    model.embedding.register_forward_pre_hook(pre)
    model.embedding.register_forward_hook(post)
    f = torch.nn.functional.binary_cross_entropy_with_logits
    inserts0 = 0
    for i, (dense, keys, _, labels, *_) in enumerate(batches):
        if i == warmup:
            inserts0 = table.stats()["inserts"]
            seen.clear()
        cur.update(dict.fromkeys(names, 0.0))
        t0 = time.perf_counter()
        loss = f(model(dense, keys), labels)
        t1 = time.perf_counter()
        opt.zero_grad()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= warmup:
            cur.update({"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2})
            for k in names:
                spent[k].append(cur[k])
    gather = []
    for keys in seen:  # the same lookups again, every key present now: gather only
        t0 = time.perf_counter()
        real_lookup(keys, insert=False)
        gather.append(time.perf_counter() - t0)
    out = {k: float(np.median(v)) for k, v in spent.items()}
    out["inserts"] = max(float(np.median(np.subtract(spent["lookup"], gather))), 0.0)
    out["new ids"] = (table.stats()["inserts"] - inserts0) / len(spent["lookup"])
    table.close()
    return out


def run(quick: bool, report: Report, *, batch: int | None = None, steps: int | None = None,
        warmup: int | None = None, tiered: bool = True, features: bool = True) -> None:
    """Run the workload (see the module docstring).

    Parameters
    ----------
    batch
        Samples per step (default 2048; quick 1024).
    steps
        Timed steps per form (default 150; quick 20).
    warmup
        Untimed steps first (default 10; quick 3).
    tiered
        Also time the DRAM+SSDHASH form.
    features
        Also time the per-feature forms (one table per feature,
        :mod:`tensorkv.bench.train_features`) and split their steps.
    """
    import torch

    from tensorkv import StorageOption

    batch = batch or (1024 if quick else 2048)
    steps = steps or (20 if quick else 150)
    warmup = warmup if warmup is not None else (3 if quick else 10)
    if batch < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"batch={batch}, steps={steps}, warmup={warmup}: batch and steps must "
                         "be >= 1 and warmup >= 0")
    data = SyntheticCTR(0)
    raw = [data.batch(s, batch) for s in range(warmup + steps)]
    all_keys = np.concatenate([b.keys.ravel() for b in raw])
    uniq, inverse = np.unique(all_keys, return_inverse=True)
    rows = inverse.reshape(len(raw), batch, N_CAT)
    frows, sizes = tf.feature_rows(np.stack([b.keys for b in raw]))
    batches = [(torch.from_numpy(b.dense), torch.from_numpy(b.keys), torch.from_numpy(r),
                torch.from_numpy(b.labels), torch.from_numpy(fr))
               for b, r, fr in zip(raw, rows, frows, strict=True)]
    report.params.update(batch=batch, steps=steps, warmup=warmup, distinct_ids=int(uniq.size),
                         torch=torch.__version__, torch_threads=torch.get_num_threads())

    static_emb = torch.nn.EmbeddingBag(int(uniq.size), DIM, mode="sum", sparse=True)
    static = DLRM(static_emb, dim=DIM)
    const = DLRM(constant_embedding(DIM, batch * N_CAT), dim=DIM)
    forms: dict[str, Any] = {
        "DRAM": (*_dynamic(), False),
        "DRAM fused": (*_dynamic(fused=True), False),
        "static": (static, _StaticOptimizer(static, static_emb), True),
        "dense only": (const, _StaticOptimizer(const, None), False),
    }
    if features:
        forms.update(tf.forms(sizes, DIM, DENSE_LR, TABLE_LR))
    tiered_form: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tensorkv-bench-train-") as tmp:
        if tiered:
            probe = StorageOption(storage_type="DRAM_SSDHASH", storage_size=["1MiB"])
            model, _ = _dynamic(probe)
            per_row = (1 << 20) / model.embedding.table.stats()["tiers"][0]["budget_rows"]
            model.embedding.table.close()
            tier0_rows = max(int(uniq.size * 0.1), 1)
            storage = StorageOption(storage_type="DRAM_SSDHASH",
                                    storage_path=os.path.join(tmp, "spill"),
                                    storage_size=[int(tier0_rows * per_row)],
                                    cache_strategy="lfu")
            tiered_form["DRAM+SSDHASH"] = (*_dynamic(storage), False)
            report.params["tier0_rows"] = tier0_rows
        try:
            t = _steps(forms, batches, warmup)
            # its own pass: its background writes would land in the other forms' steps
            t.update(_steps(tiered_form, batches, warmup) if tiered_form else {})
        finally:
            for model, _, _ in (*forms.values(), *tiered_form.values()):
                for table in tf.tables(model):
                    table.close()
    rate = {name: batch / s for name, s in t.items()}
    report.add("DRAM samples/s", "samples/s", rate["DRAM"], "static nn.EmbeddingBag",
               rate["static"], note="goal >= 1.0")
    cost_dyn, cost_static = t["DRAM"] - t["dense only"], t["static"] - t["dense only"]
    report.add("DRAM embedding cost", "ms/step", cost_dyn * 1e3, "static nn.EmbeddingBag",
               cost_static * 1e3, note="step minus dense-only step; goal <= 0.5")
    report.add("DRAM fused samples/s", "samples/s", rate["DRAM fused"], "static nn.EmbeddingBag",
               rate["static"], note="table updates inside backward")
    report.add("DRAM fused embedding cost", "ms/step", (t["DRAM fused"] - t["dense only"]) * 1e3,
               "static nn.EmbeddingBag", cost_static * 1e3)
    if tiered:
        report.add("DRAM+SSDHASH samples/s", "samples/s", rate["DRAM+SSDHASH"],
                   "static nn.EmbeddingBag", rate["static"], note="tier 0: 10% of rows; "
                   "goal >= 0.6")
        report.add("DRAM+SSDHASH embedding cost", "ms/step",
                   (t["DRAM+SSDHASH"] - t["dense only"]) * 1e3, "static nn.EmbeddingBag",
                   cost_static * 1e3)
    report.add("dense only samples/s", "samples/s", rate["dense only"], "static nn.EmbeddingBag",
               rate["static"], note="upper bound: no embedding work")
    if features:
        _report_features(report, t, batches, sizes, warmup)
    ph = _phases(batches, warmup)
    report.params["new_ids_per_step"] = ph.pop("new ids")
    whole = ph["forward"] + ph["backward"] + ph["optimizer"]
    for name in ("lookup", "inserts", "embedding forward", "forward", "backward", "optimizer"):
        report.add(f"DRAM step: {name}", "ms/step", ph[name] * 1e3, "DRAM whole step",
                   whole * 1e3, note="share of the step")


def _report_features(report: Report, t: dict[str, float], batches: list[Any],
                     sizes: list[int], warmup: int) -> None:
    """The per-feature forms against the 26 static tables, and their step breakdowns."""
    base = "26 static nn.EmbeddingBag"
    rate = {name: len(batches[0][3]) / s for name, s in t.items()}
    cost_static = t["26 static"] - t["dense only"]
    report.add("26 static samples/s", "samples/s", rate["26 static"], "static nn.EmbeddingBag",
               rate["static"], note="one table per feature")
    goals = {"collection": "goal >= 1.15", "convert(group=True)": "goal >= 1.15"}
    for name in ("26 DynamicEmbeddingBag", "collection", "convert(group=True)"):
        report.add(f"{name} samples/s", "samples/s", rate[name], base, rate["26 static"],
                   note=goals.get(name, ""))
        report.add(f"{name} embedding cost", "ms/step", (t[name] - t["dense only"]) * 1e3,
                   base, cost_static * 1e3,
                   note="step minus dense-only step" + ("; goal <= 0.5" if name in goals
                                                        else ""))
    for name in ("26 DynamicEmbeddingBag", "collection"):
        model, opt, use = tf.forms(sizes, DIM, DENSE_LR, TABLE_LR)[name]
        try:
            ph = tf.phases(model, opt, [(b[0], b[4] if use == "frows" else b[1], b[3])
                                        for b in batches], warmup)
        finally:
            for table in tf.tables(model):
                table.close()
        for part in ("dedup", "lookup", "inserts", "embedding forward", "backward",
                     "optimizer"):
            report.add(f"{name} step: {part}", "ms/step", ph[part], "its whole step",
                       ph["step"], note="the rest: copies, pooling"
                       if part == "embedding forward" else "")
