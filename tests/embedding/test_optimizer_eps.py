"""The optimizers put ``eps`` outside the square root, as torch does: ``sqrt(s) + eps``.

The parity tests in ``test_optimizer_parity.py`` use the default (tiny) eps and gradients of
order 1, where ``sqrt(s) + eps`` and ``sqrt(s + eps)`` agree to float32 rounding. Here eps is
large (0.1) and the gradients small (about 1e-3), so the denominator is about 0.1 one way and
0.32 the other: the updates differ threefold. Every case checks that premise on float64
references of both formulas (their results differ by far more than the tolerance), then
compares the kernels with torch (float32, rtol 1e-6) and with the float64 reference of the
right formula (rtol 1e-5). Every row is updated every step, once, so torch's sparse and dense
optimizers see the same gradients as the table's lazy kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tensorkv.embedding import EmbeddingTable
from tensorkv.embedding.optimizers import Adagrad, Adam, AdamW, RMSProp, TableOptimizer

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")

N, DIM, STEPS = 16, 6, 25
EPS = 0.1
GRAD_SCALE = 1e-3
RTOL32 = 1e-6  # against torch, float32 both
RTOL64 = 1e-5  # against the float64 reference: float32 rounding over 25 steps
MARGIN = 100  # the two formulas' results differ by at least MARGIN * RTOL64


def denom(s: np.ndarray, eps: float, under_root: bool) -> np.ndarray:
    """``sqrt(s) + eps`` (torch's formula) or, with ``under_root``, ``sqrt(s + eps)``."""
    return np.sqrt(s + eps) if under_root else np.sqrt(s) + eps


# --- float64 references: one step on every row ----------------------------------------------
def adagrad64(p, st, g, t, kw, under_root):
    lr, wd = kw["lr"], kw.get("weight_decay", 0.0)
    g = g + wd * p
    st["accumulator"] = st["accumulator"] + g * g
    return p - lr * g / denom(st["accumulator"], kw["eps"], under_root)


def adam64(p, st, g, t, kw, under_root):
    b1, b2 = kw["betas"]
    st["exp_avg"] = b1 * st["exp_avg"] + (1 - b1) * g
    st["exp_avg_sq"] = b2 * st["exp_avg_sq"] + (1 - b2) * g * g
    step = kw["lr"] * np.sqrt(1 - b2**t) / (1 - b1**t)
    return p - step * st["exp_avg"] / denom(st["exp_avg_sq"], kw["eps"], under_root)


def adamw64(p, st, g, t, kw, under_root):
    b1, b2 = kw["betas"]
    lr = kw["lr"]
    p = p * (1 - lr * kw["weight_decay"])
    st["exp_avg"] = b1 * st["exp_avg"] + (1 - b1) * g
    st["exp_avg_sq"] = b2 * st["exp_avg_sq"] + (1 - b2) * g * g
    d = denom(st["exp_avg_sq"] / (1 - b2**t), kw["eps"], under_root)
    return p - lr / (1 - b1**t) * st["exp_avg"] / d


def rmsprop64(p, st, g, t, kw, under_root):
    a, lr, mom = kw.get("alpha", 0.99), kw["lr"], kw.get("momentum", 0.0)
    g = g + kw.get("weight_decay", 0.0) * p
    st["square_avg"] = a * st["square_avg"] + (1 - a) * g * g
    v = st["square_avg"]
    if kw.get("centered"):
        st["grad_avg"] = a * st["grad_avg"] + (1 - a) * g
        v = v - st["grad_avg"] ** 2
    d = denom(v, kw["eps"], under_root)
    if mom:
        st["momentum_buffer"] = mom * st["momentum_buffer"] + g / d
        return p - lr * st["momentum_buffer"]
    return p - lr * g / d


Case = tuple[str, Callable[..., TableOptimizer], Callable[..., Any], dict[str, Any], Callable, bool]
CASES: list[Case] = [
    # (id, ours, torch optimizer, kwargs, float64 step, torch's sparse path)
    ("adagrad", Adagrad, lambda p, **kw: torch.optim.Adagrad(p, **kw),
     {"lr": 0.1, "eps": EPS}, adagrad64, True),
    ("adagrad-weight-decay", Adagrad,
     lambda p, **kw: torch.optim.Adagrad(p, foreach=False, **kw),
     {"lr": 0.1, "eps": EPS, "weight_decay": 0.01}, adagrad64, False),
    ("adam", Adam, lambda p, **kw: torch.optim.SparseAdam(p, **kw),
     {"lr": 1.0, "betas": (0.9, 0.999), "eps": EPS}, adam64, True),
    ("adamw", AdamW, lambda p, **kw: torch.optim.AdamW(p, foreach=False, **kw),
     {"lr": 0.1, "betas": (0.9, 0.999), "eps": EPS, "weight_decay": 0.01}, adamw64, False),
    ("rmsprop", RMSProp, lambda p, **kw: torch.optim.RMSprop(p, foreach=False, **kw),
     {"lr": 0.1, "eps": EPS}, rmsprop64, False),
    ("rmsprop-centered-momentum", RMSProp,
     lambda p, **kw: torch.optim.RMSprop(p, foreach=False, **kw),
     {"lr": 0.05, "eps": EPS, "centered": True, "momentum": 0.5}, rmsprop64, False),
]


TORCH_SLOT = {"accumulator": "sum"}  # torch's names of our slots where they differ


def slots_of(opt: TableOptimizer, values: np.ndarray) -> np.ndarray:
    cols = [np.full_like(values, v) for v in opt.slot_initial_values()]
    return np.ascontiguousarray(np.concatenate(cols, axis=1))


def reference64(step64: Callable, names: tuple[str, ...], init: np.ndarray, grads: list,
                kw: dict[str, Any], under_root: bool) -> np.ndarray:
    p = init.astype(np.float64)
    st = {n: np.zeros_like(p) for n in names}
    for t, g in enumerate(grads, start=1):
        p = step64(p, st, g.astype(np.float64), t, kw, under_root)
    return p


@pytest.mark.parametrize(("ours", "make_torch", "kw", "step64", "sparse"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_eps_is_added_after_the_square_root(ours, make_torch, kw, step64, sparse):
    rng = np.random.default_rng(21)
    sign = np.where(rng.random((N, DIM)) < 0.5, -1.0, 1.0)
    init = (sign * rng.uniform(1.0, 2.0, (N, DIM))).astype(np.float32)
    grads = [(rng.standard_normal((N, DIM)) * GRAD_SCALE).astype(np.float32)
             for _ in range(STEPS)]
    opt = ours(**kw)
    names = opt.slot_names()

    right = reference64(step64, names, init, grads, kw, under_root=False)
    wrong = reference64(step64, names, init, grads, kw, under_root=True)
    gap = np.abs(wrong - right) / np.abs(right)
    assert gap.max() > MARGIN * RTOL64, f"the two formulas differ by only {gap.max():.2e}"

    values, slots = init.copy(), slots_of(opt, init)
    if sparse:  # torch's sparse path, as the table's lookups feed it
        emb = torch.nn.Embedding(N, DIM, sparse=True)
        with torch.no_grad():
            emb.weight.copy_(torch.from_numpy(init))
        param = emb.weight
    else:
        param = torch.nn.Parameter(torch.from_numpy(init.copy()))
    topt = make_torch([param], **kw)
    for t, g in enumerate(grads):
        rows = rng.permutation(N).astype(np.int64)  # each row once, in the table's any order
        topt.zero_grad()
        if sparse:
            (emb(torch.from_numpy(rows)) * torch.from_numpy(g[rows])).sum().backward()
        else:
            param.grad = torch.from_numpy(g.copy())
        topt.step()
        opt.apply(values, slots, rows, np.ascontiguousarray(g[rows]), t)
    np.testing.assert_allclose(values, param.detach().numpy(), rtol=RTOL32, atol=0,
                               err_msg="values differ from torch")
    for k, name in enumerate(names):
        want = topt.state[param][TORCH_SLOT.get(name, name)].numpy()
        np.testing.assert_allclose(slots[:, k * DIM:(k + 1) * DIM], want, rtol=1e-5,
                                   atol=1e-6 * float(np.abs(want).max()),
                                   err_msg=f"slot {name} differs from torch")
    np.testing.assert_allclose(values, right, rtol=RTOL64, atol=0,
                               err_msg="values differ from the float64 sqrt(s) + eps reference")


@pytest.mark.parametrize("optimizer", [Adagrad(lr=0.1, eps=EPS),
                                       Adam(lr=1.0, eps=EPS)], ids=["adagrad", "adam"])
def test_table_training_uses_sqrt_plus_eps(optimizer):
    """The same through an EmbeddingTable: its eps reaches the kernel unchanged."""
    step64 = adagrad64 if isinstance(optimizer, Adagrad) else adam64
    kw = {"lr": optimizer.lr, "eps": EPS,
          "betas": (0.9, 0.999)}
    table = EmbeddingTable(DIM, optimizer=optimizer, seed=4)
    keys = np.arange(100, 100 + N, dtype=np.int64)
    init = table.lookup(keys)
    rng = np.random.default_rng(8)
    grads = [(rng.standard_normal((N, DIM)) * GRAD_SCALE).astype(np.float32)
             for _ in range(STEPS)]
    for g in grads:
        order = rng.permutation(N)
        table.apply_gradients(keys[order], g[order])
    names = optimizer.slot_names()
    right = reference64(step64, names, init, grads, kw, under_root=False)
    wrong = reference64(step64, names, init, grads, kw, under_root=True)
    scale = float(np.abs(right).max())
    assert np.abs(wrong - right).max() > MARGIN * RTOL64 * scale
    np.testing.assert_allclose(table[keys], right, rtol=RTOL64,
                               atol=RTOL64 * scale)
