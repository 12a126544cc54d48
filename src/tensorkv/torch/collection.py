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

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from tensorkv.errors import ConcurrentUseError, ConfigError, ShapeError
from tensorkv.kernels import hashindex as hk
from tensorkv.kernels import pooling as pk
from tensorkv.kernels.segments import distinct_segments
from tensorkv.torch.autograd import GatherRows
from tensorkv.torch.features import Jagged, KeyedTensor, parse_features
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


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.tab = np.empty(0, np.int32)

    def table(self, n: int) -> np.ndarray:
        slots = hk.map_slots(n)
        if self.tab.shape[0] < slots:
            self.tab = np.empty(slots, np.int32)
        return self.tab[:slots]


_SCRATCH = _Scratch()


@dataclass
class _Block:
    """A group's rows for one batch.

    ``inverse`` indexes ``rows`` for every id of the group (end to end), ``pad_row`` is the
    zero row of padding ids (or None), ``sink`` the receiver of the rows' gradient (None
    outside training), ``runs`` the features pooled by one torch call: ``(first id, end id,
    first feature, end feature, padded)``.
    """

    rows: torch.Tensor
    inverse: torch.Tensor
    pad_row: int | None
    sink: Any
    runs: list[tuple[int, int, int, int, bool]]
    #: Per feature: (first row, end row, first id, end id, padded).
    features: list[tuple[int, int, int, int, bool]]


@dataclass
class _Group:
    """Features whose tables are read into one block: (feature name, module) in order."""

    dim: int
    mode: str
    features: list[tuple[str, DynamicModule]]


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
        groups: dict[tuple[int, str], _Group] = {}
        self._alone: list[tuple[str, DynamicModule]] = []
        for f in self._names:
            m: Any = self._tables[self._feature_table[f]]
            if str(getattr(m.table, "device", "cpu")) != "cpu":
                self._alone.append((f, m))
                continue
            mode = getattr(m, "mode", "")
            groups.setdefault((m.dim, mode), _Group(m.dim, mode, [])).features.append((f, m))
        self._groups = list(groups.values())
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

    def _rows(self, group: _Group, js: list[Jagged], train: bool) -> _Block:
        """Every feature's distinct rows in one block (see the module docstring)."""
        feats = group.features
        ids = js[0].ids if len(js) == 1 else torch.cat([j.ids for j in js])
        keys = ids.numpy()
        ns = np.fromiter((j.n for j in js), np.int64, len(js))
        ends = np.cumsum(ns)
        pads = np.fromiter((m.padding_idx if m.padding_idx is not None else 0
                            for _, m in feats), np.int64, len(feats))
        has_pad = np.fromiter((m.padding_idx is not None for _, m in feats), np.bool_,
                              len(feats))
        n = keys.shape[0]
        uniq = np.empty(n, np.int64)
        inv = np.empty(n, np.int64)
        counts = np.empty(len(feats), np.int64)
        padded = np.empty(len(feats), np.int64)
        tab = _SCRATCH.table(int(ns.max()) if ns.size else 0)
        u = int(distinct_segments(keys, ends, pads, has_pad, tab, uniq, inv, counts, padded))
        pad = bool(padded.any())
        if pad:
            inv[inv < 0] = u
        if train:
            for _, m in feats:
                if m.step_scope is not None:
                    m.step_scope.open()  # a step begins: saves wait for Optimizer.step()
        buf = np.empty((u + pad, group.dim), np.float32)
        bounds = np.zeros(len(feats) + 1, np.int64)
        np.cumsum(counts, out=bounds[1:])
        parts = []
        for f, (_, m) in enumerate(feats):
            a, b = int(bounds[f]), int(bounds[f + 1])
            if b > a:
                m.table.lookup(uniq[a:b], insert=train, out=buf[a:b])
            parts.append((m, uniq[a:b], a, b))
        if pad:
            buf[u] = 0.0
        rows = torch.from_numpy(buf)
        sink = None
        if train:
            rows.requires_grad_(True)
            sink = _sink(parts)
        # torch pools with another kernel when given a padding_idx: features whose batch holds
        # their padding id are pooled apart from those without, as separate modules pool them
        starts = np.concatenate([[0], ends])
        runs: list[tuple[int, int, bool]] = []  # (first feature, end feature, padded)
        for f in range(len(feats)):
            flag = bool(padded[f])
            if runs and runs[-1][2] == flag:
                runs[-1] = (runs[-1][0], f + 1, flag)
            else:
                runs.append((f, f + 1, flag))
        return _Block(rows, torch.from_numpy(inv), u if pad else None, sink,
                      [(int(starts[a]), int(starts[b]), a, b, flag) for a, b, flag in runs],
                      [(int(bounds[f]), int(bounds[f + 1]), int(starts[f]), int(starts[f + 1]),
                        bool(padded[f])) for f in range(len(feats))])

    def extra_repr(self) -> str:
        """The features and the groups they are served in."""
        return f"features={self._names}, groups={self.groups()}"


