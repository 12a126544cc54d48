"""``convert(group=True)``: dynamic modules whose lookups wait to be served together.

A model written with one embedding module per feature calls them one after the other
(``[emb(x[:, i]) for i, emb in enumerate(self.embs)]``). The grouped modules
(:class:`GroupedEmbeddingBag`, :class:`GroupedEmbedding`) check their input at once but
return a :class:`Deferred` tensor: the lookup waits in the modules' :class:`LazyGroup` until
any of the waiting outputs is used (by any torch function or tensor method, e.g. the
``torch.cat`` that joins them), and then every waiting lookup of the group runs as one fused
pass (:mod:`tensorkv.torch.fused`): one dedup, each table read into one block, one pooling,
one backward scatter. The results are those of the modules called one by one (each table
is looked up with its own ids, in call order); an output that is never used is never looked
up. Modules whose table is not on the CPU, and bags with ``include_last_offset``, run at
once. TorchRec's ``EmbeddingBagCollection`` / ``EmbeddingCollection`` become
:class:`~tensorkv.torch.DynamicEmbeddingBagCollection` /
:class:`~tensorkv.torch.DynamicEmbeddingCollection` with their tables and features.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from tensorkv.torch.collection import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingCollection,
    EmbeddingBagConfig,
    EmbeddingConfig,
)
from tensorkv.torch.features import Jagged, check_offsets
from tensorkv.torch.fused import FeatureGroup, gather_group, pool_group
from tensorkv.torch.modules import DynamicEmbedding, DynamicEmbeddingBag, DynamicModule


class Deferred(torch.Tensor):
    """A grouped module's output before its lookup: using it runs every waiting lookup.

    Any torch function or tensor method given a ``Deferred`` (``torch.cat``, ``.shape``,
    ``*``...) first has its :class:`LazyGroup` compute every waiting output, then runs on the
    real tensors and returns plain tensors.
    """

    _lazy: LazyGroup
    _real: torch.Tensor | None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        """Run ``func`` on the real outputs (computed now if still waiting)."""
        args, kwargs = tree_map(_resolve, (args, kwargs or {}))
        return func(*args, **kwargs)


def _resolve(x: Any) -> Any:
    if isinstance(x, Deferred):
        real = x.__dict__.get("_real")
        if real is None:
            x._lazy.run(x.__dict__["_queue"])
            real = x.__dict__["_real"]
            if real is None:
                raise RuntimeError(
                    "this grouped module's output has no value: the fused lookup it waited "
                    "for failed (see the error it raised then); call the module again")
        return real
    return x


@dataclass
class _Waiting:
    module: DynamicModule
    jagged: Jagged
    train: bool
    shape: tuple[int, ...]
    ref: weakref.ref


class _Queue:
    """The lookups waiting on one thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[_Waiting] = []


class LazyGroup:
    """The waiting lookups of a model's grouped modules (one list per thread)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _queue(self) -> _Queue:
        q = getattr(self._local, "queue", None)
        if q is None:
            q = self._local.queue = _Queue()
        return q

    def pending(self) -> int:
        """Lookups waiting on this thread."""
        return sum(1 for w in self._queue().items if w.ref() is not None)

    def defer(self, module: DynamicModule, jagged: Jagged, shape: tuple[int, ...]) -> Deferred:
        """Queue ``module``'s lookup of ``jagged`` and return its output-to-be."""
        train = module.training and torch.is_grad_enabled()
        queue = self._queue()
        with queue.lock:
            mixed = bool(queue.items) and queue.items[0].train != train
        if mixed:  # one grad mode per fused pass
            self.run(queue)
        out = torch.empty(shape).as_subclass(Deferred)
        out.__dict__.update(_lazy=self, _queue=queue, _real=None)
        with queue.lock:
            queue.items.append(_Waiting(module, jagged, train, shape, weakref.ref(out)))
        return out

    def run(self, queue: _Queue | None = None) -> None:
        """Compute every waiting output of a thread (this one's by default).

        The lookups are fused by dim, mode and batch size, in call order.
        """
        queue = self._queue() if queue is None else queue
        with queue.lock:
            items, queue.items = queue.items, []
        waiting = [(w, w.ref()) for w in items]
        live = [(w, d) for w, d in waiting if d is not None]
        if not live:
            return
        train = live[0][0].train
        groups: dict[tuple[int, str, int], list[tuple[_Waiting, Deferred]]] = {}
        for w, d in live:
            m = w.module
            key = (m.dim, getattr(m, "mode", ""), w.jagged.batch if hasattr(m, "mode") else 0)
            groups.setdefault(key, []).append((w, d))
        with torch.enable_grad() if train else torch.no_grad():
            for (dim, mode, _), members in groups.items():
                group = FeatureGroup(dim, mode, [(str(i), w.module)
                                                 for i, (w, _) in enumerate(members)],
                                     order="calls")
                js = [w.jagged for w, _ in members]
                if mode:
                    block = pool_group(group, js, train)
                    outs = (list(block.values()) if isinstance(block, dict) else
                            list(block.view(len(members), -1, dim).unbind(0)))
                else:
                    outs = list(gather_group(group, js, train).values())
                for (w, d), o in zip(members, outs, strict=True):
                    d.__dict__["_real"] = o.reshape(w.shape)


