"""The autograd glue between an :class:`~tensorkv.EmbeddingTable` and a torch graph.

A forward pass deduplicates the batch's ids (:func:`dedup`), reads each distinct row once
into a ``[u, dim]`` tensor and passes it through :class:`RowGrad`; torch's own embedding ops
then gather or pool from that small tensor. In backward, torch sums the gradient of every
occurrence into the ``[u, dim]`` gradient of the distinct rows, and :class:`RowGrad` hands it,
with the distinct ids, to a sink: the module keeps these IndexedSlices until the optimizer
applies them to the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

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


def dedup(keys: np.ndarray, padding: int | None) -> tuple[np.ndarray, np.ndarray, bool]:
    """Distinct keys and each key's position among them.

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
    uniq, inverse = np.unique(keys, return_inverse=True)
    inverse = inverse.reshape(-1).astype(np.int64, copy=False)
    if padding is None:
        return uniq, inverse, False
    p = int(np.searchsorted(uniq, padding))
    if p == uniq.size or uniq[p] != padding:
        return uniq, inverse, False
    uniq = np.delete(uniq, p)
    is_pad = inverse == p
    inverse -= inverse > p
    inverse[is_pad] = uniq.size
    return uniq, inverse, True


__all__ = ["RowGrad", "Sink", "dedup"]
