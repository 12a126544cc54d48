"""Parity of the sparse optimizers with torch (and with TensorFlow's FTRL formula).

Every test drives ``TableOptimizer.apply`` on a dense numpy arena the way the table does: the
batch's keys are reduced to unique rows with their gradients summed (``np.add.at``), and the
unique rows are passed in a shuffled order. torch gets the raw draws, duplicates included,
through ``nn.Embedding(sparse=True)``. 100 steps, float32 throughout, compared after every
step with ``rtol=1e-6, atol=1e-7``.

Why the values start in +-[1, 2]: the kernels reproduce torch's float32 operations one for
one, fused multiply-adds included, and the optimizer slots come out bit-identical; the one
operation that cannot be reproduced is torch's CPU ``sqrt`` (MKL's vectorised square root is
not correctly rounded: about 15% of results are 1 ulp off). A 1-ulp difference in a value of
magnitude 1 is an absolute 1.2e-7, which no longer fits ``rtol=1e-6`` once the value has
drifted to near zero. Values kept away from zero measure the relative error meaningfully;
the ``crossing`` variants start in [-1, 1] and check an absolute 1e-6 (relative to that
scale) instead.
"""

from __future__ import annotations

import numpy as np
import pytest

from tensorkv.embedding.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    AdamW,
    RMSProp,
    TableOptimizer,
)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")

N, DIM, DRAWS, STEPS = 50, 8, 200, 100
RTOL, ATOL = 1e-6, 1e-7
TOL = {"away": (RTOL, ATOL), "crossing": (RTOL, 1e-6)}


@pytest.fixture(autouse=True)
def _float32_torch():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(old)


