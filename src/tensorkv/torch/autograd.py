"""The autograd glue between an :class:`~tensorkv.EmbeddingTable` and a torch graph.

A forward pass deduplicates the batch's ids (:func:`dedup`, one hash-map pass), reads each
distinct row once into a ``[u, dim]`` tensor and passes it through :class:`RowGrad`; torch's
own embedding ops then gather or pool from that small tensor. In backward, torch sums the
gradient of every occurrence into the ``[u, dim]`` gradient of the distinct rows, and
:class:`RowGrad` hands it, with the distinct ids, to a sink: the module keeps these
IndexedSlices until the optimizer applies them to the table.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from tensorkv.kernels import hashindex as hk
from tensorkv.kernels import pooling as pk

Sink = Callable[[torch.Tensor], None]


class RowGrad(torch.autograd.Function):
    """Identity on the distinct rows whose backward passes their gradient to a sink.

    ``RowGrad.apply(rows, sink)`` returns ``rows`` (a view, no copy); backward calls
    ``sink(grad)`` with the ``[u, dim]`` gradient and returns none to ``rows`` itself, so no
    ``.grad`` is kept on the throw-away row tensor.
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, sink: Sink) -> torch.Tensor:
        """Return ``rows`` as a view and remember the sink."""
        ctx.sink = sink
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        """Give ``grad`` (``[u, dim]``) to the sink; no gradient flows to ``rows``."""
        ctx.sink(grad)
        return None, None


def _host_f32(t: torch.Tensor) -> np.ndarray:
    """A float32 C-contiguous numpy view of a CPU tensor (a copy only when it must)."""
    return np.ascontiguousarray(t.detach().to(torch.float32).numpy())


class GatherRows(torch.autograd.Function):
    """``F.embedding(inv, rows)`` whose backward sums the gradient per row in one numba pass.

    ``GatherRows.apply(rows, inv, pad, sink)``: ``rows`` float32 ``[u (+1), dim]`` on the CPU,
    ``inv`` int64 positions (any shape), ``pad`` the padding row or None. Backward hands the
    ``[u (+1), dim]`` row gradient to ``sink`` and returns none to ``rows``: torch's dense
    embedding backward (a sort of every id) is avoided.
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, inv: torch.Tensor, pad: int | None,
                sink: Sink) -> torch.Tensor:
        """Rows of ``inv``: ``[*inv.shape, dim]``."""
        ctx.sink, ctx.inv, ctx.pad, ctx.shape = sink, inv.reshape(-1).numpy(), pad, rows.shape
        return F.embedding(inv, rows.detach(), padding_idx=pad)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        """Scatter-add ``grad`` onto the rows and give the sum to the sink."""
        out = np.empty(tuple(ctx.shape), np.float32)
        pk.scatter_rows(_host_f32(grad).reshape(-1, out.shape[1]), ctx.inv,
                        -1 if ctx.pad is None else ctx.pad, out)
        ctx.sink(torch.from_numpy(out))
        return None, None, None, None


class PoolRows(torch.autograd.Function):
    """``F.embedding_bag`` (sum or mean) whose backward is one numba pass over the ids.

    ``PoolRows.apply(rows, inv, offsets, weights, mode, include_last, pad, sink, single)``
    with a 1-D ``inv`` and its ``offsets`` (``nn.EmbeddingBag``'s 1-D form; callers flatten the
    2-D form), ``weights`` the per-sample weights or None (not differentiated: callers whose
    weights need a gradient use torch's own backward). ``single``: the caller knows every bag
    holds one id and there are no weights (a 2-D ``[bags, 1]`` input of one-hot features), so
    each output row's gradient goes to its id's row as it is (a simpler scatter).
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor,
                weights: torch.Tensor | None, mode: str, include_last: bool, pad: int | None,
                sink: Sink, single: bool = False) -> torch.Tensor:
        """Pooled rows of each bag: ``[bags, dim]``."""
        out = F.embedding_bag(inv, rows.detach(), offsets, mode=mode,
                              per_sample_weights=weights, include_last_offset=include_last,
                              padding_idx=pad)
        ctx.sink, ctx.shape, ctx.mean = sink, rows.shape, mode == "mean"
        ctx.inv, ctx.pad = inv.numpy(), -1 if pad is None else pad
        ctx.single = single and weights is None
        if ctx.single:  # the bags are the ids themselves
            return out
        off = offsets.numpy().astype(np.int64, copy=False)
        n = inv.shape[0]
        if include_last:
            ctx.starts, ctx.ends = off[:-1], np.minimum(off[1:], n)
        else:
            ctx.starts, ctx.ends = off, np.append(off[1:], n)
        ctx.weights = (np.empty(0, np.float32) if weights is None else _host_f32(weights))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        """Scatter-add ``grad`` onto the rows and give the sum to the sink."""
        out = np.empty(tuple(ctx.shape), np.float32)
        if ctx.single:  # a sum or mean of one id is its row (times 1.0): same sums
            pk.scatter_rows(_host_f32(grad), ctx.inv, ctx.pad, out)
        else:
            pk.scatter_bags(_host_f32(grad), ctx.inv, ctx.starts, ctx.ends, ctx.weights,
                            ctx.mean, ctx.pad, out)
        ctx.sink(torch.from_numpy(out))
        return (None,) * 9


class _Scratch(threading.local):
    """Per-thread buffers of :func:`dedup`, grown as batches grow (no allocation per batch)."""

    def __init__(self) -> None:
        self.tab = np.empty(0, np.int32)
        self.uniq = np.empty(0, np.int64)

    def buffers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        slots = hk.map_slots(n)
        if self.tab.shape[0] < slots:
            self.tab = np.empty(slots, np.int32)
        if self.uniq.shape[0] < n:
            self.uniq = np.empty(max(n, 1024), np.int64)
        return self.tab[:slots], self.uniq[:n]


_SCRATCH = _Scratch()


def dedup(keys: np.ndarray, padding: int | None) -> tuple[np.ndarray, np.ndarray, bool]:
    """Distinct keys (in order of first occurrence) and each key's position among them.

    One pass of a hash map (:func:`tensorkv.kernels.hashindex.map_distinct`), several times
    faster than sorting (``np.unique``) for the tens of thousands of ids of a batch.

    Parameters
    ----------
    keys
        int64 keys of the batch (any order, duplicates allowed).
    padding
        The padding id or None. It is left out of the distinct keys (never read, inserted
        or trained); its occurrences point one past the last distinct key, where the caller
        puts a zero row.

    Returns
    -------
    (uniq, inverse, has_padding)
        ``uniq[inverse] == keys`` wherever ``keys != padding``.
    """
    flat = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
    tab, scratch = _SCRATCH.buffers(flat.size)
    inverse = np.empty(flat.size, np.int64)
    u = hk.map_distinct(flat, tab, scratch, inverse)
    uniq = scratch[:u].copy()
    if padding is None:
        return uniq, inverse, False
    hit = np.flatnonzero(uniq == padding)
    if not hit.size:
        return uniq, inverse, False
    p = int(hit[0])
    uniq = np.delete(uniq, p)
    is_pad = inverse == p
    inverse -= inverse > p
    inverse[is_pad] = uniq.size
    return uniq, inverse, True


__all__ = ["GatherRows", "PoolRows", "RowGrad", "Sink", "dedup"]
