"""Embedding collections: many features' tables served by one call per step.

:class:`DynamicEmbeddingBagCollection` (pooled) and :class:`DynamicEmbeddingCollection`
(unpooled) hold one dynamic module per table (``embedding_bags[name]`` /
``embeddings[name]``, each with its own :class:`~tensorkv.EmbeddingTable` of any storage),
and take every feature of a batch at once (a dict or a TorchRec-style ``KeyedJaggedTensor``,
:mod:`tensorkv.torch.features`).

How the features share the work: the CPU tables of the same dim (and pooling mode) form a
group. A group's ids are laid end to end, feature after feature, and one kernel finds each
feature's distinct ids (each feature its own key space: the same id in two features is two
rows, in two tables); each table reads its feature's distinct rows straight into one
``[rows, dim]`` block (a slice each); one pooling (or gather) over the block makes every
feature's output; in backward one pass over the ids sums every row's gradient, and each
table's slice goes to its module, where :class:`~tensorkv.torch.Optimizer` applies it with
the table's own optimizer. Each table keeps its own key space, locks, tiers, admission and
eviction, and is checkpointed, viewed and stored under its module path, as separate modules
are; the results are bit-identical to one :class:`~tensorkv.torch.DynamicEmbeddingBag` per
table. Tables on a device other than the CPU (an HBM tier 0) are called one by one. See
docs/torch.md ("Collections").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tensorkv.errors import ConcurrentUseError, ConfigError, ShapeError
from tensorkv.torch.features import KeyedTensor, parse_features
from tensorkv.torch.fused import FeatureGroup, gather_group, pool_group
from tensorkv.torch.modules import DynamicEmbedding, DynamicEmbeddingBag, DynamicModule

_POOLINGS = ("sum", "mean", "max")
_TABLE_OPTIONS = ("optimizer", "storage", "initializer", "admission", "eviction", "seed")


@dataclass
class EmbeddingConfig:
    """One table of a collection and the features it serves (TorchRec's field names).

    Parameters
    ----------
    name
        The table's name: its module is ``embedding_bags[name]`` (``embeddings[name]``).
    embedding_dim
        Row width.
    feature_names
        The features looked up in this table (default ``[name]``); several features share
        the table's rows and key space.
    num_embeddings
        Accepted for TorchRec configs and ignored: a dynamic table grows with its ids.
    padding_idx
        An id left out of every bag (zero row, never trained).
    optimizer, storage, initializer, admission, eviction, seed
        The table's options (:class:`~tensorkv.EmbeddingTable`); None: the collection's.
    table
        An existing table to use (no other table options then).
    table_kwargs
        Further :class:`~tensorkv.EmbeddingTable` options.
    """

    name: str
    embedding_dim: int
    feature_names: list[str] | None = None
    num_embeddings: int | None = None
    padding_idx: int | None = None
    optimizer: Any = None
    storage: Any = None
    initializer: Any = None
    admission: Any = None
    eviction: Any = None
    seed: int | None = None
    table: Any = None
    table_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class EmbeddingBagConfig(EmbeddingConfig):
    """A pooled table: :class:`EmbeddingConfig` and ``pooling`` (``"sum"``, ``"mean"``, ``"max"``).

    ``pooling`` also takes TorchRec's ``PoolingType`` members (by name).
    """

    pooling: Any = "sum"


def pooling_name(pooling: Any) -> str:
    """``pooling`` as ``"sum"``, ``"mean"`` or ``"max"`` (a str or an enum member, by name)."""
    name = getattr(pooling, "name", pooling)
    mode = str(name).lower() if isinstance(name, str) else None
    if mode not in _POOLINGS:
        raise ConfigError(f"pooling={pooling!r} must be one of {list(_POOLINGS)}")
    return mode


class _Collection(nn.Module):
    """What both collections share: tables from configs, feature groups, the fused lookup."""

    _bag = True
    _attr = "embedding_bags"

    def __init__(self, tables: Sequence[EmbeddingConfig], defaults: dict[str, Any],
                 table_kwargs: dict[str, Any]) -> None:
        super().__init__()
        if isinstance(tables, EmbeddingConfig) or not isinstance(tables, Sequence) or not tables:
            raise ConfigError(f"tables={tables!r} must be a non-empty list of "
                              f"{self._config_type().__name__}")
        modules: dict[str, DynamicModule] = {}
        self._feature_table: dict[str, str] = {}
        for cfg in tables:
            self._add(cfg, modules, defaults, table_kwargs)
        self._names = list(self._feature_table)
        setattr(self, self._attr, nn.ModuleDict(modules))  # state_dict keys: <attr>.<table>.
        self._busy = threading.Lock()
        self._plan()

    @property
    def _tables(self) -> nn.ModuleDict:
        tables: nn.ModuleDict = getattr(self, self._attr)
        return tables

    @classmethod
    def _config_type(cls) -> type:
        return EmbeddingBagConfig if cls._bag else EmbeddingConfig

    def _add(self, cfg: Any, modules: dict[str, DynamicModule], defaults: dict[str, Any],
             table_kwargs: dict[str, Any]) -> None:
        want: Any = self._config_type()
        if not isinstance(cfg, want) or (not self._bag and isinstance(cfg, EmbeddingBagConfig)):
            raise ConfigError(f"{type(cfg).__name__} is not an {want.__name__}; "
                              f"{type(self).__name__} takes {want.__name__}(name=..., "
                              "embedding_dim=..., feature_names=[...])")
        name = cfg.name
        if not isinstance(name, str) or not name or "." in name or name in modules:
            raise ConfigError(f"table name {name!r} must be a non-empty str without '.', "
                              "different from the other tables' names")
        feats = [name] if cfg.feature_names is None else list(cfg.feature_names)
        if not feats or not all(isinstance(f, str) and f for f in feats):
            raise ConfigError(f"table {name!r}: feature_names={cfg.feature_names!r} must be a "
                              "non-empty list of feature names")
        dup = [f for f in feats if f in self._feature_table or feats.count(f) > 1]
        if dup:
            raise ConfigError(f"table {name!r}: features {sorted(set(dup))} are named twice; "
                              "a feature is looked up in one table (list it once)")
        if cfg.table is not None:
            opts: dict[str, Any] = {"table": cfg.table}
            given = [k for k in _TABLE_OPTIONS if getattr(cfg, k) is not None] + list(
                cfg.table_kwargs)
            if given:
                raise ConfigError(f"table {name!r}: table= was given together with {given}; "
                                  "those options belong to the table")
        else:
            opts = {k: getattr(cfg, k) if getattr(cfg, k) is not None else defaults.get(k)
                    for k in _TABLE_OPTIONS}
            opts["seed"] = opts["seed"] or 0
            kwargs = {**table_kwargs, **cfg.table_kwargs}
            if kwargs.get("storage_path") is not None and "storage_path" not in cfg.table_kwargs:
                kwargs["storage_path"] = os.path.join(os.fspath(kwargs["storage_path"]), name)
            opts.update(kwargs)
        if self._bag:
            modules[name] = DynamicEmbeddingBag(cfg.embedding_dim, pooling_name(cfg.pooling),
                                                padding_idx=cfg.padding_idx, **opts)
        else:
            modules[name] = DynamicEmbedding(cfg.embedding_dim, padding_idx=cfg.padding_idx,
                                             **opts)
        for f in feats:
            self._feature_table[f] = name

    def _plan(self) -> None:
        """Group the features of CPU tables by (dim, mode); the others are called alone."""
        groups: dict[tuple[int, str], FeatureGroup] = {}
        self._alone: list[tuple[str, DynamicModule]] = []
        for f in self._names:
            m: Any = self._tables[self._feature_table[f]]
            if str(getattr(m.table, "device", "cpu")) != "cpu":
                self._alone.append((f, m))
                continue
            mode = getattr(m, "mode", "")
            groups.setdefault((m.dim, mode), FeatureGroup(m.dim, mode, [])).features.append((f, m))
        self._groups = list(groups.values())
        self._widths = [self.table_of(f).dim for f in self._names]
        #: Every feature in one group, in output order: values() is a transpose of its block.
        self._one_group = (not self._alone and len(self._groups) == 1
                           and [f for f, _ in self._groups[0].features] == self._names)

    # --- the public surface ---------------------------------------------------------------------
    def feature_names(self) -> list[str]:
        """The features, in output order."""
        return list(self._names)

    def table_of(self, feature: str) -> DynamicModule:
        """The module (and so the table) that serves ``feature``."""
        try:
            m: Any = self._tables[self._feature_table[feature]]
            return m
        except KeyError:
            raise ConfigError(f"{feature!r} is not a feature of this collection; its features "
                              f"are {self._names}") from None

    def groups(self) -> list[list[str]]:
        """The features served by each fused pass (and, last, each feature called alone)."""
        return ([[f for f, _ in g.features] for g in self._groups]
                + [[f] for f, _ in self._alone])

    # --- the fused pass -----------------------------------------------------------------------
    def _enter(self) -> None:
        if not self._busy.acquire(blocking=False):
            raise ConcurrentUseError(
                f"{type(self).__name__} is already running a forward pass in another thread; "
                "a collection is used by one thread at a time")

    def extra_repr(self) -> str:
        """The features and the groups they are served in."""
        return f"features={self._names}, groups={self.groups()}"


class DynamicEmbeddingBagCollection(_Collection):
    """Pooled lookups of many features in one call: TorchRec's ``EmbeddingBagCollection``.

    Parameters
    ----------
    tables
        One :class:`EmbeddingBagConfig` per table (dim, pooling, features, table options).
    optimizer, storage, initializer, admission, eviction, seed, **table_kwargs
        Defaults for the tables whose config leaves them out; with ``storage_path=`` each
        table spills to its own subdirectory, named after the table.

    Notes
    -----
    ``forward(features)`` takes every feature of the batch (a dict or a
    ``KeyedJaggedTensor``, :mod:`tensorkv.torch.features`) and returns a
    :class:`~tensorkv.torch.features.KeyedTensor`: ``values()`` is ``[batch, sum(dims)]``,
    ``to_dict()`` each feature's ``[batch, dim]``. Per-sample weights only with ``"sum"``
    pooling. The tables are ``embedding_bags[name]`` (:class:`DynamicEmbeddingBag` modules):
    :class:`~tensorkv.torch.Optimizer`, ``state_dict()``, :func:`tensorkv.save` and the
    viewer see them there. Every feature of a fused group counts as used in backward (a
    feature whose output the loss ignores gets a zero gradient, a table step).
    """

    _bag = True
    _attr = "embedding_bags"
    #: Table name -> its :class:`DynamicEmbeddingBag`.
    embedding_bags: nn.ModuleDict

    def __init__(self, tables: Sequence[EmbeddingBagConfig], *, optimizer: Any = None,
                 storage: Any = None, initializer: Any = None, admission: Any = None,
                 eviction: Any = None, seed: int = 0, **table_kwargs: Any) -> None:
        defaults = {"optimizer": optimizer, "storage": storage, "initializer": initializer,
                    "admission": admission, "eviction": eviction, "seed": seed}
        super().__init__(tables, defaults, table_kwargs)

    def forward(self, features: Any) -> KeyedTensor:
        """Pool every feature's bags: a :class:`KeyedTensor` of ``[batch, dim]`` per feature."""
        js = parse_features(features, self._names)
        for f, j in js.items():
            if j.weights is not None and getattr(self.table_of(f), "mode", "") != "sum":
                raise ConfigError(f"feature {f!r}: per-sample weights work only with "
                                  f"pooling='sum' (its table pools "
                                  f"{getattr(self.table_of(f), 'mode', '')!r})")
        self._enter()
        try:
            train = self.training and torch.is_grad_enabled()
            blocks = [pool_group(g, [js[f] for f, _ in g.features], train)
                      for g in self._groups]
            alone = {f: m(js[f].ids, js[f].starts, per_sample_weights=js[f].weights)
                     for f, m in self._alone}
            widths = self._widths
            if self._one_group and isinstance(blocks[0], torch.Tensor):
                block, nf, dim = blocks[0], len(self._names), self._groups[0].dim
                b = block.shape[0] // nf if nf else 0

                def values() -> torch.Tensor:  # [features, batch, dim] -> [batch, features * dim]
                    return block.view(nf, b, dim).transpose(0, 1).reshape(b, nf * dim)

                def tensors() -> dict[str, torch.Tensor]:  # views, one backward node
                    return dict(zip(self._names, block.view(nf, b, dim).unbind(0), strict=True))

                return KeyedTensor(self._names, tensors, values, widths)
            out: dict[str, torch.Tensor] = dict(alone)
            for g, blk in zip(self._groups, blocks, strict=True):
                if isinstance(blk, dict):
                    out.update(blk)
                else:  # one view per feature, one backward node for all
                    out.update(zip([f for f, _ in g.features],
                                   blk.view(len(g.features), -1, g.dim).unbind(0), strict=True))
            return KeyedTensor(self._names, {f: out[f] for f in self._names}, None, widths)
        finally:
            self._busy.release()

class DynamicEmbeddingCollection(_Collection):
    """Unpooled lookups of many features in one call: TorchRec's ``EmbeddingCollection``.

    Parameters
    ----------
    tables
        One :class:`EmbeddingConfig` per table.
    optimizer, storage, initializer, admission, eviction, seed, **table_kwargs
        As for :class:`DynamicEmbeddingBagCollection`.

    Notes
    -----
    ``forward(features)`` takes the same inputs as :class:`DynamicEmbeddingBagCollection`
    (per-sample weights are refused) and returns a dict: each feature's rows, ``[n, dim]``
    for ``n`` jagged ids (in the order of the input, so the input's lengths split them), or
    ``[*ids.shape, dim]`` for an ids tensor given as it is. The tables are
    ``embeddings[name]`` (:class:`DynamicEmbedding` modules).
    """

    _bag = False
    _attr = "embeddings"
    #: Table name -> its :class:`DynamicEmbedding`.
    embeddings: nn.ModuleDict

    def __init__(self, tables: Sequence[EmbeddingConfig], *, optimizer: Any = None,
                 storage: Any = None, initializer: Any = None, admission: Any = None,
                 eviction: Any = None, seed: int = 0, **table_kwargs: Any) -> None:
        defaults = {"optimizer": optimizer, "storage": storage, "initializer": initializer,
                    "admission": admission, "eviction": eviction, "seed": seed}
        super().__init__(tables, defaults, table_kwargs)

    def forward(self, features: Any) -> dict[str, torch.Tensor]:
        """Every feature's rows: ``{feature: [n, dim]}`` (see the class notes)."""
        js = parse_features(features, self._names)
        bad = [f for f, j in js.items() if j.weights is not None]
        if bad:
            raise ShapeError(f"features {bad} carry per-sample weights, which only pooled "
                             "lookups use; leave them out or use DynamicEmbeddingBagCollection")
        self._enter()
        try:
            train = self.training and torch.is_grad_enabled()
            out: dict[str, torch.Tensor] = {}
            for g in self._groups:
                group_js = [js[f] for f, _ in g.features]
                out.update(gather_group(g, group_js, train))
            for f, m in self._alone:
                j = js[f]
                out[f] = m(j.ids.reshape(j.shape) if j.shape is not None else j.ids)
            return {f: out[f] for f in self._names}
        finally:
            self._busy.release()


__all__ = ["DynamicEmbeddingBagCollection", "DynamicEmbeddingCollection", "EmbeddingBagConfig",
           "EmbeddingConfig", "pooling_name"]
