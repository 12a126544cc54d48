"""The fused pass of a group of features: one dedup, one row block, one pooling, one backward.

A group is features whose tables sit on the CPU and share a row width (and, pooled, a mode).
:func:`fused_rows` lays the group's ids end to end, finds each feature's distinct ids in one
kernel (each feature its own key space), and has each table read its feature's rows into one
``[rows, dim]`` block (a slice each, a call of the table's own ``lookup``); :func:`pool_group`
pools every bag of the group, :func:`gather_group` gathers every id; in backward one pass
over the ids sums each row's gradient, and each feature's slice goes to its module
(:meth:`~tensorkv.torch.modules.DynamicModule.accept_gradients`), in feature order. Used by
the collections (:mod:`tensorkv.torch.collection`) and by the modules
``convert(group=True)`` makes (:mod:`tensorkv.torch.grouping`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from tensorkv.kernels import hashindex as hk
from tensorkv.kernels import pooling as pk
from tensorkv.kernels.segments import distinct_segments
from tensorkv.torch.autograd import GatherRows
from tensorkv.torch.features import Jagged
from tensorkv.torch.modules import DynamicModule


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
class Block:
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
class FeatureGroup:
    """Features whose tables are read into one block: (feature name, module) in order."""

    dim: int
    mode: str
    features: list[tuple[str, DynamicModule]]
    #: How the row gradients reach the modules: ``"tables"`` as separate modules sharing a
    #: table (each feature its source, in feature order), ``"calls"`` as one module called
    #: once per feature (backward order: the last call's first).
    order: str = "tables"


def fused_rows(group: FeatureGroup, js: list[Jagged], train: bool) -> Block:
    """Every feature's distinct rows in one block (see the module docstring)."""
    feats = group.features
    ids = js[0].ids if len(js) == 1 else torch.cat([j.ids for j in js])
    keys = np.ascontiguousarray(ids.numpy())
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
        sink = _sink(parts, group.order == "calls")
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
    return Block(rows, torch.from_numpy(inv), u if pad else None, sink,
                  [(int(starts[a]), int(starts[b]), a, b, flag) for a, b, flag in runs],
                  [(int(bounds[f]), int(bounds[f + 1]), int(starts[f]), int(starts[f + 1]),
                    bool(padded[f])) for f in range(len(feats))])

def _sink(parts: list[tuple[DynamicModule, np.ndarray, int, int]], calls: bool) -> Any:
    """The group's gradient receiver: each feature's slice of rows goes to its module."""
    sources: list[int] = []
    seen: dict[int, int] = {}
    for m, *_ in parts:  # a feature's place among the features of its table
        sources.append(seen.get(id(m), 0))
        seen[id(m)] = sources[-1] + 1

    def sink(grad: torch.Tensor) -> None:
        g = grad.detach().to("cpu", torch.float32).contiguous().numpy()
        # separate modules' fused updates, and one module's calls, go in backward order
        backward = calls or bool(parts and parts[0][0].fused)
        order = range(len(parts) - 1, -1, -1) if backward else range(len(parts))
        for i in order:
            m, uniq, a, b = parts[i]
            m.accept_gradients(uniq, g[a:b], 0 if calls else sources[i])

    return sink


def pool_group(group: FeatureGroup, js: list[Jagged],
               train: bool) -> torch.Tensor | dict[str, torch.Tensor]:
    """The group's pooled bags: ``[features * batch, dim]``, or a dict by feature."""
    blk = fused_rows(group, js, train)
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
        return pool_each(group, js, blk)
    return out

def pool_each(group: FeatureGroup, js: list[Jagged], blk: Block) -> dict[str, torch.Tensor]:
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
            inv, offsets = inv.reshape(j.shape if len(j.shape) == 2 else (-1, 1)), None
        out[f] = F.embedding_bag(inv, piece, offsets, mode=group.mode,
                                 per_sample_weights=j.weights,
                                 padding_idx=b - a if padded else None)
    return out


def pool_runs(rows: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor,
              weights: torch.Tensor | None, mode: str,
              runs: list[tuple[int, int, int, int, bool]], batch: int,
              pad: int | None) -> torch.Tensor:
    """``F.embedding_bag`` of a group's bags, one call per run of features (see ``Block``)."""
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

    ``SplitRows.apply(rows, features, sink)`` with ``features`` as ``Block.features``;
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


def gather_group(group: FeatureGroup, js: list[Jagged],
                 train: bool) -> dict[str, torch.Tensor]:
    """Every id's row of the group's features (unpooled): ``{feature: [n or *shape, dim]}``."""
    blk = fused_rows(group, js, train)
    if blk.sink is None:
        flat = F.embedding(blk.inverse, blk.rows, padding_idx=blk.pad_row)
    else:
        flat = GatherRows.apply(blk.rows, blk.inverse, blk.pad_row, blk.sink)
    out = {}
    lo = 0
    for (f, _), j in zip(group.features, js, strict=True):
        piece = flat[lo:lo + j.n]
        out[f] = piece.reshape(*j.shape, group.dim) if j.shape is not None else piece
        lo += j.n
    return out


__all__ = ["Block", "FeatureGroup", "PoolGroup", "SplitRows", "fused_rows", "gather_group",
           "pool_each", "pool_group", "pool_runs"]
