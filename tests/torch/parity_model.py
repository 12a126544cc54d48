"""The parity model: EmbeddingBag + Linear, dynamic or static, and its deterministic data.

Run as a script to restore a checkpoint into a fresh process and continue training:
``python parity_model.py OPT STORAGE URL TAG SPILL_DIR FIRST_STEP STEPS`` prints the losses
as JSON.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

import tensorkv
import tensorkv.torch as tt
from tensorkv.embedding.tiers.base import RecordLayout

DIM, N_IDS, BATCH, BAG, TIER0_ROWS = 8, 300, 12, 3, 48
KEYS = np.sort(np.random.default_rng(99).choice(1 << 62, N_IDS, replace=False)).astype(np.int64)
W_TRUE = np.random.default_rng(5).standard_normal(N_IDS).astype(np.float32)

#: name -> (table optimizer, torch optimizer of the static table, torch optimizer of dense params)
OPTIMIZERS = {
    "sgd": (lambda: tensorkv.SGD(lr=0.2), lambda p: torch.optim.SGD(p, lr=0.2),
            lambda p: torch.optim.SGD(p, lr=0.05)),
    "adagrad": (lambda: tensorkv.Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1),
                lambda p: torch.optim.Adagrad(p, lr=0.05)),
    "adam": (lambda: tensorkv.Adam(lr=0.01), lambda p: torch.optim.SparseAdam(p, lr=0.01),
             lambda p: torch.optim.Adam(p, lr=0.01)),
}
NUM_SLOTS = {"sgd": 0, "adagrad": 1, "adam": 2}


def batch(step: int):
    """Batch ``step``: (ids, offsets, per-sample weights, targets); the same in every process."""
    rng = np.random.default_rng(1000 + step)
    idx = rng.choice(N_IDS, BATCH * BAG, replace=False)
    idx[-BAG:] = idx[:BAG]  # duplicates within the batch
    offsets = np.arange(0, BATCH * BAG, BAG)
    psw = rng.uniform(0.5, 1.5, BATCH * BAG).astype(np.float32)
    y = np.add.reduceat(W_TRUE[idx] * psw, offsets).astype(np.float32)
    return (torch.from_numpy(KEYS[idx]), torch.from_numpy(offsets), torch.from_numpy(psw),
            torch.from_numpy(y), torch.from_numpy(idx.astype(np.int64)))


class Model(torch.nn.Module):
    """A bag of ids through a linear layer."""

    def __init__(self, bag: torch.nn.Module) -> None:
        super().__init__()
        self.bag = bag
        self.lin = torch.nn.Linear(DIM, 1)
        with torch.no_grad():
            self.lin.weight.copy_(torch.linspace(-0.5, 0.5, DIM))
            self.lin.bias.fill_(0.1)

    def forward(self, ids, offsets, psw):
        return self.lin(self.bag(ids, offsets, per_sample_weights=psw)).squeeze(-1)


def storage(opt: str, kind: str, spill_dir: str) -> dict:
    """Table options: DRAM, or a DRAM+SSDHASH chain whose tier 0 is smaller than the ids."""
    if kind == "dram":
        return {}
    rec = RecordLayout(dim=DIM, num_slots=NUM_SLOTS[opt]).record_bytes
    return {"storage": "DRAM_SSDHASH", "storage_path": spill_dir,
            "storage_size": [TIER0_ROWS * rec]}


def dynamic(opt: str, kind: str = "dram", spill_dir: str = "", fused: bool = False):
    """The dynamic model and its tensorkv.torch.Optimizer (``fused``: updates in backward)."""
    bag = tt.DynamicEmbeddingBag(DIM, "sum", optimizer=OPTIMIZERS[opt][0](),
                                 initializer="normal", seed=7, **storage(opt, kind, spill_dir))
    model = Model(bag)
    return model, tt.Optimizer(model, dense=OPTIMIZERS[opt][2](model.lin.parameters()),
                               fused=fused)


def static(opt: str):
    """The static twin: nn.EmbeddingBag(sparse=True) holding every id's initial row."""
    init = tensorkv.EmbeddingTable(DIM, initializer="normal", seed=7).lookup(KEYS, insert=False)
    bag = torch.nn.EmbeddingBag(N_IDS, DIM, mode="sum", sparse=True,
                                _weight=torch.from_numpy(init.copy()))
    model = Model(bag)
    return model, [OPTIMIZERS[opt][1]([bag.weight]), OPTIMIZERS[opt][2](model.lin.parameters())]


def train_step(model, opts, step: int, is_static: bool) -> float:
    ids, offsets, psw, y, idx = batch(step)
    for o in opts:
        o.zero_grad()
    out = model(idx if is_static else ids, offsets, psw)
    loss = torch.nn.functional.mse_loss(out, y)
    loss.backward()
    for o in opts:
        o.step()
    return loss.item()


def main(argv: list[str]) -> None:
    opt, kind, url, tag, spill_dir, first, steps = argv
    model, o = dynamic(opt, kind, spill_dir)
    tt.load(model, url, tag, optimizer=o)
    losses = [train_step(model, [o], s, False) for s in range(int(first), int(first) + int(steps))]
    rows = model.bag.table.lookup(KEYS, insert=False)
    print(json.dumps({"losses": losses, "rows": rows.tolist(),
                      "lin": model.lin.weight.detach().reshape(-1).tolist()}))
    model.bag.table.close()


if __name__ == "__main__":
    main(sys.argv[1:])
