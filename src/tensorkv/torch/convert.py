"""``convert``: replace a model's ``nn.Embedding`` / ``nn.EmbeddingBag`` by dynamic modules.

The new modules' tables start with the old rows for ids ``0..num_embeddings-1`` (the padding
row excepted), so the converted model computes the same outputs. See docs/torch.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
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
            include: Iterable[str] | None = None, group: bool = False, ps: Any = None,
            ps_tables: Mapping[str, str] | None = None, **table_kwargs: Any) -> nn.Module:
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
    ps
        A :class:`~tensorkv.distributed.ParameterServer`: each converted module's table is a
        sharded table on it (``ps.table(name, dim, ...)``), named by the module's path, so
        every worker that converts the same model trains the same rows. The process that
        creates a table copies the module's old rows into it; one that finds the table
        there attaches to it and copies nothing (a late worker never overwrites trained
        rows). None: local tables.
    ps_tables
        With ``ps``: module path -> table name, to rename tables or share one between
        modules (the first module to create it copies its rows).
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
                               ps=ps, ps_tables=ps_tables, **table_kwargs)
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
    tables = _ps_names(ps, ps_tables, names)
    for name in names:
        new = _dynamic(name, found[name], storage, optimizer, table_kwargs, ps, tables)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, new)
    return model


def convert_grouped(model: nn.Module, *, storage: Any = None, optimizer: Any = None,
                    include: Iterable[str] | None = None, ps: Any = None,
                    ps_tables: Mapping[str, str] | None = None,
                    **table_kwargs: Any) -> nn.Module:
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
        elif ps is not None:
            raise ConfigError(f"{name!r} is a TorchRec collection: convert(group=True, ps=...) "
                              "puts nn.Embedding/EmbeddingBag modules on a parameter server, "
                              "not collections; leave it out with include=[...]")
    tables = _ps_names(ps, ps_tables, [n for n in names if n not in collections])
    lazy = LazyGroup()
    for name in names:
        if name in collections:
            kwargs = dict(table_kwargs)
            if kwargs.get("storage_path") is not None:
                kwargs["storage_path"] = os.path.join(os.fspath(kwargs["storage_path"]), name)
            new: nn.Module = from_torchrec(found[name], {"storage": storage,
                                                         "optimizer": optimizer, **kwargs})
        else:
            new = grouped(_dynamic(name, found[name], storage, optimizer, table_kwargs, ps,
                                   tables), lazy)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, new)
    return model


def _ps_names(ps: Any, ps_tables: Mapping[str, str] | None, names: list[str]) -> dict[str, str]:
    """Module path -> parameter-server table name (empty without ``ps``), checked."""
    if ps is None:
        if ps_tables is not None:
            raise ConfigError("ps_tables names tables on a parameter server: give ps= too")
        return {}
    if not all(callable(getattr(ps, a, None)) for a in ("table", "tables")):
        raise ConfigError(f"ps={ps!r} must be a tensorkv.distributed.ParameterServer, e.g. "
                          "ParameterServer(2) or ParameterServer(name='...') to attach")
    given = dict(ps_tables or {})
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ConfigError(f"ps_tables names modules {unknown} that are not converted; the "
                          f"converted modules are {sorted(names)}")
    for path, table in given.items():
        if not isinstance(table, str) or not table:
            raise ConfigError(f"ps_tables[{path!r}]={table!r} must be a non-empty table name")
    return {n: given.get(n, n) for n in names}


def _dynamic(name: str, old: nn.Embedding | nn.EmbeddingBag, storage: Any, optimizer: Any,
             table_kwargs: dict[str, Any], ps: Any = None,
             tables: dict[str, str] | None = None) -> DynamicModule:
    kwargs = dict(table_kwargs)
    if kwargs.get("storage_path") is not None:
        kwargs["storage_path"] = os.path.join(os.fspath(kwargs["storage_path"]), name)
    pad = old.padding_idx
    fresh = True
    if ps is not None and tables is not None:
        table_name = tables[name]
        fresh = table_name not in ps.tables()
        if storage is not None:
            kwargs["storage"] = storage
        if optimizer is not None:
            kwargs["optimizer"] = optimizer
        module_kwargs: dict[str, Any] = {"table": ps.table(table_name, old.embedding_dim,
                                                            **kwargs)}
    else:
        module_kwargs = {"storage": storage, "optimizer": optimizer, **kwargs}
    new: DynamicModule
    if isinstance(old, nn.EmbeddingBag):
        new = DynamicEmbeddingBag(old.embedding_dim, old.mode,
                                  include_last_offset=old.include_last_offset, padding_idx=pad,
                                  **module_kwargs)
    else:
        new = DynamicEmbedding(old.embedding_dim, padding_idx=pad, **module_kwargs)
    ids, weight = weight_rows(old.weight, pad)
    if ids.size and fresh:
        new.table.upsert(ids, weight)
    new.train(old.training)
    return new


__all__ = ["convert", "convert_grouped"]
