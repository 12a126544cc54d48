"""tensorkv.torch.Optimizer: accumulated passes, shared optimizer objects, NaN/Inf refusal."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tensorkv  # noqa: E402
from tensorkv.embedding.table import EmbeddingTable  # noqa: E402
from tensorkv.errors import ConfigError, NonFiniteGradientError  # noqa: E402
from tensorkv.torch import DynamicEmbedding, DynamicEmbeddingBag, Optimizer  # noqa: E402

DIM = 3


def rows(table) -> tuple[bytes, ...]:
    """Keys, values, slots, frequencies and versions of ``table`` sorted by key, as bytes."""
    [ch] = list(table.export(chunk_rows=1 << 20))
    order = np.argsort(ch.keys)
    return tuple(np.asarray(a)[order].tobytes()
                 for a in (ch.keys, ch.values, ch.slots, ch.freq, ch.version))


@pytest.mark.parametrize("opt", ["adagrad", "adam"])
def test_backward_passes_before_one_step_apply_each_ids_summed_gradient_once(opt):
    """Id 7 in both passes: its two gradients are summed and applied in one table step."""
    e = DynamicEmbedding(DIM, optimizer=opt, seed=4)
    ref = EmbeddingTable(DIM, optimizer=opt, seed=4)
    passes = [(torch.tensor([7, 2, 7]), torch.tensor([[1.0, 2.0, 3.0]] * 3)),
              (torch.tensor([5, 7]), torch.tensor([[-0.5, 0.25, 4.0]] * 2))]
    grads: dict[int, np.ndarray] = {}
    for ids, w in passes:
        (e(ids) * w).sum().backward()
        for i, row in zip(ids.tolist(), w.numpy(), strict=True):
            grads[i] = grads.get(i, np.zeros(DIM, np.float32)) + row
    Optimizer(e).step()
    keys = np.array(sorted(grads))
    for ids, _ in passes:  # the same sightings: one per distinct id and forward pass
        ref.lookup(np.unique(ids.numpy()))
    ref.apply_gradients(keys, np.stack([grads[k] for k in keys]))
    assert e.table.step == 1 and e.table.optimizer.step == 1
    assert rows(e.table) == rows(ref)


def test_modules_sharing_an_optimizer_object_train_like_modules_with_their_own():
    def model(opts):
        m = torch.nn.ModuleDict({"x": DynamicEmbeddingBag(DIM, "sum", optimizer=opts[0], seed=1),
                                 "y": DynamicEmbeddingBag(DIM, "sum", optimizer=opts[1], seed=2)})
        return m, Optimizer(m)

    shared = tensorkv.Adam(lr=0.05)
    a, opt_a = model([shared, shared])
    b, opt_b = model([tensorkv.Adam(lr=0.05), tensorkv.Adam(lr=0.05)])
    rng = np.random.default_rng(0)
    for _ in range(4):
        ids = torch.from_numpy(rng.integers(0, 20, (5, 3)))
        w = torch.from_numpy(rng.standard_normal((5, DIM)).astype(np.float32))
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            ((m["x"](ids) + m["y"](ids + 100)) * w).sum().backward()
            opt.step()
    for name in ("x", "y"):
        assert rows(a[name].table) == rows(b[name].table)
    assert shared.step == 0


def model_with_dense(nan_policy="raise"):
    e = DynamicEmbedding(2, optimizer="adagrad", initializer="zeros", nan_policy=nan_policy)
    lin = torch.nn.Linear(2, 2)
    return e, lin, torch.nn.Sequential(e, lin)


def spoil(param, value=float("nan")):
    with torch.no_grad():
        param.grad[0] = value


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("dense", [torch.optim.SGD, torch.optim.Adam])
def test_nonfinite_dense_gradient_is_refused_before_anything_changes(value, dense):
    e, lin, model = model_with_dense()
    opt = Optimizer(model, dense=dense(lin.parameters(), lr=0.1))
    model(torch.tensor([1, 2])).sum().backward()
    spoil(lin.bias, value)
    before = [p.detach().clone() for p in lin.parameters()]
    with pytest.raises(NonFiniteGradientError, match=r"\['1.bias'\].*zero_grad"):
        opt.step()
    assert e.table.step == 0 and e.pending_gradients() == 1
    assert all(torch.equal(p, q) for p, q in zip(lin.parameters(), before, strict=True))
    assert not torch.isfinite(lin.bias.grad).all()  # the gradients still wait
    opt.zero_grad()
    model(torch.tensor([1])).sum().backward()
    opt.step()
    assert e.table.step == 1 and torch.isfinite(lin.weight).all()


def test_nonfinite_dense_gradient_without_tables_is_refused():
    lin = torch.nn.Linear(2, 1)
    opt = Optimizer(lin, dense=torch.optim.SGD(lin.parameters(), lr=0.1))
    lin(torch.ones(1, 2)).sum().backward()
    spoil(lin.weight, float("-inf"))
    w0 = lin.weight.detach().clone()
    with pytest.raises(NonFiniteGradientError, match=r"\['weight'\]"):
        opt.step()
    assert torch.equal(lin.weight, w0)


def test_skip_policy_steps_the_other_parameters():
    """Tables with nan_policy='skip' make the dense policy 'skip' too: the bad one is left out."""
    e, lin, model = model_with_dense(nan_policy="skip")
    opt = Optimizer(model, dense=torch.optim.SGD(lin.parameters(), lr=0.1))
    assert opt.nan_policy == "skip"
    model(torch.tensor([1, 2])).sum().backward()
    spoil(lin.weight)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    opt.step()
    assert torch.equal(lin.weight, w0) and not torch.equal(lin.bias, b0)
    assert e.table.step == 1 and opt.nonfinite_skipped == 1
    assert torch.isnan(lin.weight.grad).any()  # the caller's gradient is left as it was
    with pytest.raises(NonFiniteGradientError):  # an explicit policy wins over the tables'
        Optimizer(model, dense=torch.optim.SGD(lin.parameters(), lr=0.1),
                  nan_policy="raise").step()


def test_fused_tables_have_stepped_when_the_dense_gradient_is_refused():
    e, lin, model = model_with_dense()
    opt = Optimizer(model, dense=torch.optim.SGD(lin.parameters(), lr=0.1), fused=True)
    model(torch.tensor([1])).sum().backward()
    spoil(lin.weight)
    w0 = lin.weight.detach().clone()
    with pytest.raises(NonFiniteGradientError, match="stepped in backward"):
        opt.step()
    assert e.table.step == 1 and torch.equal(lin.weight, w0)


def test_bad_nan_policy_is_refused():
    lin = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="nan_policy='ignore'"):
        Optimizer(lin, dense=torch.optim.SGD(lin.parameters(), lr=0.1), nan_policy="ignore")
