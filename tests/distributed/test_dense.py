"""Dense parameters served by the parameter server: async and sync steps, attach, bad input.

Each test uses the module's 2-shard server (``ps``) and a dense server of its own name; the
server's optimizer steps are compared bit for bit with the same torch optimizer run locally.
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
import torch
from torch import nn

from tensorkv.errors import ConfigError


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))


def set_grads(model: nn.Module, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g) for p in model.parameters()]
    for p, x in zip(model.parameters(), grads, strict=True):
        p.grad = x.clone()
    return grads


def test_async_steps_and_a_second_worker_attaches(ps):
    name = f"d{uuid.uuid4().hex[:6]}"
    a, b, ref = net(0), net(1), net(0)
    da = ps.dense(a, torch.optim.Adam, name=name, lr=0.01)
    db = ps.dense(b, torch.optim.Adam, name=name, lr=0.01)  # attaches: a's values win
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step, (model, remote) in enumerate([(a, da), (b, db), (a, da)]):
        set_grads(model, step)
        set_grads(ref, step)
        remote.step()  # one server step per push
        opt.step()
        for x, y in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert da.version == 3
    db.pull()
    for x, y in zip(b.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_sync_rounds_average_the_workers_and_leave(ps):
    name = f"s{uuid.uuid4().hex[:6]}"
    a, b, ref = net(0), net(0), net(0)
    da = ps.dense(a, torch.optim.SGD, mode="sync", workers=2, name=name, lr=0.5)
    db = ps.dense(b, torch.optim.SGD, mode="sync", workers=2, name=name, lr=0.5)
    ga, gb = set_grads(a, 10), set_grads(b, 11)
    t = threading.Thread(target=db.step)
    t.start()
    da.step()  # returns once both pushed: one step with the mean gradient
    t.join()
    with torch.no_grad():
        for p, x, y in zip(ref.parameters(), ga, gb, strict=True):
            p.grad = torch.from_numpy(np.mean(np.stack([x.numpy(), y.numpy()]), axis=0))
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    for m in (a, b):
        for x, y in zip(m.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert da.version == db.version == 1
    db.leave()  # b is done: a's next push is a round of its own
    set_grads(a, 12)
    da.step()
    assert da.version == 2


def test_bad_dense_arguments(ps):
    with pytest.raises(ConfigError, match="mode='x' must be one of async, sync"):
        ps.dense(net(0), mode="x")
    with pytest.raises(ConfigError, match="give workers=N"):
        ps.dense(net(0), mode="sync")
    with pytest.raises(ConfigError, match="must be a torch.optim.Optimizer class"):
        ps.dense(net(0), torch.optim.Adam(net(0).parameters()))
    with pytest.raises(ConfigError, match="no dense parameters"):
        ps.dense([])
    name = f"b{uuid.uuid4().hex[:6]}"
    ps.dense(net(0), name=name)
    with pytest.raises(ConfigError, match="the same model on every worker"):
        ps.dense(nn.Linear(2, 2), name=name)