def _sink(parts: list[tuple[DynamicModule, np.ndarray, int, int]]) -> Any:
    """The group's gradient receiver: each feature's slice of rows goes to its module."""

    def sink(grad: torch.Tensor) -> None:
        g = grad.detach().to("cpu", torch.float32).contiguous().numpy()
        # separate modules' fused updates run in backward order, the last feature's first
        order = reversed(parts) if parts and parts[0][0].fused else parts
        for m, uniq, a, b in order:
            m.accept_gradients(uniq, g[a:b])

    return sink


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
            out: dict[str, torch.Tensor] = {}
            blocks = []
            for g in self._groups:
                block = self._pool(g, [js[f] for f, _ in g.features], train)
                blocks.append(block)
                if isinstance(block, dict):
                    out.update(block)
                else:  # one view per feature, one backward node for all
                    out.update(zip([f for f, _ in g.features],
                                   block.view(len(g.features), -1, g.dim).unbind(0),
                                   strict=True))
            for f, m in self._alone:
                j = js[f]
                out[f] = m(j.ids, j.starts, per_sample_weights=j.weights)
            values = None
            if self._one_group and isinstance(blocks[0], torch.Tensor):
                block, nf, dim = blocks[0], len(self._names), self._groups[0].dim
                b = block.shape[0] // nf if nf else 0

                def values() -> torch.Tensor:  # [features, batch, dim] -> [batch, features * dim]
                    return block.view(nf, b, dim).transpose(0, 1).reshape(b, nf * dim)

            return KeyedTensor(self._names, out, values)
        finally:
            self._busy.release()

    def _pool(self, group: _Group, js: list[Jagged],
              train: bool) -> torch.Tensor | dict[str, torch.Tensor]:
        """The group's pooled bags: ``[features * batch, dim]``, or a dict by feature."""
        blk = self._rows(group, js, train)
        b = js[0].batch
        bases = torch.zeros(len(js), dtype=torch.int64)
        if len(js) > 1:
            torch.cumsum(torch.tensor([j.n for j in js[:-1]]), 0, out=bases[1:])
        offsets = (js[0].starts if len(js) == 1 else
                   torch.cat([j.starts for j in js]) + bases.repeat_interleave(b))
        psw = None
        if any(j.weights is not None for j in js):
            psw = torch.cat([j.weights if j.weights is not None else torch.ones(j.n)
                             for j in js])
        mode, inv = group.mode, blk.inverse
        if blk.sink is None:
            out = pool_runs(blk.rows, inv, offsets, psw, mode, blk.runs, b, blk.pad_row)
        elif mode != "max" and not (psw is not None and psw.requires_grad):
            n = inv.shape[0]
            single = psw is None and n == offsets.shape[0] and bool(
                torch.equal(offsets, torch.arange(n)))
            out = PoolGroup.apply(blk.rows, inv, offsets, psw, mode, blk.runs, b, blk.pad_row,
                                  blk.sink, single)
        else:  # torch's own backward (max; weights that need a gradient), feature by feature
            return self._pool_each(group, js, blk)
        return out

    def _pool_each(self, group: _Group, js: list[Jagged], blk: _Block) -> dict[str, torch.Tensor]:
        """Each feature pooled by its own torch call on its own rows, as a separate module.

        Torch's backward of a pooling sums a row's gradients in an order that depends on the
        whole call, so these features are not pooled together; their rows still come from
        (and their gradients still go back through) the group's block in one piece.
        """
        pieces = SplitRows.apply(blk.rows, blk.features, blk.sink)
        out = {}
        for (f, _), j, piece, (a, b, i0, i1, padded) in zip(
                group.features, js, pieces, blk.features, strict=True):
            inv = blk.inverse[i0:i1] - a
            if padded:
                inv = torch.where(torch.eq(blk.inverse[i0:i1], blk.pad_row or 0), b - a, inv)
            offsets: torch.Tensor | None = j.starts
            if j.shape is not None:  # an ids tensor: its [batch, ids] form
                inv, offsets = inv.reshape(j.shape[0], -1), None
            out[f] = F.embedding_bag(inv, piece, offsets, mode=group.mode,
                                     per_sample_weights=j.weights,
                                     padding_idx=b - a if padded else None)
        return out


