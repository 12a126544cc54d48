"""EmbeddingTable: a single-process dynamic embedding table.

No fixed vocabulary: a row appears the first time its key is looked up (subject to an admission
filter), trains with a sparse optimizer, and may be evicted. Row storage is a
:class:`~tensorkv.embedding.arena.RowArena` (hash index + contiguous rows); this module adds the
table logic on top: key normalisation, initialisation, optimizer calls, admission, eviction,
statistics, export/import and locking.

Concurrency
-----------
A readers-writer lock guards the arena. Lookups of keys that are all present run under the
shared lock, so several threads gather in parallel (the numba kernels release the GIL);
inserts, gradient updates, removals, imports and evictions take the exclusive lock. Frequency
counters and hit/miss statistics bumped by concurrent lookups are serialised by a small
separate mutex, so they stay exact.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from tensorkv.embedding.arena import STORAGE_DTYPES, RowArena
from tensorkv.embedding.filters import AdmissionFilter, Eviction, admission_from_config
from tensorkv.embedding.initializers import Initializer, get_initializer
from tensorkv.embedding.keys import as_int64_keys
from tensorkv.embedding.optimizers import get_optimizer
from tensorkv.errors import ConfigError, NonFiniteGradientError, ShapeError
from tensorkv.kernels import arena as ak
from tensorkv.pages import FreshPages

META_FORMAT = 1


class ExportChunk(NamedTuple):
    """Rows exported from a table (see :meth:`EmbeddingTable.export`)."""

    keys: np.ndarray  #: int64 [m]
    values: np.ndarray  #: [m, dim] in the storage dtype (float32, float16 or bfloat16)
    slots: np.ndarray  #: float32 [m, num_slots * dim]
    freq: np.ndarray  #: int64 [m]
    version: np.ndarray  #: int64 [m], last-update step
    seq: np.ndarray  #: int64 [m], mutation sequence of the row's last change


class RWLock:
    """A writer-preferring readers-writer lock."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextmanager
    def read(self) -> Iterator[None]:
        """Shared section."""
        with self._cond:
            while self._writer or self._waiting_writers:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        """Exclusive section."""
        with self._cond:
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class _Scratch(threading.local):
    """Per-thread scratch arrays for :meth:`EmbeddingTable.apply_gradients`.

    The summed-gradient buffers are reused across calls; each thread has its own set.
    """

    def __init__(self) -> None:
        self.n = -1
        self.dim = -1

    def dedup_buffers(self, n: int, dim: int) -> tuple[np.ndarray, ...]:
        if n > self.n or dim != self.dim:
            cap = max(n, 1024)
            self.uniq = np.empty(cap, np.int64)
            self.sums = np.empty((cap, dim), np.float32)
            self.bad = np.empty(cap, np.bool_)
            self.tab = np.empty((ak.dedup_table_size(cap), 2), np.int64)
            self.pos = np.empty(cap, np.int64)
            self.n, self.dim = cap, dim
        size = ak.dedup_table_size(n)
        return (self.uniq[:n], self.sums[:n], self.bad[:n], self.tab[:size], self.pos[:n])

    def row_slots(self, capacity: int) -> np.ndarray:
        """An ``int64[>= capacity]`` array of ``-1``: the row map of ``dedup_rows``.

        The kernel leaves it all ``-1`` again, so it is reused as it is.
        """
        first = getattr(self, "first", None)
        if first is None or first.shape[0] < capacity:
            first = self.first = np.full(max(capacity, 1024), -1, np.int64)
        return first


_STAT_NAMES = ("hits", "misses", "inserts", "collisions", "evictions", "admissions_rejected",
               "gradients_dropped", "nonfinite_skipped", "removed")


