"""Checkpoints of a model with dynamic modules together with its optimizer's state.

``tensorkv.save(model, ...)`` already saves a module's dense state and every table it holds;
:func:`save` and :func:`load` add the dense torch optimizer's state: its tensors become dense
entries named ``dense_optimizer/state/<param>/<name>`` and the rest (param groups, plain
numbers) goes into the tag's metadata under ``"dense_optimizer"``. See docs/torch.md.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from torch import nn

from tensorkv.checkpoint import load as kv_load
from tensorkv.checkpoint import tag_manifest
from tensorkv.checkpoint.handle import SaveHandle
from tensorkv.checkpoint.objects import module_state, module_tables
from tensorkv.checkpoint.save import begin_save
from tensorkv.errors import CheckpointError
from tensorkv.torch.optim import Optimizer

PREFIX = "dense_optimizer/state/"
META_KEY = "dense_optimizer"


def _entries(model: nn.Module) -> dict[str, Any]:
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"model={type(model).__name__} must be a torch nn.Module")
    out: dict[str, Any] = module_state(model)
    tables = module_tables(model)
    clash = sorted(set(out) & set(tables))
    if clash:
        raise CheckpointError(f"names {clash} are both module state and embedding tables")
    out.update(tables)
    return out


def _dense(optimizer: Optimizer | torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(optimizer, Optimizer):
        return optimizer.dense
    raise CheckpointError(f"optimizer={type(optimizer).__name__} must be a "
                          "tensorkv.torch.Optimizer, a torch.optim.Optimizer or None")


def save(model: nn.Module, url: Any, tag: str | None = None, *,
         optimizer: Optimizer | torch.optim.Optimizer | None = None,
         **kwargs: Any) -> str | SaveHandle:
    """:func:`tensorkv.save` of ``model`` plus the dense optimizer's state.

    The model's tables, its ``state_dict()`` and the optimizer's state are taken at one
    moment (between two training steps, see ``step_scope``); with ``blocking=False`` the
    call returns a :class:`~tensorkv.checkpoint.handle.SaveHandle` once they are, and the
    data is written in the background while training goes on.

    Parameters
    ----------
    model
        The model: its ``state_dict()`` (dense parameters, buffers) and every table its
        dynamic modules hold.
    url, tag
        As for :func:`tensorkv.save`.
    optimizer
        A :class:`tensorkv.torch.Optimizer` (its dense optimizer is saved; tables carry their
        own optimizer state) or a ``torch.optim.Optimizer``.
    **kwargs
        Passed to :func:`tensorkv.save` (``step``, ``incremental``, ``metadata``,
        ``blocking``, ``step_scope``...).

    Returns
    -------
    str or SaveHandle
        The tag (``blocking=True``, the default), or the save in flight.
    """
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"model={type(model).__name__} must be a torch nn.Module")
    tables = module_tables(model)
    dense = _dense(optimizer)
    metadata = dict(kwargs.pop("metadata", None) or {})

    def state() -> tuple[dict[str, Any], dict[str, Any] | None]:  # inside the snapshot
        entries: dict[str, Any] = module_state(model)
        if dense is None:
            return entries, None
        sd = dense.state_dict()
        plain: dict[str, dict[str, Any]] = {}
        for pid, st in sd["state"].items():
            for name, val in st.items():
                if isinstance(val, torch.Tensor):
                    entries[f"{PREFIX}{pid}/{name}"] = val
                else:
                    plain.setdefault(str(pid), {})[name] = val
        meta = {"param_groups": sd["param_groups"], "plain": plain,
                "tensors": sorted(n[len(PREFIX):] for n in entries if n.startswith(PREFIX))}
        try:
            return entries, {META_KEY: json.loads(json.dumps(meta))}
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"the dense optimizer's state holds a value JSON cannot keep "
                                  f"({e}); only tensors and plain numbers can be saved") from None

    return begin_save("dict", tables, state, url, tag, metadata=metadata, **kwargs)


def load(model: nn.Module, url: Any, tag: str = "latest", *,
         optimizer: Optimizer | torch.optim.Optimizer | None = None, **kwargs: Any) -> nn.Module:
    """Restore what :func:`save` stored into ``model`` (and ``optimizer``); returns ``model``.

    Everything is read and checked before the model changes (as :func:`tensorkv.load`); the
    optimizer's state is loaded last. ``kwargs`` go to :func:`tensorkv.load`.
    """
    entries = _entries(model)
    dense = _dense(optimizer)
    meta = tag_manifest(url, tag).get("metadata", {}).get(META_KEY)
    if dense is not None and meta is None:
        raise CheckpointError(f"tag {tag!r} holds no dense optimizer state; it was saved without "
                              "optimizer=, so load it without optimizer= (or with tensorkv.load)")
    # without optimizer=, the optimizer's entries stay in the store
    only_model = list(entries) if meta is not None and dense is None else None
    got = kv_load(entries, url, tag, variables=only_model, **kwargs)
    if dense is None or meta is None:
        return model
    state: dict[int, dict[str, Any]] = {}
    for n in meta["tensors"]:
        pid, name = n.split("/", 1)
        arr = np.asarray(got[PREFIX + n])
        state.setdefault(int(pid), {})[name] = torch.from_numpy(arr.copy())
    for pid, vals in meta["plain"].items():
        state.setdefault(int(pid), {}).update(vals)
    groups = [{k: tuple(v) if isinstance(v, list) and isinstance(cur.get(k), tuple) else v
               for k, v in saved.items()}  # JSON keeps tuples (betas) as lists
              for saved, cur in zip(meta["param_groups"], dense.param_groups, strict=False)]
    dense.load_state_dict({"state": state, "param_groups": groups})
    return model


__all__ = ["load", "save"]
