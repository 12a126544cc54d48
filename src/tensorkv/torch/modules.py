"""``DynamicEmbedding`` and ``DynamicEmbeddingBag``: ``nn.Embedding``-like modules on a table.

Each module holds an :class:`~tensorkv.EmbeddingTable` (``module.table``, any storage chain).
A forward pass reads each distinct id's row once (:mod:`tensorkv.torch.autograd`); backward
leaves the distinct ids and their summed gradients on the module, and
:class:`tensorkv.torch.Optimizer` applies them with the table's sparse optimizer. See
docs/torch.md.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from tensorkv.embedding import EmbeddingTable
from tensorkv.embedding.protocol import Table
from tensorkv.embedding.table_io import is_int
from tensorkv.errors import CheckpointError, ConcurrentUseError, ConfigError, ShapeError
from tensorkv.torch.autograd import GatherRows, PoolRows, RowGrad, dedup
from tensorkv.torch.state import load_table_state, load_weight, table_state

_BAG_MODES = ("sum", "mean", "max")


def make_table(dim: int, table: Table | None, options: dict[str, Any],
               table_kwargs: dict[str, Any]) -> Table:
    """The module's table: ``table`` checked against ``dim``, or a new one from the options."""
    if not is_int(dim) or dim <= 0:
        raise ShapeError(f"dim={dim!r} must be a positive integer, e.g. dim=64")
    if table is None:
        return EmbeddingTable(int(dim), **options, **table_kwargs)
    if not isinstance(table, Table):
        raise ConfigError(f"table={type(table).__name__} must be a tensorkv.EmbeddingTable "
                          "(or a table with its API, such as a ShardedEmbeddingTable)")
    given = sorted([k for k, v in options.items() if v is not None and k != "seed"]
                   + list(table_kwargs) + (["seed"] if options.get("seed") else []))
    if given:
        raise ConfigError(
            f"table= was given together with {given}; these options belong to the table: set "
            "them when creating the EmbeddingTable, or leave table= out")
    if table.dim != dim:
        raise ShapeError(f"dim={dim} but table= has dim={table.dim}; give dim={table.dim}")
    return table


