"""PyTorch modules on tensorkv tables: ``DynamicEmbedding``, ``DynamicEmbeddingBag``, ``Optimizer``.

Needs torch (``pip install "tensorkv[torch]"``). See docs/torch.md.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess without torch
    from tensorkv.errors import MissingDependencyError

    raise MissingDependencyError(
        'tensorkv.torch needs PyTorch, which is not installed; install it with: '
        'pip install "tensorkv[torch]"') from e

from tensorkv.torch.checkpoint import load, save
from tensorkv.torch.collection import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingCollection,
    EmbeddingBagConfig,
    EmbeddingConfig,
)
from tensorkv.torch.convert import convert
from tensorkv.torch.features import KeyedTensor
from tensorkv.torch.modules import DynamicEmbedding, DynamicEmbeddingBag, DynamicModule
from tensorkv.torch.optim import Optimizer

__all__ = ["DynamicEmbedding", "DynamicEmbeddingBag", "DynamicEmbeddingBagCollection",
           "DynamicEmbeddingCollection", "DynamicModule", "EmbeddingBagConfig", "EmbeddingConfig",
           "KeyedTensor", "Optimizer", "convert", "load", "save"]
