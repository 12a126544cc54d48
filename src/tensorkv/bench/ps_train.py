"""``tensorkv bench ps_train``: the demo's DLRM trained data-parallel on a parameter server.

Worker actors train the model of ``tensorkv demo`` (:mod:`tensorkv.bench.dlrm`) on the
synthetic click data: its embedding rows live in a :class:`~tensorkv.distributed.ParameterServer`
(one Adagrad table over ``shards`` shard actors, a ``DynamicEmbeddingBag`` in every worker),
its dense layers on the parameter server too (``ps.dense``: Adam run by the server, each
worker's ``Optimizer.step()`` pushes its dense gradients and pulls the new weights). Worker
``r`` of ``W`` trains batches ``r, r + W, ...``, all workers at once. The baseline is the
same model trained on the same batches in one process. Reported: the AUC of both on
held-out batches (goal: within 0.002), and the samples/s of both. Starts a local Ray
(``num_cpus`` = the machine's) unless one runs.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from tensorkv.bench.common import Report
from tensorkv.bench.dlrm import DLRM, SyntheticCTR, auc

DIM = 16
TABLE_LR = 0.05
DENSE_LR = 1e-3


def _bce(out: Any, labels: Any) -> Any:
    import torch

    return torch.nn.functional.binary_cross_entropy_with_logits(out, labels)


def _model(ps: Any, table: str, seed: int, dim: int = DIM) -> tuple[Any, Any]:
    """The DLRM over the parameter server's table, and its dense optimizer on the server."""
    import torch

    from tensorkv.torch import DynamicEmbeddingBag

    rows: Any = ps.table(table)  # a ShardedEmbeddingTable, taken as a table
    model = DLRM(DynamicEmbeddingBag(dim, mode="sum", table=rows), dim=dim, seed=seed)
    return model, ps.dense(model, torch.optim.Adam, lr=DENSE_LR)


class Worker:
    """One data-parallel worker (a Ray actor): rows and dense weights on the parameter server."""

    def __init__(self, ps_name: str, table: str, seed: int) -> None:
        import torch

        from tensorkv.distributed import ParameterServer
        from tensorkv.torch import Optimizer

        torch.set_num_threads(1)
        self.ps = ParameterServer(name=ps_name)
        self.model, dense = _model(self.ps, table, seed)
        self.opt = Optimizer(self.model, dense=dense)  # rows: Adagrad; dense: the server's

    def train(self, steps: list[int], batch: int, data_seed: int) -> dict[str, Any]:
        """Train the given batch numbers; losses and the predictions made before each update."""
        import torch

        data = SyntheticCTR(data_seed)
        losses, preds, labels = [], [], []
        t0 = time.perf_counter()
        for s in steps:
            b = data.batch(s, batch)
            out = self.model(torch.from_numpy(b.dense), torch.from_numpy(b.keys))
            loss = _bce(out, torch.from_numpy(b.labels))
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()  # sparse gradients to the shards, dense ones to the dense server
            losses.append(float(loss.item()))
            preds.append(out.detach().numpy())
            labels.append(b.labels)
        return {"losses": losses, "seconds": time.perf_counter() - t0,
                "preds": np.concatenate(preds) if preds else np.empty(0),
                "labels": np.concatenate(labels) if labels else np.empty(0)}


def _evaluate(model: Any, data: SyntheticCTR, first: int, n: int, batch: int) -> float:
    import torch

    model.eval()
    preds, labels = [], []
    with torch.no_grad():
        for s in range(first, first + n):
            b = data.batch(s, batch)
            preds.append(model(torch.from_numpy(b.dense), torch.from_numpy(b.keys)).numpy())
            labels.append(b.labels)
    model.train()
    return auc(np.concatenate(labels), np.concatenate(preds))


