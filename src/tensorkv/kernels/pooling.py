"""Backward kernels of the PyTorch modules: scatter an output gradient onto distinct rows.

A forward pass of ``DynamicEmbedding`` / ``DynamicEmbeddingBag`` reads each distinct id's row
once and gathers or pools from that small ``[u, dim]`` block by ``inv`` (each id's position
among the distinct ids). These kernels compute the gradient of that block in one pass over
the ids, in id order: the sum over every occurrence of the gradient of its output row, scaled
by the per-sample weight (``sum``) or one over the bag's size (``mean``). Ids equal to ``pad``
(the padding row) get nothing.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def scatter_rows(grad_out, inv, pad, grad_rows):  # pragma: no cover - compiled
    """``grad_rows[inv[j]] += grad_out[j]`` for every ``j`` with ``inv[j] != pad``.

    ``grad_rows`` (float32 ``[u, dim]``) is zeroed first.
    """
    grad_rows[:] = 0.0
    dim = grad_rows.shape[1]
    for j in range(inv.shape[0]):
        r = inv[j]
        if r == pad:
            continue
        for d in range(dim):
            grad_rows[r, d] += grad_out[j, d]


@njit(nogil=True, cache=True)
def scatter_bags(grad_out, inv, starts, ends, weights, mean, pad,
                 grad_rows):  # pragma: no cover - compiled
    """Gradient of a sum/mean bag pooling with respect to the pooled rows.

    Parameters
    ----------
    grad_out
        float32 ``[bags, dim]`` gradient of the pooled output.
    inv
        int64 ``[n]``: the row (in ``grad_rows``) of each id.
    starts, ends
        int64 ``[bags]``: bag ``b`` holds ids ``starts[b]:ends[b]``.
    weights
        float32 ``[n]`` per-sample weights, or an empty array for none.
    mean
        Divide by the number of non-padding ids of the bag.
    pad
        Row of the padding id (skipped, not counted by ``mean``), or ``-1``.
    grad_rows
        float32 ``[u, dim]`` output, zeroed first.
    """
    grad_rows[:] = 0.0
    dim = grad_rows.shape[1]
    weighted = weights.shape[0] > 0
    for b in range(starts.shape[0]):
        lo, hi = starts[b], ends[b]
        scale = np.float32(1.0)
        if mean:
            cnt = 0
            for j in range(lo, hi):
                if inv[j] != pad:
                    cnt += 1
            if cnt == 0:
                continue
            scale = np.float32(1.0) / np.float32(cnt)
        for j in range(lo, hi):
            r = inv[j]
            if r == pad:
                continue
            s = weights[j] if weighted else scale
            for d in range(dim):
                grad_rows[r, d] += s * grad_out[b, d]