class GroupedEmbeddingBag(DynamicEmbeddingBag):
    """A :class:`DynamicEmbeddingBag` whose lookups wait to be fused (see the module notes)."""

    @property
    def lazy(self) -> LazyGroup:
        """The group whose fused pass serves this module's lookups."""
        lazy: LazyGroup = self.__dict__["_lazy"]
        return lazy

    def forward(self, input: Any, offsets: torch.Tensor | None = None,  # noqa: A002
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled rows of each bag, ``[bags, dim]``: a :class:`Deferred` output."""
        if self.include_last_offset or str(getattr(self.table, "device", "cpu")) != "cpu":
            return super().forward(input, offsets, per_sample_weights)
        keys, shape = self._keys(input)
        self._check_bags(shape, offsets, per_sample_weights)
        ids = torch.from_numpy(keys)
        n = ids.shape[0]
        psw = per_sample_weights
        if psw is not None:
            psw = psw.reshape(-1).to("cpu", torch.float32)
        if len(shape) == 2:
            b, m = shape
            starts = torch.arange(0, n, m) if m else torch.zeros(b, dtype=torch.int64)
            j = Jagged(ids, starts, psw, shape)
        else:
            j = Jagged(ids, check_offsets("input", offsets, n, with_end=False), psw, None)
        return self.lazy.defer(self, j, (j.batch, self.dim))


class GroupedEmbedding(DynamicEmbedding):
    """A :class:`DynamicEmbedding` whose lookups wait to be fused (see the module notes)."""

    @property
    def lazy(self) -> LazyGroup:
        """The group whose fused pass serves this module's lookups."""
        lazy: LazyGroup = self.__dict__["_lazy"]
        return lazy

    def forward(self, ids: Any) -> torch.Tensor:
        """Rows of ``ids``, ``[*ids.shape, dim]``: a :class:`Deferred` output."""
        if str(getattr(self.table, "device", "cpu")) != "cpu":
            return super().forward(ids)
        keys, shape = self._keys(ids)
        k = torch.from_numpy(keys)
        j = Jagged(k, torch.arange(k.shape[0]), None, shape)
        return self.lazy.defer(self, j, (*shape, self.dim))


def grouped(module: DynamicModule, lazy: LazyGroup) -> DynamicModule:
    """``module`` (a new dynamic module) as its grouped class, waiting in ``lazy``."""
    cls = GroupedEmbeddingBag if isinstance(module, DynamicEmbeddingBag) else GroupedEmbedding
    module.__class__ = cls
    # private: no submodule, not in state_dict, not in a model repository's layer config
    module.__dict__["_lazy"] = lazy
    return module


def is_torchrec_collection(module: nn.Module) -> bool:
    """Whether ``module`` is TorchRec's ``EmbeddingBagCollection``/``EmbeddingCollection``."""
    name = type(module).__name__
    return ((name == "EmbeddingBagCollection" and hasattr(module, "embedding_bag_configs"))
            or (name == "EmbeddingCollection" and hasattr(module, "embedding_configs")))


def from_torchrec(module: nn.Module, options: dict[str, Any]) -> nn.Module:
    """The dynamic collection of a TorchRec collection: same tables, features and rows."""
    from tensorkv.torch.state import weight_rows

    m: Any = module
    bag = type(module).__name__ == "EmbeddingBagCollection"
    configs = m.embedding_bag_configs() if bag else m.embedding_configs()
    weights = dict(m.embedding_bags.items() if bag else m.embeddings.items())
    mine: list[Any] = []
    for c in configs:
        common = {"name": c.name, "embedding_dim": int(c.embedding_dim),
                  "feature_names": list(c.feature_names)}
        mine.append(EmbeddingBagConfig(**common, pooling=c.pooling) if bag
                    else EmbeddingConfig(**common))
    new: Any = (DynamicEmbeddingBagCollection(mine, **options) if bag
                else DynamicEmbeddingCollection(mine, **options))
    tables = new.embedding_bags if bag else new.embeddings
    for name, old in weights.items():
        ids, rows = weight_rows(old.weight, None)
        if ids.size:
            tables[name].table.upsert(ids, rows)
    new.train(module.training)
    return new


__all__ = ["Deferred", "GroupedEmbedding", "GroupedEmbeddingBag", "LazyGroup", "from_torchrec",
           "grouped", "is_torchrec_collection"]
