"""Sparse optimizers: kernels, laziness, schedules, configs, state and bad inputs."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pytest

from tensorkv.embedding.optimizers import (
    FTRL,
    OPTIMIZERS,
    SGD,
    Adagrad,
    Adam,
    AdamW,
    ConstantLR,
    ExponentialDecay,
    RMSProp,
    TableOptimizer,
    WarmupCosine,
    constant,
    exponential_decay,
    get_optimizer,
    schedule_from_config,
    warmup_cosine,
)
from tensorkv.errors import ConfigError, ShapeError
from tensorkv.kernels import optimizers as K

F32 = np.float32


def _all_optimizers() -> list[TableOptimizer]:
    return [
        SGD(lr=0.1),
        Adagrad(lr=0.1, initial_accumulator_value=0.1),
        Adagrad(lr=0.1, weight_decay=0.01, lr_decay=0.01),
        Adam(lr=0.01),
        AdamW(lr=0.01, weight_decay=0.1),
        FTRL(lr=0.1, l1=0.01, l2=0.01),
        FTRL(lr=0.1, lr_power=-0.3, l2_shrinkage=0.01, beta=0.5),
        RMSProp(lr=0.01),
        RMSProp(lr=0.01, momentum=0.9, centered=True, weight_decay=0.01),
    ]


IDS = [repr(o) for o in _all_optimizers()]


def _arena(opt: TableOptimizer, n: int, dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((n, dim)).astype(F32)
    slots = np.ascontiguousarray(np.concatenate(
        [np.full((n, dim), v, F32) for v in opt.slot_initial_values()]
        or [np.empty((n, 0), F32)], axis=1))
    if opt.num_slots:  # some history in the slots, kept valid (accumulators non-negative)
        slots += np.abs(rng.standard_normal(slots.shape)).astype(F32) * F32(0.1)
    names = opt.slot_names()
    if "grad_avg" in names:  # a reachable state: grad_avg**2 <= square_avg
        k = names.index("grad_avg")
        slots[:, k * dim:(k + 1) * dim] = F32(0.5) * np.sqrt(slots[:, :dim])
    return values, slots


# --- kernels -----------------------------------------------------------------------------------
def test_fma32_is_a_fused_multiply_add():
    from numba import njit

    @njit
    def run(a, b, c, out):
        for i in range(a.shape[0]):
            out[i] = K.fma32(a[i], b[i], c[i])

    rng = np.random.default_rng(1)
    a, b, c = (rng.standard_normal(10_000).astype(F32) for _ in range(3))
    out = np.empty_like(a)
    run(a, b, c, out)
    fused = (a.astype(np.float64) * b + c).astype(F32)  # product exact in float64
    assert np.array_equal(out, fused)
    assert not np.array_equal(out, a * b + c)  # two roundings differ somewhere


def test_get_kernel_names_and_unknown_name():
    assert set(K.KERNEL_NAMES) == {"sgd", "adagrad", "adam", "adamw", "rmsprop", "ftrl"}
    with pytest.raises(KeyError, match="no optimizer kernel named 'lamb'"):
        K.get_kernel("lamb")


@pytest.mark.parametrize("opt", _all_optimizers(), ids=IDS)
def test_parallel_and_serial_kernels_agree_bit_for_bit(opt):
    n, m, dim = 4096, 2048, 64  # m * dim above the parallel threshold
    values, slots = _arena(opt, n, dim, seed=2)
    rng = np.random.default_rng(3)
    rows = rng.choice(n, m, replace=False).astype(np.int64)
    grads = rng.standard_normal((m, dim)).astype(F32)
    scalars = opt._scalars(0.01, 3)
    v1, s1, v2, s2 = values.copy(), slots.copy(), values.copy(), slots.copy()
    K.get_kernel(opt._kernel, parallel=False)(v1, s1, rows, grads, *scalars)
    K.get_kernel(opt._kernel, parallel=True)(v2, s2, rows, grads, *scalars)
    assert np.isfinite(v1).all() and np.isfinite(s1).all()
    assert np.array_equal(v1, v2) and np.array_equal(s1, s2)
    assert not np.array_equal(v1, values)


def test_adagrad_kernel_against_scalar_formula():
    values = np.array([[1.0, -2.0]], F32)
    slots = np.array([[0.5, 0.0]], F32)
    grads = np.array([[0.25, 3.0]], F32)
    K.get_kernel("adagrad")(values, slots, np.array([0]), grads, F32(-0.1), F32(1e-10), F32(0))
    s = np.array([0.5 + 0.0625, 9.0], F32)
    assert np.array_equal(slots[0], s)
    expected = np.array([1.0, -2.0], np.float64) - 0.1 * np.array([0.25, 3.0]) / np.sqrt(s)
    np.testing.assert_allclose(values[0], expected, rtol=1e-6)


def test_ftrl_l1_gives_exact_zeros_and_formula():
    opt = FTRL(lr=0.1, l1=1.0, l2=0.5, initial_accumulator_value=0.1)
    values = np.array([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]], F32)
    slots = np.tile(np.array([0.1, 0.1, 0.0, 0.0], F32), (3, 1))
    grads = np.array([[0.5, -0.5], [20.0, -20.0]], F32)
    opt.apply(values, slots, np.array([0, 2]), grads, step=0)
    assert np.array_equal(values[0], [0.0, 0.0])  # |z| = 0.5 <= l1: exactly zero
    assert np.array_equal(values[1], [1.0, 1.0])  # untouched
    n, z = 0.1 + 400.0, 20.0 - (math.sqrt(400.1) - math.sqrt(0.1)) / 0.1 * 1.0
    w = (math.copysign(1.0, z) * 1.0 - z) / (math.sqrt(n) / 0.1 + 2 * 0.5)
    np.testing.assert_allclose(values[2, 0], w, rtol=1e-5)
    np.testing.assert_allclose(slots[2, :2], [n, n], rtol=1e-6)


# --- laziness: rows not listed are untouched ---------------------------------------------------
@pytest.mark.parametrize("opt", _all_optimizers(), ids=IDS)
@pytest.mark.parametrize("m", [7, 3000])  # serial and (above the threshold) parallel kernels
def test_rows_not_given_are_bit_identical(opt, m):
    n, dim = 5000, 32
    values, slots = _arena(opt, n, dim, seed=4)
    rng = np.random.default_rng(5)
    rows = rng.choice(n, m, replace=False)
    before_v, before_s = values.copy(), slots.copy()
    for step in range(3):
        opt.apply(values, slots, rows, rng.standard_normal((m, dim)).astype(F32), step)
    others = np.setdiff1d(np.arange(n), rows)
    assert np.array_equal(values[others], before_v[others])
    assert np.array_equal(slots[others], before_s[others])
    assert not np.array_equal(values[rows], before_v[rows])


def test_lazy_adam_uses_the_global_step_for_bias_correction():
    opt = Adam(lr=0.1, betas=(0.9, 0.999), eps=1e-8)
    values, slots = np.zeros((2, 1), F32), np.zeros((2, 2), F32)
    g = np.ones((1, 1), F32)
    opt.apply(values, slots, np.array([0]), g, 0)  # t = 1
    opt.apply(values, slots, np.array([0]), g, 1)  # t = 2
    opt.apply(values, slots, np.array([1]), g, 2)  # t = 3, first update of row 1
    assert opt.step == 3
    m, v, t = 0.1, 0.001, 3
    expected = -0.1 * math.sqrt(1 - 0.999**t) / (1 - 0.9**t) * m / (math.sqrt(v) + 1e-8)
    np.testing.assert_allclose(values[1, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(slots[1], [m, v], rtol=1e-6)


def test_empty_update_counts_a_step_and_changes_nothing():
    opt = Adam()
    values, slots = _arena(opt, 10, 4)
    bv, bs = values.copy(), slots.copy()
    opt.apply(values, slots, np.empty(0, np.int64), np.empty((0, 4), F32), 0)
    assert opt.step == 1
    assert np.array_equal(values, bv) and np.array_equal(slots, bs)


def test_float64_grads_and_int32_rows_are_accepted():
    opt = SGD(lr=0.5)
    values = np.zeros((4, 2), F32)
    opt.apply(values, None, np.array([3, 1], np.int32), np.array([[1.0, 2.0], [3.0, 4.0]]), 0)
    assert np.array_equal(values, [[0, 0], [-1.5, -2], [0, 0], [-0.5, -1]])


# --- learning-rate schedules -------------------------------------------------------------------
def test_schedule_is_called_with_the_passed_step():
    seen: list[int] = []

    def lr(step: int) -> float:
        seen.append(step)
        return 0.5 if step < 10 else 0.25

    opt = SGD(lr=lr)
    values = np.zeros((2, 1), F32)
    opt.apply(values, None, np.array([0]), np.ones((1, 1), F32), step=3)
    opt.apply(values, None, np.array([1]), np.ones((1, 1), F32), step=42)
    assert seen == [3, 42]
    assert np.array_equal(values[:, 0], [-0.5, -0.25])
    assert opt.lr_at(7) == 0.5


def test_ready_made_schedules():
    assert constant(0.1)(0) == constant(0.1)(10**9) == 0.1
    ed = exponential_decay(0.1, 0.5, 100)
    assert ed(0) == 0.1 and math.isclose(ed(200), 0.025) and math.isclose(ed(50), 0.1 / 2**0.5)
    st = exponential_decay(0.1, 0.5, 100, staircase=True)
    assert st(199) == 0.05
    wc = warmup_cosine(1.0, warmup_steps=10, total_steps=110, min_lr=0.1)
    assert wc(0) == pytest.approx(0.1) and wc(9) == pytest.approx(1.0)
    assert wc(10) == pytest.approx(1.0) and wc(60) == pytest.approx(0.55)
    assert wc(110) == pytest.approx(0.1) and wc(10**6) == pytest.approx(0.1)
    for s in (constant(0.1), ed, st, wc):
        again = schedule_from_config(json.loads(json.dumps(s.config())))
        assert again == s and again(77) == s(77)


@pytest.mark.parametrize("make,match", [
    (lambda: ConstantLR(0), "lr=0.0"),
    (lambda: ExponentialDecay(0.1, -0.5, 10), "decay_rate=-0.5"),
    (lambda: ExponentialDecay(0.1, 0.5, 0), "decay_steps=0"),
    (lambda: WarmupCosine(0.1, 10, 10), "total_steps=10 must exceed"),
    (lambda: WarmupCosine(0.1, 0, 10, min_lr=0.2), "min_lr=0.2"),
    (lambda: schedule_from_config({"schedule": "cyclic"}), "unknown schedule 'cyclic'"),
    (lambda: schedule_from_config({"schedule": "constant", "lr": 0.1, "x": 1}), "constant"),
])
def test_bad_schedules_raise(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


@pytest.mark.parametrize("bad", [-0.1, float("nan"), "fast", None])
def test_schedule_returning_bad_rate_raises_and_changes_nothing(bad):
    opt = Adam(lr=lambda step: bad)
    values, slots = _arena(opt, 4, 2)
    bv, bs = values.copy(), slots.copy()
    with pytest.raises(ConfigError, match="at step 5"):
        opt.apply(values, slots, np.array([1]), np.ones((1, 2), F32), 5)
    assert opt.step == 0 and np.array_equal(values, bv) and np.array_equal(slots, bs)


def test_ftrl_refuses_a_zero_learning_rate_from_a_schedule():
    opt = FTRL(lr=lambda step: 0.0)
    values, slots = _arena(opt, 4, 2)
    with pytest.raises(ConfigError, match="FTRL divides"):
        opt.apply(values, slots, np.array([1]), np.ones((1, 2), F32), 0)
    assert opt.step == 0


# --- config, names, state ----------------------------------------------------------------------
@pytest.mark.parametrize("opt", _all_optimizers()
                         + [Adagrad(lr=exponential_decay(0.1, 0.9, 10)),
                            FTRL(lr=warmup_cosine(0.1, 5, 50))], ids=lambda o: repr(o))
def test_config_round_trip(opt):
    cfg = json.loads(json.dumps(opt.config()))
    again = TableOptimizer.from_config(cfg)
    assert type(again) is type(opt)
    assert again.config() == opt.config()
    assert again.slot_names() == opt.slot_names()
    assert again.slot_initial_values() == opt.slot_initial_values()
    assert type(opt).from_config(cfg).config() == opt.config()
    assert get_optimizer(cfg).config() == opt.config()


def test_custom_callable_lr_needs_an_explicit_lr_to_rebuild():
    opt = SGD(lr=lambda step: 0.1)
    cfg = json.loads(json.dumps(opt.config()))
    assert cfg["lr"]["schedule"] == "custom"
    with pytest.raises(ConfigError, match="pass lr="):
        TableOptimizer.from_config(cfg)
    assert TableOptimizer.from_config(cfg, lr=0.2).lr == 0.2


def test_from_config_on_the_wrong_class_raises():
    with pytest.raises(ConfigError, match="not 'adam'"):
        Adam.from_config(SGD().config())


def test_slots_of_each_optimizer():
    assert SGD().slot_names() == ()
    assert Adagrad(initial_accumulator_value=0.3).slot_initial_values() == (0.3,)
    assert Adam().slot_names() == AdamW().slot_names() == ("exp_avg", "exp_avg_sq")
    assert FTRL(initial_accumulator_value=0.2).slot_initial_values() == (0.2, 0.0)
    assert FTRL().slot_names() == ("accumulator", "linear")
    assert RMSProp().slot_names() == ("square_avg",)
    assert RMSProp(momentum=0.5, centered=True).slot_names() == (
        "square_avg", "momentum_buffer", "grad_avg")
    assert RMSProp(centered=True).num_slots == 2


def test_get_optimizer_resolves_names_classes_instances():
    assert isinstance(get_optimizer(None), SGD) and get_optimizer(None).lr == 0.01
    assert get_optimizer("Adagrad", lr=0.3).lr == 0.3
    assert isinstance(get_optimizer("sparse_adam"), Adam)
    assert isinstance(get_optimizer("sparse-adam"), Adam)
    assert type(get_optimizer("adamw")) is AdamW
    assert isinstance(get_optimizer(FTRL, l1=0.1), FTRL)
    opt = RMSProp()
    assert get_optimizer(opt) is opt
    assert set(OPTIMIZERS) == {"sgd", "adagrad", "adam", "adamw", "ftrl", "rmsprop"}


@pytest.mark.parametrize("call,match", [
    (lambda: get_optimizer("lamb"), "unknown optimizer 'lamb'"),
    (lambda: get_optimizer("adam", momentum=0.9), r"no option\(s\) \['momentum'\]"),
    (lambda: get_optimizer(SGD(), lr=0.1), "cannot be applied to an existing SGD"),
    (lambda: get_optimizer(42), "cannot make an optimizer from 42"),
    (lambda: TableOptimizer.from_config({"lr": 0.1}), "'name' entry"),
])
def test_get_optimizer_bad_inputs(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_adam_state_round_trip_continues_identically():
    rng = np.random.default_rng(6)
    grads = [rng.standard_normal((5, 4)).astype(F32) for _ in range(6)]
    rows = np.array([0, 2, 3, 5, 7])
    a = Adam(lr=0.01)
    va, sa = _arena(a, 8, 4)
    for t in range(3):
        a.apply(va, sa, rows, grads[t], t)
    state = json.loads(json.dumps(a.state()))
    assert state == {"name": "adam", "step": 3}
    b = TableOptimizer.from_config(a.config())
    b.load_state(state)
    vb, sb = va.copy(), sa.copy()
    for t in range(3, 6):
        a.apply(va, sa, rows, grads[t], t)
        b.apply(vb, sb, rows, grads[t], t)
    assert np.array_equal(va, vb) and np.array_equal(sa, sb) and b.step == 6


@pytest.mark.parametrize("state,match", [
    ({}, "'step' entry"),
    ({"step": -1}, "state step=-1"),
    ({"step": 2.5}, "state step=2.5"),
    ({"name": "sgd", "step": 1}, "belongs to 'sgd'"),
    ([("step", 1)], "'step' entry"),
])
def test_bad_state_raises_and_keeps_the_step(state, match):
    opt = Adam()
    opt.load_state({"step": 4})
    with pytest.raises(ConfigError, match=match):
        opt.load_state(state)
    assert opt.step == 4


# --- invalid hyper-parameters ------------------------------------------------------------------
@pytest.mark.parametrize("make,match", [
    (lambda: SGD(lr=0), r"lr=0\.0 is out of range; it must be > 0"),
    (lambda: SGD(lr=-1e-3), "lr=-0.001"),
    (lambda: SGD(lr=float("inf")), "not finite"),
    (lambda: SGD(lr="0.1"), "not a number"),
    (lambda: SGD(lr=True), "not a number"),
    (lambda: Adagrad(eps=0), "eps=0.0"),
    (lambda: Adagrad(initial_accumulator_value=-0.1), "initial_accumulator_value=-0.1"),
    (lambda: Adagrad(lr_decay=-1), "lr_decay=-1.0"),
    (lambda: Adagrad(weight_decay=-0.1), "weight_decay=-0.1"),
    (lambda: Adam(betas=(1.0, 0.999)), r"betas\[0\]=1.0 .* \[0, 1\)"),
    (lambda: Adam(betas=(0.9, -0.1)), r"betas\[1\]=-0.1"),
    (lambda: Adam(betas=0.9), "must be a pair"),
    (lambda: Adam(eps=-1e-8), "eps=-1e-08"),
    (lambda: AdamW(weight_decay=-0.01), "weight_decay=-0.01"),
    (lambda: FTRL(lr_power=0.5), r"lr_power=0\.5 .* <= 0"),
    (lambda: FTRL(l1=-0.1), "l1=-0.1"),
    (lambda: FTRL(l2=-0.1), "l2=-0.1"),
    (lambda: FTRL(l2_shrinkage=-1), "l2_shrinkage=-1.0"),
    (lambda: FTRL(initial_accumulator_value=-1), "initial_accumulator_value=-1.0"),
    (lambda: FTRL(beta=-1), "beta=-1.0"),
    (lambda: RMSProp(alpha=1.5), r"alpha=1\.5 .* \[0, 1\]"),
    (lambda: RMSProp(momentum=1.0), r"momentum=1\.0 .* \[0, 1\)"),
    (lambda: RMSProp(eps=0), "eps=0.0"),
    (lambda: RMSProp(centered="yes"), "centered='yes'"),
])
def test_invalid_hyperparameters_raise_config_error(make, match):
    with pytest.raises(ConfigError, match=match) as info:
        make()
    assert isinstance(info.value, ValueError)


# --- bad arrays --------------------------------------------------------------------------------
def _bad_calls():
    n, dim = 10, 4
    ok_v = np.zeros((n, dim), F32)
    ok_s = np.zeros((n, 2 * dim), F32)
    rows = np.array([1, 2])
    g = np.ones((2, dim), F32)
    return [
        ("f64 values", (ok_v.astype(np.float64), ok_s, rows, g), "2-D float32"),
        ("1-D values", (np.zeros(n, F32), ok_s, rows, g), "2-D float32"),
        ("list values", (ok_v.tolist(), ok_s, rows, g), "numpy array"),
        ("strided values", (np.zeros((n, 2 * dim), F32)[:, ::2], ok_s, rows, g),
         "C-contiguous"),
        ("slots width", (ok_v, np.zeros((n, dim), F32), rows, g), r"needs \(10, 8\)"),
        ("slots rows", (ok_v, np.zeros((n + 1, 2 * dim), F32), rows, g), r"needs \(10, 8\)"),
        ("no slots", (ok_v, None, rows, g), "numpy array"),
        ("rows 2-D", (ok_v, ok_s, rows[None], g), "1-D integer"),
        ("rows float", (ok_v, ok_s, rows.astype(float), g), "1-D integer"),
        ("row too big", (ok_v, ok_s, np.array([1, 10]), g), r"row 10 is out of range .* 0\.\.9"),
        ("row negative", (ok_v, ok_s, np.array([-1, 2]), g), "row -1 is out of range"),
        ("grads shape", (ok_v, ok_s, rows, np.ones((3, dim), F32)), r"\(2, 4\)"),
        ("grads dim", (ok_v, ok_s, rows, np.ones((2, dim + 1), F32)), r"\(2, 4\)"),
        ("grads int", (ok_v, ok_s, rows, np.ones((2, dim), np.int64)), "floating-point"),
    ]


@pytest.mark.parametrize("label,args,match", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_arrays_raise_shape_error_and_change_nothing(label, args, match):
    opt = Adam()
    snapshot = [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in args]
    with pytest.raises(ShapeError, match=match):
        opt.apply(*args, step=0)
    assert opt.step == 0
    for a, b in zip(args, snapshot, strict=True):
        if isinstance(a, np.ndarray):
            assert np.array_equal(a, b)


def test_read_only_values_are_refused():
    values = np.zeros((3, 2), F32)
    values.flags.writeable = False
    with pytest.raises(ShapeError, match="writeable"):
        SGD().apply(values, None, np.array([0]), np.ones((1, 2), F32), 0)


# --- threads and processes ---------------------------------------------------------------------
def _child_parallel_flag(queue) -> None:
    opt = Adagrad(lr=0.1)
    values, slots = _arena(opt, 4096, 64)
    opt.apply(values, slots, np.arange(2048), np.ones((2048, 64), F32), 0)
    queue.put((K.parallel_enabled(), bool(np.isfinite(values).all())))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_runs_serial_kernels():
    opt = Adagrad(lr=0.1)
    values, slots = _arena(opt, 4096, 64)
    opt.apply(values, slots, np.arange(2048), np.ones((2048, 64), F32), 0)  # parent may go parallel
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_parallel_flag, args=(queue,))
    proc.start()
    result = queue.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert result == (False, True)


def test_env_var_forces_serial_kernels():
    code = ("from tensorkv.kernels.optimizers import parallel_enabled, get_kernel;"
            "print(parallel_enabled(), get_kernel('sgd', 1 << 30).__name__)")
    env = {**os.environ, "TENSORKV_PARALLEL_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out == ["False", "_sgd_serial"]


def test_kernels_run_concurrently_from_threads():
    """The table calls kernels from several threads with the GIL released."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(8)
    grads = rng.standard_normal((2048, 64)).astype(F32)
    rows = rng.choice(4096, 2048, replace=False)

    def run(_: int) -> np.ndarray:
        opt = Adam(lr=0.01)
        values, slots = _arena(opt, 4096, 64, seed=9)
        for step in range(5):
            opt.apply(values, slots, rows, grads, step)
        return values

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(8)))
    for r in results[1:]:
        assert np.array_equal(r, results[0])
