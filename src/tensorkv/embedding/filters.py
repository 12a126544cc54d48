"""Admission filters (which new keys get a row) and eviction policies (which rows go).

:class:`CounterFilter` (exact counts) and :class:`BloomFilter` (a counting Bloom filter with
bounded memory) admit a key after ``min_count`` sightings; :class:`Eviction` combines
``steps_to_live``, ``l2_threshold`` and ``max_rows`` (LFU or LRU). Semantics, sizing and
false-positive rate: docs/internals.md ("Admission filters and eviction rules").
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np

from tensorkv.errors import ConfigError
from tensorkv.kernels import filters as fk
from tensorkv.kernels import hashindex as hk


class AdmissionFilter:
    """Base class of admission filters."""

    name = "admission"
    min_count: int

    def observe(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Count one sighting per occurrence of ``keys`` (keys without a row).

        Returns
        -------
        (admitted, counts)
            ``admitted[i]``: key ``i`` has reached ``min_count`` (at this or an earlier
            occurrence in the batch); ``counts[i]``: its (estimated) count afterwards.
        """
        raise NotImplementedError

    def peek(self, keys: np.ndarray) -> np.ndarray:
        """Current (estimated) counts of ``keys`` without counting a sighting."""
        raise NotImplementedError

    def forget(self, keys: np.ndarray) -> None:
        """Drop state held for ``keys`` (called once they are admitted); may be a no-op."""

    def clear(self) -> None:
        """Forget everything."""
        raise NotImplementedError

    def copy(self) -> AdmissionFilter:
        """Return an independent filter with the same settings and the sightings counted so far.

        A table keeps a copy of the filter it is given, so one filter object may configure
        many tables without one table's sightings admitting keys in another.
        """
        return copy.deepcopy(self)

    @property
    def nbytes(self) -> int:
        """Memory held."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """JSON-serialisable configuration; :func:`admission_from_config` rebuilds it."""
        raise NotImplementedError

    def _admitted(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        # once any occurrence of a key reaches min_count, every occurrence in the batch is
        # admitted (the key gets its row for the whole batch)
        hit = counts >= self.min_count
        if not hit.any():
            return hit
        return np.isin(keys, keys[hit])


def _check_min_count(min_count: int) -> int:
    if not isinstance(min_count, (int, np.integer)) or isinstance(min_count, bool) or \
            min_count < 1:
        raise ConfigError(f"min_count={min_count!r} must be an integer >= 1")
    return int(min_count)


class CounterFilter(AdmissionFilter):
    """Exact counting admission: a key gets a row after ``min_count`` sightings.

    Parameters
    ----------
    min_count
        Sightings needed (1 admits at first sight).
    """

    name = "counter"

    def __init__(self, min_count: int = 2) -> None:
        self.min_count = _check_min_count(min_count)
        self.clear()

    def clear(self) -> None:  # noqa: D102
        self._index = hk.new_index(1024)
        self._state = np.zeros(4, np.int64)

    def __len__(self) -> int:
        return int(self._state[0])

    def _grow(self) -> None:
        new = hk.new_index(self._index.shape[0] * 2)
        hk.index_rehash(self._index, new)
        self._index = new

    def observe(self, keys):  # noqa: D102
        counts = np.zeros(keys.shape[0], np.int64)
        while True:
            max_size = self._index.shape[0] // 2
            pos = hk.count_map_add(self._index, keys, counts, self._state, max_size)
            if pos >= keys.shape[0]:
                break
            self._grow()
        return self._admitted(keys, counts), counts

    def peek(self, keys):  # noqa: D102
        out = np.zeros(keys.shape[0], np.int64)
        hk.count_map_get(self._index, keys, out)
        return out

    def forget(self, keys):  # noqa: D102
        hk.count_map_remove(self._index, keys, self._state)

    @property
    def nbytes(self):  # noqa: D102
        return int(self._index.nbytes)

    def config(self):  # noqa: D102
        return {"name": self.name, "min_count": self.min_count}

    def __repr__(self) -> str:
        return f"CounterFilter(min_count={self.min_count})"


class BloomFilter(AdmissionFilter):
    """Counting Bloom filter admission with bounded memory.

    Parameters
    ----------
    min_count
        Sightings needed.
    capacity
        Distinct keys the filter is sized for.
    fp_rate
        Target probability that an unseen key looks admitted once ``capacity`` keys were
        counted.
    counter_bits
        Bits per counter (1..8); counters saturate at ``2**counter_bits - 1``, which must be
        at least ``min_count``.
    num_hashes
        Override ``k`` (default: the optimum for ``capacity`` and ``fp_rate``).
    seed
        Hash seed.
    """

    name = "bloom"

    def __init__(
        self,
        min_count: int = 2,
        capacity: int = 1_000_000,
        fp_rate: float = 0.01,
        counter_bits: int = 8,
        num_hashes: int | None = None,
        seed: int = 0,
    ) -> None:
        self.min_count = _check_min_count(min_count)
        if not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ConfigError(f"capacity={capacity!r} must be an integer >= 1")
        if not 0.0 < fp_rate < 1.0:
            raise ConfigError(f"fp_rate={fp_rate!r} must be strictly between 0 and 1")
        if counter_bits not in range(1, 9):
            raise ConfigError(f"counter_bits={counter_bits!r} must be 1..8")
        if (1 << counter_bits) - 1 < self.min_count:
            raise ConfigError(
                f"counter_bits={counter_bits} counts only up to {(1 << counter_bits) - 1} < "
                f"min_count={self.min_count}; raise counter_bits"
            )
        self.capacity = int(capacity)
        self.target_fp_rate = float(fp_rate)
        self.counter_bits = int(counter_bits)
        self.seed = int(seed)
        m = math.ceil(-self.capacity * math.log(fp_rate) / (math.log(2) ** 2))
        self.num_counters = max(m, 8)
        k = num_hashes if num_hashes is not None else round(
            self.num_counters / self.capacity * math.log(2))
        if int(k) < 1:
            raise ConfigError(f"num_hashes={num_hashes!r} must be >= 1")
        self.num_hashes = max(1, int(k))
        self._cap = (1 << self.counter_bits) - 1
        self.clear()

    def clear(self) -> None:  # noqa: D102
        self._counters = np.zeros(self.num_counters, np.uint8)

    def fp_rate(self, n_keys: int | None = None) -> float:
        """Expected false-positive rate after ``n_keys`` distinct keys (default: capacity).

        ``(1 - exp(-k n / m)) ** k``.
        """
        n = self.capacity if n_keys is None else n_keys
        k, m = self.num_hashes, self.num_counters
        return (1.0 - math.exp(-k * n / m)) ** k

    def observe(self, keys):  # noqa: D102
        est = np.empty(keys.shape[0], np.int64)
        fk.bloom_add(self._counters, self.num_hashes, self._cap,
                     np.uint64(self.seed & 0xFFFFFFFFFFFFFFFF), keys, est)
        return self._admitted(keys, est), est

    def peek(self, keys):  # noqa: D102
        est = np.empty(keys.shape[0], np.int64)
        fk.bloom_query(self._counters, self.num_hashes,
                       np.uint64(self.seed & 0xFFFFFFFFFFFFFFFF), keys, est)
        return est

    @property
    def nbytes(self):  # noqa: D102
        return int(self._counters.nbytes)

    def config(self):  # noqa: D102
        return {"name": self.name, "min_count": self.min_count, "capacity": self.capacity,
                "fp_rate": self.target_fp_rate, "counter_bits": self.counter_bits,
                "num_hashes": self.num_hashes, "seed": self.seed}

    def __repr__(self) -> str:
        return (f"BloomFilter(min_count={self.min_count}, capacity={self.capacity}, "
                f"fp_rate={self.target_fp_rate}, counters={self.num_counters}, "
                f"k={self.num_hashes})")


def admission_from_config(cfg: dict[str, Any] | AdmissionFilter | None) -> AdmissionFilter | None:
    """Rebuild an admission filter from :meth:`AdmissionFilter.config` (or pass one through)."""
    if cfg is None or isinstance(cfg, AdmissionFilter):
        return cfg
    if not isinstance(cfg, dict):
        raise ConfigError(
            f"admission={cfg!r} is not a filter; use CounterFilter(min_count) or BloomFilter(...)"
        )
    cfg = dict(cfg)
    name = cfg.pop("name", None)
    if name == "counter":
        return CounterFilter(**cfg)
    if name == "bloom":
        return BloomFilter(**cfg)
    raise ConfigError(f"unknown admission filter {name!r}; use 'counter' or 'bloom'")


class Eviction:
    """Which rows :meth:`EmbeddingTable.evict` removes.

    Parameters
    ----------
    steps_to_live
        Evict rows whose last update is more than this many steps before the current step.
    l2_threshold
        Evict rows whose value L2 norm is below this.
    max_rows
        After the rules above, keep at most this many rows.
    policy
        Which rows ``max_rows`` keeps: ``"lfu"`` (most frequent) or ``"lru"`` (most recently
        updated).
    every_n_steps
        Also run after every ``N``-th ``apply_gradients`` step (``step % N == 0``).
    """

    def __init__(
        self,
        *,
        steps_to_live: int | None = None,
        l2_threshold: float | None = None,
        max_rows: int | None = None,
        policy: str = "lfu",
        every_n_steps: int | None = None,
    ) -> None:
        for name, v in (("steps_to_live", steps_to_live), ("max_rows", max_rows),
                        ("every_n_steps", every_n_steps)):
            if v is not None and (not isinstance(v, (int, np.integer)) or v < (0 if name ==
                                                                              "max_rows" else 1)):
                raise ConfigError(f"{name}={v!r} must be a positive integer or None")
        if l2_threshold is not None and not l2_threshold >= 0:
            raise ConfigError(f"l2_threshold={l2_threshold!r} must be >= 0 or None")
        if policy not in ("lfu", "lru"):
            raise ConfigError(f"policy={policy!r} must be 'lfu' or 'lru'")
        self.steps_to_live = steps_to_live
        self.l2_threshold = l2_threshold
        self.max_rows = max_rows
        self.policy = policy
        self.every_n_steps = every_n_steps

    def select(self, arena, step: int) -> np.ndarray:
        """Rows of ``arena`` to evict at ``step`` (unique, any order)."""
        hw = arena.high_water
        victims = []
        if self.steps_to_live is not None:
            victims.append(fk.stale_rows(arena.live, arena.version, hw,
                                         step - self.steps_to_live))
        if self.l2_threshold is not None:
            if getattr(arena, "raw", False):  # 16-bit storage: norms of float32 copies
                for start in range(0, hw, 1 << 20):
                    rows = start + np.flatnonzero(arena.live[start:start + (1 << 20)])
                    norms = np.linalg.norm(arena.gather_f32(rows), axis=1)
                    victims.append(rows[norms < self.l2_threshold])
            else:
                victims.append(fk.small_norm_rows(arena.live, arena.values, hw,
                                                  float(self.l2_threshold)))
        gone = np.unique(np.concatenate(victims)) if victims else np.empty(0, np.int64)
        if self.max_rows is not None and len(arena) - gone.size > self.max_rows:
            live = np.flatnonzero(arena.live[:hw]).astype(np.int64)
            if gone.size:
                live = np.setdiff1d(live, gone, assume_unique=True)
            n_evict = live.size - self.max_rows
            freq, ver, key = arena.freq[live], arena.version[live], arena.row_key[live]
            # np.lexsort: last key is primary; ascending = evicted first
            order = np.lexsort((key, ver, freq) if self.policy == "lfu" else (key, freq, ver))
            gone = np.concatenate([gone, live[order[:n_evict]]])
        return gone

    def config(self) -> dict[str, Any]:
        """JSON-serialisable configuration."""
        return {"steps_to_live": self.steps_to_live, "l2_threshold": self.l2_threshold,
                "max_rows": self.max_rows, "policy": self.policy,
                "every_n_steps": self.every_n_steps}

    @classmethod
    def from_config(cls, cfg: dict[str, Any] | Eviction | None) -> Eviction | None:
        """Rebuild from :meth:`config` (or pass an instance / None through)."""
        if cfg is None or isinstance(cfg, Eviction):
            return cfg
        if not isinstance(cfg, dict):
            raise ConfigError(f"eviction={cfg!r} is not an Eviction or its config dict")
        return cls(**cfg)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if v is not None)
        return f"Eviction({args})"
