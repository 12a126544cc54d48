"""The dense server's rules, run in this process (the actor's class without Ray).

Async mode: each push is one optimizer step. Sync mode: one step per round of ``workers``
pushes, with their mean gradient; ``leave`` lets a round finish with fewer workers. Each result
is compared bit for bit with ``torch.optim.Adam`` stepped by hand on the same gradients.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tensorkv.distributed.dense import DenseServer
from tensorkv.errors import ConfigError

W = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(3, np.float32)]


def grads(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=w.shape).astype(np.float32) for w in W]


def mean(*gs: list[np.ndarray]) -> list[np.ndarray]:
    return [np.mean(np.stack(parts), axis=0) for parts in zip(*gs, strict=True)]


def reference(steps: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The parameters after stepping Adam (lr 0.1) by hand with each list of gradients."""
    params = [torch.nn.Parameter(torch.from_numpy(w.copy())) for w in W]
    opt = torch.optim.Adam(params, lr=0.1)
    for step in steps:
        for p, g in zip(params, step, strict=True):
            p.grad = torch.from_numpy(np.array(g, np.float32))
        opt.step()
    return [p.detach().numpy().copy() for p in params]


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def server(mode: str, workers: int = 1) -> DenseServer:
    return DenseServer(torch.optim.Adam, {"lr": 0.1}, mode, workers)


def test_async_pushes_are_one_step_each():
    async def main():
        s = server("async")
        version, weights = await s.init(W)
        assert version == 0
        assert_same(weights, W)
        assert await s.push(grads(1)) == 1
        assert await s.push(grads(2)) == 2
        return await s.pull(2)

    version, weights = asyncio.run(main())
    assert version == 2
    assert_same(weights, reference([grads(1), grads(2)]))


def test_sync_rounds_step_once_with_the_mean():
    async def main():
        s = server("sync", workers=2)
        await s.init(W)
        target = await s.push(grads(1))
        assert target == 1 and s.version == 0  # the round waits for the second worker
        waiter = asyncio.ensure_future(s.pull(target))
        await asyncio.sleep(0)
        assert not waiter.done()
        assert await s.push(grads(2)) == 1
        return await waiter

    version, weights = asyncio.run(main())
    assert version == 1
    assert_same(weights, reference([mean(grads(1), grads(2))]))


def test_leave_finishes_the_waiting_round_and_later_rounds_need_fewer_pushes():
    async def main():
        s = server("sync", workers=2)
        await s.init(W)
        await s.push(grads(1))
        await s.leave()  # the other worker is done: the round steps with the one push
        assert s.version == 1
        target = await s.push(grads(2))  # one worker left: one push is a round
        return await s.pull(target)

    version, weights = asyncio.run(main())
    assert version == 2
    assert_same(weights, reference([grads(1), grads(2)]))


def test_a_second_worker_attaches_and_a_different_model_is_refused():
    async def main():
        s = server("async")
        await s.init(W)
        await s.push(grads(1))
        version, weights = await s.init([w + 5 for w in W])  # attaches: keeps the server's
        assert version == 1
        assert_same(weights, reference([grads(1)]))
        with pytest.raises(ConfigError, match=r"shapes \[\(2, 3\), \(3,\)\].*same model"):
            await s.init([np.zeros((3, 2), np.float32), np.ones(3, np.float32)])
        return await s.pull()

    _, weights = asyncio.run(main())
    assert_same(weights, reference([grads(1)]))
