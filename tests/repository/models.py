"""Small torch models for the repository tests (fx-traceable and not)."""

from __future__ import annotations

import torch
from torch import nn


def mlp(widths=(8, 16, 16, 4), seed=0) -> nn.Module:
    """A chain of Linear + ReLU layers."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class CNN(nn.Module):
    """A small CNN with a residual merge and BatchNorm buffers."""

    def __init__(self, classes: int = 10, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv1(x)))
        y = y + self.conv2(y)
        return self.head(y.mean(dim=(2, 3)))


class Untraceable(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        y = self.a(x)
        if y.sum() > 0:
            y = -y
        return self.b(y)


def assert_state_equal(got: dict, want: dict) -> None:
    """Same names, and every tensor bit-identical."""
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k
