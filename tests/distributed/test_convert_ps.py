"""``tensorkv.torch.convert(model, ps=...)``: converted tables live on the parameter server.

One client's training is bit-identical to the same model converted locally; a second
worker's convert attaches to the trained tables without overwriting them; ``ps_tables``
renames and shares tables; bad arguments are refused. Uses the module's 2-shard server.
"""

from __future__ import annotations

import copy
import uuid

import numpy as np
import pytest
import torch
from torch import nn

import tensorkv
from tensorkv.errors import ConfigError
from tensorkv.testing.tablecheck import assert_same_rows, table_rows
from tensorkv.torch import Optimizer, convert


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.user = nn.Embedding(50, 8, padding_idx=0)
        with torch.no_grad():
            self.user.weight[0] = 0
        self.items = nn.EmbeddingBag(40, 8, mode="sum")
        self.head = nn.Linear(16, 1)

    def forward(self, u, i):
        return self.head(torch.cat([self.user(u), self.items(i)], 1)).squeeze(-1)


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 80, (16,), generator=g), torch.randint(0, 60, (16, 3), generator=g))
            for _ in range(n)]


def train(model, data) -> list[torch.Tensor]:
    opt = Optimizer(model, dense=torch.optim.SGD(model.parameters(), lr=0.1))
    outs = []
    for u, i in data:
        out = model(u, i)
        outs.append(out.detach())
        opt.zero_grad()
        out.pow(2).mean().backward()
        opt.step()
    return outs


def test_convert_onto_the_parameter_server(ps):
    base = Model()
    names = {"user": f"u{uuid.uuid4().hex[:6]}", "items": f"i{uuid.uuid4().hex[:6]}"}
    kw = {"optimizer": tensorkv.Adagrad(lr=0.05), "seed": 4}
    local = convert(copy.deepcopy(base), **kw)
    remote = convert(copy.deepcopy(base), ps=ps, ps_tables=names, **kw)
    assert set(names.values()) <= set(ps.tables())
    u, i = torch.tensor([1, 7, 49]), torch.tensor([[0, 5], [39, 2], [1, 1]])  # old ids
    for m in (local, remote):  # the old rows were copied: the same outputs
        torch.testing.assert_close(m(u, i), base(u, i), rtol=0, atol=0)
    data = batches(3)
    for a, b in zip(train(local, data), train(remote, data), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # bit for bit
    assert_same_rows(table_rows(remote.user.table), table_rows(local.user.table), seq=False)
    assert_same_rows(table_rows(remote.items.table), table_rows(local.items.table), seq=False)
    # a second worker converting the same model attaches: the trained rows stay
    late = convert(copy.deepcopy(base), ps=ps, ps_tables=names, **kw)
    assert_same_rows(table_rows(late.user.table), table_rows(local.user.table), seq=False)
    # one table shared by two modules: the first creates it with its rows
    shared = f"s{uuid.uuid4().hex[:6]}"
    both = convert(copy.deepcopy(base), ps=ps, ps_tables={"user": shared, "items": shared}, **kw)
    assert ps.tables().count(shared) == 1 and both.user.table.name == both.items.table.name
    rows = both.user.table.lookup(np.arange(1, 50), insert=False)
    np.testing.assert_array_equal(rows, base.user.weight.detach().numpy()[1:])


def test_bad_parameter_server_arguments(ps):
    with pytest.raises(ConfigError, match="must be a tensorkv.distributed.ParameterServer"):
        convert(Model(), ps=object())
    with pytest.raises(ConfigError, match="ps_tables names tables on a parameter server"):
        convert(Model(), ps_tables={"user": "x"})
    with pytest.raises(ConfigError, match=r"ps_tables names modules \['head'\]"):
        convert(Model(), ps=ps, ps_tables={"head": "x"})
    with pytest.raises(ConfigError, match="ps_tables\\['user'\\]=''"):
        convert(Model(), ps=ps, ps_tables={"user": ""})