def _arena(opt: TableOptimizer, init: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values = init.copy()
    cols = [np.full((init.shape[0], init.shape[1]), v, np.float32)
            for v in opt.slot_initial_values()]
    slots = (np.ascontiguousarray(np.concatenate(cols, axis=1)) if cols
             else np.empty((init.shape[0], 0), np.float32))
    return values, slots


def _grads(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Gradients on a 2**-10 grid: sums of a few of them are exact in float32 in any order,
    so the table's summation order and torch's coalesce order cannot differ."""
    return (np.round(rng.standard_normal(shape) * 1024) / 1024).astype(np.float32)


def _init(rng: np.random.Generator, kind: str) -> np.ndarray:
    if kind == "away":  # +-[1, 2]: the values stay far from zero over the 100 steps
        sign = np.where(rng.random((N, DIM)) < 0.5, -1.0, 1.0)
        return (sign * rng.uniform(1.0, 2.0, (N, DIM))).astype(np.float32)
    return rng.uniform(-1.0, 1.0, (N, DIM)).astype(np.float32)


def _check_away(kind: str, values: np.ndarray) -> None:
    if kind == "away":  # the premise of the relative comparison held
        assert np.abs(values).min() > 0.25


def _check_slots(slots: np.ndarray, state: dict, keys: tuple[str, ...], rtol: float,
                 atol: float) -> None:
    """Slots against torch's state. Momentum-like slots swing through zero whatever the
    values do, so their absolute tolerance is 1e-6 of the slot's largest magnitude."""
    for k, key in enumerate(keys):
        want = state[key].numpy()
        np.testing.assert_allclose(slots[:, k * DIM:(k + 1) * DIM], want, rtol=rtol,
                                   atol=max(atol, 1e-6 * float(np.abs(want).max())),
                                   err_msg=f"slot {key} differs")


def _summed(idx: np.ndarray, g: np.ndarray, rng: np.random.Generator):
    """Unique rows (shuffled) and their summed gradients, as the table hands them over."""
    rows, inverse = np.unique(idx, return_inverse=True)
    summed = np.zeros((rows.shape[0], g.shape[1]), np.float32)
    np.add.at(summed, inverse, g)
    order = rng.permutation(rows.shape[0])
    return rows[order].astype(np.int64), np.ascontiguousarray(summed[order])


def _run_sparse(ours: TableOptimizer, make_torch, slot_keys: tuple[str, ...], seed: int, kind: str):
    rng = np.random.default_rng(seed)
    rtol, atol = TOL[kind]
    init = _init(rng, kind)
    emb = torch.nn.Embedding(N, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(init))
    topt = make_torch(emb.parameters())
    values, slots = _arena(ours, init)
    for step in range(STEPS):
        idx = rng.integers(0, N // 2 if step % 3 == 0 else N, DRAWS)  # some steps skip rows
        g = _grads(rng, (DRAWS, DIM))
        topt.zero_grad()
        (emb(torch.from_numpy(idx)) * torch.from_numpy(g)).sum().backward()
        # Adagrad and SparseAdam coalesce (sum duplicates) themselves; SGD would add each
        # duplicate separately, which rounds differently from the table's summed gradient.
        emb.weight.grad = emb.weight.grad.coalesce()
        topt.step()
        rows, summed = _summed(idx, g, rng)
        ours.apply(values, slots, rows, summed, step)
        np.testing.assert_allclose(values, emb.weight.detach().numpy(), rtol=rtol, atol=atol,
                                   err_msg=f"values differ at step {step}")
    _check_away(kind, values)
    _check_slots(slots, topt.state[emb.weight], slot_keys, rtol, atol)


KINDS = pytest.mark.parametrize("kind", ["away", "crossing"])


@KINDS
def test_sgd_matches_torch_sparse_sgd(kind):
    _run_sparse(SGD(lr=0.01), lambda p: torch.optim.SGD(p, lr=0.01), (), seed=1, kind=kind)


@pytest.mark.parametrize("kw", [
    {"lr": 0.1},
    {"lr": 0.05, "initial_accumulator_value": 0.1, "lr_decay": 0.01, "eps": 1e-6},
])
@KINDS
def test_adagrad_matches_torch_sparse_adagrad(kw, kind):
    _run_sparse(Adagrad(**kw), lambda p: torch.optim.Adagrad(p, **kw), ("sum",), seed=2,
                kind=kind)


@pytest.mark.parametrize("kw", [
    {"lr": 0.01},
    {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6},
])
@KINDS
def test_adam_matches_torch_sparse_adam(kw, kind):
    _run_sparse(Adam(**kw), lambda p: torch.optim.SparseAdam(p, **kw),
                ("exp_avg", "exp_avg_sq"), seed=3, kind=kind)


def _run_dense(ours: TableOptimizer, make_torch, slot_keys: tuple[str, ...], seed: int, kind: str):
    """Every row touched every step: the lazy per-row optimizers equal torch's dense ones."""
    rng = np.random.default_rng(seed)
    rtol, atol = TOL[kind]
    init = _init(rng, kind)
    param = torch.nn.Parameter(torch.from_numpy(init.copy()))
    topt = make_torch([param])
    values, slots = _arena(ours, init)
    for step in range(STEPS):
        g = rng.standard_normal((N, DIM)).astype(np.float32)
        param.grad = torch.from_numpy(g.copy())
        topt.step()
        rows = rng.permutation(N).astype(np.int64)
        ours.apply(values, slots, rows, np.ascontiguousarray(g[rows]), step)
        np.testing.assert_allclose(values, param.detach().numpy(), rtol=rtol, atol=atol,
                                   err_msg=f"values differ at step {step}")
    _check_away(kind, values)
    _check_slots(slots, topt.state[param], slot_keys, rtol, atol)


@pytest.mark.parametrize("kw", [
    {"lr": 0.01},
    {"lr": 0.02, "betas": (0.85, 0.995), "eps": 1e-7, "weight_decay": 0.1},
])
@KINDS
def test_adamw_matches_torch_adamw_when_every_row_is_touched(kw, kind):
    _run_dense(AdamW(**kw), lambda p: torch.optim.AdamW(p, foreach=False, **kw),
               ("exp_avg", "exp_avg_sq"), seed=4, kind=kind)


@pytest.mark.parametrize("kw,keys", [
    ({"lr": 0.01}, ("square_avg",)),
    ({"lr": 0.0005, "momentum": 0.9}, ("square_avg", "momentum_buffer")),
    ({"lr": 0.005, "centered": True, "alpha": 0.9}, ("square_avg", "grad_avg")),
    ({"lr": 0.003, "momentum": 0.5, "centered": True, "weight_decay": 0.01, "eps": 1e-6},
     ("square_avg", "momentum_buffer", "grad_avg")),
])
@KINDS
def test_rmsprop_matches_torch_rmsprop_when_every_row_is_touched(kw, keys, kind):
    opt = RMSProp(**kw)
    assert opt.slot_names() == keys
    _run_dense(opt, lambda p: torch.optim.RMSprop(p, foreach=False, **kw), keys, seed=5,
               kind=kind)


@KINDS
def test_adagrad_weight_decay_matches_torch_dense_adagrad(kind):
    kw = {"lr": 0.1, "weight_decay": 0.05}
    _run_dense(Adagrad(**kw), lambda p: torch.optim.Adagrad(p, foreach=False, **kw), ("sum",),
               seed=6, kind=kind)


# --- FTRL against TensorFlow's formula -----------------------------------------------------------
def _ftrl_reference(w, n, z, g, *, lr, lr_power, l1, l2, l2_shrinkage, dtype):
    """TensorFlow ApplyFtrlV2 (training_ops.cc), vectorised numpy in ``dtype``.

    Same order of operations as TensorFlow's Eigen expression; float32 for parity (powers
    other than -0.5 via float64, rounded once, as the kernel does), float64 as an independent
    check of the float32 arithmetic.
    """
    c = dtype.type
    w, n, z, g = (a.astype(dtype) for a in (w, n, z, g))
    g_shr = g + c(2 * l2_shrinkage) * w
    n_new = n + g * g
    if lr_power == -0.5:
        pw_new, pw_old = np.sqrt(n_new), np.sqrt(n)
    else:
        # float32 power via float64, rounded once (what the kernel does)
        pw_new, pw_old = ((a.astype(np.float64) ** -lr_power).astype(dtype) for a in (n_new, n))
    z = z + (g_shr - (pw_new - pw_old) / c(lr) * w)
    quadratic = pw_new / c(lr) + c(2 * l2)
    w = np.where(np.abs(z) > c(l1), (np.sign(z) * c(l1) - z) / quadratic, c(0))
    return w, n_new, z


@pytest.mark.parametrize("kw", [
    {"lr": 0.05, "lr_power": -0.5, "l1": 0.0, "l2": 0.0},
    {"lr": 0.05, "lr_power": -0.5, "l1": 0.5, "l2": 0.1},
    {"lr": 0.1, "lr_power": -0.3, "l1": 0.2, "l2": 0.05, "initial_accumulator_value": 0.5},
    {"lr": 0.05, "lr_power": -0.5, "l1": 0.1, "l2": 0.1, "l2_shrinkage": 0.05},
])
def test_ftrl_matches_tensorflow_formula(kw):
    opt = FTRL(**kw)
    rng = np.random.default_rng(7)
    init = rng.uniform(-1.0, 1.0, (N, DIM)).astype(np.float32)
    values, slots = _arena(opt, init)
    ref32 = [init.copy(), slots[:, :DIM].copy(), slots[:, DIM:].copy()]
    ref64 = [a.astype(np.float64) for a in ref32]
    params = {k: kw.get(k, d) for k, d in (("lr", 0.05), ("lr_power", -0.5), ("l1", 0.0),
                                          ("l2", 0.0), ("l2_shrinkage", 0.0))}
    zeros_seen = 0
    for step in range(STEPS):
        idx = rng.integers(0, N, DRAWS)
        g = rng.standard_normal((DRAWS, DIM)).astype(np.float32)
        rows, summed = _summed(idx, g, rng)
        opt.apply(values, slots, rows, summed, step)
        for ref, dt in ((ref32, np.dtype(np.float32)), (ref64, np.dtype(np.float64))):
            w, n, z = _ftrl_reference(ref[0][rows], ref[1][rows], ref[2][rows], summed,
                                      dtype=dt, **params)
            ref[0][rows], ref[1][rows], ref[2][rows] = w, n, z
        np.testing.assert_allclose(values, ref32[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(slots[:, :DIM], ref32[1], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(slots[:, DIM:], ref32[2], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(values, ref64[0], rtol=1e-4, atol=1e-5)
        if params["l1"] > 0:
            small = np.abs(slots[:, DIM:]) <= params["l1"]
            touched = np.zeros(N, bool)
            touched[rows] = True
            mask = small & touched[:, None]
            assert np.all(values[mask] == 0.0)  # exactly zero, the sparsity FTRL is used for
            assert np.all(values[~small & touched[:, None]] != 0.0)
            zeros_seen += int(mask.sum())
    if params["l1"] > 0:
        assert zeros_seen > 0
