"""Numba kernels for the sparse optimizers of :mod:`tensorkv.embedding.optimizers`.

Every kernel is ``kernel(values, slots, rows, grads, *scalars)``: float32 ``[N, dim]`` values
and ``[N, num_slots * dim]`` slots updated in place at the unique ``rows`` from the summed
``grads[m, dim]``, with this step's float32 hyper-parameters. :func:`get_kernel` returns the
serial or the parallel (``prange``) variant. Argument rules, torch's float32 order and the
choice of variant: docs/internals.md ("Sparse optimizers").
"""

from __future__ import annotations

import importlib
import os
import types as pytypes
from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from tensorkv import config
from tensorkv.errors import UnknownNameError
from tensorkv.kernels.arena import prefetch_row
from tensorkv.kernels.hashindex import PREFETCH_DISTANCE

__all__ = [
    "KERNEL_NAMES",
    "fma32",
    "get_kernel",
    "parallel_enabled",
]

_lerp_jit = njit(nogil=True, cache=True, error_model="numpy")


@intrinsic
def fma32(typingctx, a, b, c):
    """``a * b + c`` rounded once (``llvm.fma.f32``), for float32 arguments.

    torch's CPU kernels fuse ``add(x, alpha=a)``, ``addcmul``, ``lerp`` and the sparse
    ``add_`` (BLAS axpy) into fused multiply-adds; the kernels below do the same at the same
    places so their float32 results follow torch's rounding.
    """
    if not all(t == types.float32 for t in (a, b, c)):
        return None
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32")
        return builder.call(fn, args)

    return sig, codegen


@njit(nogil=True, cache=True, inline="always")
def _ahead(values, slots, rows, i):  # pragma: no cover - compiled
    """Prefetch the value and slot rows of the update ``PREFETCH_DISTANCE`` ahead (a hint).

    Updated rows are scattered over the table, so each waits on memory; asking for later
    ones early overlaps the waits (17,700 Adagrad rows of dim 16: 0.45 -> 0.37 ms).
    """
    k = i + PREFETCH_DISTANCE
    if k < rows.shape[0]:
        r = rows[k]
        prefetch_row(values, r)
        prefetch_row(slots, r)


def _sgd(values, slots, rows, grads, neg_lr):
    """``p = fma(-lr, g, p)`` for each given row (``slots`` is unused, width 0)."""
    dim = values.shape[1]
    for i in prange(rows.shape[0]):
        _ahead(values, slots, rows, i)
        r = rows[i]
        for j in range(dim):
            values[r, j] = fma32(neg_lr, grads[i, j], values[r, j])


def _adagrad(values, slots, rows, grads, neg_clr, eps, weight_decay):
    """Adagrad in torch's float32 order. Slot 0 is the accumulator ``s``.

    Without weight decay, torch's sparse path: ``s = s + g*g; p = fma(-clr, g / std, p)``
    with ``std = sqrt(s) + eps``. With weight decay (which torch allows for dense gradients
    only) its dense path: ``g = fma(p, wd, g); s = fma(g, g, s); p = p + (-clr*g) / std``,
    applied lazily to the given rows.
    """
    dim = values.shape[1]
    use_wd = weight_decay != np.float32(0.0)
    for i in prange(rows.shape[0]):
        _ahead(values, slots, rows, i)
        r = rows[i]
        if use_wd:
            for j in range(dim):
                p = values[r, j]
                g = fma32(p, weight_decay, grads[i, j])
                s = fma32(g, g, slots[r, j])
                slots[r, j] = s
                values[r, j] = p + (neg_clr * g) / (np.sqrt(s) + eps)
        else:
            for j in range(dim):
                g = grads[i, j]
                s = slots[r, j] + g * g
                slots[r, j] = s
                values[r, j] = fma32(neg_clr, g / (np.sqrt(s) + eps), values[r, j])


def _adam(values, slots, rows, grads, one_minus_beta1, one_minus_beta2, eps,
          neg_step_size):
    """Lazy Adam in torch ``SparseAdam``'s exact float32 order.

    Slot 0 is ``exp_avg``, slot 1 ``exp_avg_sq``. ``neg_step_size`` is
    ``-lr * sqrt(1 - beta2**t) / (1 - beta1**t)`` with ``t`` the optimizer's global step.
    """
    dim = values.shape[1]
    for i in prange(rows.shape[0]):
        _ahead(values, slots, rows, i)
        r = rows[i]
        for j in range(dim):
            g = grads[i, j]
            old_m = slots[r, j]
            old_v = slots[r, dim + j]
            m = old_m + (g - old_m) * one_minus_beta1
            v = old_v + (g * g - old_v) * one_minus_beta2
            slots[r, j] = m
            slots[r, dim + j] = v
            values[r, j] = values[r, j] + neg_step_size * (m / (np.sqrt(v) + eps))


