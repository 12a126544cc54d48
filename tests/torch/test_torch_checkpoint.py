"""Checkpoints of models with dynamic modules: tensorkv.save/load and tensorkv.torch.save/load."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tensorkv  # noqa: E402
import tensorkv.torch as tt  # noqa: E402
from tensorkv.checkpoint.objects import module_state  # noqa: E402
from tensorkv.errors import CheckpointError, ShapeError  # noqa: E402


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
    dense_a, dense_b = module_state(a), module_state(b)  # tensors only: the tables are above
    for (n, x), (_, y) in zip(dense_a.items(), dense_b.items(), strict=True):
        assert torch.equal(x, y), n


def test_tensorkv_save_load_of_a_module_holds_tables_params_and_buffers(tmp_path):
    url = f"lmdb://{tmp_path / 'ck'}"
    net = Net()
    opt = tt.Optimizer(net, dense=torch.optim.Adam(net.head.parameters()))
    train(net, opt, 5)
    tensorkv.save(net, url, "t1")
    assert "emb.table" in tensorkv.tag_manifest(url, "t1")["tables"]
    assert "norm.running_mean" in tensorkv.tag_manifest(url, "t1")["dense"]
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
    info = tensorkv.tag_manifest(url, "inc")
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


def _losses(net, opt, first, steps):
    out = []
    for s in range(first, first + steps):
        ids = torch.from_numpy(np.random.default_rng(s).integers(0, 80, (8, 3)))
        opt.zero_grad()
        loss = net(ids).pow(2).mean()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def test_state_dict_round_trip_holds_every_table():
    """``torch.save(model.state_dict())`` + ``load_state_dict`` keep the tables (rows, slots,
    frequencies, versions, step, optimizer state): training goes on bit for bit."""
    import io

    net = Net()
    opt = tt.Optimizer(net, dense=torch.optim.Adam(net.head.parameters()))
    train(net, opt, 5)
    sd = net.state_dict()
    assert sd["emb._extra_state"]["keys"].shape[0] == len(net.emb.table) > 0
    buf = io.BytesIO()
    torch.save({"model": sd, "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)  # weights_only: plain dicts, tensors and numbers
    fresh = Net()
    fresh.emb.table.lookup(np.arange(1000, 1010))  # rows the saved model never had: replaced
    fresh_opt = tt.Optimizer(fresh, dense=torch.optim.Adam(fresh.head.parameters()))
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    assert_same(net, fresh)
    assert fresh.emb.table.step == 5
    assert _losses(net, opt, 5, 4) == _losses(fresh, fresh_opt, 5, 4)
    assert_same(net, fresh)


def test_tensorkv_save_keeps_tables_out_of_the_dense_state(tmp_path):
    url = f"lmdb://{tmp_path / 'ck'}"
    net = Net()
    train(net, tt.Optimizer(net, dense=torch.optim.Adam(net.head.parameters())), 2)
    tensorkv.save(net, url, "t")
    info = tensorkv.tag_manifest(url, "t")
    assert not any("_extra_state" in n for n in info["dense"]) and "emb.table" in info["tables"]
    assert "emb._extra_state" not in module_state(net)
    assert "emb._extra_state" in net.state_dict()  # outside the collection, rows again


def test_bad_table_states_leave_the_table_as_it_was():
    net = Net()
    train(net, tt.Optimizer(net, dense=torch.optim.Adam(net.head.parameters())), 2)
    good = net.state_dict()
    before = table_rows(net)

    def with_state(**change):
        sd = dict(good)
        sd["emb._extra_state"] = {**good["emb._extra_state"], **change}
        return sd

    bad_values = good["emb._extra_state"]["values"].clone()
    bad_values[0, 0] = float("nan")
    cases = [
        (with_state(tensorkv_table=0), CheckpointError, "placeholder"),
        (with_state(tensorkv_table=9), CheckpointError, "format 9"),
        (with_state(meta={**good["emb._extra_state"]["meta"], "dim": 8}), CheckpointError,
         "dim 8"),
        (with_state(values=good["emb._extra_state"]["values"][:, :2]), ShapeError, "values"),
        (with_state(values=bad_values), CheckpointError, "NaN"),
    ]
    for sd, err, match in cases:
        with pytest.raises(err, match=match):
            net.load_state_dict(sd)
        after = table_rows(net)
        for f in before:
            assert np.array_equal(before[f], after[f]), f
    small = tt.DynamicEmbeddingBag(4, "sum", optimizer=tensorkv.Adagrad(lr=0.1), seed=2,
                                   capacity=3, growth=False)
    small.table.lookup(np.array([1, 2]))
    with pytest.raises(CheckpointError, match="at most capacity=3"):
        small.set_extra_state(good["emb._extra_state"])
    assert sorted(small.table.keys().tolist()) == [1, 2]
    sd = dict(good)
    sd["emb._extra_state"] = "not a table"
    with pytest.raises(CheckpointError, match="not a tensorkv table"):
        net.load_state_dict(sd)
    sd = dict(good)
    del sd["emb._extra_state"]["freq"]
    with pytest.raises(CheckpointError, match="lacks 'freq'"):
        net.load_state_dict(sd)
