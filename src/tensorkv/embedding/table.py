"""EmbeddingTable: a dynamic embedding table, the reference semantics of every table kind.

A row appears the first time its key is looked up (subject to an admission filter), trains
with a sparse optimizer and may be evicted. The table's logic runs on tier 0, a
:class:`~tensorkv.embedding.arena.RowArena`; its *rows* object (:mod:`tensorkv.embedding.rows`
or a tier chain, :mod:`tensorkv.embedding.chain`) holds the rest, and tiered tables train
bit-identically to DRAM-only ones. See docs/tiers.md and docs/internals.md ("Concurrency").
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorkv.embedding.arena import STORAGE_DTYPES, RowArena
from tensorkv.embedding.backend import RowBackend
from tensorkv.embedding.chain import open_rows, resolve_storage
from tensorkv.embedding.chain.tierchain import DEFAULT_MAX_PENDING_BYTES
from tensorkv.embedding.chunks import ExportChunk, nonfinite_rows
from tensorkv.embedding.filters import AdmissionFilter, Eviction, admission_from_config
from tensorkv.embedding.initializers import Initializer, get_initializer
from tensorkv.embedding.keys import as_int64_keys
from tensorkv.embedding.optimizers import get_optimizer
from tensorkv.embedding.rows import ArenaBackend
from tensorkv.embedding.scratch import Scratch
from tensorkv.embedding.table_io import TableIO, is_int
from tensorkv.errors import (
    ConfigError,
    NonFiniteGradientError,
    ShapeError,
    import_optional,
)

_STAT_NAMES = ("hits", "misses", "inserts", "collisions", "evictions", "admissions_rejected",
               "gradients_dropped", "nonfinite_skipped", "removed")

class EmbeddingTable(TableIO):
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
        default SGD(lr=0.01). The table keeps its own copy of an optimizer object (its global
        step is the table's), so one object may configure several tables;
        :attr:`optimizer` is the copy.
    admission
        ``None`` (every key admitted), :class:`CounterFilter` or :class:`BloomFilter`; the
        table keeps its own copy of a filter object, as of an optimizer.
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
        ``"raise"``: gradients with NaN/Inf raise :class:`NonFiniteGradientError`, and rows
        with NaN/Inf given to ``upsert``/``import_`` raise :class:`NonFiniteValueError`;
        nothing changes. ``"skip"``: those keys (rows) are left unchanged (out) and counted.
    growth
        Whether the table may grow past ``capacity``.
    storage
        Multi-tier storage: a :class:`~tensorkv.embedding.chain.specs.StorageOption` or a
        storage type name (``"DRAM_SSDHASH"``, ``"DRAM_LEVELDB"``, ``"HBM_DRAM"``...): hot rows
        in DRAM (or HBM), the rest in lower tiers, bit-identical training (docs/tiers.md).
        ``len``, ``keys``, ``contains``, ``frequency``, ``version``, ``remove``,
        ``export``/``import_`` and eviction see every tier; whole-table views first wait for
        the pending background writes. Close the table (or use it as a context manager) to
        flush and release its tiers.
    storage_path, storage_size, cache_strategy
        With a storage type name: the tiers' directory (or URL; relative paths resolve
        against the working directory; none: a temporary directory removed on close), their
        sizes in bytes (a tier holds ``size // record_bytes`` rows), and ``"lfu"`` /
        ``"lru"``. A path holding an earlier table's rows is refused unless
        ``storage=StorageOption(..., overwrite=True)`` (docs/tiers.md, "Spill directories").
    max_pending_bytes
        With storage: evicted bytes that may wait for their background write before the
        caller blocks (bytes or a size string such as ``"64MiB"``).
    device
        With an HBM tier 0: its torch device (``"cuda"``; ``"cpu"`` runs the same code
        anywhere).

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
        max_pending_bytes: int | str = DEFAULT_MAX_PENDING_BYTES,
        device: Any = "cuda",
    ) -> None:
        if not is_int(dim) or dim <= 0:
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
        if capacity is not None and (not is_int(capacity) or capacity < 1):
            raise ConfigError(f"capacity={capacity!r} must be a positive integer or None")
        if not growth and capacity is None:
            raise ConfigError("growth=False needs capacity=N, the most rows the table may hold")
        if not is_int(seed):
            raise ConfigError(f"seed={seed!r} must be an integer")
        self.seed = int(seed)
        self.storage = resolve_storage(storage, storage_path, storage_size, cache_strategy)
        if self.storage is not None and not growth:
            raise ConfigError("growth=False cannot be combined with storage tiers; the tier "
                              "sizes bound the rows (storage_size=[...])")
        self.initializer = get_initializer(initializer)
        # copies the table owns: no step count or sighting is shared with another table
        self.optimizer = get_optimizer(optimizer).copy()
        adm = admission_from_config(admission)
        self.admission = None if adm is None else adm.copy()
        self.eviction = Eviction.from_config(eviction)
        self.capacity_limit = None if capacity is None else int(capacity)
        self.growth = bool(growth)
        self._default = self._check_default(default_value)
        self._slot_init = np.asarray(self.optimizer.slot_initial_values(), np.float32)
        self.num_slots = len(self.optimizer.slot_names())
        if self.storage is None:
            self._rows: RowBackend = ArenaBackend(RowArena(
                self.dim, self.num_slots * self.dim, capacity=capacity, growth=growth,
                dtype=self.dtype))
        else:
            self._rows = open_rows(self.storage, dim=self.dim, dtype=self.dtype,
                                   num_slots=self.num_slots, capacity=capacity,
                                   max_pending_bytes=max_pending_bytes, device=device)
        self._lock = self._rows.lock
        self._meta_lock = threading.Lock()
        self._step = 0
        self._mseq = 0
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        self._scratch = Scratch()

    @property
    def arena(self) -> RowArena:
        """Tier 0: the row arena where every read and update happens.

        For inspection (statistics, benchmarks) and bulk loads; change rows through the
        table's methods.
        """
        return self._rows.arena

    # --- input normalisation ------------------------------------------------------------------
    def _check_default(self, default: Any) -> np.ndarray | None:
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

    def as_keys(self, keys: Any) -> np.ndarray:
        """``keys`` as the table stores them: a 1-D C-contiguous int64 array.

        Integer keys keep their value; str/bytes keys are hashed (XXH64); collisions among
        the strings of one call are counted in :meth:`stats`.
        """
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
        self.arena.init_rows(self.initializer, rows, keys, self.seed, self._slot_init)

    def _check_room(self, keys: np.ndarray) -> None:
        if not self.growth:
            a = self.arena
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
        k = self.as_keys(keys)
        raw = self._lookup_buffer(k.shape[0], out)  # a bad ``out`` fails before anything moves
        rows_ = self._rows
        with rows_.op:
            if insert:
                rows_.begin_write(self, "lookup(insert=True)", k)
            rows = rows_.promote_lookup(k)
            with rows_.holding_meta():
                res = self._lookup(k, insert, out, raw, rows)
            rows_.after_batch(k)
        return res

    def lookup_torch(self, keys: Any, insert: bool = True) -> Any:
        """:meth:`lookup` as a float32 torch tensor on tier 0's device.

        With an HBM tier 0 the lookup does the usual work on the host (promotion, insertion,
        admission, frequency counts) and the rows are gathered on the device
        (``index_select``): only keys without a row (not admitted, or ``insert=False``) have
        their initial/default value made on the host and copied up; the batch's values never
        travel to the host. With a host tier 0 it is ``torch.from_numpy(lookup(keys))``.
        """
        torch = import_optional("torch", "lookup_torch", "torch")
        k = self.as_keys(keys)
        a, rows_ = self.arena, self._rows
        buf = self._lookup_buffer(k.shape[0], None)
        with rows_.op:
            if insert:
                rows_.begin_write(self, "lookup_torch(insert=True)", k)
            rows = rows_.promote_lookup(k)
            # a device arena gathers the rows itself (``gathered``: _lookup then writes only
            # the rows of keys it inserts or leaves out); a host arena's are gathered here
            with rows_.holding_meta():
                host = self._lookup(k, insert, None, buf, rows, gathered=a.on_device)
            with self._lock.read():
                res = a.torch_rows(k, host, torch)
            rows_.after_batch(k)
        return res

    def prefetch(self, keys: Any) -> None:
        """Start moving the next batch's rows up from the lower tiers in the background.

        Call it with the keys of batch ``i + 1`` once batch ``i`` has been looked up (before
        its :meth:`apply_gradients`, or before the dense model's forward pass): a background
        thread reads their records from the lower tiers into spare tier-0 rows while batch
        ``i`` trains, and the :meth:`lookup` of batch ``i + 1`` only maps the keys to those
        rows. Values never depend on it (rows move whole), so calling it for a DRAM-only
        table, where it does nothing, is harmless. The tier-0 hit/miss counters still count
        prefetched keys as misses; ``stats()["tiers"][0]["prefetched"]`` counts the rows
        moved ahead. One prefetch is in flight at a time: a second call first finishes the
        first, and rows it fetched that no lookup used go back down.

        Examples
        --------
        >>> import numpy as np
        >>> from tensorkv import EmbeddingTable
        >>> t = EmbeddingTable(8, optimizer="adagrad", storage="DRAM_SSDHASH",
        ...                    storage_size=["64KiB"])  # spills to a temporary directory
        >>> batches = [np.arange(i * 100, i * 100 + 100) for i in range(4)] * 2
        >>> for i, keys in enumerate(batches):
        ...     rows = t.lookup(keys)
        ...     if i + 1 < len(batches):
        ...         t.prefetch(batches[i + 1])
        ...     n = t.apply_gradients(keys, np.ones_like(rows))
        >>> t.close()
        """
        k = self.as_keys(keys)
        with self._rows.op:
            self._rows.start_prefetch(k)

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
        if out is not None and not self.arena.raw:
            return out
        # 16-bit rows as raw bits; no assumption that tier 0 is a numpy array
        return np.empty((n, self.dim), np.uint16 if self.arena.raw else np.float32)

    def _lookup(self, k: np.ndarray, insert: bool, out: np.ndarray | None, raw: np.ndarray,
                rows: np.ndarray | None = None, gathered: bool = False) -> np.ndarray:
        """:meth:`lookup` of validated keys into ``raw`` (from :meth:`_lookup_buffer`).

        ``rows``: every key's tier-0 row if the promotion step found them (under the same
        operation lock, with no change to the index since), so the index is not probed
        twice; ``gathered``: ``raw`` holds those rows' values already.
        """
        n = k.shape[0]
        a = self.arena
        with self._lock.read():
            moves, size = a.moves, len(a)
            if rows is None:
                rows, misses = a.find_gather(k, raw)
            else:
                if not gathered:
                    a.gather(rows, raw)
                misses = int(np.count_nonzero(rows < 0))
            if misses == 0 and insert:
                with self._meta_lock:
                    self._mseq += 1
                    self._rows.meta_write(a.bump_freq, rows, self._mseq)
                    self._stats["hits"] += n
                self._rows.note_lookup(k, rows, moves)
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
            self._insert_missing(k, raw, rows, moves, size)
        return self._result(raw, out)

    def _result(self, raw: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        if raw is out:
            return out
        f32 = self.arena.from_raw(raw)
        if out is None:
            return f32
        np.copyto(out, f32)
        return out

    def _insert_missing(self, k: np.ndarray, out: np.ndarray, found: np.ndarray,
                        moves: int, size: int) -> None:
        """Write-locked slow path of :meth:`lookup`: insert/admit the missing keys.

        ``found``: each key's row in the shared-lock pass (``-1``: missing), when the arena's
        :attr:`~tensorkv.embedding.arena.RowArena.moves` was ``moves`` and it held ``size``
        keys. Another writer may have inserted missing keys since (the size changed), so
        those are read again; the found rows are still valid unless some key has moved since
        (then every key is read again).
        """
        a = self.arena
        missed = np.flatnonzero(found < 0)
        if a.moves != moves:
            rows = a.find(k)
            miss = np.flatnonzero(rows < 0)
        else:
            rows = found.copy()
            miss = missed
            if len(a) != size:
                rows[missed] = a.find(k[missed])
                miss = missed[rows[missed] < 0]
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
            a.set_meta(fresh, self._step, self._mseq)
            self._stats["inserts"] += fresh.size
            rows[miss] = new_rows
            if prior is not None:
                assert self.admission is not None
                uk, first = np.unique(mk, return_index=True)
                a.add_freq(new_rows[first], prior[first])
                self.admission.forget(uk)
        # the missing keys' rows straight into the result (the others are in it already)
        a.gather(rows if missed.size == k.shape[0] else np.where(found >= 0, -1, rows), out)
        if rejected.size:
            out[rejected] = a.to_raw(self._initial(k[rejected]))
        else:
            self._rows.note_lookup(k, rows, a.moves)
        with self._meta_lock:
            self._mseq += 1
            a.bump_freq(rows, self._mseq)
            self._stats["hits"] += n_hits
            self._stats["misses"] += n_misses

    def __getitem__(self, keys: Any) -> np.ndarray:
        """``table[keys]`` is ``lookup(keys, insert=False)``."""
        return self.lookup(keys, insert=False)

    def contains(self, keys: Any) -> np.ndarray:
        """Boolean array saying whether each key has a row (in any tier)."""
        k = self.as_keys(keys)
        with self._rows.op, self._lock.read():
            out = self.arena.find(k) >= 0
            miss = np.flatnonzero(~out)
            if miss.size:
                out[miss] = self._rows.read_lower(k[miss])[0]
        return out

    def __contains__(self, key: Any) -> bool:
        return bool(self.contains([key])[0])

    def __len__(self) -> int:
        with self._rows.op:
            lower = self._rows.lower_len()  # lands every background write first
            return len(self.arena) + lower

    def keys(self) -> np.ndarray:
        """All keys with a row (int64; tier 0 in row order, then the lower tiers)."""
        with self._rows.op:
            with self._lock.read():
                top = self.arena.keys()
            lower = self._rows.lower_keys()
        return np.concatenate([top, lower]) if lower.size else top

    def frequency(self, keys: Any) -> np.ndarray:
        """Lookup count of each key (0 for keys without a row)."""
        return self._meta_of(keys, "freq", 0)

    def version(self, keys: Any) -> np.ndarray:
        """Last-update step of each key (-1 for keys without a row)."""
        return self._meta_of(keys, "version", -1)

    def _meta_of(self, keys: Any, name: str, missing: int) -> np.ndarray:
        k = self.as_keys(keys)
        with self._rows.op, self._lock.read():
            rows = self.arena.find(k)
            out = getattr(self.arena, name)[np.maximum(rows, 0)].copy()
            out[rows < 0] = missing
            miss = np.flatnonzero(rows < 0)
            if miss.size:
                found, f = self._rows.read_lower(k[miss])
                if found.any():
                    out[miss[found]] = getattr(f, name)[found]
        return out

    # --- updates -------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The table's step: the last ``apply_gradients`` step."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        """Set the step, e.g. when restoring a checkpoint into an existing table."""
        if not is_int(value) or value < 0:
            raise ConfigError(f"step={value!r} must be a non-negative integer")
        with self._rows.op:
            self._rows.begin_write(self, "step", int(value))
            with self._lock.write():
                self._step = int(value)

    def reserve(self, n_keys: int) -> None:
        """Allocate room for ``n_keys`` rows in total now, so inserting them does not regrow.

        Loading a checkpoint of known size calls this first: one allocation instead of a
        series of doublings and rehashes.
        """
        if not is_int(n_keys) or n_keys < 0:
            raise ConfigError(f"n_keys={n_keys!r} must be a non-negative integer")
        with self._lock.write():
            self.arena.check_room(max(0, int(n_keys) - len(self.arena)))
            self.arena.reserve(int(n_keys))

    def apply_gradients(self, keys: Any, grads: Any, step: int | None = None, *,
                        unique: bool = False) -> int:
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
        unique
            The caller guarantees the keys are distinct (IndexedSlices already summed, as
            the PyTorch modules' are): the summing pass is skipped. Duplicates then update
            their row once per occurrence.

        Returns
        -------
        int
            Number of rows updated.
        """
        k = self.as_keys(keys)
        g = self._as_grads(grads, k.shape[0])
        if step is not None and not is_int(step):
            raise ConfigError(f"step={step!r} must be an integer or None")
        rows_ = self._rows
        with rows_.op:
            rows_.begin_write(self, "apply_gradients", k, g, step, bool(unique))
            rows = rows_.promote_update(k)
            with rows_.holding_meta():
                n = self._apply(k, g, step, rows, unique=bool(unique))
            rows_.after_batch(k)
        return n

    def _apply(self, k: np.ndarray, g: np.ndarray, step: int | None,
               rows: np.ndarray | None = None, unique: bool = False) -> int:
        """:meth:`apply_gradients` of validated input; ``rows``: every key's row, if known.

        With the rows of a batch just looked up (all present, under the same operation lock)
        duplicates are summed by row, without hashing keys, and the index is not probed again.
        ``unique``: the keys are distinct, nothing to sum.
        """
        uniq, sums, bad, urows = self._scratch.summed(k, g, rows, unique, self.arena.row_key)
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
        a = self.arena
        with self._lock.write():
            if urows is None and unique:
                urows = self._rows.known_rows(uniq)
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
            a.apply_optimizer(self.optimizer, rows, sums, self._step,
                              parallel=self._rows.parallel, split=self._rows.split)
            self._mseq += 1
            self._rows.meta_write(a.set_meta, rows, self._step, self._mseq)
            ev = self.eviction
            if ev is not None and ev.every_n_steps and self._step % ev.every_n_steps == 0:
                self._evict_locked()
        return int(rows.size)

    def upsert(self, keys: Any, values: Any) -> int:
        """Set the values of ``keys`` (inserting absent ones; a later duplicate wins).

        New rows get initial optimizer slots; existing rows keep theirs. Rows holding NaN or
        Inf (or values beyond a 16-bit dtype's range) follow :attr:`nan_policy`: ``"raise"``
        raises :class:`~tensorkv.errors.NonFiniteValueError` and writes nothing, ``"skip"``
        leaves those rows out and counts them in ``stats()["nonfinite_skipped"]``. Returns
        the number of rows written.
        """
        k = self.as_keys(keys)
        v = np.asarray(values)
        if v.dtype.kind != "f" or v.shape != (k.shape[0], self.dim):
            raise ShapeError(
                f"values have shape {v.shape} and dtype {v.dtype}; {k.shape[0]} keys need a "
                f"float array of shape ({k.shape[0]}, {self.dim})"
            )
        keep = self.keep_finite(k, nonfinite_rows(v, None, self.arena.np_dtype), "upsert")
        n_skip = 0
        if keep is not None:
            k, v, n_skip = k[keep], v[keep], k.shape[0] - int(keep.sum())
        v = np.ascontiguousarray(v, dtype=np.float32)
        if k.shape[0] == 0:
            with self._meta_lock:
                self._stats["nonfinite_skipped"] += n_skip
            return 0
        with self._rows.op:
            self._rows.begin_write(self, "upsert", k, v)
            self._rows.promote(k)
            a = self.arena
            with self._lock.write():
                if not self.growth:
                    self._check_room(k)
                self._stats["nonfinite_skipped"] += n_skip
                rows, is_new = a.insert(k)
                self._init_rows(rows[is_new], k[is_new])
                self._stats["inserts"] += int(is_new.sum())
                a.scatter(rows, v)
                self._mseq += 1
                a.set_meta(rows, self._step, self._mseq)
            self._rows.after(k)
        return int(k.shape[0])

    def remove(self, keys: Any) -> int:
        """Remove keys (absent ones ignored); returns how many rows were removed."""
        k = self.as_keys(keys)
        with self._rows.op:
            self._rows.begin_write(self, "remove", k)
            self._rows.promote(k)
            with self._lock.write():
                rows = self.arena.remove(k)
                n = int((rows >= 0).sum())
                if n:
                    self._mseq += 1
                    self._stats["removed"] += n
        return n

    def clear(self) -> None:
        """Remove every row (and the admission filter's counts)."""
        with self._rows.op:
            self._rows.begin_write(self, "clear")
            self._rows.sync()  # the writer reads held tier-0 rows until its batches land
            with self._lock.write():
                self.arena.clear()
                if self.admission is not None:
                    self.admission.clear()
                self._mseq += 1
            self._rows.clear_lower()

    def evict(self) -> int:
        """Apply the eviction policy now; returns how many rows were evicted."""
        with self._rows.op:
            self._rows.begin_write(self, "evict")
            with self._lock.write():
                return self._evict_locked()

    def _evict_locked(self) -> int:
        self._rows.run_held_meta()  # the eviction rules read the batch's new versions
        if self.eviction is None:
            return 0
        dead = self._rows.evict_keys(self.eviction, self._step)
        if dead.size == 0:
            return 0
        removed = self.arena.remove(dead)
        n = int((removed >= 0).sum()) + self._rows.remove_lower(dead[removed < 0])
        self._mseq += 1
        self._stats["evictions"] += n
        return n

    # --- lifecycle -------------------------------------------------------------------------------
    @property
    def device(self) -> Any:
        """The torch device of tier 0 (``"cpu"`` for a DRAM tier 0)."""
        return self._rows.device

    def wait_writes(self) -> None:
        """Block until every background write has landed in its tier (no fsync).

        Re-raises a failed write as :class:`~tensorkv.errors.WriteBackError`. Tier 0's rows
        are made dense again if a bulk load left them spread out, and the memory it held for
        writes in flight is given back. Nothing to do for a DRAM-only table.
        """
        self._rows.wait_writes()

    def flush(self) -> None:
        """:meth:`wait_writes`, then flush the lower tiers (durable)."""
        self._rows.flush()

    def close(self) -> None:
        """Flush and close the lower tiers (a tiered table is unusable afterwards)."""
        self._rows.close()

    def __enter__(self) -> EmbeddingTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- statistics ---------------------------------------------------------------------------
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
            gradients, rows of ``upsert``/``import_`` skipped for NaN/Inf), ``removed``. A
            tiered table adds ``tier0_rows`` and ``tiers`` (per tier: rows, bytes, hits,
            misses, promotions, evictions, compactions, and ``path`` or ``url``), and
            ``rows`` counts every tier (the other sizes are tier 0's).

            ``collisions`` counts distinct str/bytes keys within one call that hashed to a
            key already used by another string of the same call (collisions across calls
            cannot be detected, as strings are not stored; XXH64 makes one unlikely before
            ~4e9 distinct strings).
        """
        with self._rows.op:
            with self._lock.read():
                a = self.arena
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
            self._rows.add_stats(out)
        return out

    def __repr__(self) -> str:
        spill = self._rows.spill_locations()
        where = f", spill={spill}" if spill else ""
        return (f"EmbeddingTable(dim={self.dim}, rows={len(self)}, optimizer={self.optimizer!r}, "
                f"initializer={self.initializer!r}{where})")


__all__ = ["EmbeddingTable", "ExportChunk"]