@_lerp_jit
def _lerp(start, end, weight, one_minus_weight):
    """Float32 ``lerp`` as torch computes it: the formula branch depends on ``|weight| < 0.5``."""
    if abs(weight) < np.float32(0.5):
        return fma32(weight, end - start, start)
    return fma32(-(end - start), one_minus_weight, end)


def _adamw(values, slots, rows, grads, decay, w1, one_minus_w1, beta2, one_minus_beta2,
           bc2_sqrt, eps, neg_step_size):
    """AdamW as torch's single-tensor path computes it, applied to the given rows only.

    ``p *= 1 - lr*wd; m = lerp(m, g, 1-beta1); v = fma((1-beta2)*g, g, v*beta2);
    p += (-lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)``. Slot 0 ``exp_avg``, slot 1 ``exp_avg_sq``.
    """
    dim = values.shape[1]
    for i in prange(rows.shape[0]):
        _ahead(values, slots, rows, i)
        r = rows[i]
        for j in range(dim):
            g = grads[i, j]
            p = values[r, j] * decay
            m = _lerp(slots[r, j], g, w1, one_minus_w1)
            v = fma32(one_minus_beta2 * g, g, slots[r, dim + j] * beta2)
            slots[r, j] = m
            slots[r, dim + j] = v
            values[r, j] = p + (neg_step_size * m) / (np.sqrt(v) / bc2_sqrt + eps)


def _rmsprop(values, slots, rows, grads, neg_lr, alpha, one_minus_alpha, w_avg,
             one_minus_w_avg, eps, weight_decay, momentum, mom_slot, avg_slot):
    """RMSprop as torch's single-tensor path computes it, applied to the given rows only.

    Slot 0 is ``square_avg``; ``mom_slot`` / ``avg_slot`` are the slot numbers of
    ``momentum_buffer`` / ``grad_avg`` or -1 when momentum is 0 / not centered.
    ``w_avg`` is ``1 - alpha`` as float32 (the lerp weight of the centered average).
    """
    dim = values.shape[1]
    use_wd = weight_decay != np.float32(0.0)
    mo = mom_slot * dim
    ao = avg_slot * dim
    for i in prange(rows.shape[0]):
        _ahead(values, slots, rows, i)
        r = rows[i]
        for j in range(dim):
            g = grads[i, j]
            p = values[r, j]
            if use_wd:
                g = fma32(p, weight_decay, g)
            sq = fma32(one_minus_alpha * g, g, slots[r, j] * alpha)
            slots[r, j] = sq
            if avg_slot >= 0:
                ga = _lerp(slots[r, ao + j], g, w_avg, one_minus_w_avg)
                slots[r, ao + j] = ga
                avg = np.sqrt(fma32(-ga, ga, sq)) + eps
            else:
                avg = np.sqrt(sq) + eps
            if mom_slot >= 0:
                buf = slots[r, mo + j] * momentum + g / avg
                slots[r, mo + j] = buf
                values[r, j] = fma32(buf, neg_lr, p)
            else:
                values[r, j] = p + (neg_lr * g) / avg


def _ftrl(values, slots, rows, grads, lr, l1, two_l2, two_l2_shrinkage, neg_lr_power,
                use_sqrt):
    """FTRL-Proximal, TensorFlow ``ApplyFtrlV2`` formula in float32.

    Slot 0 is the accumulator ``n``, slot 1 the linear term ``z``::

        g_s   = g + 2*l2_shrinkage * w
        n'    = n + g*g
        z    += g_s - (n'^(-p) - n^(-p)) / lr * w          (p = lr_power)
        w     = (sign(z)*l1 - z) / (n'^(-p) / lr + 2*l2)   if |z| > l1 else 0

    ``use_sqrt`` selects ``sqrt`` for ``lr_power == -0.5`` as TensorFlow does; other powers
    are computed in float64 (``neg_lr_power`` is a float64) and rounded to float32 once, so
    they do not depend on the platform's float32 ``powf``.
    """
    dim = values.shape[1]
    for i in prange(rows.shape[0]):
        _ahead(values, slots, rows, i)
        r = rows[i]
        for j in range(dim):
            g = grads[i, j]
            w = values[r, j]
            n = slots[r, j]
            z = slots[r, dim + j]
            g_s = g + two_l2_shrinkage * w
            n_new = n + g * g
            if use_sqrt:
                pw_new = np.sqrt(n_new)
                pw_old = np.sqrt(n)
            else:  # float64 power rounded once: reproducible across libm implementations
                pw_new = np.float32(np.float64(n_new) ** neg_lr_power)
                pw_old = np.float32(np.float64(n) ** neg_lr_power)
            z = z + (g_s - (pw_new - pw_old) / lr * w)
            slots[r, j] = n_new
            slots[r, dim + j] = z
            if abs(z) > l1:
                s = l1 if z > np.float32(0.0) else -l1
                quadratic = pw_new / lr + two_l2
                values[r, j] = (s - z) / quadratic
            else:
                values[r, j] = np.float32(0.0)