class EmbeddingTable:
    """A dynamic embedding table: int64 (or hashed str/bytes) keys -> float32 rows of ``dim``.

    Parameters
    ----------
    dim
        Row width (> 0).
    dtype
        Storage dtype of value rows: ``"float32"`` (default), ``"float16"`` or ``"bfloat16"``.
        Lookups always return float32; optimizer slots stay float32; updates are computed in
        float32 and rounded to the storage dtype (round to nearest even).
    initializer
        Initial value of a new key: an :class:`Initializer`, a name (``"normal"``...) or a
        config dict; default ``TruncatedNormal(std=0.05)``. A pure function of
        (``seed``, key, column).
    optimizer
        A sparse optimizer from :mod:`tensorkv.embedding.optimizers`, a name or a config;
        default SGD(lr=0.01).
    admission
        ``None`` (every key admitted), :class:`CounterFilter` or :class:`BloomFilter`.
    eviction
        ``None`` or an :class:`Eviction` policy.
    capacity
        Initial row capacity; with ``growth=False`` the most rows the table may hold.
    seed
        Seed of the initializer.
    default_value
        Value returned for keys without a row (``lookup(insert=False)`` of unseen keys,
        keys not yet admitted): ``None`` -> the key's initial value, a float, or a ``[dim]``
        vector.
    nan_policy
        ``"raise"``: gradients with NaN/Inf raise :class:`NonFiniteGradientError` and change
        nothing; ``"skip"``: the keys with non-finite gradients are left unchanged and counted.
    growth
        Whether the table may grow past ``capacity``.
    storage
        Multi-tier storage: a :class:`~tensorkv.embedding.storage.StorageOption` or a storage
        type name (``"DRAM_SSDHASH"``, ``"DRAM_LEVELDB"``, ``"HBM_DRAM"``...). The table is then
        a :class:`~tensorkv.embedding.tiered_table.TieredEmbeddingTable`: hot rows in DRAM (or
        HBM), the rest in lower tiers, bit-identical training (docs/tiers.md, "Tier chains").
    storage_path, storage_size, cache_strategy
        With a storage type name: the tiers' directory (or URL), their sizes in bytes, and
        ``"lfu"`` / ``"lru"``.

    Examples
    --------
    >>> import numpy as np
    >>> from tensorkv import EmbeddingTable, Adagrad
    >>> table = EmbeddingTable(8, optimizer=Adagrad(lr=0.05), initializer="normal", seed=1)
    >>> rows = table.lookup(np.array([3, 7, 3]))        # inserts 3 and 7
    >>> rows.shape, len(table)
    ((3, 8), 2)
    >>> table.apply_gradients(np.array([3, 7, 3]), np.ones((3, 8)))  # key 3's grads summed
    2
    >>> int(table.frequency(np.array([3]))[0])
    2
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> EmbeddingTable:
        """``EmbeddingTable(..., storage=...)`` builds a tiered table (see ``tiered_table``)."""
        if cls is EmbeddingTable and kwargs.get("storage") is not None:
            from tensorkv.embedding.tiered_table import TieredEmbeddingTable

            return super().__new__(TieredEmbeddingTable)
        return super().__new__(cls)

    def __init__(
        self,
        dim: int,
        *,
        dtype: str = "float32",
        initializer: Initializer | str | dict | None = None,
        optimizer: Any = None,
        admission: AdmissionFilter | dict | None = None,
        eviction: Eviction | dict | None = None,
        capacity: int | None = None,
        seed: int = 0,
        default_value: float | Sequence[float] | np.ndarray | None = None,
        nan_policy: str = "raise",
        growth: bool = True,
        storage: Any = None,
        storage_path: Any = None,
        storage_size: Any = None,
        cache_strategy: str | None = None,
    ) -> None:
        if storage is not None or storage_path is not None or storage_size is not None or \
                cache_strategy is not None:
            from tensorkv.embedding.tiered_table import resolve_storage

            resolve_storage(storage, storage_path, storage_size, cache_strategy)  # raises
            raise ConfigError(  # pragma: no cover - __new__ builds a TieredEmbeddingTable
                "storage options need the tiered table; create it with EmbeddingTable(..., "
                "storage=...)"
            )
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim <= 0:
            raise ShapeError(f"dim={dim!r} must be a positive integer, e.g. dim=64")
        self.dim = int(dim)
        dtype_name = getattr(dtype, "__name__", None) or str(dtype)
        if dtype_name not in STORAGE_DTYPES:
            raise ConfigError(
                f"dtype={dtype!r} is not a storage dtype; use one of {list(STORAGE_DTYPES)}"
            )
        self.dtype = dtype_name
        if nan_policy not in ("raise", "skip"):
            raise ConfigError(f"nan_policy={nan_policy!r} must be 'raise' or 'skip'")
        self.nan_policy = nan_policy
        if capacity is not None and (isinstance(capacity, bool) or
                                     not isinstance(capacity, (int, np.integer)) or capacity < 1):
            raise ConfigError(f"capacity={capacity!r} must be a positive integer or None")
        if not growth and capacity is None:
            raise ConfigError("growth=False needs capacity=N, the most rows the table may hold")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ConfigError(f"seed={seed!r} must be an integer")
        self.seed = int(seed)
        self.initializer = get_initializer(initializer)
        self.optimizer = get_optimizer(optimizer)
        self.admission = admission_from_config(admission)
        self.eviction = Eviction.from_config(eviction)
        self.capacity_limit = None if capacity is None else int(capacity)
        self.growth = bool(growth)
        self._default = self._check_default(default_value)
        self._slot_init = np.asarray(self.optimizer.slot_initial_values(), np.float32)
        self.num_slots = len(self.optimizer.slot_names())
        self._arena = RowArena(self.dim, self.num_slots * self.dim, capacity=capacity,
                               growth=growth, dtype=self.dtype)
        self._lock = RWLock()
        self._meta_lock = threading.Lock()
        self._step = 0
        self._mseq = 0
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        self._scratch = _Scratch()

    # --- input normalisation ------------------------------------------------------------------
    def _check_default(self, default):
        if default is None:
            return None
        arr = np.asarray(default, dtype=np.float32)
        if arr.ndim == 0:
            arr = np.full(self.dim, float(arr), np.float32)
        if arr.shape != (self.dim,):
            raise ShapeError(
                f"default_value has shape {arr.shape}; give a float or a vector of dim={self.dim}"
            )
        return arr

    def _as_keys(self, keys: Any) -> np.ndarray:
        """Normalise keys to a 1-D C-contiguous int64 array (hashing str/bytes keys)."""
        k, collisions = as_int64_keys(keys)
        if collisions:
            with self._meta_lock:
                self._stats["collisions"] += collisions
        return k

    def _as_grads(self, grads: Any, n: int) -> np.ndarray:
        g = np.asarray(grads)
        if g.dtype.kind != "f":
            raise ShapeError(
                f"gradients have dtype {g.dtype}; pass a float array of shape ({n}, {self.dim})"
            )
        if g.shape != (n, self.dim):
            raise ShapeError(
                f"gradients have shape {g.shape} but {n} keys of dim={self.dim} need shape "
                f"({n}, {self.dim})"
            )
        return np.ascontiguousarray(g, dtype=np.float32)

    def _initial(self, keys: np.ndarray) -> np.ndarray:
        if self._default is not None:
            return np.broadcast_to(self._default, (keys.shape[0], self.dim))
        return self.initializer.values(keys, self.dim, self.seed)

    def _init_rows(self, rows: np.ndarray, keys: np.ndarray) -> None:
        a = self._arena
        if a.raw:
            a.scatter(rows, self.initializer.values(keys, self.dim, self.seed))
        else:
            self.initializer.fill(a.values, rows, keys, self.seed)
        if self.num_slots:
            ak.fill_slots(a.slots, rows, self._slot_init, self.dim)
        a.freq[rows] = 0

    def _check_room(self, keys: np.ndarray) -> None:
        if not self.growth:
            a = self._arena
            missing = keys[a.find(keys) < 0]
            n_new = np.unique(missing).size if missing.size else 0
            a.check_room(n_new)

    # --- lookups -------------------------------------------------------------------------------
    def lookup(self, keys: Any, insert: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``keys`` as a float32 ``[n, dim]`` array.

        Parameters
        ----------
        keys
            1-D int64 array (any int dtype) or a sequence of str/bytes.
        insert
            Insert unseen keys (subject to admission) with their initial value and count a
            sighting of every key. ``False``: unseen keys read as their initial value (or
            ``default_value``); nothing is inserted or counted.
        out
            Optional float32 C-contiguous ``[n, dim]`` array to write the rows into (reusing
            one buffer across calls saves allocating, and page-faulting, a new result).
        """
        return self._lookup(self._as_keys(keys), insert, out)

    def prefetch(self, keys: Any) -> None:
        """Announce the next batch's keys; a no-op for a DRAM-only table.

        A tiered table (``storage=...``) starts moving their rows up from the lower tiers
        in the background, so the next :meth:`lookup` of them finds them in tier 0. Calling
        it in every table's training loop is harmless: values never depend on it.

        Parameters
        ----------
        keys
            The keys of the batch after the current one (1-D int64 array or str/bytes).
        """
        self._as_keys(keys)

    def _lookup_buffer(self, n: int, out: np.ndarray | None) -> np.ndarray:
        """Validate ``out`` and return the buffer rows are gathered into (storage dtype)."""
        if out is not None and (not isinstance(out, np.ndarray) or out.dtype != np.float32
                                or out.shape != (n, self.dim) or not out.flags.c_contiguous
                                or not out.flags.writeable):
            raise ShapeError(
                f"out must be a writeable C-contiguous float32 array of shape ({n}, {self.dim}); "
                f"got {getattr(out, 'dtype', type(out).__name__)} "
                f"{getattr(out, 'shape', '')}"
            )
        if out is not None and not self._arena.raw:
            return out
        # 16-bit rows as raw bits; no assumption that tier 0 is a numpy array
        return np.empty((n, self.dim), np.uint16 if self._arena.raw else np.float32)

    def _lookup(self, k: np.ndarray, insert: bool, out: np.ndarray | None,
                rows: np.ndarray | None = None, raw: np.ndarray | None = None) -> np.ndarray:
        """:meth:`lookup` of validated keys.

        A tiered table passes what its promotion step found (under the same operation lock,
        with no change to the index since), so the index is not probed twice: ``rows``, every
        key's tier-0 row, and optionally ``raw``, the buffer from :meth:`_lookup_buffer` with
        the values of those rows already in it.
        """
        n = k.shape[0]
        a = self._arena
        gathered = raw is not None
        if raw is None:
            raw = self._lookup_buffer(n, out)
        with self._lock.read():
            if rows is None:
                rows, misses = a.find_gather(k, raw)
            else:
                if not gathered:
                    a.gather(rows, raw)
                misses = int(np.count_nonzero(rows < 0))
            if misses == 0 and insert:
                with self._meta_lock:
                    self._mseq += 1
                    self._meta_write(ak.bump_freq, a.freq, a.seq, rows, self._mseq)
                    self._stats["hits"] += n
                return self._result(raw, out)
        if not insert:
            with self._meta_lock:
                self._stats["hits"] += n - misses
                self._stats["misses"] += misses
            if misses:
                pos = np.flatnonzero(rows < 0)
                raw[pos] = a.to_raw(self._initial(k[pos]))
            return self._result(raw, out)
        with self._lock.write():
            self._insert_missing(k, raw, np.flatnonzero(rows < 0))
        return self._result(raw, out)

    def _meta_write(self, kernel: Any, *args: Any) -> None:
        """Run a metadata kernel of a batch (``bump_freq`` of a lookup, ``set_meta`` of an update).

        A tiered table may hold it and run it later, before anything reads or changes tier 0
        again.
        """
        kernel(*args)

    def _result(self, raw: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        if raw is out:
            return out
        f32 = self._arena.from_raw(raw)
        if out is None:
            return f32
        np.copyto(out, f32)
        return out

    def _insert_missing(self, k: np.ndarray, out: np.ndarray, missed: np.ndarray) -> None:
        """Write-locked slow path of :meth:`lookup`: insert/admit the missing keys.

        ``missed``: positions not found by the shared-lock pass; another writer may have
        inserted some of them since, so they are all read again here.
        """
        a = self._arena
        rows = a.find(k)
        miss = np.flatnonzero(rows < 0)
        n_hits, n_misses = k.shape[0] - miss.size, miss.size
        mk = k[miss]
        if not self.growth and self.admission is None:
            a.check_room(np.unique(mk).size)  # before anything changes
        prior = None
        if self.admission is not None:
            prior = self.admission.peek(mk)
            admitted, _ = self.admission.observe(mk)
            rejected = miss[~admitted]
            self._stats["admissions_rejected"] += rejected.size
            miss, mk, prior = miss[admitted], mk[admitted], prior[admitted]
        else:
            rejected = miss[:0]
        if mk.size:
            if not self.growth:
                a.check_room(np.unique(mk).size)
            new_rows, is_new = a.insert(mk)
            fresh = new_rows[is_new]
            self._init_rows(fresh, mk[is_new])
            self._mseq += 1
            ak.set_meta(a.version, a.seq, fresh, self._step, self._mseq)
            self._stats["inserts"] += fresh.size
            rows[miss] = new_rows
            if prior is not None:
                uk, first = np.unique(mk, return_index=True)
                a.freq[new_rows[first]] += prior[first]
                self.admission.forget(uk)
        out[missed] = a.gather(rows[missed])
        if rejected.size:
            out[rejected] = a.to_raw(self._initial(k[rejected]))
        with self._meta_lock:
            self._mseq += 1
            ak.bump_freq(a.freq, a.seq, rows, self._mseq)
            self._stats["hits"] += n_hits
            self._stats["misses"] += n_misses

    def __getitem__(self, keys: Any) -> np.ndarray:
        """``table[keys]`` is ``lookup(keys, insert=False)``."""
        return self.lookup(keys, insert=False)

    def contains(self, keys: Any) -> np.ndarray:
        """Boolean array saying whether each key has a row."""
        k = self._as_keys(keys)
        with self._lock.read():
            return self._arena.find(k) >= 0

    def __contains__(self, key: Any) -> bool:
        return bool(self.contains([key])[0])

    def __len__(self) -> int:
        return len(self._arena)

    def keys(self) -> np.ndarray:
        """All keys with a row (int64, row order)."""
        with self._lock.read():
            return self._arena.keys()

    def frequency(self, keys: Any) -> np.ndarray:
        """Lookup count of each key (0 for keys without a row)."""
        return self._meta_of(keys, "freq", 0)

    def version(self, keys: Any) -> np.ndarray:
        """Last-update step of each key (-1 for keys without a row)."""
        return self._meta_of(keys, "version", -1)

    def _meta_of(self, keys: Any, name: str, missing: int) -> np.ndarray:
        k = self._as_keys(keys)
        with self._lock.read():
            rows = self._arena.find(k)
            out = getattr(self._arena, name)[np.maximum(rows, 0)].copy()
        out[rows < 0] = missing
        return out

    # --- updates -------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The table's step: the last ``apply_gradients`` step."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        """Set the step, e.g. when restoring a checkpoint into an existing table."""
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ConfigError(f"step={value!r} must be a non-negative integer")
        with self._lock.write():
            self._step = int(value)

    def reserve(self, n_keys: int) -> None:
        """Allocate room for ``n_keys`` rows in total now, so inserting them does not regrow.

        Loading a checkpoint of known size calls this first: one allocation instead of a
        series of doublings and rehashes.
        """
        if isinstance(n_keys, bool) or not isinstance(n_keys, (int, np.integer)) or n_keys < 0:
            raise ConfigError(f"n_keys={n_keys!r} must be a non-negative integer")
        with self._lock.write():
            self._arena.check_room(max(0, int(n_keys) - len(self._arena)))
            self._arena.reserve(int(n_keys))

    @property
    def mutation_seq(self) -> int:
        """Counter bumped by every mutating call; rows remember the value of their last change."""
        return self._mseq

    def apply_gradients(self, keys: Any, grads: Any, step: int | None = None) -> int:
        """Apply one sparse optimizer step to the rows of ``keys``.

        Gradients of duplicate keys are summed first (IndexedSlices semantics); only the
        given rows change. Keys without a row are inserted first (with their initial value)
        unless an admission filter is set, in which case their gradients are dropped.

        Parameters
        ----------
        keys
            ``n`` keys (duplicates allowed).
        grads
            float ``[n, dim]`` gradients.
        step
            The step of this update (for lr schedules and ``version``); default: the
            table's step + 1.

        Returns
        -------
        int
            Number of rows updated.
        """
        k = self._as_keys(keys)
        g = self._as_grads(grads, k.shape[0])
        if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
            raise ConfigError(f"step={step!r} must be an integer or None")
        return self._apply(k, g, step)

    def _apply(self, k: np.ndarray, g: np.ndarray, step: int | None,
               rows: np.ndarray | None = None) -> int:
        """:meth:`apply_gradients` of validated input; ``rows``: every key's row, if known.

        A tiered table passes the rows of a batch it has just looked up (all present, under
        the same operation lock): duplicates are then summed by row, without hashing keys,
        and the index is not probed again.
        """
        uniq, sums, bad, tab, pos = self._scratch.dedup_buffers(k.shape[0], self.dim)
        urows = None
        if rows is None:
            u = ak.dedup_sum(k, g, uniq, sums, bad, tab, pos)  # pure: runs outside the lock
            uniq, sums, bad = uniq[:u], sums[:u], bad[:u]
        else:
            first = self._scratch.row_slots(self._arena.capacity)
            u = ak.dedup_rows(rows, g, uniq, sums, bad, first, pos)
            urows = uniq[:u].copy()
            uniq, sums, bad = self._arena.row_key[urows], sums[:u], bad[:u]
        n_skip = 0
        if bad.any():
            bad_keys = uniq[bad]
            if self.nan_policy == "raise":
                raise NonFiniteGradientError(
                    f"gradients for {bad_keys.size} keys hold NaN or Inf (keys "
                    f"{np.sort(bad_keys)[:8].tolist()}{' ...' if bad_keys.size > 8 else ''}); "
                    "the table is unchanged. Fix the loss, clip gradients, or create the table "
                    "with nan_policy='skip' to skip such keys"
                )
            keep = ~bad
            uniq, sums = uniq[keep], np.ascontiguousarray(sums[keep])
            if urows is not None:
                urows = urows[keep]
            n_skip = bad_keys.size
        a = self._arena
        with self._lock.write():
            rows = a.find(uniq) if urows is None else urows
            miss = np.flatnonzero(rows < 0)
            if miss.size:
                if self.admission is not None:
                    self._stats["gradients_dropped"] += miss.size
                    keep = rows >= 0
                    rows, sums = rows[keep], np.ascontiguousarray(sums[keep])
                else:
                    mk = uniq[miss]
                    a.check_room(mk.size)
                    new_rows, is_new = a.insert(mk)
                    self._init_rows(new_rows, mk)
                    self._stats["inserts"] += mk.size
                    rows[miss] = new_rows
            self._step = self._step + 1 if step is None else int(step)
            self._stats["nonfinite_skipped"] += n_skip
            if rows.size and a.raw:
                # 16-bit rows: update float32 copies, then round back into storage
                vals, slots = a.gather_f32(rows), a.gather_slots(rows)
                self.optimizer.apply(vals, slots, np.arange(rows.size, dtype=np.int64), sums,
                                     self._step)
                a.scatter(rows, vals)
                a.scatter_slots(rows, slots)
            elif rows.size:
                self._apply_rows(rows, sums)
            self._mseq += 1
            self._meta_write(ak.set_meta, a.version, a.seq, rows, self._step, self._mseq)
            ev = self.eviction
            if ev is not None and ev.every_n_steps and self._step % ev.every_n_steps == 0:
                self._evict_locked()
        return int(rows.size)

    def _apply_rows(self, rows: np.ndarray, sums: np.ndarray) -> None:
        """Run the optimizer on tier-0 ``rows`` (write-locked; overridden for device rows)."""
        a = self._arena
        self.optimizer.apply(a.values, a.slots, rows, sums, self._step)

    def upsert(self, keys: Any, values: Any) -> None:
        """Set the values of ``keys`` (inserting absent ones; a later duplicate wins).

        New rows get initial optimizer slots; existing rows keep theirs.
        """
        k = self._as_keys(keys)
        v = np.asarray(values)
        if v.dtype.kind != "f" or v.shape != (k.shape[0], self.dim):
            raise ShapeError(
                f"values have shape {v.shape} and dtype {v.dtype}; {k.shape[0]} keys need a "
                f"float array of shape ({k.shape[0]}, {self.dim})"
            )
        v = np.ascontiguousarray(v, dtype=np.float32)
        if k.shape[0] == 0:
            return
        a = self._arena
        with self._lock.write():
            if not self.growth:
                self._check_room(k)
            rows, is_new = a.insert(k)
            self._init_rows(rows[is_new], k[is_new])
            self._stats["inserts"] += int(is_new.sum())
            a.scatter(rows, v)
            self._mseq += 1
            ak.set_meta(a.version, a.seq, rows, self._step, self._mseq)

    def remove(self, keys: Any) -> int:
        """Remove keys (absent ones ignored); returns how many rows were removed."""
        k = self._as_keys(keys)
        with self._lock.write():
            rows = self._arena.remove(k)
            n = int((rows >= 0).sum())
            if n:
                self._mseq += 1
                self._stats["removed"] += n
        return n

    def clear(self) -> None:
        """Remove every row (and the admission filter's counts)."""
        with self._lock.write():
            self._arena.clear()
            if self.admission is not None:
                self.admission.clear()
            self._mseq += 1

    def evict(self) -> int:
        """Apply the eviction policy now; returns how many rows were evicted."""
        with self._lock.write():
            return self._evict_locked()

    def _evict_locked(self) -> int:
        if self.eviction is None:
            return 0
        a = self._arena
        rows = self.eviction.select(a, self._step)
        if rows.size == 0:
            return 0
        removed = a.remove(a.row_key[rows].copy())
        n = int((removed >= 0).sum())
        self._mseq += 1
        self._stats["evictions"] += n
        return n

    # --- export / import ---------------------------------------------------------------------
    def export(self, chunk_rows: int = 65536, since: int | None = None) -> Iterator[ExportChunk]:
        """Yield the rows (keys, values, slots, freq, version, seq) in chunks.

        Parameters
        ----------
        chunk_rows
            Most rows per chunk.
        since
            Only rows changed after this :attr:`mutation_seq` (incremental checkpoints).

        Each chunk is copied under the shared lock; a writer running between chunks may make
        the export a mix of before/after states, so pause training for a snapshot.
        """
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, (int, np.integer)) or \
                chunk_rows < 1:
            raise ConfigError(f"chunk_rows={chunk_rows!r} must be a positive integer")
        s = -1 if since is None else int(since)
        with self._lock.read():
            hw = self._arena.high_water
            rows_all = ak.live_rows(self._arena.live, self._arena.seq, 0, hw, s)
        for start in range(0, rows_all.shape[0], chunk_rows):
            rows = rows_all[start:start + chunk_rows]
            with self._lock.read():
                a = self._arena
                rows = rows[a.live[rows].view(np.bool_)]
                if rows.size == 0:
                    continue
                chunk = ExportChunk(
                    a.row_key[rows], a.gather(rows).view(a.np_dtype), a.gather_slots(rows),
                    a.freq[rows], a.version[rows], a.seq[rows],
                )
            yield chunk

    def export_into(
        self,
        place: Callable[
            [np.ndarray, tuple[tuple[np.dtype, tuple[int, ...]], ...]],
            Sequence[tuple[np.ndarray, Sequence[np.ndarray]]],
        ],
        chunk_rows: int = 65536,
        since: int | None = None,
    ) -> Iterator[int]:
        """Export rows straight into buffers the caller chooses (no intermediate chunk copy).

        Parameters
        ----------
        place
            Called once per chunk (the rows one :meth:`export` chunk would hold) as
            ``place(keys, fields)``: ``keys`` are the chunk's keys (int64) and ``fields`` the
            ``(dtype, row shape)`` of keys, values, slots, freq and version. It returns groups
            ``(index, outs)``: ``index`` (int64) selects rows of the chunk by position in
            ``keys`` and ``outs`` are five C-contiguous arrays of ``len(index)`` rows with those
            dtypes and row shapes, which are filled with the selected rows' keys, values,
            slots, freq and version.
        chunk_rows
            Most rows per chunk.
        since
            Only rows changed after this :attr:`mutation_seq` (incremental checkpoints).

        Yields
        ------
        int
            The number of rows in the chunk, once its groups are filled.

        Notes
        -----
        Rows are gathered from the row arena into ``outs`` under the shared lock, the same
        snapshot semantics as :meth:`export`. Subclasses that override :meth:`export` (tiered
        tables) and arenas that keep rows off the host are served from :meth:`export`'s chunks.
        """
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, (int, np.integer)) or \
                chunk_rows < 1:
            raise ConfigError(f"chunk_rows={chunk_rows!r} must be a positive integer")
        arena_t = type(self._arena)
        direct = (
            type(self).export is EmbeddingTable.export
            and arena_t.gather is RowArena.gather
            and arena_t.gather_slots is RowArena.gather_slots
        )
        if not direct:
            for ch in self.export(chunk_rows, since):
                arrays = [np.asarray(x) for x in tuple(ch)[:5]]
                if arrays[0].shape[0] == 0:
                    continue
                specs = tuple((x.dtype, tuple(x.shape[1:])) for x in arrays)
                for idx, outs in place(arrays[0], specs):
                    for src, out in zip(arrays, outs, strict=True):
                        np.take(src, idx, axis=0, out=out)
                yield int(arrays[0].shape[0])
            return
        s = -1 if since is None else int(since)
        with self._lock.read():
            hw = self._arena.high_water
            rows_all = ak.live_rows(self._arena.live, self._arena.seq, 0, hw, s)
        for start in range(0, rows_all.shape[0], chunk_rows):
            rows = rows_all[start:start + chunk_rows]
            with self._lock.read():
                a = self._arena
                rows = rows[a.live[rows].view(np.bool_)]
                if rows.size == 0:
                    continue
                keys = a.row_key[rows]
                fields = (
                    (keys.dtype, ()),
                    (a.np_dtype, (a.dim,)),
                    (np.dtype(np.float32), (a.slot_width,)),
                    (a.freq.dtype, ()),
                    (a.version.dtype, ()),
                )
                for idx, outs in place(keys, fields):
                    r = rows[idx]
                    np.take(keys, idx, out=outs[0])
                    if r.size and a.dim:
                        ak.gather_rows(a.values, r, outs[1].view(a.values.dtype))
                    if r.size and a.slot_width:
                        ak.gather_rows(a.slots, r, outs[2])
                    np.take(a.freq, r, out=outs[3])
                    np.take(a.version, r, out=outs[4])
            yield int(rows.size)

    def import_(self, chunks: Iterable[Any]) -> int:
        """Upsert exported rows exactly (values, slots, freq, version); returns rows written.

        ``chunks`` is an iterable of :class:`ExportChunk` or tuples
        ``(keys, values, slots, freq, version[, seq])``. Each chunk is checked before it is
        applied; a bad chunk raises :class:`ShapeError` and leaves the table as it was after
        the previous chunk.
        """
        total = 0
        if isinstance(chunks, tuple) and len(chunks) >= 5 and isinstance(chunks[0], np.ndarray):
            chunks = [chunks]
        for ch in chunks:
            keys, values, slots, freq, version = self._check_chunk(ch)
            a = self._arena
            with self._lock.write():
                if not self.growth:
                    self._check_room(keys)
                rows, is_new = a.insert(keys)
                a.scatter(rows, values)
                if self.num_slots:
                    a.scatter_slots(rows, slots)
                a.freq[rows] = freq
                a.version[rows] = version
                self._mseq += 1
                a.seq[rows] = self._mseq
            total += keys.shape[0]
        return total

    def _check_chunk(self, ch: Any) -> tuple[np.ndarray, ...]:
        keys, values, slots, freq, version = _chunk_fields(ch, "import_")
        keys = self._as_keys(keys)
        m = keys.shape[0]
        values = np.asarray(values)
        if values.ndim != 2 or values.shape[1] != self.dim:
            raise ShapeError(
                f"imported values have shape {values.shape} (dim {values.shape[-1]}) but the "
                f"table has dim={self.dim}; import into a table with dim="
                f"{values.shape[-1] if values.ndim else '?'}"
            )
        if values.shape[0] != m:
            raise ShapeError(f"imported chunk has {m} keys but {values.shape[0]} value rows")
        sw = self.num_slots * self.dim
        slots = np.asarray(slots, dtype=np.float32)
        if slots.size == 0 and sw == 0:
            slots = np.zeros((m, 0), np.float32)
        if slots.shape != (m, sw):
            raise ShapeError(
                f"imported slots have shape {slots.shape} but this table's optimizer "
                f"{self.optimizer.name!r} needs ({m}, {sw}); import with the same optimizer"
            )
        freq = np.asarray(freq, dtype=np.int64).reshape(-1)
        version = np.asarray(version, dtype=np.int64).reshape(-1)
        if freq.shape[0] != m or version.shape[0] != m:
            raise ShapeError(
                f"imported chunk has {m} keys but {freq.shape[0]} freq and "
                f"{version.shape[0]} version entries"
            )
        return (keys, np.ascontiguousarray(values, dtype=np.float32),
                np.ascontiguousarray(slots), freq, version)

    @property
    def can_bulk_import(self) -> bool:
        """Whether :meth:`bulk_import` serves this table.

        It does for tables whose rows live in a host row arena and that keep
        :meth:`import_`; tiered tables and tables with rows off the host import with
        :meth:`import_`.
        """
        return type(self).import_ is EmbeddingTable.import_ and type(self._arena) is RowArena

    def bulk_import(self, positions: int) -> BulkImport:
        """Start building this table's new content from rows at known positions.

        The fast path of a restore: every row is copied once, straight to its final place in
        a new row arena, and the hash index is built in bulk. The table itself is untouched
        until :meth:`BulkImport.commit`, which replaces all its rows (values, slots, freq,
        version) with the imported ones; a :class:`BulkImport` dropped without a commit
        leaves it as it was.

        Parameters
        ----------
        positions
            Row positions to reserve: the rows to be imported, counting duplicates and rows
            left out later (positions nobody fills become free rows).

        Returns
        -------
        BulkImport
            ``put`` rows at positions (from several threads at once, disjoint ranges), then
            ``index`` those ranges in order (one thread), ``remove`` keys between ranges,
            and ``commit``.

        Raises
        ------
        TypeError
            When :attr:`can_bulk_import` is false (use :meth:`import_`).
        """
        if not self.can_bulk_import:
            raise TypeError(
                f"{type(self).__name__} keeps rows that bulk_import cannot build; use import_"
            )
        if isinstance(positions, bool) or not isinstance(positions, (int, np.integer)) or \
                positions < 0:
            raise ConfigError(f"positions={positions!r} must be a non-negative integer")
        return BulkImport(self, int(positions))

    # --- metadata -------------------------------------------------------------------------------
    def state_dict_meta(self) -> dict[str, Any]:
        """JSON-serialisable description, enough for :meth:`from_meta` to rebuild an empty twin."""
        return {
            "format": META_FORMAT,
            "dim": self.dim,
            "dtype": self.dtype,
            "initializer": self.initializer.config(),
            "optimizer": {"config": self.optimizer.config(), "state": self.optimizer.state()},
            "seed": self.seed,
            "step": self._step,
            "mutation_seq": self._mseq,
            "admission": None if self.admission is None else self.admission.config(),
            "eviction": None if self.eviction is None else self.eviction.config(),
            "default_value": None if self._default is None else self._default.tolist(),
            "nan_policy": self.nan_policy,
            "capacity": self.capacity_limit,
            "growth": self.growth,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> EmbeddingTable:
        """Build an empty table from :meth:`state_dict_meta` (step and optimizer state too)."""
        if not isinstance(meta, dict) or "dim" not in meta:
            raise ConfigError("from_meta needs the dict returned by state_dict_meta()")
        if meta.get("format", META_FORMAT) > META_FORMAT:
            raise ConfigError(
                f"table meta format {meta['format']} is newer than this tensorkv "
                f"({META_FORMAT}); upgrade tensorkv"
            )
        opt = meta.get("optimizer") or {}
        table = cls(
            meta["dim"], dtype=meta.get("dtype", "float32"), initializer=meta.get("initializer"),
            optimizer=opt.get("config"), admission=meta.get("admission"),
            eviction=meta.get("eviction"), capacity=meta.get("capacity"), seed=meta.get("seed", 0),
            default_value=meta.get("default_value"), nan_policy=meta.get("nan_policy", "raise"),
            growth=meta.get("growth", True),
        )
        if opt.get("state") is not None:
            table.optimizer.load_state(opt["state"])
        table._step = int(meta.get("step", 0))
        table._mseq = int(meta.get("mutation_seq", 0))
        return table

    def stats(self) -> dict[str, Any]:
        """Sizes and counters.

        Returns
        -------
        dict
            ``rows`` (keys with a row), ``capacity`` (rows allocated), ``index_slots``,
            ``load_factor`` (rows / index slots), ``bytes`` (every array of the table,
            admission filter included), ``bytes_per_key``, ``row_bytes`` (value + slot bytes
            of one row), ``step``, ``mutation_seq``; counters since creation: ``hits`` /
            ``misses`` (lookup key occurrences found / not found), ``inserts`` (rows
            created), ``collisions``, ``evictions``, ``admissions_rejected`` (lookup
            occurrences of keys not admitted yet), ``gradients_dropped`` (gradient keys
            without a row under admission), ``nonfinite_skipped`` (keys skipped for NaN/Inf
            gradients), ``removed``.

            ``collisions`` counts distinct str/bytes keys within one call that hashed to a
            key already used by another string of the same call (collisions across calls
            cannot be detected, as strings are not stored; XXH64 makes one unlikely before
            ~4e9 distinct strings).
        """
        with self._lock.read():
            a = self._arena
            rows = len(a)
            nbytes = a.nbytes + (self.admission.nbytes if self.admission is not None else 0)
            out: dict[str, Any] = {
                "rows": rows,
                "capacity": a.capacity,
                "index_slots": a.n_slots,
                "load_factor": rows / a.n_slots,
                "bytes": nbytes,
                "bytes_per_key": nbytes / rows if rows else float("nan"),
                "row_bytes": (a.values.itemsize + 4 * self.num_slots) * self.dim,
                "step": self._step,
                "mutation_seq": self._mseq,
            }
        with self._meta_lock:
            out.update(self._stats)
        return out

    def __repr__(self) -> str:
        return (f"EmbeddingTable(dim={self.dim}, rows={len(self)}, optimizer={self.optimizer!r}, "
                f"initializer={self.initializer!r})")


def _chunk_fields(chunk: Any, what: str) -> tuple[Any, ...]:
    """``(keys, values, slots, freq, version)`` of an imported chunk, unchecked."""
    try:
        keys, values, slots, freq, version = tuple(chunk)[:5]
    except (TypeError, ValueError):
        raise ShapeError(
            f"{what} got {type(chunk).__name__}; give ExportChunk objects or tuples "
            "(keys, values, slots, freq, version)"
        ) from None
    return keys, values, slots, freq, version


class BulkImport:
    """A new row arena for a table, filled from rows at known positions.

    Made by :meth:`EmbeddingTable.bulk_import`. The arrays are allocated lazily (the pages
    are touched by the rows copied into them), positions ``0 .. positions-1`` are filled by
    :meth:`put` and mapped by :meth:`index`, and :meth:`commit` swaps the arena into the
    table. Until then nothing the table holds changes.

    Threads: :meth:`put` may run on several threads at once for disjoint position ranges, and
    alongside :meth:`index` / :meth:`remove`, which run on one thread in the order the rows
    must be applied (a later duplicate key wins, a removal removes what was indexed before).
    The numpy copies and numba kernels release the GIL.

    Pages: the arena's arrays (and the index) are filled through a
    :class:`~tensorkv.pages.FreshPages` (:attr:`pages`): base pages, populated
    a range at a time; :meth:`commit` releases them.
    """

    def __init__(self, table: EmbeddingTable, positions: int) -> None:
        old = table._arena
        self.table = table
        self.positions = positions
        cap = max(positions, old._initial, 1)
        a = RowArena(table.dim, old.slot_width, capacity=1, growth=old.growth,
                     max_load=old.max_load, dtype=old.dtype)
        # lazily zeroed: a page is first touched by the rows copied into it
        a.values = np.zeros((cap, a.dim), np.uint16 if a.raw else np.float32)
        a.slots = np.zeros((cap, a.slot_width), np.float32)
        for name in ("freq", "version", "seq", "row_key"):
            setattr(a, name, np.zeros(cap, np.int64))
        a.live = np.zeros(cap, np.uint8)
        a.max_rows, a._initial = old.max_rows, old._initial
        self._arena = a
        self._index_ready = False
        self._seq = table.mutation_seq + 1  # the rows' change sequence: one mutation
        self._done = False
        #: The page policy of the arena's new arrays.
        self.pages = FreshPages()
        self.pages.track(a.values, a.slots, a.freq, a.version, a.seq, a.row_key, a.live)
        #: Keys indexed so far that were indexed before (their later row won).
        self.duplicates = 0

    def _check(self, start: int, chunk: Any) -> tuple[np.ndarray, ...]:
        keys, values, slots, freq, version = _chunk_fields(chunk, "bulk import")
        t, a = self.table, self._arena
        keys = t._as_keys(keys)
        m = keys.shape[0]
        if start < 0 or start + m > self.positions:
            raise ShapeError(
                f"rows {start}..{start + m} lie outside the {self.positions} positions reserved"
            )
        values = np.asarray(values)
        if values.ndim != 2 or values.shape[1] != t.dim or (
                values.dtype.kind != "f" and values.dtype != a.np_dtype):
            raise ShapeError(
                f"imported values have shape {values.shape} and dtype {values.dtype} but the "
                f"table stores float rows of dim={t.dim}"
            )
        sw = a.slot_width
        slots = np.asarray(slots)
        if slots.size == 0 and sw == 0:
            slots = np.zeros((m, 0), np.float32)
        if slots.shape != (m, sw) or slots.dtype != np.float32:
            raise ShapeError(
                f"imported slots have shape {slots.shape} ({slots.dtype}) but this table's "
                f"optimizer {t.optimizer.name!r} needs float32 ({m}, {sw}); import with the "
                "same optimizer"
            )
        freq = np.asarray(freq).reshape(-1)
        version = np.asarray(version).reshape(-1)
        if values.shape[0] != m or freq.shape[0] != m or version.shape[0] != m:
            raise ShapeError(
                f"imported chunk has {m} keys but {values.shape[0]} value rows, "
                f"{freq.shape[0]} freq and {version.shape[0]} version entries"
            )
        return keys, values, slots, freq, version

    def put(self, start: int, chunk: Any) -> int:
        """Copy one chunk's rows to positions ``start ..`` (not yet indexed); returns its rows.

        ``chunk`` is an :class:`ExportChunk` or a tuple ``(keys, values, slots, freq,
        version)``; values in the table's storage dtype are copied bit for bit, other float
        values are rounded to it. Raises :class:`ShapeError` for a chunk that does not fit
        the table (nothing is written then).
        """
        keys, values, slots, freq, version = self._check(start, chunk)
        a = self._arena
        stop = start + keys.shape[0]
        a.row_key[start:stop] = keys
        self.pages.prepare(a.values[start:stop], a.slots[start:stop])
        if values.dtype == a.np_dtype:
            a.values[start:stop] = values.view(a.values.dtype)
        else:
            a.values[start:stop] = a.to_raw(values)
        if a.slot_width:
            a.slots[start:stop] = slots
        a.freq[start:stop] = freq
        a.version[start:stop] = version
        a.seq[start:stop] = self._seq
        return stop - start

    def _ready_index(self) -> None:
        if self._index_ready:
            return
        from tensorkv.embedding.arena import _pow2_at_least

        a = self._arena
        # an empty index, as hashindex.new_index makes it, on pages of the same policy
        index = np.empty((_pow2_at_least(int(a.capacity / a.max_load) + 1), 2), np.int64)
        self.pages.track(index)
        self.pages.prepare(index)
        index[:, 0] = 0
        index[:, 1] = -1
        a.index = index
        self._index_ready = True

    def index(self, start: int, stop: int) -> int:
        """Map the keys of positions ``start .. stop-1`` (put before) to their rows.

        A key indexed before moves to its new row (a later duplicate wins). Returns how many
        keys were already present (also added up in :attr:`duplicates`).
        """
        if not 0 <= start <= stop <= self.positions:
            raise ShapeError(f"rows {start}..{stop} lie outside the {self.positions} positions")
        self._ready_index()
        a = self._arena
        dups = int(ak.bulk_index(a.index, a.row_key, a.live, start, stop, a.state))
        self.duplicates += dups
        return dups

    def remove(self, keys: Any) -> int:
        """Remove keys indexed so far; returns how many were present."""
        from tensorkv.kernels import hashindex as hk

        k = self.table._as_keys(keys)
        self._ready_index()
        a = self._arena
        rows = np.empty(k.shape[0], np.int64)
        return int(hk.index_remove(a.index, k, rows, a.state, a.row_key, a.live))

    def __len__(self) -> int:
        return len(self._arena)

    def commit(self) -> None:
        """Replace every row of the table with the imported rows (one mutation).

        Raises
        ------
        CapacityError
            When the table may not grow (``growth=False``) and more rows were imported than
            its capacity; the table is unchanged.
        """
        if self._done:
            raise ConfigError("this bulk import was committed already")
        self._ready_index()
        a, t = self._arena, self.table
        if not a.growth and a.max_rows is not None and len(a) > a.max_rows:
            from tensorkv.errors import CapacityError

            raise CapacityError(
                f"the import holds {len(a)} rows but the table may hold at most capacity="
                f"{a.max_rows} (growth=False); build it with a larger capacity"
            )
        ak.rebuild_free_list(a.live, a.row_key, a.state)
        self.pages.release()  # huge pages again for what the table touches from now on
        with t._lock.write():
            t._mseq += 1
            if t._mseq != self._seq:  # the table changed while the rows were copied
                a.seq[: a.high_water] = t._mseq
            removed = len(t._arena)
            t._arena = a
            t._stats["removed"] += removed
        self._done = True


__all__ = ["EmbeddingTable", "ExportChunk", "RWLock"]
