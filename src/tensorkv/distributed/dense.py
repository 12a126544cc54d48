"""Dense parameters on the parameter server: one actor holds them and their optimizer.

:class:`DenseServer` (a Ray actor named after the parameter server) keeps a model's dense
parameters and steps a ``torch.optim`` optimizer over them with the gradients workers push.
:class:`RemoteDense` is what a worker holds: a ``torch.optim.Optimizer`` over its local copy of
the parameters whose :meth:`~RemoteDense.step` pushes the local gradients and pulls the
server's parameters back, so ``tensorkv.torch.Optimizer(model, dense=ps.dense(model, ...))``
trains data-parallel with no all-reduce of its own. Modes (as ElasticDL offers them):

- ``"async"``: every push is one optimizer step on the server, applied as it arrives;
- ``"sync"``: the server waits for one push from each of ``workers`` workers, steps once with
  their mean gradient, and every worker's pull returns the parameters after that step. A
  worker that has no more batches calls :meth:`RemoteDense.leave` so the others go on.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch

from tensorkv.errors import ConfigError

MODES = ("async", "sync")


class DenseServer:
    """The dense parameters and their optimizer (a Ray actor; its methods are coroutines).

    Parameters
    ----------
    optimizer
        A ``torch.optim.Optimizer`` class, e.g. ``torch.optim.Adam``.
    options
        Its keyword arguments (``lr`` ...).
    mode
        ``"async"`` or ``"sync"`` (see the module docstring).
    workers
        Sync mode: pushes per step.
    """

    def __init__(self, optimizer: Any, options: dict[str, Any], mode: str, workers: int) -> None:
        torch.set_num_threads(1)
        self.make = (optimizer, dict(options))
        self.mode, self.workers = mode, workers
        self.params: list[torch.nn.Parameter] | None = None
        self.opt: Any = None
        self.version = 0
        self.pending: list[list[np.ndarray]] = []
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def _weights(self) -> list[np.ndarray]:
        assert self.params is not None
        return [p.detach().numpy().copy() for p in self.params]

    async def init(self, weights: list[np.ndarray]) -> tuple[int, list[np.ndarray]]:
        """Take ``weights`` if the server has none yet; the server's version and weights."""
        if self.params is None:
            self.params = [torch.nn.Parameter(torch.from_numpy(np.array(w, np.float32)))
                           for w in weights]
            cls, opts = self.make
            self.opt = cls(self.params, **opts)
        else:
            have = [tuple(p.shape) for p in self.params]
            want = [tuple(np.shape(w)) for w in weights]
            if have != want:
                raise ConfigError(f"the dense parameters on the server have shapes {have}; "
                                  f"this model's are {want}: the same model on every worker")
        return self.version, self._weights()

    def _apply(self, grads: list[np.ndarray]) -> None:
        assert self.params is not None
        for p, g in zip(self.params, grads, strict=True):
            p.grad = torch.from_numpy(np.array(g, np.float32))
        self.opt.step()
        self.version += 1

    async def push(self, grads: list[np.ndarray]) -> int:
        """A worker's gradients; the version whose parameters include them."""
        if self.mode == "async":
            self._apply(grads)
            return self.version
        cond = self._condition()
        async with cond:
            self.pending.append(grads)
            target = self.version + 1
            if len(self.pending) >= self.workers:
                self._round()
                cond.notify_all()
            return target

    def _round(self) -> None:
        mean = [np.mean(np.stack(gs), axis=0) for gs in zip(*self.pending, strict=True)]
        self.pending = []
        self._apply(mean)

    async def pull(self, at_least: int = 0) -> tuple[int, list[np.ndarray]]:
        """The parameters once the server's version reaches ``at_least``."""
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self.version >= at_least)
            return self.version, self._weights()

    async def leave(self) -> None:
        """Sync mode: one worker fewer waited for from now on."""
        cond = self._condition()
        async with cond:
            self.workers = max(1, self.workers - 1)
            if self.pending and len(self.pending) >= self.workers:
                self._round()
                cond.notify_all()


class RemoteDense(torch.optim.Optimizer):
    """A worker's view of the dense server: a ``torch.optim.Optimizer`` over local copies.

    :meth:`step` pushes the parameters' gradients (zeros where a parameter has none) and
    copies the server's parameters after that step into the local ones. Made by
    :meth:`tensorkv.distributed.ParameterServer.dense`.
    """

    def __init__(self, params: list[torch.nn.Parameter], actor: Any, mode: str) -> None:
        super().__init__(params, {})
        self.actor, self.mode = actor, mode
        self._params = list(params)
        ray = __import__("ray")
        self.version, weights = ray.get(actor.init.remote(
            [p.detach().cpu().numpy() for p in self._params]))
        self._set(weights)

    def _set(self, weights: list[np.ndarray]) -> None:
        with torch.no_grad():
            for p, w in zip(self._params, weights, strict=True):
                p.copy_(torch.from_numpy(np.array(w, np.float32)))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Push the gradients, then pull the parameters of the step that includes them."""
        loss = closure() if closure is not None else None
        ray = __import__("ray")
        grads = [np.zeros(tuple(p.shape), np.float32) if p.grad is None
                 else p.grad.detach().cpu().numpy() for p in self._params]
        target = ray.get(self.actor.push.remote(grads))
        self.version, weights = ray.get(self.actor.pull.remote(target))
        self._set(weights)
        return loss

    def pull(self) -> None:
        """Copy the server's current parameters into the local ones."""
        ray = __import__("ray")
        self.version, weights = ray.get(self.actor.pull.remote(0))
        self._set(weights)

    def leave(self) -> None:
        """Sync mode: this worker has no more steps (the others stop waiting for it)."""
        __import__("ray").get(self.actor.leave.remote())


__all__ = ["MODES", "DenseServer", "RemoteDense"]
