"""A DLRM-style click-through model and its synthetic data.

Shared by ``tensorkv demo`` and ``tensorkv bench train``.

Data (:class:`SyntheticCTR`): 13 dense and 26 categorical features per sample. Feature ``f``
draws Zipf-distributed ranks (exponent from 1.05 for the widest features to 2.0 for the
narrowest) scattered over ``vocab`` (10^8) ids by a fixed bijection, so frequent ids are
spread over the id space and new ids keep arriving, as in click logs. Labels come from a
hidden logistic model: a linear term over four dense features plus a pseudo-random effect per
id of eight categorical features (a hash of the id), so a model that learns those rows sees its
loss fall and AUC rise. A batch depends only on (seed, step), so a resumed run sees the same
data.

Model (:class:`DLRM`): bottom MLP on the dense features, one embedding module for every
categorical feature, dot interaction of the 27 vectors, top MLP. The categorical features share
one embedding module whose keys carry the feature number in their high bits
(``key = feature << 32 | id``): one deduplicated lookup, one backward and one optimizer update
per step instead of 26, one tier-0 budget that goes to the hottest rows of any feature, and one
table in the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from tensorkv.errors import import_optional

#: Dense and categorical features per sample (the Criteo layout).
N_DENSE = 13
N_CAT = 26
#: Possible ids per categorical feature.
VOCAB = 10**8
#: Bits the feature number is shifted by in a key.
FEATURE_SHIFT = 32

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser of a uint64 array (a fixed pseudo-random bijection)."""
    z = x.astype(np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class Batch:
    """One batch: ``dense`` float32 [B, 13], ``keys`` int64 [B, 26], ``labels`` float32 [B]."""

    dense: np.ndarray
    keys: np.ndarray
    labels: np.ndarray


class SyntheticCTR:
    """Deterministic click-through batches (see the module docstring).

    Parameters
    ----------
    seed
        Seed of the hidden model and of every batch.
    vocab
        Possible ids per categorical feature.
    """

    def __init__(self, seed: int = 0, vocab: int = VOCAB) -> None:
        if vocab < 2 or vocab >= 1 << FEATURE_SHIFT:
            raise ValueError(f"vocab={vocab!r} must be in [2, 2**{FEATURE_SHIFT})")
        self.seed = int(seed)
        self.vocab = int(vocab)
        f = np.arange(N_CAT)
        self.exponents = 1.05 + 0.95 * (f / (N_CAT - 1)) ** 2
        rng = np.random.default_rng([self.seed, 1])
        # rank -> id: id = (rank * mult + add) % vocab, a bijection when gcd(mult, vocab) = 1
        mult = rng.integers(1, vocab, N_CAT) | 1
        while True:
            bad = np.gcd(mult, vocab) != 1
            if not bad.any():
                break
            mult[bad] = (rng.integers(1, vocab, int(bad.sum())) | 1)
        self.mult = mult.astype(np.int64)
        self.add = rng.integers(0, vocab, N_CAT).astype(np.int64)
        self.dense_weight = np.zeros(N_DENSE, np.float32)
        self.dense_weight[:4] = rng.normal(0, 0.3, 4)
        self.effect_scale = np.zeros(N_CAT, np.float32)
        self.effect_scale[rng.choice(N_CAT, 12, replace=False)] = 1.0
        self.bias = -1.0

    def batch(self, step: int, size: int) -> Batch:
        """Batch number ``step`` of ``size`` samples (a pure function of seed, step, size)."""
        rng = np.random.default_rng([self.seed, 2, int(step)])
        dense = rng.standard_normal((size, N_DENSE), dtype=np.float32)
        ranks = (rng.zipf(np.broadcast_to(self.exponents, (size, N_CAT))) - 1) % self.vocab
        ids = (ranks * self.mult + self.add) % self.vocab  # < 10^8 * 2^27: no overflow
        keys = ids | (np.arange(N_CAT, dtype=np.int64) << FEATURE_SHIFT)
        logit = self.bias + dense @ self.dense_weight + self.id_effects(keys).sum(1)
        p = 1.0 / (1.0 + np.exp(-logit))
        labels = (rng.random(size) < p).astype(np.float32)
        return Batch(dense, keys, labels)

    def id_effects(self, keys: np.ndarray) -> np.ndarray:
        """The hidden effect of each key on the logit, [B, 26] float32."""
        u = mix64(keys.view(np.uint64) ^ np.uint64(self.seed)) >> np.uint64(11)
        centred = u.astype(np.float64) / float(1 << 53) * 2.0 - 1.0
        return (centred * self.effect_scale).astype(np.float32)


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve by ranks (ties share their mean rank); NaN for one class."""
    labels = np.asarray(labels).ravel() > 0.5
    scores = np.asarray(scores, np.float64).ravel()
    n = scores.shape[0]
    pos = int(labels.sum())
    neg = n - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    s = scores[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], n]
    ranks = np.empty(n)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def _torch() -> Any:
    return import_optional("torch", "the DLRM model", "torch")


def mlp(sizes: list[int], *, last_relu: bool) -> Any:
    """Linear layers of ``sizes`` with ReLU between them (and after the last if asked)."""
    nn = _torch().nn
    layers: list[Any] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@cache
def _classes() -> tuple[type, type]:
    _torch()  # the clear error where torch is missing
    import torch
    from torch import nn

    class Constant(nn.Module):
        """Returns the same rows for every id: the model without embedding lookups."""

        rows: torch.Tensor

        def __init__(self, dim: int, n: int) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.register_buffer("rows", torch.randn(n, dim, generator=g) * 0.05,
                                 persistent=False)

        def forward(self, ids: Any) -> Any:
            return self.rows[: ids.shape[0]]

    class Model(nn.Module):
        """Bottom MLP, shared embedding module, dot interaction, top MLP."""

        li: torch.Tensor
        lj: torch.Tensor

        def __init__(self, embedding: Any, dim: int, bottom: int, top: int, seed: int) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.dim = dim
            self.bottom = mlp([N_DENSE, bottom, dim], last_relu=True)
            self.embedding = embedding
            n = N_CAT + 1
            li, lj = torch.triu_indices(n, n, offset=1)
            self.register_buffer("li", li, persistent=False)
            self.register_buffer("lj", lj, persistent=False)
            self.top = mlp([dim + n * (n - 1) // 2, top, 1], last_relu=False)

        def forward(self, dense: Any, keys: Any) -> Any:
            b = dense.shape[0]
            x = self.bottom(dense)
            e = self.embedding(keys.reshape(-1, 1)).reshape(b, N_CAT, self.dim)
            z = torch.cat([x.unsqueeze(1), e], 1)
            inter = torch.bmm(z, z.transpose(1, 2))[:, self.li, self.lj]
            return self.top(torch.cat([x, inter], 1)).squeeze(1)

    return Constant, Model


def constant_embedding(dim: int, rows: int) -> Any:
    """An embedding stand-in that returns fixed rows (the dense-only form of the model)."""
    constant, _ = _classes()
    return constant(dim, rows)


def DLRM(embedding: Any, *, dim: int = 16, bottom: int = 64, top: int = 64,  # noqa: N802
         seed: int = 0) -> Any:
    """The model around ``embedding`` (a module mapping ids [N, 1] to rows [N, dim]).

    Parameters
    ----------
    embedding
        ``DynamicEmbeddingBag(dim)``, ``nn.EmbeddingBag(rows, dim, sparse=True)`` fed compact
        row numbers, or :func:`constant_embedding`.
    dim
        Embedding width, also the bottom MLP's output width.
    bottom, top
        Hidden widths of the bottom and top MLPs.
    seed
        Seed of the dense layers' initial values.
    """
    _, model = _classes()
    return model(embedding, dim, bottom, top, seed)
