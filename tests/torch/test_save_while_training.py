"""``tensorkv.torch.save(model, blocking=False)`` from a checkpoint thread while a model trains.

The training thread runs ``tensorkv.torch.Optimizer`` steps (which hold the default step scope
from a module's forward pass to the end of ``step()``) on a model with two dynamic modules
(one on a DRAM table, one spilling to SSDHASH), dense layers and a dense Adam optimizer, and
records the whole state after every step. A checkpoint thread saves at seeded step counts.
Each tag must hold one step's state: both tables, every dense parameter and buffer, and the
dense optimizer's state, all of the same step.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tensorkv  # noqa: E402
import tensorkv.torch as tt  # noqa: E402
from tensorkv.checkpoint.objects import module_state  # noqa: E402
from tensorkv.testing.tablecheck import assert_same_rows, table_rows  # noqa: E402

STEPS = 30


class Net(torch.nn.Module):
    def __init__(self, spill: str):
        super().__init__()
        rb = tensorkv.embedding.tiers.base.RecordLayout(4, "float32", 1).record_bytes
        self.a = tt.DynamicEmbeddingBag(4, "sum", optimizer=tensorkv.Adagrad(lr=0.1), seed=2)
        self.b = tt.DynamicEmbedding(4, optimizer=tensorkv.Adagrad(lr=0.05), seed=3,
                                     storage="DRAM_SSDHASH", storage_path=spill,
                                     storage_size=[30 * rb])
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids):
        x = self.norm(self.a(ids))
        y = self.b(ids[:, 0])
        return self.head(torch.cat([x, y], 1))


def state(net, opt):
    """Everything a tag of the model holds, copied."""
    dense = {k: v.clone() for k, v in module_state(net).items()}
    sd = opt.dense.state_dict()["state"]
    adam = {f"{pid}/{k}": v.clone() for pid, st in sd.items() for k, v in st.items()
            if isinstance(v, torch.Tensor)}
    return {"a": table_rows(net.a.table, 1 << 30), "b": table_rows(net.b.table, 1 << 30),
            "dense": dense, "adam": adam}


def test_module_saves_in_the_background_hold_one_training_step(tmp_path):
    url = f"lmdb://{tmp_path / 'ck'}"
    torch.manual_seed(0)
    net = Net(str(tmp_path / "spill"))
    opt = tt.Optimizer(net, dense=torch.optim.Adam(net.parameters(), lr=0.01))
    states = {0: state(net, opt)}
    stepped = threading.Semaphore(0)
    errors: list[BaseException] = []

    def train():
        try:
            for s in range(1, STEPS + 1):
                ids = torch.from_numpy(np.random.default_rng(s).integers(0, 400, (16, 3)))
                out = net(ids)
                loss = out.pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                states[s] = state(net, opt)
                stepped.release()
        except BaseException as e:
            errors.append(e)
            stepped.release(1000)

    pick = random.Random("torch-bg")
    tags = []
    with net.b.table:
        th = threading.Thread(target=train)
        th.start()
        for i in range(3):
            for _ in range(pick.randint(2, 8)):
                stepped.acquire()
            h = tt.save(net, url, f"s{i}", optimizer=opt, blocking=False, block_rows=8,
                        bucket_bits=0)
            tags.append(h.result())
        th.join()
        assert not errors, errors
    for tag in tags:
        info = tensorkv.tag_manifest(url, tag)["tables"]
        step = info["a.table"]["meta"]["step"]
        assert info["b.table"]["meta"]["step"] == step, f"{tag}: the tables are two steps"
        want = states[step]
        fresh = Net(str(tmp_path / f"fresh-{tag}"))
        fresh_opt = tt.Optimizer(fresh, dense=torch.optim.Adam(fresh.parameters(), lr=0.01))
        with fresh.b.table:
            tt.load(fresh, url, tag, optimizer=fresh_opt)
            got = state(fresh, fresh_opt)
        for name in ("a", "b"):
            assert_same_rows(got[name], want[name], f"{tag} table {name}", seq=False)
        for group in ("dense", "adam"):
            assert got[group].keys() == want[group].keys()
            for k in want[group]:
                assert torch.equal(got[group][k], want[group][k]), f"{tag}: {group} {k}"