def train_single(steps: int, batch: int, eval_batches: int, seed: int = 0,
                 data_seed: int = 0) -> dict[str, Any]:
    """The baseline: the model trained in this process; AUC on the held-out batches."""
    import torch

    from tensorkv import Adagrad, EmbeddingTable
    from tensorkv.torch import DynamicEmbeddingBag, Optimizer

    table = EmbeddingTable(DIM, optimizer=Adagrad(lr=TABLE_LR), seed=seed)
    model = DLRM(DynamicEmbeddingBag(DIM, mode="sum", table=table), dim=DIM, seed=seed)
    opt = Optimizer(model, dense=torch.optim.Adam(model.parameters(), lr=DENSE_LR))
    data = SyntheticCTR(data_seed)
    losses = []
    t0 = time.perf_counter()
    for s in range(steps):
        b = data.batch(s, batch)
        loss = _bce(model(torch.from_numpy(b.dense), torch.from_numpy(b.keys)),
                    torch.from_numpy(b.labels))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    seconds = time.perf_counter() - t0
    return {"auc": _evaluate(model, data, steps, eval_batches, batch), "losses": losses,
            "seconds": seconds, "rows": len(table)}


def train_distributed(steps: int, batch: int, eval_batches: int, *, workers: int = 2,
                      shards: int = 2, seed: int = 0, data_seed: int = 0) -> dict[str, Any]:
    """The model trained by ``workers`` actors on ``shards`` shards (Ray must be running)."""
    import ray

    from tensorkv import Adagrad
    from tensorkv.distributed import ParameterServer

    ps = ParameterServer(shards, name=f"bench-{uuid.uuid4().hex[:8]}")
    try:
        table: Any = ps.table("emb", DIM, optimizer=Adagrad(lr=TABLE_LR), seed=seed)
        model, dense = _model(ps, "emb", seed)  # creates the dense server: its first weights
        actors: list[Any] = [ray.remote(num_cpus=0)(Worker).remote(ps.name, "emb", seed)
                             for _ in range(workers)]
        t0 = time.perf_counter()
        outs = ray.get([a.train.remote(list(range(r, steps, workers)), batch, data_seed)
                        for r, a in enumerate(actors)])
        seconds = time.perf_counter() - t0
        dense.pull()  # the trained dense weights into the evaluation model
        result = {"auc": _evaluate(model, SyntheticCTR(data_seed), steps, eval_batches, batch),
                  "seconds": seconds, "rows": len(table),
                  "losses": [o["losses"] for o in outs]}
        for a in actors:
            ray.kill(a)
        return result
    finally:
        ps.shutdown()


def run(quick: bool, report: Report, *, steps: int | None = None, batch: int | None = None,
        eval_batches: int | None = None, workers: int = 2, shards: int = 2) -> None:
    """Run the workload (see the module docstring).

    Parameters
    ----------
    steps
        Training batches in all (default 400; quick 40).
    batch
        Samples per batch (default 2048; quick 512).
    eval_batches
        Held-out batches the AUC is measured on (default 20; quick 4).
    workers, shards
        Worker actors and shard actors.
    """
    import ray

    steps = steps or (40 if quick else 400)
    batch = batch or (512 if quick else 2048)
    eval_batches = eval_batches or (4 if quick else 20)
    if steps < 1 or batch < 1 or eval_batches < 1 or workers < 1 or shards < 1:
        raise ValueError(f"steps={steps}, batch={batch}, eval_batches={eval_batches}, "
                         f"workers={workers}, shards={shards}: all must be >= 1")
    report.params.update(steps=steps, batch=batch, eval_batches=eval_batches, workers=workers,
                         shards=shards)
    started = not ray.is_initialized()
    if started:
        from tensorkv.distributed import start_local_ray

        start_local_ray()
    try:
        single = train_single(steps, batch, eval_batches)
        dist = train_distributed(steps, batch, eval_batches, workers=workers, shards=shards)
    finally:
        if started:
            ray.shutdown()
    report.params.update(rows=dist["rows"], auc_gap=dist["auc"] - single["auc"])
    report.add(f"AUC, {workers} workers x {shards} shards", "AUC", dist["auc"],
               "one process", single["auc"], note="goal: within 0.002")
    report.add(f"samples/s, {workers} workers x {shards} shards", "samples/s",
               steps * batch / dist["seconds"], "one process", steps * batch / single["seconds"])
