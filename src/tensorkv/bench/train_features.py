"""The per-feature forms of ``tensorkv bench train``: one table per categorical feature.

The demo's DLRM (:mod:`tensorkv.bench.dlrm`) takes one embedding module for the 26 features;
here that module is an adapter over one table per feature, as users write the model:

* ``26 static``: 26 ``nn.EmbeddingBag(sparse=True)`` tables, each sized to its feature's
  distinct ids (ids pre-mapped to compact rows), ``torch.optim.Adagrad`` over the 26 weights.
* ``26 DynamicEmbeddingBag``: 26 modules called one by one (what ``convert()`` gives).
* ``collection``: one :class:`~tensorkv.torch.DynamicEmbeddingBagCollection` of 26 tables,
  called once per step with a dict of the 26 columns.
* ``convert(group=True)``: the ``26 static`` model (before training) converted with
  ``group=True``: the 26 modules' lookups run as one fused pass; fed the compact rows of the
  static model (its tables hold every row from the start, as the static tables do).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np

from tensorkv.bench.dlrm import DLRM, N_CAT


def _adapters() -> tuple[type, type]:
    import torch
    from torch import nn

    class PerFeature(nn.Module):
        """ids ``[B * 26, 1]`` -> rows ``[B * 26, dim]`` through one module per feature."""

        def __init__(self, bags: list[Any]) -> None:
            super().__init__()
            self.bags = nn.ModuleList(bags)

        def forward(self, ids: Any) -> Any:
            x = ids.reshape(-1, N_CAT)
            out = torch.stack([bag(x[:, i:i + 1]) for i, bag in enumerate(self.bags)], 1)
            return out.reshape(x.shape[0] * N_CAT, -1)

    class Collection(nn.Module):
        """The same through one collection call with a dict of the 26 columns."""

        def __init__(self, collection: Any) -> None:
            super().__init__()
            self.collection = collection

        def forward(self, ids: Any) -> Any:
            x = ids.reshape(-1, N_CAT)
            kt = self.collection({f"f{i}": x[:, i] for i in range(N_CAT)})
            return kt.values().reshape(x.shape[0] * N_CAT, -1)

    return PerFeature, Collection


class StaticOptimizer:
    """Adam on the dense parameters, Adagrad on the sparse embedding weights."""

    def __init__(self, model: Any, weights: list[Any], dense_lr: float, table_lr: float) -> None:
        import torch

        dense = [p for n, p in model.named_parameters() if not n.startswith("embedding.")]
        self.opts: list[Any] = [torch.optim.Adam(dense, lr=dense_lr)]
        if weights:
            self.opts.append(torch.optim.Adagrad(weights, lr=table_lr))

    def zero_grad(self) -> None:
        """Clear every gradient."""
        for o in self.opts:
            o.zero_grad()

    def step(self) -> None:
        """Step both optimizers."""
        for o in self.opts:
            o.step()


def feature_rows(keys: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Each column's keys as compact rows ``0..n_f - 1``, and each column's ``n_f``."""
    rows = np.empty(keys.shape, np.int64)
    sizes = []
    for f in range(keys.shape[-1]):  # 26 columns, each one vectorised pass
        uniq, inv = np.unique(keys[..., f], return_inverse=True)
        rows[..., f] = inv.reshape(keys.shape[:-1])
        sizes.append(int(uniq.size))
    return rows, sizes


def forms(sizes: list[int], dim: int, dense_lr: float, table_lr: float) -> dict[str, Any]:
    """The per-feature forms: name -> (model, optimizer, input) with input "keys" or "frows"."""
    import torch

    from tensorkv.embedding.optimizers import Adagrad
    from tensorkv.torch import (
        DynamicEmbeddingBag,
        DynamicEmbeddingBagCollection,
        EmbeddingBagConfig,
        Optimizer,
        convert,
    )

    per_feature, collection = _adapters()
    static_bags = [torch.nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in sizes]
    static = DLRM(per_feature(static_bags), dim=dim)
    grouped = convert(copy.deepcopy(static), optimizer=Adagrad(lr=table_lr), group=True)
    separate = DLRM(per_feature([DynamicEmbeddingBag(dim, mode="sum", seed=i,
                                                     optimizer=Adagrad(lr=table_lr))
                                 for i in range(N_CAT)]), dim=dim)
    cfgs = [EmbeddingBagConfig(f"f{i}", dim, pooling="sum", seed=i) for i in range(N_CAT)]
    col = DLRM(collection(DynamicEmbeddingBagCollection(cfgs, optimizer=Adagrad(lr=table_lr))),
               dim=dim)

    def dynamic_opt(model: Any) -> Any:
        return Optimizer(model, dense=torch.optim.Adam(
            [p for n, p in model.named_parameters()], lr=dense_lr))

    return {
        "26 static": (static, StaticOptimizer(static, [b.weight for b in static_bags],
                                              dense_lr, table_lr), "frows"),
        "26 DynamicEmbeddingBag": (separate, dynamic_opt(separate), "keys"),
        "collection": (col, dynamic_opt(col), "keys"),
        "convert(group=True)": (grouped, dynamic_opt(grouped), "frows"),
    }


