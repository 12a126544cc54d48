"""Layers are named by the module paths the user wrote; their stable hash stays the identity."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner
from torch import nn

from tensorkv import Repository
from tensorkv.cli.main import main
from tensorkv.repository import Graph, capture


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Encoder(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Model(nn.Module):
    def __init__(self, depth: int = 2, classes: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.encoder = Encoder(8, depth)
        self.head = nn.Sequential(nn.Linear(8, classes))
        self.scale = nn.Parameter(torch.ones(classes))

    def forward(self, x):
        return self.head(self.encoder(x)) * self.scale


def module_nodes(g: Graph) -> list[str]:
    return [n.name for n in g.nodes if n.op in ("module", "attr")]


def test_graph_nodes_carry_module_paths():
    g = capture(Model())
    assert module_nodes(g) == ["encoder.layers.0.fc1", "encoder.layers.0.fc2",
                               "encoder.layers.1.fc1", "encoder.layers.1.fc2", "head.0", "scale"]
    fc2 = g.nodes[g.index["encoder.layers.1.fc2"]]
    assert fc2.inputs == ("relu_1",) and g.nodes[g.index["relu_1"]].inputs == (
        "encoder.layers.1.fc1",)
    # names are labels: the hashes are those of the same graph under fx's own names
    fx_named = Graph.from_dict(json.loads(json.dumps(g.to_dict()).replace(
        "encoder.layers.", "encoder_layers_").replace('"head.0"', '"head_0"')))
    assert fx_named.hashes() == g.hashes()


def test_a_module_called_twice_and_a_clashing_name():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.x = nn.Linear(4, 4)  # the same name as forward's argument

        def forward(self, x):
            return self.x(self.x(x))

    g = capture(Twice())
    assert [n.name for n in g.nodes] == ["x#3", "x", "x#2", "output"]  # the argument yields
    assert g.nodes[2].inputs == ("x",) and g.nodes[1].inputs == ("x#3",)


def test_prefix_transfer_and_listing_name_module_paths(tmp_path):
    url = str(tmp_path / "r")
    with Repository(url) as repo:
        mid = repo.put(Model(depth=2, seed=1), name="base", metrics={"val_acc": 0.7})
        child = Model(depth=2, classes=5, seed=2)  # a new head: the encoder matches
        got, layers = repo.longest_prefix(child)
        assert got == mid
        assert [n for n in layers if "." in n] == ["encoder.layers.0.fc1", "encoder.layers.0.fc2",
                                                   "encoder.layers.1.fc1", "encoder.layers.1.fc2"]
        copied = repo.transfer(child)
        assert sorted(copied) == sorted(k for k in Model().state_dict() if k.startswith("encoder"))
        stored = Graph.from_dict(repo.manifest(mid)["graph"])
        assert "encoder.layers.1.fc2" in stored.index
    out = CliRunner().invoke(main, ["repo", "show", url, mid])
    assert out.exit_code == 0 and "encoder.layers.0.fc1" in out.output
    assert "torch.nn.modules.linear.Linear" in out.output
