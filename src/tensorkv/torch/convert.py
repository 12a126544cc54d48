"""``convert``: replace a model's ``nn.Embedding`` / ``nn.EmbeddingBag`` by dynamic modules.

The new modules' tables start with the old rows for ids ``0..num_embeddings-1`` (the padding
row excepted), so the converted model computes the same outputs. See docs/torch.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tensorkv.errors import ConfigError
from tensorkv.torch.grouping import LazyGroup, from_torchrec, grouped, is_torchrec_collection
from tensorkv.torch.modules import DynamicEmbedding, DynamicEmbeddingBag, DynamicModule
from tensorkv.torch.state import weight_rows


def _refuse(name: str, module: nn.Embedding | nn.EmbeddingBag) -> None:
    """Raise for the options of ``module`` a dynamic module cannot honour."""
    bad = []
    if module.max_norm is not None:
        bad.append(f"max_norm={module.max_norm}")
    if module.scale_grad_by_freq:
        bad.append("scale_grad_by_freq=True")
    if module.weight.dtype != torch.float32:
        bad.append(f"weight dtype {module.weight.dtype} (tables hold float32 rows)")
    if bad:
        raise ConfigError(
            f"cannot convert {name!r} ({type(module).__name__}): {', '.join(bad)} has no "
            "dynamic counterpart; remove it from the module, or leave the module out with "
            "include=[...]")
    pad = module.padding_idx
    if isinstance(module, nn.Embedding) and pad is not None and bool(module.weight[pad].any()):
        raise ConfigError(
            f"cannot convert {name!r}: its padding row (padding_idx={pad}) is not zero, and a "
            "DynamicEmbedding reads the padding id as a zero row; zero it first "
            "(with torch.no_grad(): weight[padding_idx] = 0)")


def convert(model: nn.Module, *, storage: Any = None, optimizer: Any = None,
            include: Iterable[str] | None = None, group: bool = False,
            **table_kwargs: Any) -> nn.Module:
    """Replace ``nn.Embedding`` / ``nn.EmbeddingBag`` modules by dynamic ones, in place.

    Parameters
    ----------
    model
        The model; it is changed in place and returned.
    storage
        Storage of the new tables (``None``: DRAM; ``"DRAM_SSDHASH"``...). With
        ``storage_path=`` each table gets its own subdirectory, named after the module.
    optimizer
        The tables' sparse optimizer (each table keeps its own copy of it), e.g.
        ``tensorkv.Adagrad(lr=0.05)``; default the table's SGD(lr=0.01).
    include
        Dotted names (as in ``model.named_modules()``) of the modules to convert; default
        every embedding module.
    group
        Serve the new modules' lookups together: each returns its output when it is first
        used, and every lookup waiting then runs as one fused pass (one dedup, one pooling,
        one backward scatter for all the features; :mod:`tensorkv.torch.grouping`), with the
        results of separate modules. TorchRec's ``EmbeddingBagCollection`` /
        ``EmbeddingCollection`` become tensorkv's collections (their tables, features and
        rows; ``include`` names them as a whole).
    **table_kwargs
        Further :class:`~tensorkv.EmbeddingTable` options (``initializer`` for ids beyond the
        old rows, ``admission``, ``eviction``, ``seed``...).

    Returns
    -------
    nn.Module
        ``model``, whose embedding modules are now :class:`DynamicEmbedding` /
        :class:`DynamicEmbeddingBag` with the old rows, ``padding_idx``, ``mode`` and
        ``include_last_offset``.

    Raises
    ------
    ConfigError
        For a name in ``include`` that is not an embedding module of ``model``, and for
        options a dynamic module cannot honour (``max_norm``, ``scale_grad_by_freq``,
        non-float32 weights, a non-zero padding row of ``nn.Embedding``), named.

    Notes
    -----
    Convert before creating the dense optimizer: the old weights leave the model.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model={type(model).__name__} must be a torch nn.Module")
    if group:
        return convert_grouped(model, storage=storage, optimizer=optimizer, include=include,
                               **table_kwargs)
    found: dict[str, nn.Embedding | nn.EmbeddingBag] = {
        n: m for n, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    names = list(found) if include is None else list(include)
    unknown = sorted(set(names) - set(found))
    if unknown:
        raise ConfigError(f"include names {unknown}, which are not nn.Embedding/EmbeddingBag "
                          f"modules of the model; its embedding modules are {sorted(found)}")
    if "" in names:
        raise ConfigError("the model itself is an embedding module; convert a model holding it")
    for name in names:
        _refuse(name, found[name])
    for name in names:
        new = _dynamic(name, found[name], storage, optimizer, table_kwargs)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, new)
    return model


def convert_grouped(model: nn.Module, *, storage: Any = None, optimizer: Any = None,
                    include: Iterable[str] | None = None, **table_kwargs: Any) -> nn.Module:
    """``convert(model, group=True)``: see :func:`convert`."""
    collections = {n: m for n, m in model.named_modules() if is_torchrec_collection(m)}
    inside = tuple(n + "." for n in collections)
    found: dict[str, Any] = {
        n: m for n, m in model.named_modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and not n.startswith(inside)}
    found.update(collections)
    names = list(found) if include is None else list(include)
    unknown = sorted(set(names) - set(found))
    if unknown:
        raise ConfigError(f"include names {unknown}, which are not embedding modules (or "
                          f"TorchRec collections) of the model; they are {sorted(found)}")
    if "" in names:
        raise ConfigError("the model itself is an embedding module; convert a model holding it")
    for name in names:
        if name not in collections:
            _refuse(name, found[name])
    lazy = LazyGroup()
    for name in names:
        if name in collections:
            kwargs = dict(table_kwargs)
            if kwargs.get("storage_path") is not None:
                kwargs["storage_path"] = os.path.join(os.fspath(kwargs["storage_path"]), name)
            new: nn.Module = from_torchrec(found[name], {"storage": storage,
                                                         "optimizer": optimizer, **kwargs})
        else:
            new = grouped(_dynamic(name, found[name], storage, optimizer, table_kwargs), lazy)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, new)
    return model


def _dynamic(name: str, old: nn.Embedding | nn.EmbeddingBag, storage: Any, optimizer: Any,
             table_kwargs: dict[str, Any]) -> DynamicModule:
    kwargs = dict(table_kwargs)
    if kwargs.get("storage_path") is not None:
        kwargs["storage_path"] = os.path.join(os.fspath(kwargs["storage_path"]), name)
    pad = old.padding_idx
    new: DynamicModule
    if isinstance(old, nn.EmbeddingBag):
        new = DynamicEmbeddingBag(old.embedding_dim, old.mode,
                                  include_last_offset=old.include_last_offset, padding_idx=pad,
                                  storage=storage, optimizer=optimizer, **kwargs)
    else:
        new = DynamicEmbedding(old.embedding_dim, padding_idx=pad, storage=storage,
                               optimizer=optimizer, **kwargs)
    ids, weight = weight_rows(old.weight, pad)
    if ids.size:
        new.table.upsert(ids, weight)
    new.train(old.training)
    return new


__all__ = ["convert", "convert_grouped"]
