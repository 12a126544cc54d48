"""Per-key initializers: a new key's row is a pure function of (seed, key, column).

:class:`Constant`, :class:`Zeros`, :class:`Uniform`, :class:`Normal` and
:class:`TruncatedNormal`, resolved by :func:`get_initializer`. The counter-based generator
(the same values whatever batch, order, shard or tier a key first appears in) is described in
docs/internals.md ("Kernels", initial values).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorkv import config
from tensorkv.errors import ConfigError
from tensorkv.kernels import initializers as ik
from tensorkv.kernels.optimizers import parallel_enabled


def _parts(n_values: int) -> int:
    """Ranges to split an initialisation of ``n_values`` values into (1: serial kernel).

    Large batches of new keys run on numba's threads, as large optimizer updates do
    (``config.OPTIMIZER_PARALLEL_MIN_ELEMENTS``, ``TENSORKV_PARALLEL_KERNELS``).
    """
    if n_values < config.OPTIMIZER_PARALLEL_MIN_ELEMENTS or not parallel_enabled():
        return 1
    return max(1, min(ik.threads(), n_values * 4 // config.OPTIMIZER_PARALLEL_MIN_ELEMENTS))


class Initializer:
    """Base class: fills rows of an arena from (seed, key, column)."""

    name = "initializer"

    def fill(self, out: np.ndarray, rows: np.ndarray, keys: np.ndarray, seed: int) -> None:
        """Write the initial value of ``keys[i]`` into ``out[rows[i]]`` (rows ``< 0`` skipped).

        Parameters
        ----------
        out
            float32 C-contiguous ``[N, dim]`` array.
        rows
            int64 row of ``out`` for each key.
        keys
            int64 keys.
        seed
            The table's seed.
        """
        raise NotImplementedError

    def values(self, keys: np.ndarray, dim: int, seed: int) -> np.ndarray:
        """Initial rows of ``keys`` as a new float32 ``[len(keys), dim]`` array."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        out = np.empty((keys.shape[0], dim), np.float32)
        self.fill(out, np.arange(keys.shape[0], dtype=np.int64), keys, seed)
        return out

    def config(self) -> dict[str, Any]:
        """JSON-serialisable description; ``get_initializer(**config)`` rebuilds it."""
        return {"name": self.name}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Initializer) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.config().items())))


class Constant(Initializer):
    """Every column is ``value``."""

    name = "constant"

    def __init__(self, value: float = 0.0) -> None:
        self.value = float(value)

    def fill(self, out, rows, keys, seed):  # noqa: D102
        ik.init_constant(out, rows, np.float32(self.value))

    def config(self):  # noqa: D102
        return {"name": self.name, "value": self.value}


class Zeros(Constant):
    """Every column is 0."""

    name = "zeros"

    def __init__(self) -> None:
        super().__init__(0.0)

    def config(self):  # noqa: D102
        return {"name": self.name}


class Uniform(Initializer):
    """Uniform in ``[low, high)``."""

    name = "uniform"

    def __init__(self, low: float = -0.05, high: float = 0.05) -> None:
        if not high > low:
            raise ConfigError(f"Uniform(low={low}, high={high}): high must exceed low")
        self.low = float(low)
        self.high = float(high)

    def fill(self, out, rows, keys, seed):  # noqa: D102
        s = np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
        parts = _parts(keys.shape[0] * out.shape[1])
        if parts > 1:
            ik.init_uniform_parallel(out, rows, keys, s, self.low, self.high, parts)
        else:
            ik.init_uniform(out, rows, keys, s, self.low, self.high)

    def config(self):  # noqa: D102
        return {"name": self.name, "low": self.low, "high": self.high}


class Normal(Initializer):
    """Normal with ``mean`` and ``std``."""

    name = "normal"
    _truncated = False

    def __init__(self, mean: float = 0.0, std: float = 0.05) -> None:
        if not std >= 0:
            raise ConfigError(f"{type(self).__name__}(std={std}): std must be >= 0")
        self.mean = float(mean)
        self.std = float(std)

    def fill(self, out, rows, keys, seed):  # noqa: D102
        s = np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
        parts = _parts(keys.shape[0] * out.shape[1])
        if parts > 1:
            ik.init_normal_parallel(out, rows, keys, s, self.mean, self.std, self._truncated,
                                    parts)
        else:
            ik.init_normal(out, rows, keys, s, self.mean, self.std, self._truncated)

    def config(self):  # noqa: D102
        return {"name": self.name, "mean": self.mean, "std": self.std}


class TruncatedNormal(Normal):
    """Normal with ``mean`` and ``std`` truncated to ``mean +- 2 std`` by resampling."""

    name = "truncated_normal"
    _truncated = True


_REGISTRY: dict[str, type[Initializer]] = {
    "zeros": Zeros,
    "constant": Constant,
    "uniform": Uniform,
    "normal": Normal,
    "truncated_normal": TruncatedNormal,
}


def get_initializer(spec: str | Initializer | dict | None = None, **kwargs: Any) -> Initializer:
    """Resolve an initializer from a name, a config dict, an instance or ``None``.

    Parameters
    ----------
    spec
        ``"zeros"``, ``"constant"``, ``"uniform"``, ``"normal"``, ``"truncated_normal"``, a
        dict from :meth:`Initializer.config`, an :class:`Initializer`, or ``None`` for the
        default ``TruncatedNormal(std=0.05)``.
    **kwargs
        Constructor arguments (``std=``, ``low=``, ``value=``...).
    """
    if spec is None:
        return TruncatedNormal(**kwargs)
    if isinstance(spec, Initializer):
        return spec
    if isinstance(spec, dict):
        cfg = dict(spec)
        name = cfg.pop("name", None)
        return get_initializer(name, **cfg, **kwargs)
    if isinstance(spec, str):
        cls = _REGISTRY.get(spec.lower())
        if cls is None:
            raise ConfigError(
                f"unknown initializer {spec!r}; choose one of {sorted(_REGISTRY)}"
            )
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ConfigError(f"initializer {spec!r}: {e}") from None
    raise ConfigError(
        f"initializer={spec!r} is not a name, config dict or Initializer; use e.g. 'normal'"
    )
