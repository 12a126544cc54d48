"""Checkpoints of models with dynamic modules: tensorkv.save/load and tensorkv.torch.save/load."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tensorkv  # noqa: E402
import tensorkv.torch as tt  # noqa: E402
from tensorkv.errors import CheckpointError  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = tt.DynamicEmbeddingBag(4, "sum", optimizer=tensorkv.Adagrad(lr=0.1), seed=2)
        self.norm = torch.nn.BatchNorm1d(4)  # buffers
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


def train(net, opt, steps, first=0):
    for s in range(first, first + steps):
        ids = torch.from_numpy(np.random.default_rng(s).integers(0, 50, (8, 3)))
        opt.zero_grad()
        net(ids).pow(2).mean().backward()
        opt.step()


def table_rows(net):
    [ch] = list(net.emb.table.export())
    order = np.argsort(ch.keys)
    return {f: getattr(ch, f)[order] for f in ("keys", "values", "slots", "freq", "version")}


def assert_same(a, b):
    ra, rb = table_rows(a), table_rows(b)
    for f in ra:
        assert np.array_equal(ra[f], rb[f]), f
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), n


def test_tensorkv_save_load_of_a_module_holds_tables_params_and_buffers(tmp_path):
    url = f"lmdb://{tmp_path / 'ck'}"
    net = Net()
    opt = tt.Optimizer(net, dense=torch.optim.Adam(net.head.parameters()))
    train(net, opt, 5)
    tensorkv.save(net, url, "t1")
    assert "emb.table" in tensorkv.tag_info(url, "t1")["tables"]
    assert "norm.running_mean" in tensorkv.tag_info(url, "t1")["dense"]
    fresh = Net()
    tensorkv.load(fresh, url, "t1")
    assert_same(net, fresh)
    assert fresh.emb.table.step == net.emb.table.step == 5


def test_incremental_saves_through_the_module(tmp_path):
    url = f"lmdb://{tmp_path / 'ck'}"
    net = Net()
    opt = tt.Optimizer(net, dense=torch.optim.SGD(net.head.parameters(), lr=0.1))
    train(net, opt, 3)
    tensorkv.save(net, url, "base")
    train(net, opt, 2, first=3)
    tensorkv.save(net, url, "inc", incremental=True)
    info = tensorkv.tag_info(url, "inc")
    assert info["incremental"] and info["parent"] == "base"
    fresh = Net()
    tensorkv.load(fresh, url, "inc")
    assert_same(net, fresh)


def test_torch_save_load_carry_the_dense_optimizer_state(tmp_path):
    url = f"lmdb://{tmp_path / 'ck'}"
    net = Net()
    opt = tt.Optimizer(net, dense=torch.optim.Adam(net.head.parameters(), lr=0.01))
    train(net, opt, 4)
    tt.save(net, url, "t", optimizer=opt)
    fresh = Net()
    fopt = tt.Optimizer(fresh, dense=torch.optim.Adam(fresh.head.parameters(), lr=0.5))
    tt.load(fresh, url, "t", optimizer=fopt)
    assert_same(net, fresh)
    a, b = opt.state_dict()["dense"], fopt.state_dict()["dense"]
    assert a["param_groups"] == b["param_groups"]  # lr=0.01 restored
    for pid, st in a["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["state"][pid][k]), k
    train(net, opt, 2, first=4)
    train(fresh, fopt, 2, first=4)
    assert_same(net, fresh)
    # a model alone loads from the same tag; a tag without optimizer state is refused
    tt.load(Net(), url, "t")
    tensorkv.save(net, url, "plain")
    with pytest.raises(CheckpointError, match="holds no dense optimizer state"):
        tt.load(Net(), url, "plain", optimizer=fopt)


def test_state_dict_holds_the_dense_state_only():
    net = Net()
    assert not any("emb" in k for k in net.state_dict())
    Net().load_state_dict(net.state_dict())