# --- compiled variants and the choice between them ----------------------------------------------
_SOURCES = {
    "sgd": _sgd,
    "adagrad": _adagrad,
    "adam": _adam,
    "adamw": _adamw,
    "rmsprop": _rmsprop,
    "ftrl": _ftrl,
}
#: Names accepted by :func:`get_kernel`.
KERNEL_NAMES = tuple(_SOURCES)


def _compile(fn: Callable, parallel: bool) -> Callable:
    """Jit a copy of ``fn`` under its own name so serial and parallel caches do not collide."""
    name = f"{fn.__name__}_{'parallel' if parallel else 'serial'}"
    copy = pytypes.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = name
    copy.__doc__ = fn.__doc__
    return njit(nogil=True, cache=True, error_model="numpy", parallel=parallel)(copy)


_SERIAL = {name: _compile(fn, False) for name, fn in _SOURCES.items()}
_PARALLEL = {name: _compile(fn, True) for name, fn in _SOURCES.items()}
_parallel_state: bool | None = None  # None: not decided yet


def _threadsafe_layer() -> bool:
    """Whether numba's threading layer is (or will be) TBB or OpenMP, both thread-safe.

    The workqueue layer aborts the process when two threads enter a parallel region at once,
    and the table calls kernels from several threads with the GIL released.
    """
    import numba
    from numba.np.ufunc import parallel as npp

    if numba.config.NUMBA_NUM_THREADS < 2:
        return False
    try:
        return npp.threading_layer() in ("tbb", "omp")
    except ValueError:  # not launched yet: predict numba's own choice
        pass
    wanted = str(numba.config.THREADING_LAYER).lower()
    if wanted in ("tbb", "omp", "safe", "threadsafe"):
        return True
    if wanted != "default":
        return False
    priority = [str(x).lower() for x in numba.config.THREADING_LAYER_PRIORITY]
    for layer in priority:
        if layer == "workqueue":
            return False
        try:
            if layer == "tbb":
                npp._check_tbb_version_compatible()  # numba's own test before it picks TBB
            importlib.import_module(f"numba.np.ufunc.{layer}pool")
            return True
        except Exception:  # noqa: BLE001 - numba reports any load failure as unavailable
            continue
    return False


def parallel_enabled() -> bool:
    """Whether large updates run their row loop on numba's thread pool (decided once)."""
    global _parallel_state
    if _parallel_state is None:
        _parallel_state = config.env_bool(config.ENV_PARALLEL_KERNELS, True) and _threadsafe_layer()
    return _parallel_state


def _serial_after_fork() -> None:
    global _parallel_state
    _parallel_state = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_serial_after_fork)


def get_kernel(name: str, elements: int = 0, parallel: bool | None = None) -> Callable:
    """Return the compiled kernel ``name`` for an update of ``elements`` values (rows * dim).

    Parameters
    ----------
    name : str
        One of :data:`KERNEL_NAMES`.
    elements : int
        Size of the update; at or above ``config.OPTIMIZER_PARALLEL_MIN_ELEMENTS`` the
        parallel variant is returned when :func:`parallel_enabled` allows it.
    parallel : bool, optional
        Force the parallel (True) or serial (False) variant, e.g. to compare them.

    Returns
    -------
    Callable
        ``kernel(values, slots, rows, grads, *scalars)``; see the module docstring.
    """
    if name not in _SOURCES:
        raise UnknownNameError(f"no optimizer kernel named {name!r}; choose one of {KERNEL_NAMES}")
    if parallel is None:
        parallel = elements >= config.OPTIMIZER_PARALLEL_MIN_ELEMENTS and parallel_enabled()
    if parallel:
        return _PARALLEL[name]
    return _SERIAL[name]
