"""Learning-rate schedules for the sparse optimizers, and the validation helpers they share.

A schedule (:class:`ConstantLR`, :class:`ExponentialDecay`, :class:`WarmupCosine`) is a
callable ``lr(step) -> float`` with a ``config()`` so checkpoints can rebuild it; any plain
callable works as a learning rate too (docs/internals.md, "Sparse optimizers").
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

from tensorkv.errors import ConfigError


# --- validation helpers ------------------------------------------------------------------------
def check_real(owner: str, name: str, value: Any) -> float:
    """A finite float setting ``name`` of ``owner``, else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{owner} {name}={value!r} is not a number; pass a float")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{owner} {name}={value!r} is not finite; pass a finite float")
    return value


def check_at_least(owner: str, name: str, value: Any, low: float = 0.0) -> float:
    """A finite float ``>= low``, else ConfigError."""
    value = check_real(owner, name, value)
    if value < low:
        raise ConfigError(f"{owner} {name}={value!r} is out of range; it must be >= {low}")
    return value


def check_positive(owner: str, name: str, value: Any) -> float:
    """A finite float ``> 0``, else ConfigError."""
    value = check_real(owner, name, value)
    if value <= 0.0:
        raise ConfigError(f"{owner} {name}={value!r} is out of range; it must be > 0")
    return value


def check_unit(owner: str, name: str, value: Any, *, closed: bool = False) -> float:
    """A float in ``[0, 1)`` (``closed``: ``[0, 1]``), else ConfigError."""
    value = check_real(owner, name, value)
    ok = 0.0 <= value <= 1.0 if closed else 0.0 <= value < 1.0
    if not ok:
        rng = "[0, 1]" if closed else "[0, 1)"
        raise ConfigError(f"{owner} {name}={value!r} is out of range; it must lie in {rng}")
    return value


def check_count(owner: str, name: str, value: Any, low: int = 1) -> int:
    """An integer ``>= low``, else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ConfigError(f"{owner} {name}={value!r} is invalid; pass an integer >= {low}")
    return int(value)


# --- learning-rate schedules -------------------------------------------------------------------
class Schedule:
    """A learning rate as a function of the table's step; subclasses are JSON-serialisable.

    Any callable ``lr(step) -> float`` may be passed as an optimizer's ``lr``; subclasses of
    this class additionally survive :meth:`TableOptimizer.config` /
    :meth:`TableOptimizer.from_config`.
    """

    kind: ClassVar[str] = ""

    def __call__(self, step: int) -> float:
        """Return the learning rate at ``step``."""
        raise NotImplementedError

    def config(self) -> dict:
        """Return the JSON-serialisable settings, with ``"schedule"`` naming the kind."""
        return {"schedule": self.kind, **self._params()}

    def _params(self) -> dict:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.config() == self.config()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.config().items())))


class ConstantLR(Schedule):
    """The same learning rate at every step."""

    kind = "constant"

    def __init__(self, lr: float) -> None:
        self.lr = check_positive("constant schedule", "lr", lr)

    def __call__(self, step: int) -> float:
        """Return ``lr``."""
        return self.lr

    def _params(self) -> dict:
        return {"lr": self.lr}


class ExponentialDecay(Schedule):
    """``lr * decay_rate ** (step / decay_steps)``; with ``staircase`` the exponent is floored."""

    kind = "exponential_decay"

    def __init__(self, lr: float, decay_rate: float, decay_steps: int,
                 staircase: bool = False) -> None:
        owner = "exponential_decay schedule"
        self.lr = check_positive(owner, "lr", lr)
        self.decay_rate = check_positive(owner, "decay_rate", decay_rate)
        self.decay_steps = check_count(owner, "decay_steps", decay_steps)
        self.staircase = bool(staircase)

    def __call__(self, step: int) -> float:
        """Return the decayed learning rate at ``step``."""
        exponent = step / self.decay_steps
        if self.staircase:
            exponent = math.floor(exponent)
        return self.lr * self.decay_rate**exponent

    def _params(self) -> dict:
        return {"lr": self.lr, "decay_rate": self.decay_rate, "decay_steps": self.decay_steps,
                "staircase": self.staircase}


class WarmupCosine(Schedule):
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``total_steps``.

    ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps``; then
    ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2`` with
    ``p = (step - warmup_steps) / (total_steps - warmup_steps)`` clipped to 1.
    """

    kind = "warmup_cosine"

    def __init__(self, lr: float, warmup_steps: int, total_steps: int,
                 min_lr: float = 0.0) -> None:
        owner = "warmup_cosine schedule"
        self.lr = check_positive(owner, "lr", lr)
        self.warmup_steps = check_count(owner, "warmup_steps", warmup_steps, low=0)
        self.total_steps = check_count(owner, "total_steps", total_steps)
        if self.total_steps <= self.warmup_steps:
            raise ConfigError(
                f"{owner} total_steps={self.total_steps} must exceed "
                f"warmup_steps={self.warmup_steps}")
        self.min_lr = check_at_least(owner, "min_lr", min_lr)
        if self.min_lr > self.lr:
            raise ConfigError(f"{owner} min_lr={self.min_lr} must not exceed lr={self.lr}")

    def __call__(self, step: int) -> float:
        """Return the warmed-up or cosine-decayed learning rate at ``step``."""
        if step < self.warmup_steps:
            return self.lr * (max(step, 0) + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def _params(self) -> dict:
        return {"lr": self.lr, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "min_lr": self.min_lr}


_SCHEDULES: dict[str, type[Schedule]] = {
    cls.kind: cls for cls in (ConstantLR, ExponentialDecay, WarmupCosine)
}


def constant(lr: float) -> ConstantLR:
    """Return a schedule giving ``lr`` at every step."""
    return ConstantLR(lr)


def exponential_decay(lr: float, decay_rate: float, decay_steps: int,
                      staircase: bool = False) -> ExponentialDecay:
    """Return ``step -> lr * decay_rate ** (step / decay_steps)`` (floored with ``staircase``).

    Examples
    --------
    >>> exponential_decay(0.1, 0.5, 100)(200)
    0.025
    """
    return ExponentialDecay(lr, decay_rate, decay_steps, staircase)


def warmup_cosine(lr: float, warmup_steps: int, total_steps: int,
                  min_lr: float = 0.0) -> WarmupCosine:
    """Return a linear warm-up over ``warmup_steps`` then a cosine decay to ``min_lr``."""
    return WarmupCosine(lr, warmup_steps, total_steps, min_lr)


def schedule_from_config(cfg: Mapping) -> Schedule:
    """Rebuild a schedule from :meth:`Schedule.config`'s dict."""
    if not isinstance(cfg, Mapping) or "schedule" not in cfg:
        raise ConfigError(f"schedule config {cfg!r} is not a dict with a 'schedule' entry")
    kind = cfg["schedule"]
    if kind == "custom":
        raise ConfigError(
            f"the learning rate was a custom callable ({cfg.get('repr', '?')}) that cannot be "
            "stored; pass lr=<float or callable> when rebuilding the optimizer")
    if kind not in _SCHEDULES:
        raise ConfigError(f"unknown schedule {kind!r}; known schedules: {sorted(_SCHEDULES)}")
    params = {k: v for k, v in cfg.items() if k != "schedule"}
    try:
        return _SCHEDULES[kind](**params)
    except TypeError as exc:
        raise ConfigError(f"bad settings for schedule {kind!r}: {exc}") from None