def tables(model: Any) -> list[Any]:
    """The dynamic tables of a form's model."""
    return [m.table for m in model.modules()
            if hasattr(m, "table") and hasattr(m, "take_gradients")]


def phases(model: Any, opt: Any, batches: list[tuple[Any, Any, Any]], warmup: int) -> dict[
        str, float]:
    """Median ms per step of a dynamic form's parts and of its whole step.

    The parts: lookup (and its inserts), dedup, the rest of the embedding forward (copies,
    pooling), backward, optimizer (tables and dense).

    ``batches``: ``(dense, ids, labels)``. The insert share is the lookup time minus a lookup
    of the same keys once they all exist.
    """
    import torch

    import tensorkv.torch.fused as fused
    import tensorkv.torch.modules as modules

    names = ("lookup", "dedup", "embedding forward", "backward", "optimizer", "step")
    spent: dict[str, list[float]] = {k: [] for k in names}
    cur = dict.fromkeys(names, 0.0)
    seen: list[tuple[Any, np.ndarray]] = []
    real: list[tuple[Any, Any]] = []
    for table in tables(model):
        lookup = table.lookup

        def timed(keys: Any, *args: Any, _lookup: Any = lookup, _t: Any = table,
                  **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _lookup(keys, *args, **kw)
            finally:
                cur["lookup"] += time.perf_counter() - t0
                seen.append((_t, np.array(keys, copy=True)))

        table.lookup = timed
        real.append((table, lookup))

    def timed_fn(fn: Any) -> Any:
        def wrapper(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                cur["dedup"] += time.perf_counter() - t0
        return wrapper

    saved = (fused.distinct_segments, modules.dedup)
    fused.distinct_segments = timed_fn(saved[0])
    modules.dedup = timed_fn(saved[1])
    emb_t0 = [0.0]
    pre = model.embedding.register_forward_pre_hook(
        lambda *_: emb_t0.__setitem__(0, time.perf_counter()))
    post = model.embedding.register_forward_hook(
        lambda *_: cur.__setitem__("embedding forward", cur["embedding forward"]
                                   + time.perf_counter() - emb_t0[0]))
    f = torch.nn.functional.binary_cross_entropy_with_logits
    try:
        for i, (dense, ids, labels) in enumerate(batches):
            if i == warmup:
                seen.clear()
            cur.update(dict.fromkeys(names, 0.0))
            t0 = time.perf_counter()
            loss = f(model(dense, ids), labels)
            emb = cur["embedding forward"]
            opt.zero_grad()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if i >= warmup:
                cur.update({"embedding forward": max(emb, cur["lookup"] + cur["dedup"]),
                            "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0})
                for k in names:
                    spent[k].append(cur[k])
    finally:
        fused.distinct_segments, modules.dedup = saved
        pre.remove()
        post.remove()
        for table, lookup in real:
            table.lookup = lookup
    gather: dict[int, float] = {}
    steps = max(len(spent["lookup"]), 1)
    for table, keys in seen:  # the same lookups again, every key present now: gather only
        t0 = time.perf_counter()
        table.lookup(keys, insert=False)
        gather[id(table)] = gather.get(id(table), 0.0) + time.perf_counter() - t0
    out = {k: float(np.median(v)) * 1e3 for k, v in spent.items()}
    out["inserts"] = max(out["lookup"] - sum(gather.values()) / steps * 1e3, 0.0)
    out["embedding forward"] -= out["lookup"] + out["dedup"]
    return out


__all__ = ["StaticOptimizer", "feature_rows", "forms", "phases", "tables"]