def pool_runs(rows: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor,
              weights: torch.Tensor | None, mode: str,
              runs: list[tuple[int, int, int, int, bool]], batch: int,
              pad: int | None) -> torch.Tensor:
    """``F.embedding_bag`` of a group's bags, one call per run of features (see ``_Block``)."""
    outs = []
    for i0, i1, f0, f1, padded in runs:
        off = offsets[f0 * batch:f1 * batch]
        outs.append(F.embedding_bag(
            inv[i0:i1], rows, off - i0 if i0 else off, mode=mode,
            per_sample_weights=None if weights is None else weights[i0:i1],
            padding_idx=pad if padded else None))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class SplitRows(torch.autograd.Function):
    """A group's row block as one tensor per feature (its rows, and a zero row if padded).

    ``SplitRows.apply(rows, features, sink)`` with ``features`` as ``_Block.features``;
    backward receives every feature's row gradient at once and hands the block's gradient
    (the features' rows end to end) to ``sink``.
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, features: list[tuple[int, int, int, int, bool]],
                sink: Any) -> tuple[torch.Tensor, ...]:
        """Each feature's ``[rows (+1), dim]`` tensor (copies)."""
        ctx.features, ctx.sink, ctx.shape = features, sink, rows.shape
        det = rows.detach()
        out = []
        for a, b, _, _, padded in features:
            piece = det[a:b]
            out.append(torch.cat([piece, piece.new_zeros((1, det.shape[1]))]) if padded
                       else piece.clone())
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, None, None]:
        """Lay the features' row gradients end to end and give them to the sink."""
        out = torch.zeros(tuple(ctx.shape), dtype=torch.float32)
        for (a, b, _, _, _), g in zip(ctx.features, grads, strict=True):
            if g is not None:
                out[a:b] = g[:b - a]
        ctx.sink(out)
        return None, None, None


class PoolGroup(torch.autograd.Function):
    """A group's sum/mean pooling whose backward is one numba pass over every feature's ids.

    ``PoolGroup.apply(rows, inv, offsets, weights, mode, runs, batch, pad, sink, single)``:
    forward as :func:`pool_runs`; backward as :class:`~tensorkv.torch.autograd.PoolRows`
    (``single``: every bag holds one id and there are no weights).
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor,
                weights: torch.Tensor | None, mode: str,
                runs: list[tuple[int, int, int, int, bool]], batch: int, pad: int | None,
                sink: Any, single: bool) -> torch.Tensor:
        """Pooled rows of every bag of the group: ``[features * batch, dim]``."""
        out = pool_runs(rows.detach(), inv, offsets, weights, mode, runs, batch, pad)
        ctx.sink, ctx.shape, ctx.mean = sink, rows.shape, mode == "mean"
        ctx.inv, ctx.pad, ctx.single = inv.numpy(), -1 if pad is None else pad, single
        if not single:
            off = offsets.numpy()
            ctx.starts, ctx.ends = off, np.append(off[1:], inv.shape[0])
            ctx.weights = (np.empty(0, np.float32) if weights is None
                           else np.ascontiguousarray(weights.detach().numpy(), np.float32))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        """Scatter-add ``grad`` onto the rows and give the sum to the sink."""
        out = np.empty(tuple(ctx.shape), np.float32)
        g = np.ascontiguousarray(grad.detach().to(torch.float32).numpy())
        if ctx.single:
            pk.scatter_rows(g, ctx.inv, ctx.pad, out)
        else:
            pk.scatter_bags(g, ctx.inv, ctx.starts, ctx.ends, ctx.weights, ctx.mean, ctx.pad,
                            out)
        ctx.sink(torch.from_numpy(out))
        return (None,) * 10


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
                blk = self._rows(g, group_js, train)
                if blk.sink is None:
                    flat = F.embedding(blk.inverse, blk.rows, padding_idx=blk.pad_row)
                else:
                    flat = GatherRows.apply(blk.rows, blk.inverse, blk.pad_row, blk.sink)
                lo = 0
                for (f, _), j in zip(g.features, group_js, strict=True):
                    piece = flat[lo:lo + j.n]
                    out[f] = piece.reshape(*j.shape, g.dim) if j.shape is not None else piece
                    lo += j.n
            for f, m in self._alone:
                j = js[f]
                out[f] = m(j.ids.reshape(j.shape) if j.shape is not None else j.ids)
            return {f: out[f] for f in self._names}
        finally:
            self._busy.release()


__all__ = ["DynamicEmbeddingBagCollection", "DynamicEmbeddingCollection", "EmbeddingBagConfig",
           "EmbeddingConfig", "PoolGroup", "SplitRows", "pool_runs", "pooling_name"]
