"""The repository benchmark's worker functions, run in this process on tiny inputs.

``tensorkv bench repo`` runs them in spawned pool processes; here they run once each so a
change that breaks them fails without the benchmark: puts of NAS graphs (metadata only)
land as named models, and random single-tensor reads count what they read, from a
repository (copying or not) and from safetensors files.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import tensorkv
from tensorkv.bench import repo as bench_repo


def test_put_population_puts_named_graphs(tmp_path):
    url = f"lmdb://{tmp_path}/pop"
    bench_repo.put_population(url, 7, 3, 2, 4)
    with tensorkv.Repository(url) as repo:
        assert sorted(r["name"] for r in repo.list()) == ["w7-0", "w7-1", "w7-2"]


@pytest.mark.parametrize("kind", ["tensorkv", "tensorkv-view"])
def test_read_random_reads_tensors_of_the_repository(tmp_path, kind):
    url = f"lmdb://{tmp_path}/rd"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with tensorkv.Repository(url) as repo:
        repo.put(model, name="m")
    assert bench_repo.read_random(kind, url, ["0.weight", "2.bias"], 0.02, 1) >= 1


def test_read_random_reads_safetensors_files(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path = str(tmp_path / "m.safetensors")
    safetensors_numpy.save_file({"a": np.ones((2, 2), np.float32)}, path)
    assert bench_repo.read_random("safetensors", [path], ["a"], 0.02, 1) >= 1
