"""``tensorkv.torch.Optimizer``: one object that steps a dense torch optimizer and every table.

The dynamic modules of a model keep the IndexedSlices of each backward pass (distinct ids and
their summed gradients); :meth:`Optimizer.step` applies them, grouped by table, with the
table's own sparse optimizer, and steps the dense optimizer. See docs/torch.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from tensorkv.checkpoint.steps import StepScope, default_scope
from tensorkv.embedding.protocol import Table
from tensorkv.errors import ConfigError, NonFiniteGradientError
from tensorkv.torch.modules import DynamicModule


class Optimizer:
    """Drive a dense torch optimizer and the sparse optimizers of a model's tables together.

    Parameters
    ----------
    model
        An ``nn.Module`` holding :class:`DynamicEmbedding` / :class:`DynamicEmbeddingBag`
        modules anywhere in its tree (found when the optimizer is made).
    dense
        A ``torch.optim.Optimizer`` over the model's dense parameters, or None.
    fused
        Apply each table's update inside backward, as soon as its row gradients exist (as
        TorchRec/FBGEMM do), instead of in :meth:`step`; :meth:`step` then steps the dense
        optimizer only. Same results as the default when every table is used by one module
        once per step; gradients do not accumulate over several backward passes (each pass
        is a table step), and a NaN/Inf gradient under ``nan_policy="raise"`` raises from
        ``backward()`` with the table unchanged.
    nan_policy
        What :meth:`step` does with a dense parameter whose gradient holds NaN or Inf:
        ``"raise"`` refuses the step (:class:`~tensorkv.errors.NonFiniteGradientError`)
        before any table or dense parameter changes; ``"skip"`` leaves those parameters out
        of the dense step (the others step; :attr:`nonfinite_skipped` counts them). Default:
        the tables' policy, ``"skip"`` when every table of the model has
        ``nan_policy="skip"``, else ``"raise"``.
    step_scope
        True (default): a training step, from a dynamic module's first forward pass to the
        end of :meth:`step`, holds the process's default step scope, so ``tensorkv.save``
        (from any thread) snapshots the model between two steps: the tables and the dense
        parameters of one step. A :class:`~tensorkv.checkpoint.steps.StepScope`: that scope
        (pass the same to ``save(step_scope=...)``). False: no scope. Run forward and
        :meth:`step` on one thread; evaluate under ``model.eval()`` or ``torch.no_grad()``
        (no step is opened then).

    Notes
    -----
    Backward passes add to the gradients waiting on each module; several before one
    :meth:`step` accumulate (summed), a :meth:`step` without any changes no table (nor its
    step count), and :meth:`zero_grad` drops them. The tables' learning rates and
    hyper-parameters are their own (``EmbeddingTable(optimizer=...)``). Before anything
    changes, the dense gradients are checked for NaN/Inf under ``nan_policy`` and the waiting
    table gradients under each table's ``nan_policy``, so a refused step leaves every table
    and dense parameter as it was and the gradients waiting.
    """

    def __init__(self, model: nn.Module, dense: torch.optim.Optimizer | None = None, *,
                 fused: bool = False, nan_policy: str | None = None,
                 step_scope: StepScope | bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model={type(model).__name__} must be a torch nn.Module")
        if dense is not None and not isinstance(dense, torch.optim.Optimizer):
            raise ConfigError(f"dense={type(dense).__name__} must be a torch.optim.Optimizer "
                              "(e.g. torch.optim.Adam(dense_params)) or None")
        self.model = model
        self.dense = dense
        self.modules = [m for m in model.modules() if isinstance(m, DynamicModule)]
        if not self.modules and dense is None:
            raise ConfigError("the model holds no DynamicEmbedding/DynamicEmbeddingBag and no "
                              "dense optimizer was given; pass dense=torch.optim.X(...)")
        self.fused = bool(fused)
        if step_scope is True:
            self.step_scope: StepScope | None = default_scope()
        elif step_scope is False or step_scope is None:
            self.step_scope = None
        elif isinstance(step_scope, StepScope):
            self.step_scope = step_scope
        else:
            raise ConfigError(f"step_scope={step_scope!r} must be True, False or a StepScope")
        for m in self.modules:
            m.fused = self.fused
            m.step_scope = self.step_scope
        if nan_policy is None:
            skip = bool(self.modules) and all(
                getattr(m.table, "nan_policy", "raise") == "skip" for m in self.modules)
            nan_policy = "skip" if skip else "raise"
        if nan_policy not in ("raise", "skip"):
            raise ConfigError(f"nan_policy={nan_policy!r} must be 'raise', 'skip' or None (the "
                              "tables' policy)")
        #: What :meth:`step` does with a NaN/Inf dense gradient: ``"raise"`` or ``"skip"``.
        self.nan_policy = nan_policy
        #: Dense parameter gradients left out of a step for holding NaN/Inf (``"skip"``).
        self.nonfinite_skipped = 0

    @property
    def tables(self) -> list[Table]:
        """The distinct tables of the model's dynamic modules."""
        seen: dict[int, Table] = {}
        for m in self.modules:
            seen.setdefault(id(m.table), m.table)
        return list(seen.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the dense gradients and drop the tables' waiting gradients."""
        if self.dense is not None:
            self.dense.zero_grad(set_to_none=set_to_none)
        for m in self.modules:
            m.discard_gradients()

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Apply the waiting table gradients, then step the dense optimizer; ends the step."""
        if closure is not None:
            raise ConfigError("closure= is not supported: compute the loss and call backward() "
                              "before step()")
        scope = self.step_scope
        try:  # the dense step too: a save copies the parameters before or after it
            with scope.step() if scope is not None else contextlib.nullcontext():
                self._step()
        finally:
            if scope is not None:
                scope.close()

    def _step(self) -> None:
        bad = self._nonfinite_dense()
        if bad and self.nan_policy == "raise":
            raise self._dense_error(bad)
        taken = [(m, m.take_gradients()) for m in self.modules]
        try:
            batches = self._group(taken)
            if len(batches) == 1:  # the table's own check refuses NaN/Inf before it changes
                table, keys, grads, unique = batches[0]
                try:
                    table.apply_gradients(keys, grads, unique=unique)
                except NonFiniteGradientError:
                    raise _nonfinite(keys, grads) from None
                batches = []
        except Exception:
            for m, items in taken:
                m.restore_gradients(items)
            raise
        for table, keys, grads, unique in batches:
            table.apply_gradients(keys, grads, unique=unique)
        if self.dense is not None:
            self._dense_step(bad)

    def _nonfinite_dense(self) -> list[torch.Tensor]:
        """The dense optimizer's parameters whose gradient holds NaN or Inf (one sync)."""
        if self.dense is None:
            return []
        params = [p for group in self.dense.param_groups for p in group["params"]
                  if p.grad is not None]
        if not params:
            return []
        flags = [torch.isfinite(p.grad.coalesce().values() if p.grad.is_sparse else p.grad)
                 .all() for p in params]
        finite = torch.stack([f.to("cpu") for f in flags]).tolist()
        return [p for p, ok in zip(params, finite, strict=True) if not ok]

    def _dense_error(self, bad: list[torch.Tensor]) -> NonFiniteGradientError:
        names = {id(p): n for n, p in self.model.named_parameters()}
        shown = [names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in bad[:8]]
        changed = ("the tables stepped in backward (fused=True); no dense parameter changed"
                   if self.fused else "no table or dense parameter changed")
        return NonFiniteGradientError(
            f"the gradients of {len(bad)} dense parameters hold NaN or Inf ({shown}"
            f"{' ...' if len(bad) > 8 else ''}); {changed} and the gradients still wait. Fix "
            "the loss or clip gradients and call zero_grad(), or pass nan_policy='skip' to "
            "step the other parameters")

    def _dense_step(self, bad: list[torch.Tensor]) -> None:
        """Step the dense optimizer, leaving the parameters in ``bad`` out (``"skip"``)."""
        assert self.dense is not None
        if not bad:
            self.dense.step()
            return
        held = [(p, p.grad) for p in bad]
        for p in bad:
            p.grad = None  # torch optimizers leave parameters without a gradient alone
        try:
            self.dense.step()
        finally:
            for p, g in held:
                p.grad = g
        self.nonfinite_skipped += len(bad)

    def _group(self, taken: list[tuple[DynamicModule, list]]) -> list[tuple[Any, Any, Any, bool]]:
        """One ``(table, keys, grads, unique)`` per table with gradients.

        With several tables each is checked for NaN/Inf here, before any changes (one table
        checks its own). ``unique``: one backward pass of one module, whose ids are distinct.
        """
        by_table: dict[int, tuple[Table, list, list]] = {}
        for m, items in taken:
            for keys, grads in items:
                entry = by_table.setdefault(id(m.table), (m.table, [], []))
                entry[1].append(keys)
                entry[2].append(grads)
        out = []
        for table, keys, grads in by_table.values():
            k = keys[0] if len(keys) == 1 else np.concatenate(keys)
            g = grads[0] if len(grads) == 1 else np.concatenate(grads)
            if len(by_table) > 1 and table.nan_policy == "raise" and not np.isfinite(g).all():
                raise _nonfinite(k, g)
            out.append((table, k, g, len(keys) == 1))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The dense optimizer's ``state_dict()`` (tables carry their own state)."""
        return {"dense": None if self.dense is None else self.dense.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s dict."""
        if not isinstance(state, dict) or "dense" not in state:
            raise ConfigError("load_state_dict needs the dict returned by state_dict()")
        if (state["dense"] is None) != (self.dense is None):
            raise ConfigError("the state was saved with a different dense optimizer setup "
                              f"(dense={'None' if state['dense'] is None else 'set'})")
        if self.dense is not None:
            self.dense.load_state_dict(state["dense"])

    def __repr__(self) -> str:
        return (f"tensorkv.torch.Optimizer(tables={len(self.tables)}, "
                f"dense={type(self.dense).__name__ if self.dense is not None else None}"
                f"{', fused=True' if self.fused else ''})")


def _nonfinite(keys: np.ndarray, grads: np.ndarray) -> NonFiniteGradientError:
    bad = np.unique(keys[~np.isfinite(grads).all(axis=1)])
    return NonFiniteGradientError(
        f"gradients for {bad.size} ids hold NaN or Inf (ids {bad[:8].tolist()}); no table or "
        "dense parameter changed and the gradients still wait. Fix the loss or clip gradients "
        "and call zero_grad(), or create the table with nan_policy='skip'")


__all__ = ["Optimizer"]
