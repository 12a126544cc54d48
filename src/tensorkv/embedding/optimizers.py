"""Sparse optimizers for dynamic embedding tables.

:class:`SGD`, :class:`Adagrad`, :class:`Adam`, :class:`AdamW`, :class:`FTRL` and
:class:`RMSProp` (base class :class:`TableOptimizer`, built by :func:`get_optimizer`) update only
the rows a batch touched, in numba kernels that follow torch's float32 arithmetic. Semantics,
slots and the global step: docs/internals.md ("Sparse optimizers").
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from tensorkv.embedding.schedules import (
    ConstantLR,
    ExponentialDecay,
    Schedule,
    WarmupCosine,
    check_at_least,
    check_count,
    check_positive,
    check_real,
    check_unit,
    constant,
    exponential_decay,
    schedule_from_config,
    warmup_cosine,
)
from tensorkv.errors import ConfigError, ShapeError
from tensorkv.kernels.optimizers import get_kernel

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "ConstantLR",
    "ExponentialDecay",
    "TableOptimizer",
    "RMSProp",
    "Schedule",
    "WarmupCosine",
    "constant",
    "exponential_decay",
    "get_optimizer",
    "optimizer_from_config",
    "schedule_from_config",
    "warmup_cosine",
]

_F32 = np.float32


def _check_lr(owner: str, lr: Any) -> float | Callable[[int], float]:
    if callable(lr):
        return lr
    if isinstance(lr, Mapping):
        return schedule_from_config(lr)
    return check_positive(owner, "lr", lr)


# --- the base class ----------------------------------------------------------------------------
class TableOptimizer:
    """Base class of the sparse optimizers.

    Subclasses set :attr:`name` and the kernel they run, declare their slots, and turn the
    learning rate and global step into the kernel's float32 scalars.

    Parameters
    ----------
    lr : float or callable
        Learning rate (> 0), or a schedule ``lr(step) -> float`` called with the step given to
        :meth:`apply`; a schedule may return 0 but never a negative or non-finite rate.
    """

    name: ClassVar[str] = "optimizer"
    _kernel: ClassVar[str] = ""

    def __init__(self, lr: float | Callable[[int], float]) -> None:
        self._lr = _check_lr(type(self).__name__, lr)
        self._step = 0

    # -- description
    @property
    def lr(self) -> float | Callable[[int], float]:
        """The learning rate: a float or a schedule callable."""
        return self._lr

    @lr.setter
    def lr(self, value: float | Callable[[int], float]) -> None:
        self._lr = _check_lr(type(self).__name__, value)

    @property
    def step(self) -> int:
        """Number of :meth:`apply` calls so far (the global step used for bias correction)."""
        return self._step

    def lr_at(self, step: int) -> float:
        """Return the learning rate for the table's ``step``."""
        if not callable(self._lr):
            return self._lr
        value = self._lr(step)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                math.isfinite(value) and value >= 0.0):
            raise ConfigError(
                f"{type(self).__name__} learning-rate schedule {self._lr!r} returned {value!r} "
                f"at step {step}; it must return a finite float >= 0")
        return float(value)

    def slot_names(self) -> tuple[str, ...]:
        """Names of the per-row state slots, each ``dim`` float32 columns wide."""
        return ()

    def slot_initial_values(self) -> tuple[float, ...]:
        """Initial value of each slot, in :meth:`slot_names` order."""
        return tuple(0.0 for _ in self.slot_names())

    @property
    def num_slots(self) -> int:
        """``len(slot_names())``; the slot arena is ``num_slots * dim`` columns wide."""
        return len(self.slot_names())

    def hyperparameters(self) -> dict:
        """Return the constructor arguments other than ``lr``."""
        return {}

    def config(self) -> dict:
        """Return a JSON-serialisable description that :meth:`from_config` rebuilds.

        The learning rate is stored as a float, as a :class:`Schedule`'s config, or, for any
        other callable, as ``{"schedule": "custom", "repr": ...}`` (rebuilding then needs an
        explicit ``lr``).
        """
        lr = self._lr
        if isinstance(lr, Schedule):
            lr_cfg: Any = lr.config()
        elif callable(lr):
            lr_cfg = {"schedule": "custom", "repr": repr(lr)}
        else:
            lr_cfg = lr
        return {"name": self.name, "lr": lr_cfg, **self.hyperparameters()}

    @classmethod
    def from_config(cls, cfg: Mapping, **overrides: Any) -> TableOptimizer:
        """Rebuild an optimizer from :meth:`config`'s dict; ``overrides`` replace entries.

        Called on :class:`TableOptimizer` it dispatches on ``cfg["name"]``; called on a subclass
        the name must match.
        """
        opt = optimizer_from_config(cfg, **overrides)
        if cls is not TableOptimizer and not isinstance(opt, cls):
            raise ConfigError(f"config names optimizer {opt.name!r}, not {cls.name!r}")
        return opt

    def state(self) -> dict:
        """Return the optimizer-global state (the global step), JSON-serialisable."""
        return {"name": self.name, "step": self._step}

    def copy(self) -> TableOptimizer:
        """Return an independent optimizer: same hyper-parameters, learning rate and state.

        A table keeps a copy of the optimizer it is given (so one object may configure many
        tables, each counting its own step); the copy's later steps leave this one as it is.
        A learning-rate schedule is shared by reference (a schedule is a function of the step).

        Examples
        --------
        >>> opt = Adam(lr=0.01)
        >>> twin = opt.copy()
        >>> twin.load_state({"step": 5})
        >>> opt.step, twin.step
        (0, 5)
        """
        return copy.copy(self)

    def load_state(self, state: Mapping) -> None:
        """Restore :meth:`state`'s dict; a bad dict raises and leaves the state unchanged."""
        if not isinstance(state, Mapping) or "step" not in state:
            raise ConfigError(f"optimizer state {state!r} is not a dict with a 'step' entry")
        name = state.get("name", self.name)
        if name != self.name:
            raise ConfigError(f"optimizer state belongs to {name!r}, not {self.name!r}")
        self._step = check_count(type(self).__name__, "state step", state["step"], low=0)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in {"lr": self._lr,
                                                    **self.hyperparameters()}.items())
        return f"{type(self).__name__}({args})"

    # -- the update
    def apply(self, values: np.ndarray, slots: np.ndarray | None, rows: np.ndarray,
              grads: np.ndarray, step: int, parallel: bool | None = None,
              split: Callable[[Callable[[int, int], None], int], None] | None = None) -> None:
        """Update ``values[rows]`` and ``slots[rows]`` in place from ``grads``.

        Parameters
        ----------
        values : numpy.ndarray
            float32 C-contiguous ``[N, dim]`` row arena.
        slots : numpy.ndarray or None
            float32 C-contiguous ``[N, num_slots * dim]`` (``None`` allowed when there are no
            slots); slot ``k`` occupies columns ``k * dim : (k + 1) * dim``.
        rows : numpy.ndarray
            ``[m]`` integer row numbers in ``[0, N)``; they must be unique (duplicate rows
            give undefined results: sum their gradients first).
        grads : numpy.ndarray
            ``[m, dim]`` finite gradients (converted to C-contiguous float32 if needed).
        step : int
            The table's step, passed to a learning-rate schedule.
        parallel : bool, optional
            Force the multi-threaded (True) or the serial (False) kernel; by default large
            updates run on all cores (see :func:`tensorkv.kernels.optimizers.get_kernel`).
        split : callable, optional
            ``split(fn, m)`` runs ``fn(start, stop)`` over row ranges covering ``[0, m)``
            (e.g. :func:`tensorkv.embedding.chain.assist.run_split`); the serial kernel then runs
            once per range. Rows are independent, so the result is the same bit for bit.

        Raises
        ------
        ShapeError
            An array has the wrong dtype, shape or layout, or a row is out of range; nothing
            is modified.
        ConfigError
            The schedule returned an invalid learning rate; nothing is modified.

        Notes
        -----
        Rows not in ``rows`` are neither read nor written. The global step is incremented
        once per call, even when ``rows`` is empty.
        """
        values, slots, rows, grads = self._check_arrays(values, slots, rows, grads)
        lr = self.lr_at(step)
        self._check_lr_value(lr, step)
        t = self._step + 1
        scalars = self._scalars(lr, t)
        self._step = t
        m, dim = grads.shape
        if m == 0 or dim == 0:
            return
        if split is None:
            get_kernel(self._kernel, m * dim, parallel)(values, slots, rows, grads, *scalars)
            return
        kernel = get_kernel(self._kernel, m * dim, False)
        split(lambda lo, hi: kernel(values, slots, rows[lo:hi], grads[lo:hi], *scalars), m)

    def _check_lr_value(self, lr: float, step: int) -> None:
        """Hook for optimizers that cannot run with a zero learning rate."""

    def _scalars(self, lr: float, t: int) -> tuple:
        raise NotImplementedError

    def _check_arrays(self, values: Any, slots: Any, rows: Any,
                      grads: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        _check_arena("values", values)
        n, dim = values.shape
        width = self.num_slots * dim
        if slots is None and width == 0:
            slots = np.empty((n, 0), dtype=_F32)
        _check_arena("slots", slots)
        if slots.shape != (n, width):
            raise ShapeError(
                f"slots has shape {slots.shape}; {type(self).__name__} needs "
                f"({n}, {width}) = (rows of values, {self.num_slots} slots x dim {dim})")
        rows = np.asarray(rows)
        if rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise ShapeError(
                f"rows must be a 1-D integer array, got {rows.dtype} with shape {rows.shape}")
        rows = rows.astype(np.int64, copy=False)
        grads = np.asarray(grads)
        if grads.dtype.kind != "f":
            raise ShapeError(f"grads must be a floating-point array, got {grads.dtype}")
        grads = np.ascontiguousarray(grads, dtype=_F32)
        if grads.shape != (rows.shape[0], dim):
            raise ShapeError(
                f"grads has shape {grads.shape}; it must be ({rows.shape[0]}, {dim}) = "
                "(len(rows), dim of values)")
        if rows.shape[0]:
            lo, hi = int(rows.min()), int(rows.max())
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise ShapeError(f"row {bad} is out of range for an arena of {n} rows "
                                 f"(valid rows: 0..{n - 1})")
        return values, slots, rows, grads


def _check_arena(what: str, arr: Any) -> None:
    if not isinstance(arr, np.ndarray):
        raise ShapeError(f"{what} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != _F32 or arr.ndim != 2:
        raise ShapeError(
            f"{what} must be a 2-D float32 array (updated in place), got {arr.dtype} with "
            f"shape {arr.shape}; gather rows to float32 first")
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ShapeError(f"{what} must be C-contiguous and writeable (it is updated in place); "
                         "pass np.ascontiguousarray(...) and copy back")


# --- the optimizers ----------------------------------------------------------------------------
class SGD(TableOptimizer):
    """Plain stochastic gradient descent: ``p -= lr * g`` (``torch.optim.SGD``, no momentum).

    Parameters
    ----------
    lr : float or callable
        Learning rate (> 0) or schedule.
    """

    name = "sgd"
    _kernel = "sgd"

    def __init__(self, lr: float | Callable[[int], float] = 0.01) -> None:
        super().__init__(lr)

    def _scalars(self, lr: float, t: int) -> tuple:
        return (_F32(-lr),)


class Adagrad(TableOptimizer):
    """Adagrad with ``torch.optim.Adagrad`` semantics, on the touched rows only.

    ``s += g*g;  p -= clr * g / (sqrt(s) + eps)`` with ``clr = lr / (1 + (t-1) * lr_decay)``
    and ``t`` the global step.

    Parameters
    ----------
    lr : float or callable
        Learning rate (> 0) or schedule.
    initial_accumulator_value : float
        Initial value of the accumulator slot (>= 0).
    eps : float
        Added to the square root of the accumulator (> 0).
    lr_decay : float
        Learning-rate decay per global step (>= 0).
    weight_decay : float
        L2 penalty added to the gradient, ``g + weight_decay * p`` (>= 0); torch rejects it
        with sparse gradients, here it applies to the touched rows only.
    """

    name = "adagrad"
    _kernel = "adagrad"

    def __init__(self, lr: float | Callable[[int], float] = 0.01,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10,
                 lr_decay: float = 0.0, weight_decay: float = 0.0) -> None:
        super().__init__(lr)
        self.initial_accumulator_value = check_at_least(
            "Adagrad", "initial_accumulator_value", initial_accumulator_value)
        self.eps = check_positive("Adagrad", "eps", eps)
        self.lr_decay = check_at_least("Adagrad", "lr_decay", lr_decay)
        self.weight_decay = check_at_least("Adagrad", "weight_decay", weight_decay)

    def slot_names(self) -> tuple[str, ...]:
        """``("accumulator",)``."""
        return ("accumulator",)

    def slot_initial_values(self) -> tuple[float, ...]:
        """``(initial_accumulator_value,)``."""
        return (self.initial_accumulator_value,)

    def hyperparameters(self) -> dict:
        """Return the constructor arguments other than ``lr``."""
        return {"initial_accumulator_value": self.initial_accumulator_value, "eps": self.eps,
                "lr_decay": self.lr_decay, "weight_decay": self.weight_decay}

    def _scalars(self, lr: float, t: int) -> tuple:
        clr = lr / (1 + (t - 1) * self.lr_decay)
        return (_F32(-clr), _F32(self.eps), _F32(self.weight_decay))


def _betas(owner: str, betas: Any) -> tuple[float, float]:
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ConfigError(f"{owner} betas={betas!r} must be a pair (beta1, beta2)") from None
    return check_unit(owner, "betas[0]", b1), check_unit(owner, "betas[1]", b2)


class Adam(TableOptimizer):
    """Lazy Adam with ``torch.optim.SparseAdam`` semantics.

    Only the touched rows' moments move; bias correction uses the global step ``t``::

        m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
        p -= lr * sqrt(1 - b2**t) / (1 - b1**t) * m / (sqrt(v) + eps)

    Parameters
    ----------
    lr : float or callable
        Learning rate (> 0) or schedule.
    betas : tuple of float
        Decay rates of the two moments, each in ``[0, 1)``.
    eps : float
        Added to ``sqrt(v)`` (> 0).
    """

    name = "adam"
    _kernel = "adam"

    def __init__(self, lr: float | Callable[[int], float] = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        super().__init__(lr)
        self.betas = _betas(type(self).__name__, betas)
        self.eps = check_positive(type(self).__name__, "eps", eps)

    def slot_names(self) -> tuple[str, ...]:
        """``("exp_avg", "exp_avg_sq")``."""
        return ("exp_avg", "exp_avg_sq")

    def hyperparameters(self) -> dict:
        """Return the constructor arguments other than ``lr``."""
        return {"betas": list(self.betas), "eps": self.eps}

    def _scalars(self, lr: float, t: int) -> tuple:
        b1, b2 = self.betas
        step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        return (_F32(1 - b1), _F32(1 - b2), _F32(self.eps), _F32(-step_size))


class AdamW(Adam):
    """Adam with decoupled weight decay, ``torch.optim.AdamW`` per row, on the touched rows.

    ``p *= 1 - lr*weight_decay`` then the Adam step (torch's dense formula order); rows not
    touched are neither decayed nor moved. Bias correction uses the global step.

    Parameters
    ----------
    lr : float or callable
        Learning rate (> 0) or schedule.
    betas : tuple of float
        Decay rates of the two moments, each in ``[0, 1)``.
    eps : float
        Added to the bias-corrected ``sqrt(v)`` (> 0).
    weight_decay : float
        Decoupled weight decay (>= 0).
    """

    name = "adamw"
    _kernel = "adamw"

    def __init__(self, lr: float | Callable[[int], float] = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        super().__init__(lr, betas, eps)
        self.weight_decay = check_at_least("AdamW", "weight_decay", weight_decay)

    def hyperparameters(self) -> dict:
        """Return the constructor arguments other than ``lr``."""
        return {**super().hyperparameters(), "weight_decay": self.weight_decay}

    def _scalars(self, lr: float, t: int) -> tuple:
        b1, b2 = self.betas
        w1 = _F32(1 - b1)
        return (_F32(1 - lr * self.weight_decay), w1, _F32(1) - w1, _F32(b2), _F32(1 - b2),
                _F32((1 - b2**t) ** 0.5), _F32(self.eps), _F32(-(lr / (1 - b1**t))))


class FTRL(TableOptimizer):
    """FTRL-Proximal with TensorFlow's ``ApplyFtrlV2`` formula (as DeepRec uses it).

    With accumulator ``n``, linear term ``z`` and ``p = lr_power``::

        n' = n + g*g
        z += g + 2*l2_shrinkage*w - (n'^-p - n^-p) / lr * w
        w  = (sign(z)*l1 - z) / (n'^-p / lr + 2*l2)   if |z| > l1 else 0

    so ``l1 > 0`` makes weights exactly zero. ``beta`` adds ``beta / lr`` to the quadratic
    term, as Keras' ``Ftrl`` does.

    Parameters
    ----------
    lr : float or callable
        Learning rate (> 0; a schedule must not return 0 here).
    lr_power : float
        Power of the accumulator (<= 0; -0.5 uses square roots as TensorFlow does).
    l1, l2 : float
        L1 and L2 regularisation strengths (>= 0).
    initial_accumulator_value : float
        Initial accumulator (>= 0).
    l2_shrinkage : float
        L2 shrinkage added to the gradient in the linear term (>= 0).
    beta : float
        Keras' ``beta`` (>= 0).
    """

    name = "ftrl"
    _kernel = "ftrl"

    def __init__(self, lr: float | Callable[[int], float] = 0.05, lr_power: float = -0.5,
                 l1: float = 0.0, l2: float = 0.0, initial_accumulator_value: float = 0.1,
                 l2_shrinkage: float = 0.0, beta: float = 0.0) -> None:
        super().__init__(lr)
        self.lr_power = check_real("FTRL", "lr_power", lr_power)
        if self.lr_power > 0:
            raise ConfigError(f"FTRL lr_power={self.lr_power!r} is out of range; it must be <= 0 "
                              "(e.g. -0.5)")
        self.l1 = check_at_least("FTRL", "l1", l1)
        self.l2 = check_at_least("FTRL", "l2", l2)
        self.initial_accumulator_value = check_at_least(
            "FTRL", "initial_accumulator_value", initial_accumulator_value)
        self.l2_shrinkage = check_at_least("FTRL", "l2_shrinkage", l2_shrinkage)
        self.beta = check_at_least("FTRL", "beta", beta)

    def slot_names(self) -> tuple[str, ...]:
        """``("accumulator", "linear")``."""
        return ("accumulator", "linear")

    def slot_initial_values(self) -> tuple[float, ...]:
        """``(initial_accumulator_value, 0.0)``."""
        return (self.initial_accumulator_value, 0.0)

    def hyperparameters(self) -> dict:
        """Return the constructor arguments other than ``lr``."""
        return {"lr_power": self.lr_power, "l1": self.l1, "l2": self.l2,
                "initial_accumulator_value": self.initial_accumulator_value,
                "l2_shrinkage": self.l2_shrinkage, "beta": self.beta}

    def _check_lr_value(self, lr: float, step: int) -> None:
        if lr <= 0.0:
            raise ConfigError(f"FTRL learning rate is {lr!r} at step {step}; FTRL divides by "
                              "it, so the schedule must stay > 0")

    def _scalars(self, lr: float, t: int) -> tuple:
        return (_F32(lr), _F32(self.l1), _F32(2 * self.l2 + self.beta / lr),
                _F32(2 * self.l2_shrinkage), float(-self.lr_power), self.lr_power == -0.5)


class RMSProp(TableOptimizer):
    """RMSprop with ``torch.optim.RMSprop`` semantics, on the touched rows only.

    ``v = alpha*v + (1-alpha)*g*g``; centered: ``a = lerp(a, g, 1-alpha)`` and the
    denominator is ``sqrt(v - a*a) + eps``, else ``sqrt(v) + eps``; with momentum
    ``b = momentum*b + g/denom; p -= lr*b``, else ``p -= lr*g/denom``.

    Parameters
    ----------
    lr : float or callable
        Learning rate (> 0) or schedule.
    alpha : float
        Smoothing constant in ``[0, 1]``.
    eps : float
        Added to the denominator (> 0).
    momentum : float
        Momentum factor in ``[0, 1)``; > 0 adds the ``momentum_buffer`` slot.
    centered : bool
        Normalise by the centered second moment; adds the ``grad_avg`` slot.
    weight_decay : float
        L2 penalty added to the gradient (>= 0).
    """

    name = "rmsprop"
    _kernel = "rmsprop"

    def __init__(self, lr: float | Callable[[int], float] = 0.01, alpha: float = 0.99,
                 eps: float = 1e-8, momentum: float = 0.0, centered: bool = False,
                 weight_decay: float = 0.0) -> None:
        super().__init__(lr)
        self.alpha = check_unit("RMSProp", "alpha", alpha, closed=True)
        self.eps = check_positive("RMSProp", "eps", eps)
        self.momentum = check_unit("RMSProp", "momentum", momentum)
        if not isinstance(centered, bool | np.bool_):
            raise ConfigError(f"RMSProp centered={centered!r} must be True or False")
        self.centered = bool(centered)
        self.weight_decay = check_at_least("RMSProp", "weight_decay", weight_decay)

    def slot_names(self) -> tuple[str, ...]:
        """``("square_avg",)`` + ``("momentum_buffer",)`` + ``("grad_avg",)`` as configured."""
        names: tuple[str, ...] = ("square_avg",)
        if self.momentum > 0:
            names += ("momentum_buffer",)
        if self.centered:
            names += ("grad_avg",)
        return names

    def hyperparameters(self) -> dict:
        """Return the constructor arguments other than ``lr``."""
        return {"alpha": self.alpha, "eps": self.eps, "momentum": self.momentum,
                "centered": self.centered, "weight_decay": self.weight_decay}

    def _scalars(self, lr: float, t: int) -> tuple:
        names = self.slot_names()
        mom_slot = names.index("momentum_buffer") if self.momentum > 0 else -1
        avg_slot = names.index("grad_avg") if self.centered else -1
        w_avg = _F32(1 - self.alpha)
        return (_F32(-lr), _F32(self.alpha), _F32(1 - self.alpha), w_avg, _F32(1) - w_avg,
                _F32(self.eps), _F32(self.weight_decay), _F32(self.momentum), mom_slot,
                avg_slot)


# --- lookup by name ----------------------------------------------------------------------------
OPTIMIZERS: dict[str, type[TableOptimizer]] = {
    cls.name: cls for cls in (SGD, Adagrad, Adam, AdamW, FTRL, RMSProp)
}
_ALIASES = {"sparse_adam": "adam", "sparseadam": "adam", "lazy_adam": "adam",
            "lazyadam": "adam", "ftrl_proximal": "ftrl", "rms_prop": "rmsprop"}


def _lookup(name: str) -> type[TableOptimizer]:
    key = name.strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[key]


def _construct(cls: type[TableOptimizer], kwargs: Mapping[str, Any]) -> TableOptimizer:
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigError(f"{cls.__name__} has no option(s) {unknown}; accepted: {accepted}")
    return cls(**kwargs)


def optimizer_from_config(cfg: Mapping, **overrides: Any) -> TableOptimizer:
    """Rebuild an optimizer from :meth:`TableOptimizer.config`'s dict (``overrides`` win)."""
    if not isinstance(cfg, Mapping) or "name" not in cfg:
        raise ConfigError(f"optimizer config {cfg!r} is not a dict with a 'name' entry")
    kwargs = {k: v for k, v in cfg.items() if k != "name"}
    kwargs.update(overrides)
    return _construct(_lookup(str(cfg["name"])), kwargs)


def get_optimizer(name_or_obj: str | TableOptimizer | Mapping | type[TableOptimizer] | None = None,
                  **kwargs: Any) -> TableOptimizer:
    """Resolve an optimizer from a name, a config dict, a class or an instance.

    Parameters
    ----------
    name_or_obj : str, dict, TableOptimizer subclass, TableOptimizer or None
        ``"sgd"``, ``"adagrad"``, ``"adam"`` (also ``"sparse_adam"``), ``"adamw"``,
        ``"ftrl"``, ``"rmsprop"``; a :meth:`TableOptimizer.config` dict; a class; an instance
        (returned as is); ``None`` gives ``SGD`` (lr 0.01 unless given).
    **kwargs
        Constructor options (or overrides of a config dict's entries).

    Returns
    -------
    TableOptimizer

    Examples
    --------
    >>> get_optimizer("adam", lr=0.01)
    Adam(lr=0.01, betas=[0.9, 0.999], eps=1e-08)
    """
    if name_or_obj is None:
        return _construct(SGD, kwargs)
    if isinstance(name_or_obj, TableOptimizer):
        if kwargs:
            raise ConfigError(f"options {sorted(kwargs)} cannot be applied to an existing "
                              f"{type(name_or_obj).__name__}; pass them to its constructor")
        return name_or_obj
    if isinstance(name_or_obj, str):
        return _construct(_lookup(name_or_obj), kwargs)
    if isinstance(name_or_obj, Mapping):
        return optimizer_from_config(name_or_obj, **kwargs)
    if isinstance(name_or_obj, type) and issubclass(name_or_obj, TableOptimizer):
        return _construct(name_or_obj, kwargs)
    raise ConfigError(f"cannot make an optimizer from {name_or_obj!r}; pass a name "
                      f"({sorted(OPTIMIZERS)}), a config dict, a class or an instance")


def __getattr__(name: str) -> object:
    if name == "Optimizer":  # the old name, kept importable for one release
        import warnings

        warnings.warn("tensorkv.embedding.optimizers.Optimizer is deprecated and will be removed "
                      "in the next release; use TableOptimizer (tensorkv.torch.Optimizer is the "
                      "optimizer of a torch model)", DeprecationWarning, stacklevel=2)
        return TableOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