class DynamicModule(nn.Module):
    """What both dynamic modules share: the table, the row reads and the pending gradients.

    Attributes
    ----------
    table : EmbeddingTable
        The rows. Saved by :func:`tensorkv.save` of any model holding the module.
    """

    table: Table

    def __init__(self, dim: int, padding_idx: int | None, table: Table | None,
                 options: dict[str, Any], table_kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.table = make_table(dim, table, options, table_kwargs)
        self.dim = int(dim)
        if padding_idx is not None and not is_int(padding_idx):
            raise ConfigError(f"padding_idx={padding_idx!r} must be an integer id or None")
        self.padding_idx = None if padding_idx is None else int(padding_idx)
        self._busy = threading.Lock()
        self._grad_lock = threading.Lock()
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._sources: list[int] = []  # each pending item's source (kept sorted, stable)
        self._fused = False
        self._step_scope: Any = None

    @property
    def fused(self) -> bool:
        """Apply each backward pass's gradients to the table at once, inside backward.

        Set by ``tensorkv.torch.Optimizer(..., fused=True)``: a way of training, not part of
        the module's configuration (nor of its layer hash in a model repository).
        """
        return self._fused

    @fused.setter
    def fused(self, value: bool) -> None:
        self._fused = bool(value)

    @property
    def step_scope(self) -> Any:
        """The step scope a training forward pass opens (closed by ``Optimizer.step()``).

        Set by ``tensorkv.torch.Optimizer`` so saves snapshot between steps: a way of
        training, not part of the module's configuration (nor of its layer hash).
        """
        return self._step_scope

    @step_scope.setter
    def step_scope(self, value: Any) -> None:
        self._step_scope = value

    # --- state_dict ---------------------------------------------------------------------------
    def get_extra_state(self) -> dict[str, Any]:
        """The table's rows, slots, frequencies, versions and step, for ``state_dict()``."""
        return table_state(self.table)

    def set_extra_state(self, state: Any) -> None:
        """Replace the table's rows with those of ``state`` (``load_state_dict``)."""
        load_table_state(self.table, state, type(self).__name__)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any,
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """Torch's loading hook; also takes the ``weight`` of the module ``convert`` replaced."""
        weight = state_dict.get(prefix + "weight")
        if weight is not None and prefix + "_extra_state" not in state_dict:
            try:
                load_weight(self.table, weight, self.padding_idx, prefix + "weight")
            except CheckpointError as e:
                error_msgs.append(str(e))
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    # --- gradients ----------------------------------------------------------------------------
    def take_gradients(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Remove and return the IndexedSlices accumulated since the last step.

        Each item is ``(ids, grads)``: distinct int64 ids of one forward pass and the float32
        ``[len(ids), dim]`` sums of their gradients in one backward pass.
        """
        with self._grad_lock:
            out, self._pending, self._sources = self._pending, [], []
        return out

    def pending_gradients(self) -> int:
        """Number of backward passes whose gradients wait for the next optimizer step."""
        with self._grad_lock:
            return len(self._pending)

    def discard_gradients(self) -> None:
        """Drop the accumulated gradients (``Optimizer.zero_grad`` calls this)."""
        with self._grad_lock:
            self._pending, self._sources = [], []

    def restore_gradients(self, items: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Put gradients taken by :meth:`take_gradients` back in front (a step that failed)."""
        with self._grad_lock:
            self._pending = list(items) + self._pending
            self._sources = [-1] * len(items) + self._sources

    # --- reads --------------------------------------------------------------------------------
    def _keys(self, ids: Any) -> tuple[np.ndarray, tuple[int, ...]]:
        """The batch's ids as int64 keys, and the shape of ``ids``."""
        if isinstance(ids, torch.Tensor):
            if ids.dtype not in (torch.int64, torch.int32):
                raise ShapeError(
                    f"ids have dtype {ids.dtype}; pass an int64 (or int32) tensor of ids, or a "
                    "list of str ids (cast with ids.long())")
            flat = ids.detach().reshape(-1).cpu().numpy()
            return self.table.as_keys(flat), tuple(ids.shape)
        if isinstance(ids, np.ndarray) and ids.ndim != 1:
            shape = ids.shape
            return self.table.as_keys(ids.reshape(-1)), tuple(shape)
        keys = self.table.as_keys(ids)
        return keys, (keys.shape[0],)

    def _rows(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int | None, Any]:
        """Distinct rows of ``keys`` (``[u (+1 zero padding row), dim]``) ready for torch.

        Returns ``(rows, inverse, pad_row, sink)``: ``inverse`` indexes ``rows`` for every
        key; ``sink`` receives the rows' gradient in backward, None when no gradient is
        recorded (``eval()``, ``no_grad``).
        """
        train = self.training and torch.is_grad_enabled()
        if train and self.step_scope is not None:
            self.step_scope.open()  # a step begins: saves wait for Optimizer.step() to end it
        uniq, inverse, has_pad = dedup(keys, self.padding_idx)
        u, table = uniq.shape[0], self.table
        if str(table.device) == "cpu":
            buf = np.empty((u + has_pad, self.dim), np.float32)
            if u:
                table.lookup(uniq, insert=train, out=buf[:u])
            if has_pad:
                buf[u] = 0.0
            rows = torch.from_numpy(buf)
        else:
            rows = table.lookup_torch(uniq, insert=train) if u else torch.empty(
                (0, self.dim), device=table.device)
            if has_pad:
                rows = torch.cat([rows, rows.new_zeros((1, self.dim))])
        inv = torch.from_numpy(inverse).to(rows.device)
        pad_row = u if has_pad else None
        if not train:
            return rows, inv, pad_row, None
        rows.requires_grad_(True)
        return rows, inv, pad_row, self._sink(uniq)

    def _sink(self, uniq: np.ndarray) -> Any:
        u = uniq.shape[0]

        def sink(grad: torch.Tensor) -> None:
            self.accept_gradients(uniq, grad.detach()[:u].to("cpu", torch.float32)
                                  .contiguous().numpy())

        return sink

    def accept_gradients(self, ids: np.ndarray, grads: np.ndarray, source: int = 0) -> None:
        """Take one backward pass's IndexedSlices: distinct ``ids`` and their summed ``grads``.

        They wait for the optimizer step, or with :attr:`fused` go to the table at once. A
        collection (:mod:`tensorkv.torch.collection`) hands each feature's rows in here, with
        ``source`` the feature's place among the features of this table: the waiting items
        are kept in ``source`` order (then arrival), as separate modules' would be.
        """
        if self.fused:
            self.table.apply_gradients(ids, grads, unique=True)
            return
        with self._grad_lock:
            at = bisect.bisect_right(self._sources, source)
            self._pending.insert(at, (ids, grads))
            self._sources.insert(at, source)

    def _enter(self) -> None:
        if not self._busy.acquire(blocking=False):
            raise ConcurrentUseError(
                f"{type(self).__name__} is already running a forward pass in another thread; "
                "a module is used by one thread at a time. Give each thread its own module "
                "(they may share one table through table=), or serialise the calls with a lock")

    def extra_repr(self) -> str:
        """Dim, padding id and table, as printed inside the module's repr."""
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.dim}{pad}, table={self.table!r}"


class DynamicEmbedding(DynamicModule):
    """``nn.Embedding`` whose rows live in an :class:`~tensorkv.EmbeddingTable` and never run out.

    Parameters
    ----------
    dim
        Row width.
    storage, initializer, optimizer, admission, eviction, seed, **table_kwargs
        Options of the new :class:`~tensorkv.EmbeddingTable` (its defaults when None); the
        ``optimizer`` is the table's sparse optimizer (``tensorkv.Adagrad(lr=0.05)``, ...).
    padding_idx
        An id whose output is a zero row and that never gets a row or a gradient.
    table
        An existing table to use instead (no other table options then).

    Notes
    -----
    ``forward(ids)`` takes an int64 tensor of any shape (or a list of str ids, hashed as the
    table hashes them) and returns float32 ``[*ids.shape, dim]`` on the table's device.
    Training (``module.training`` with gradients enabled) inserts unseen ids and counts one
    sighting per distinct id and batch; in ``eval()`` or under ``torch.no_grad()`` nothing is
    inserted or counted and ids without a row read as their initial value (the table's
    ``lookup(insert=False)``).
    """

    def __init__(self, dim: int, *, storage: Any = None, initializer: Any = None,
                 optimizer: Any = None, admission: Any = None, eviction: Any = None,
                 seed: int = 0, padding_idx: int | None = None,
                 table: Table | None = None, **table_kwargs: Any) -> None:
        options = {"storage": storage, "initializer": initializer, "optimizer": optimizer,
                   "admission": admission, "eviction": eviction, "seed": seed}
        super().__init__(dim, padding_idx, table, options, table_kwargs)

    def forward(self, ids: Any) -> torch.Tensor:
        """Rows of ``ids``: ``[*ids.shape, dim]``."""
        self._enter()
        try:
            keys, shape = self._keys(ids)
            rows, inv, pad_row, sink = self._rows(keys)
            if sink is None:
                out = F.embedding(inv, rows, padding_idx=pad_row)
            elif rows.device.type == "cpu":
                out = GatherRows.apply(rows, inv, pad_row, sink)
            else:
                out = F.embedding(inv, RowGrad.apply(rows, sink), padding_idx=pad_row)
            return out.reshape(*shape, self.dim)
        finally:
            self._busy.release()


class DynamicEmbeddingBag(DynamicModule):
    """``nn.EmbeddingBag`` whose rows live in an :class:`~tensorkv.EmbeddingTable`.

    Parameters
    ----------
    dim
        Row width.
    mode
        ``"sum"``, ``"mean"`` or ``"max"`` over each bag.
    include_last_offset
        As in ``nn.EmbeddingBag``: ``offsets`` has one more entry, the end of the last bag.
    padding_idx
        An id left out of every bag (not counted by ``"mean"``); it never gets a row.
    storage, initializer, optimizer, admission, eviction, seed, table, **table_kwargs
        As for :class:`DynamicEmbedding`.

    Notes
    -----
    ``forward(input, offsets=None, per_sample_weights=None)`` works like
    ``nn.EmbeddingBag``: a 1-D ``input`` with ``offsets`` (start of each bag), or a 2-D
    ``[bags, ids]`` input without; ``per_sample_weights`` (same shape as ``input``) only with
    ``mode="sum"``. Returns float32 ``[bags, dim]``.
    """

    def __init__(self, dim: int, mode: str = "mean", *, include_last_offset: bool = False,
                 padding_idx: int | None = None, storage: Any = None, initializer: Any = None,
                 optimizer: Any = None, admission: Any = None, eviction: Any = None,
                 seed: int = 0, table: Table | None = None,
                 **table_kwargs: Any) -> None:
        if mode not in _BAG_MODES:
            raise ConfigError(f"mode={mode!r} must be one of {list(_BAG_MODES)}")
        options = {"storage": storage, "initializer": initializer, "optimizer": optimizer,
                   "admission": admission, "eviction": eviction, "seed": seed}
        super().__init__(dim, padding_idx, table, options, table_kwargs)
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)

    def forward(self, input: Any, offsets: torch.Tensor | None = None,  # noqa: A002
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled rows of each bag: ``[bags, dim]``."""
        self._enter()
        try:
            keys, shape = self._keys(input)
            self._check_bags(shape, offsets, per_sample_weights)
            rows, inv, pad_row, sink = self._rows(keys)
            dev = rows.device
            if offsets is not None:
                offsets = torch.as_tensor(offsets).to(dev, torch.int64)
            psw = per_sample_weights
            if psw is not None:
                psw = psw.to(dev, torch.float32)
            if sink is not None and dev.type == "cpu" and self.mode != "max" and not (
                    psw is not None and psw.requires_grad) and (offsets is not None
                                                                or shape[1] > 0):
                single = False
                if offsets is None:  # the 2-D form: bags of equal length
                    offsets = torch.from_numpy(np.arange(0, inv.shape[0], shape[1]))
                    include_last = False
                    psw = None if psw is None else psw.reshape(-1)
                    single = shape[1] == 1
                else:
                    include_last = self.include_last_offset
                return PoolRows.apply(rows, inv, offsets, psw, self.mode, include_last,
                                      pad_row, sink, single)
            if sink is not None:
                rows = RowGrad.apply(rows, sink)
            return F.embedding_bag(
                inv.reshape(shape), rows, offsets, mode=self.mode, per_sample_weights=psw,
                include_last_offset=self.include_last_offset, padding_idx=pad_row)
        finally:
            self._busy.release()

    def _check_bags(self, shape: tuple[int, ...], offsets: Any, psw: Any) -> None:
        if len(shape) == 2:
            if offsets is not None:
                raise ShapeError(
                    f"input has shape {shape} (one bag per row) and offsets were given; pass "
                    "offsets=None with a 2-D input, or a 1-D input with offsets")
        elif len(shape) == 1:
            if offsets is None:
                raise ShapeError(
                    f"a 1-D input of {shape[0]} ids needs offsets (the start of each bag), "
                    "e.g. offsets=torch.tensor([0, 3]); or pass a 2-D [bags, ids] input")
            off = torch.as_tensor(offsets)
            if off.dim() != 1 or off.dtype not in (torch.int64, torch.int32):
                raise ShapeError(f"offsets must be a 1-D int64 tensor; got {off.dtype} "
                                 f"{tuple(off.shape)}")
        else:
            raise ShapeError(f"input has shape {shape}; EmbeddingBag takes a 1-D input with "
                             "offsets or a 2-D [bags, ids] input")
        if psw is not None:
            if self.mode != "sum":
                raise ConfigError(f"per_sample_weights work only with mode='sum' (this bag "
                                  f"has mode={self.mode!r}), as in nn.EmbeddingBag")
            if not isinstance(psw, torch.Tensor) or tuple(psw.shape) != shape:
                raise ShapeError(
                    f"per_sample_weights must be a float tensor of the input's shape {shape}; "
                    f"got {tuple(getattr(psw, 'shape', ()))}")

    def extra_repr(self) -> str:
        """Dim, padding id, table and mode."""
        return f"{super().extra_repr()}, mode={self.mode!r}"


__all__ = ["DynamicEmbedding", "DynamicEmbeddingBag", "DynamicModule", "make_table"]
