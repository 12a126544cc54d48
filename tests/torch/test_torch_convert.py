"""convert(): nn.Embedding / nn.EmbeddingBag replaced by dynamic modules, same outputs."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tensorkv  # noqa: E402
from tensorkv.errors import ConfigError  # noqa: E402
from tensorkv.torch import (  # noqa: E402
    DynamicEmbedding,
    DynamicEmbeddingBag,
    Optimizer,
    convert,
)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.user = torch.nn.Embedding(20, 4, padding_idx=3)
        self.items = torch.nn.EmbeddingBag(30, 4, mode="max", include_last_offset=True)
        self.tags = torch.nn.EmbeddingBag(10, 4, mode="mean", padding_idx=0)
        self.head = torch.nn.Linear(12, 1)

    def forward(self, u, items, offs, tags):
        x = torch.cat([self.user(u), self.items(items, offs), self.tags(tags)], dim=1)
        return self.head(x)


def inputs():
    return (torch.tensor([1, 3, 19]), torch.tensor([0, 5, 29, 5, 7]), torch.tensor([0, 2, 4, 5]),
            torch.tensor([[0, 2], [9, 9], [0, 0]]))


def test_converted_model_gives_the_same_outputs_and_trains():
    net = Net()
    with torch.no_grad():
        before = net(*inputs())
    convert(net, optimizer=tensorkv.Adagrad(lr=0.1))
    assert isinstance(net.user, DynamicEmbedding) and net.user.padding_idx == 3
    assert isinstance(net.items, DynamicEmbeddingBag) and net.items.mode == "max"
    assert net.items.include_last_offset and net.tags.padding_idx == 0
    assert net.user.table.optimizer is not net.items.table.optimizer  # one per table
    assert len(net.user.table) == 19 and 3 not in net.user.table
    with torch.no_grad():
        after = net(*inputs())
    assert torch.allclose(before, after, atol=1e-6)
    opt = Optimizer(net, dense=torch.optim.SGD(net.head.parameters(), lr=0.1))
    net(*inputs()).sum().backward()
    opt.step()
    assert net.user.table.step == 1 and net.items.table.step == 1


def test_a_converted_model_loads_a_state_dict_saved_before_conversion():
    """``load_state_dict`` takes the ``weight`` entries of the modules ``convert`` replaced
    (a pretrained checkpoint of the static model), as ``convert`` takes the rows."""
    pretrained = Net()
    with torch.no_grad():
        for m in (pretrained.user, pretrained.items, pretrained.tags):
            m.weight.add_(1.0)
        pretrained.user.weight[3] = 0.0  # the padding row stays zero
        want = pretrained(*inputs())
    old_state = pretrained.state_dict()
    fresh = Net()
    convert(fresh)
    fresh.user.table.lookup(np.array([500, 501]))  # rows the checkpoint lacks: replaced
    fresh.load_state_dict(old_state)
    with torch.no_grad():
        assert torch.allclose(fresh(*inputs()), want, atol=1e-6)
    assert len(fresh.user.table) == 19 and 500 not in fresh.user.table
    rows = fresh.user.table.lookup(np.array([5]), insert=False)
    np.testing.assert_array_equal(rows[0], old_state["user.weight"][5].numpy())
    bad = dict(old_state, **{"user.weight": old_state["user.weight"][:, :2]})
    with pytest.raises(RuntimeError, match=r"user.weight: a weight of shape \(20, 2\)"):
        fresh.load_state_dict(bad)
    nan = old_state["user.weight"].clone()
    nan[1, 1] = float("nan")
    with pytest.raises(RuntimeError, match="NaN"):
        fresh.load_state_dict(dict(old_state, **{"user.weight": nan}))
    assert len(fresh.user.table) == 19  # unchanged by the refused loads


def test_include_converts_only_the_named_modules():
    net = Net()
    convert(net, include=["tags"])
    assert isinstance(net.tags, DynamicEmbeddingBag)
    assert isinstance(net.user, torch.nn.Embedding) and isinstance(net.items, torch.nn.EmbeddingBag)
    assert np.array_equal(net.tags.table.lookup(np.arange(1, 10), insert=False),
                          Net().tags.weight.detach().numpy()[1:])


@pytest.mark.parametrize("option,match", [
    ({"max_norm": 1.0}, "max_norm=1.0"),
    ({"scale_grad_by_freq": True}, "scale_grad_by_freq=True"),
])
def test_options_without_a_dynamic_counterpart_are_refused_by_name(option, match):
    model = torch.nn.Sequential(torch.nn.Embedding(5, 2, **option))
    with pytest.raises(ConfigError, match=match):
        convert(model)
    assert isinstance(model[0], torch.nn.Embedding)  # unchanged


def test_bad_include_and_nonzero_padding_row_refused():
    with pytest.raises(ConfigError, match=r"\['nope'\].*\['items', 'tags', 'user'\]"):
        convert(Net(), include=["nope"])
    net = Net()
    with torch.no_grad():
        net.user.weight[3] = 1.0
    with pytest.raises(ConfigError, match="padding_idx=3"):
        convert(net)
    assert isinstance(net.items, torch.nn.EmbeddingBag)  # nothing converted
