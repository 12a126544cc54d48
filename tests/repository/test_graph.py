"""Graph capture and stable layer hashes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from tensorkv.errors import GraphError
from tensorkv.repository import Graph, capture

from .models import CNN, Untraceable, mlp

HASH_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from repository.models import CNN
from tensorkv.repository import capture
print(",".join(h.hex() for h in capture(CNN(seed=7)).hashes()))
"""


def test_hashes_stable_across_processes_and_seeds():
    here = ",".join(h.hex() for h in capture(CNN(seed=1)).hashes())
    tests = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", HASH_SCRIPT.format(tests=tests)],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here  # weights differ, architecture does not


def test_renamed_modules_hash_the_same():
    class A(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(4, 8)
            self.second = nn.Linear(8, 2)

        def forward(self, x):
            return self.second(torch.relu(self.first(x)))

    class B(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(4, 8)
            self.dec = nn.Linear(8, 2)

        def forward(self, x):
            return self.dec(torch.relu(self.enc(x)))

    assert capture(A()).hashes() == capture(B()).hashes()
    assert capture(A()).hashes() != capture(mlp((4, 8, 3))).hashes()


def test_fx_graph_has_branches_and_params():
    g = capture(CNN())
    ops = {n.op for n in g.nodes}
    assert {"input", "module", "function", "output"} <= ops
    add = next(n for n in g.nodes if n.op == "function" and "add" in n.type)
    assert len(add.inputs) == 2
    names = g.tensor_names()
    assert set(names) == set(CNN().state_dict())  # BatchNorm buffers included


def test_a_changed_layer_changes_it_and_its_descendants_only():
    a, b = capture(mlp((4, 8, 8, 2))), capture(mlp((4, 8, 9, 2)))
    same = [x == y for x, y in zip(a.hashes(), b.hashes(), strict=True)]
    assert same[:3] == [True, True, True] and not any(same[4:])


def test_untraceable_falls_back_to_hooks_or_tree():
    m = Untraceable()
    tree = capture(m)
    assert [n.name for n in tree.nodes] == ["input", "a", "b"]
    hooks = capture(m, torch.randn(1, 4))
    assert [n.name for n in hooks.nodes] == ["input", "a", "b"]
    with pytest.raises(GraphError, match="cannot trace Untraceable.*trace='hooks'"):
        capture(m, trace="fx")
    with pytest.raises(GraphError, match="needs example_inputs"):
        capture(m, trace="hooks")


def test_identical_branches_get_distinct_hashes():
    g = Graph.from_dict({"nodes": [
        {"name": "x", "op": "input", "type": "input"},
        {"name": "a", "type": "relu", "inputs": ["x"]},
        {"name": "b", "type": "relu", "inputs": ["x"]},
    ]})
    h = g.hashes()
    assert len(set(h)) == 3


def test_graph_round_trips_through_its_dict():
    g = capture(CNN())
    g2 = Graph.from_dict(g.to_dict())
    assert g2.hashes() == g.hashes() and g2.to_dict() == g.to_dict()


@pytest.mark.parametrize("doc, match", [
    ([], "dict with a 'nodes' list"),
    ({"nodes": "x"}, "'nodes' must be a list"),
    ({"nodes": [{"type": "t"}]}, "node 0 has no 'name'"),
    ({"nodes": [{"name": "a", "type": "t", "inputs": ["zz"]}]}, "input 'zz'.*topological"),
    ({"nodes": [{"name": "a", "type": "t"}, {"name": "a", "type": "t"}]}, "appears twice"),
    ({"nodes": [{"name": "a", "type": "t", "params": {"w": {"shape": [1]}}}]}, "needs 'shape'"),
    ({"nodes": [{"name": "a", "type": "t", "config": {"f": object()}}]}, "JSON"),
    ({"format": "other/9", "nodes": []}, "upgrade"),
])
def test_bad_graphs_are_refused(doc, match):
    with pytest.raises(GraphError, match=match):
        Graph.from_dict(doc)


class One(nn.Module):
    """A model of one layer (fx traces it: the layer is one module node)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


MHA, ENC = nn.MultiheadAttention, nn.TransformerEncoderLayer
CONFIG_CHANGES = {
    "dropout p": (lambda: nn.Dropout(0.1), lambda: nn.Dropout(0.2)),
    "attention heads": (lambda: MHA(16, 2), lambda: MHA(16, 4)),
    "attention dropout": (lambda: MHA(16, 2, dropout=0.1), lambda: MHA(16, 2, dropout=0.2)),
    "attention batch_first": (lambda: MHA(16, 2), lambda: MHA(16, 2, batch_first=True)),
    "encoder feed-forward": (lambda: ENC(16, 2, 32), lambda: ENC(16, 2, 64)),
    "encoder dropout": (lambda: ENC(16, 2, 32, 0.1), lambda: ENC(16, 2, 32, 0.3)),
    "encoder activation": (lambda: ENC(16, 2, 32), lambda: ENC(16, 2, 32, activation="gelu")),
    "encoder norm_first": (lambda: ENC(16, 2, 32), lambda: ENC(16, 2, 32, norm_first=True)),
    "encoder eps": (lambda: ENC(16, 2, 32), lambda: ENC(16, 2, 32, layer_norm_eps=1e-6)),
    "lstm dropout": (lambda: nn.LSTM(4, 4, 2, dropout=0.1), lambda: nn.LSTM(4, 4, 2, dropout=0.2)),
    "gelu approximate": (lambda: nn.GELU(), lambda: nn.GELU("tanh")),
    "conv padding": (lambda: nn.Conv2d(2, 2, 3), lambda: nn.Conv2d(2, 2, 3, padding=1)),
    "embedding max_norm": (lambda: nn.Embedding(4, 2), lambda: nn.Embedding(4, 2, max_norm=1.0)),
}


@pytest.mark.parametrize("change", sorted(CONFIG_CHANGES))
def test_a_layers_hash_changes_when_any_field_of_its_config_changes(change):
    make_a, make_b = CONFIG_CHANGES[change]
    a = capture(One(make_a())).hashes()
    assert capture(One(make_a())).hashes() == a  # the same configuration: the same hashes
    b = capture(One(make_b())).hashes()
    assert a[0] == b[0] and a[1] != b[1]  # the input is the same, the layer is not


def test_a_layer_traced_whole_owns_its_submodules_tensors():
    g = capture(One(ENC(16, 2, 32)))
    assert set(g.tensor_names()) == {f"layer.{k}" for k in ENC(16, 2, 32).state_dict()}


def test_the_tree_capture_covers_a_custom_layers_attributes():
    class Scale(nn.Module):
        def __init__(self, k: float) -> None:
            super().__init__()
            self.k = k

        def forward(self, x):
            return x * self.k

    def model(k):
        m = Untraceable()
        m.b = nn.Sequential(Scale(k))
        return m

    a, b = capture(model(2.0), trace="tree"), capture(model(3.0), trace="tree")
    assert capture(model(2.0), trace="tree").hashes() == a.hashes()
    assert a.hashes()[:2] == b.hashes()[:2] and a.hashes()[2] != b.hashes()[2]


def test_a_dynamic_embeddings_hash_depends_on_its_configuration_not_its_rows():
    from tensorkv.torch import DynamicEmbedding, Optimizer

    class Rec(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.emb = DynamicEmbedding(dim, optimizer="adagrad")
            self.head = nn.Linear(dim, 1)

        def forward(self, ids):
            return self.head(self.emb(ids))

    m = Rec(4)
    before = capture(m).hashes()
    m(torch.tensor([1, 2, 3])).sum().backward()  # rows and a gradient
    Optimizer(m, fused=True).step()  # a training setting
    assert capture(m).hashes() == before
    assert capture(Rec(8)).hashes()[1] != before[1]
