"""Row storage of tier 0: :class:`RowArena`, a hash index plus a row arena as one object.

Int64 keys map to rows of contiguous arrays: the value, the optimizer slots and per-row
metadata (frequency, version, change sequence, key, live flag). :class:`HostRows` shapes rows
held elsewhere like an arena for the eviction rules. Layout, growth, memory per key and the
locking rule: docs/internals.md.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from tensorkv import config
from tensorkv.embedding.growable import prefault_enabled, resized_all
from tensorkv.errors import CapacityError, ConfigError
from tensorkv.kernels import arena as ak
from tensorkv.kernels import hashindex as hk
from tensorkv.kernels import records as kr
from tensorkv.kernels.initializers import threads
from tensorkv.kernels.optimizers import parallel_enabled

#: Storage dtypes of value rows. 16-bit ones are held as raw ``uint16`` bit patterns (numba has
#: no float16/bfloat16 scalars) and converted to and from float32 with numpy / ml_dtypes.
STORAGE_DTYPES = ("float32", "float16", "bfloat16")
_MOVES = itertools.count(1)
ROW_GROWTH = 1.0625  # row capacity multiplier on growth (in place: see embedding/growable.py)


def pow2_at_least(n: int) -> int:
    """The smallest power of two ``>= n`` (at least 16): an index size."""
    p = 16
    while p < n:
        p *= 2
    return p


def probe_parts(n: int) -> int:
    """Ranges to split an index probe of ``n`` keys into for numba's threads (1: serial).

    From ``config.LOOKUP_PARALLEL_MIN_KEYS`` keys on, while parallel kernels are on
    (``TENSORKV_PARALLEL_KERNELS``): a probe waits on memory, and threads overlap the waits.
    """
    if n < config.LOOKUP_PARALLEL_MIN_KEYS or not parallel_enabled():
        return 1
    return max(1, min(threads(), 2 * n // config.LOOKUP_PARALLEL_MIN_KEYS))


class HostRows:
    """Rows held elsewhere, shaped like a :class:`RowArena` for eviction rules.

    :meth:`~tensorkv.embedding.filters.Eviction.select` reads ``row_key``, ``freq``,
    ``version``, ``live``, ``high_water`` and the values; this view gives it the rows of a
    device arena or of a lower tier's records. ``values`` are in the storage dtype; 16-bit
    ones are read as float32 copies like the DRAM arena's, so the rules compute exactly what
    they compute on tier 0.

    Parameters
    ----------
    keys, freq, version
        ``int64[n]`` per-row fields.
    values
        ``[n, dim]`` value rows in their storage dtype.
    """

    def __init__(self, keys: np.ndarray, freq: np.ndarray, version: np.ndarray,
                 values: np.ndarray) -> None:
        n = keys.size
        self.row_key = keys
        self.freq = freq
        self.version = version
        self.raw = values.dtype != np.float32
        self.values = np.ascontiguousarray(values)
        self.live = np.ones(n, np.uint8)
        self.high_water = n

    def gather_f32(self, rows: np.ndarray) -> np.ndarray:
        """Float32 copy of the value rows."""
        return self.values[rows].astype(np.float32)

    def __len__(self) -> int:
        return int(self.row_key.size)


class RowArena:
    """Hash index + row arena with per-row metadata.

    Parameters
    ----------
    dim
        Columns of a value row.
    slot_width
        Columns of the slot row (``num_slots * dim``; 0 for SGD).
    capacity
        Initial row capacity; with ``growth=False`` the most rows ever held.
    growth
        Whether the arena may grow past ``capacity``.
    max_load
        Index load factor (keys / slots) that triggers doubling.
    dtype
        Storage dtype of value rows: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (slots stay
        float32). 16-bit rows live in ``values`` as raw ``uint16``; :meth:`to_raw` /
        :meth:`from_raw` convert.
    """

    #: Where the rows live ("DRAM" here, "HBM" for a device arena), for statistics.
    kind = "DRAM"
    #: Whether ``values`` and ``slots`` are device tensors rather than host numpy arrays.
    on_device = False
    #: The open snapshot of these rows (a :class:`~tensorkv.embedding.snapshot.Tier0Snapshot`)
    #: or None. Every method that writes a row's value, slots, freq, version or change
    #: sequence calls :meth:`before_write` first, which copies the row for the snapshot if it
    #: still needs it; nothing else writes rows.
    snap: Any = None
    #: The row arrays of the last snapshot, reused by the next (see ``Tier0Snapshot``).
    snap_spare: Any = None

    def __init__(
        self,
        dim: int,
        slot_width: int = 0,
        *,
        capacity: int | None = None,
        growth: bool = True,
        max_load: float = config.TABLE_MAX_LOAD_FACTOR,
        dtype: str = "float32",
    ) -> None:
        if dtype not in STORAGE_DTYPES:
            raise ConfigError(f"dtype={dtype!r} is not one of {STORAGE_DTYPES}")
        self.dtype = dtype
        self.raw = dtype != "float32"
        self.np_dtype: np.dtype[Any]
        if dtype == "float16":
            self.np_dtype = np.dtype(np.float16)
        elif dtype == "bfloat16":
            import ml_dtypes

            self.np_dtype = np.dtype(ml_dtypes.bfloat16)
        else:
            self.np_dtype = np.dtype(np.float32)
        self.dim = int(dim)
        self.slot_width = int(slot_width)
        self.growth = bool(growth)
        self.max_load = float(max_load)
        self.max_rows = int(capacity) if capacity is not None else None
        self._initial = int(capacity) if capacity is not None else config.TABLE_INITIAL_CAPACITY
        #: Held while the row arrays are reallocated or replaced, and by whoever reads rows
        #: without the table's lock (a snapshot's export); a tiered table sets it to the lock
        #: its background writer holds while it reads detached rows.
        self.resize_guard: Any = threading.Lock()
        prefault_enabled()  # a malformed TENSORKV_PREFAULT raises here, not mid-growth
        try:
            self._alloc(self._initial)
        except MemoryError as exc:
            item = 2 if self.raw else 4
            need = self._initial * (self.dim * item + self.slot_width * 4 + 33)
            raise CapacityError(
                f"a table of dim={self.dim} with room for {self._initial} rows needs "
                f"{need / 2**30:,.1f} GiB of memory up front ({exc}); give a smaller dim or "
                "capacity=, or a storage chain that keeps most rows on disk (storage="
                "'DRAM_SSDHASH', storage_size=[...])") from None

    # --- allocation ---------------------------------------------------------------------------
    def _alloc_row_arrays(self, cap: int) -> None:
        """Allocate ``values`` and ``slots`` (the hook a device arena overrides)."""
        self.values = np.zeros((cap, self.dim), np.uint16 if self.raw else np.float32)
        self.slots = np.zeros((cap, self.slot_width), np.float32)

    def _resized_row_arrays(self, new: int) -> list[Any]:
        """``values`` and ``slots`` resized to ``new`` rows (the hook a device arena overrides).

        Allocates every new array before changing any, and leaves both as they were when an
        allocation fails; the caller swaps the results in.
        """
        return resized_all([self.values, self.slots], new)

    def _alloc(self, cap: int) -> None:
        cap = max(int(cap), 1)
        self._alloc_row_arrays(cap)
        self.freq = np.zeros(cap, np.int64)
        self.version = np.zeros(cap, np.int64)
        self.seq = np.zeros(cap, np.int64)
        self.row_key = np.zeros(cap, np.int64)
        self.live = np.zeros(cap, np.uint8)
        n_slots = pow2_at_least(int(cap / self.max_load) + 1)
        self.index = hk.new_index(n_slots)
        self.state = np.array([0, 0, -1, 0], np.int64)
        self.note_moves()

    def note_moves(self) -> None:
        """Say that some present key may now have another row, or none.

        :attr:`moves` changes with each (removals, detaches, repacking, a new index): row
        numbers found while it stays the same are still valid (inserts and growth keep
        them). Its values come from one process-wide counter, so no two arenas share one.
        """
        self.moves = next(_MOVES)

    @property
    def capacity(self) -> int:
        """Rows allocated."""
        return int(self.values.shape[0])

    @property
    def n_slots(self) -> int:
        """Hash index slots."""
        return int(self.index.shape[0])

    @property
    def high_water(self) -> int:
        """One past the highest row ever used (rows below it are live or on the free list)."""
        return int(self.state[hk.NEXT_ROW])

    def __len__(self) -> int:
        return int(self.state[hk.SIZE])

    @property
    def nbytes(self) -> int:
        """Bytes held by every array of the arena and index."""
        arrays = (self.values, self.slots, self.freq, self.version, self.seq, self.row_key,
                  self.live, self.index, self.state)
        return int(sum(a.nbytes for a in arrays))

    # --- snapshots ------------------------------------------------------------------------------
    def before_write(self, rows: np.ndarray) -> None:
        """Let an open snapshot copy ``rows`` before they are written (a no-op without one)."""
        snap = self.snap
        if snap is not None:
            snap.preserve(rows)

    def copy_rows(self, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """Host copies of ``rows``: values (storage dtype), slots, freq, version, seq."""
        return (self.gather(rows).view(self.np_dtype), self.gather_slots(rows),
                self.freq[rows], self.version[rows], self.seq[rows])

    def _grow_rows(self, need: int) -> None:
        cap = self.capacity
        new = max(need, int(cap * ROW_GROWTH) + 1)
        if self.max_rows is not None and not self.growth:
            new = min(new, self.max_rows)
        self._resize_rows(new)

    def _resize_rows(self, new: int) -> None:
        """Resize every per-row array to ``new`` rows (grow or shrink, contents kept)."""
        with self.resize_guard:  # the arrays move: no other thread may be reading them
            # every array is allocated before any is swapped in: an allocation that fails
            # (out of memory) leaves all of them as they were, never different sizes
            values, slots = self._resized_row_arrays(new)
            meta = ("freq", "version", "seq", "row_key", "live")
            host = resized_all([getattr(self, name) for name in meta], new)
            self.values, self.slots = values, slots
            for name, arr in zip(meta, host, strict=True):
                setattr(self, name, arr)

    def shrink_rows(self, rows: int) -> int:
        """Give back row capacity above ``rows`` (never below :attr:`high_water`).

        For an arena that grew for a burst (a tiered table's tier 0 holding rows for writes
        in flight during a bulk load): ``realloc`` returns the tail's pages to the system.
        Returns the capacity afterwards.
        """
        new = max(int(rows), self.high_water, 1)
        if new >= self.capacity:
            return self.capacity
        if self.snap is not None:
            self.snap.preserve_from(new)
        self._resize_rows(new)
        return new

    def _grow_index(self, need_keys: int) -> None:
        n_slots = self.n_slots
        while need_keys > int(n_slots * self.max_load):
            n_slots *= 2
        if n_slots == self.n_slots:
            return
        new = hk.new_index(n_slots)
        hk.index_rehash(self.index, new)
        self.index = new

    def reserve(self, n_keys: int) -> None:
        """Make room for ``n_keys`` keys in total without further growth."""
        if n_keys > self.capacity:
            self._grow_rows(n_keys)
        self._grow_index(n_keys)

    def check_room(self, n_new: int) -> None:
        """Raise :class:`CapacityError` when ``n_new`` more keys do not fit and growth is off."""
        if self.growth or self.max_rows is None:
            return
        if len(self) + n_new > self.max_rows:
            raise CapacityError(
                f"the table holds {len(self)} rows and may hold at most capacity="
                f"{self.max_rows}; inserting {n_new} new keys would need {len(self) + n_new} "
                "rows. Create it with a larger capacity or growth=True, or evict rows first"
            )

    # --- vectorised API -----------------------------------------------------------------------
    def find(self, keys: np.ndarray) -> np.ndarray:
        """Row of each key, ``-1`` where absent."""
        rows = np.empty(keys.shape[0], np.int64)
        parts = probe_parts(keys.shape[0])
        if parts > 1:
            ak.find_parallel(self.index, keys, rows, parts)
        else:
            hk.index_find(self.index, keys, rows)
        return rows

    def find_gather(self, keys: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, int]:
        """Rows of ``keys`` and their values copied into ``out``; returns (rows, misses)."""
        rows = np.empty(keys.shape[0], np.int64)
        parts = probe_parts(keys.shape[0])
        if parts > 1:
            misses = ak.find_gather_parallel(self.index, keys, self.values, out, rows, parts)
        else:
            misses = ak.find_gather(self.index, keys, self.values, out, rows)
        return rows, int(misses)

    def insert(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Find-or-insert ``keys``; returns ``(rows, is_new)``.

        New rows have undefined values/slots and zero metadata: the caller initialises them.
        Call :meth:`check_room` first when growth is off.
        """
        n = keys.shape[0]
        rows = np.empty(n, np.int64)
        is_new = np.zeros(n, np.bool_)
        pos = 0
        while True:
            max_size = int(self.n_slots * self.max_load)
            pos = hk.index_insert(
                self.index, keys, pos, rows, is_new, self.state,
                self.row_key, self.live, max_size, self.capacity,
            )
            if pos >= n:
                break
            if len(self) >= max_size:
                self._grow_index(max_size + 1)  # doubles
            else:
                if not self.growth and self.max_rows is not None and \
                        self.capacity >= self.max_rows:
                    raise CapacityError(
                        f"capacity={self.max_rows} rows reached with growth=False"
                    )
                # room for the rest of the batch at once (an upper bound: some may exist)
                need = self.high_water + (n - pos) - int(self.state[hk.N_FREE])
                if self.max_rows is not None and not self.growth:
                    need = min(need, self.max_rows)
                self._grow_rows(max(need, self.capacity + 1))
        new_rows = rows[is_new]
        self.before_write(new_rows)  # a reused row may still hold a snapshot's data
        self.freq[new_rows] = 0
        return rows, is_new

    def remove(self, keys: np.ndarray) -> np.ndarray:
        """Remove keys; returns the freed row of each key (``-1`` where it was absent)."""
        rows = np.empty(keys.shape[0], np.int64)
        self.note_moves()
        hk.index_remove(self.index, keys, rows, self.state, self.row_key,
                        self.live)
        return rows

    def detach(self, keys: np.ndarray) -> np.ndarray:
        """Remove keys but hold their rows: data intact, not reused until :meth:`free_rows`.

        Returns the held row of each key (``-1`` where absent). A tiered table detaches the
        rows it moves down, so its background writer can read them after the call returns.
        """
        rows = np.empty(keys.shape[0], np.int64)
        self.note_moves()
        hk.index_detach(self.index, keys, rows, self.state, self.row_key, self.live)
        return rows

    def attach(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Map absent, distinct ``keys`` to held ``rows`` again (undo a :meth:`detach`)."""
        if keys.size:
            self._grow_index(len(self) + keys.size)
            hk.index_attach(self.index, keys, rows, self.state, self.row_key, self.live)

    def hold_rows(self, n: int) -> np.ndarray:
        """Take ``n`` unused rows without keys (growing if needed), held like detached rows.

        A tiered table fills held rows from a background thread (prefetch) and maps keys to
        them later with :meth:`attach`; :meth:`free_rows` gives unused ones back.
        """
        n = int(n)
        need = self.high_water + max(0, n - int(self.state[hk.N_FREE]))
        if need > self.capacity:
            self._grow_rows(need)
        rows = np.empty(n, np.int64)
        got = hk.hold_rows(rows, self.state, self.row_key, self.capacity)
        self.before_write(rows[:got])  # filled later, from another thread
        return rows[:got]

    def free_rows(self, rows: np.ndarray) -> None:
        """Give held (detached) rows back to the free list."""
        if rows.size:
            hk.free_rows(rows, self.state, self.row_key)

    def pack_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Move live rows into the free rows below ``len(self)``; return ``(from, to)``.

        Afterwards the live rows are ``0 .. len - 1`` and the free list is empty. For arenas
        that held many more rows than they hold now (a tiered table's tier 0 after a bulk
        load): the rows in use end up dense in memory again. Call with no row detached (held
        rows would be overwritten).
        """
        n = len(self)
        hw = self.high_water
        if hw == n:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        self.note_moves()
        live = self.live[:hw].view(np.bool_)
        src = np.flatnonzero(live[n:]) + n
        dst = np.flatnonzero(~live[:n])
        self.before_write(dst)
        self._move_rows(src, dst)
        hk.index_set_rows(self.index, self.row_key[dst], dst)
        self.live[n:hw] = 0
        self.state[hk.NEXT_ROW] = n
        self.state[hk.FREE_HEAD] = -1
        self.state[hk.N_FREE] = 0
        return src, dst

    def _move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy every field of rows ``src`` to rows ``dst`` (the hook a device arena overrides)."""
        for name in ("values", "slots", "freq", "version", "seq", "row_key", "live"):
            arr = getattr(self, name)
            arr[dst] = arr[src]

    def to_raw(self, values: np.ndarray) -> np.ndarray:
        """Float rows -> the ``values`` array's representation (identity for float32)."""
        if not self.raw:
            return np.ascontiguousarray(values, dtype=np.float32)
        if values.dtype == self.np_dtype:
            return np.ascontiguousarray(values).view(np.uint16)
        return np.ascontiguousarray(values, dtype=np.float32).astype(self.np_dtype).view(
            np.uint16)

    def from_raw(self, raw: np.ndarray) -> np.ndarray:
        """Rows in the ``values`` representation -> float32 (identity for float32)."""
        if not self.raw:
            return raw
        return raw.view(self.np_dtype).astype(np.float32)

    def gather(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Copy of the value rows in the storage representation (``-1`` rows left zero)."""
        if out is None:
            out = np.zeros((rows.shape[0], self.dim), self.values.dtype)
        ak.gather_rows(self.values, rows, out)
        return out

    def gather_f32(self, rows: np.ndarray) -> np.ndarray:
        """Float32 copy of the value rows."""
        return self.from_raw(self.gather(rows))

    def gather_slots(self, rows: np.ndarray) -> np.ndarray:
        """Copy of the slot rows."""
        out = np.zeros((rows.shape[0], self.slot_width), np.float32)
        if self.slot_width:
            ak.gather_rows(self.slots, rows, out)
        return out

    def scatter(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Write float value rows (in order; a later duplicate wins), rounding to the dtype."""
        self.before_write(rows)
        self._scatter_values(rows, values)

    def scatter_slots(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Write slot rows."""
        if self.slot_width:
            self.before_write(rows)
            self._scatter_slots(rows, slots)

    def _scatter_values(self, rows: np.ndarray, values: np.ndarray) -> None:
        ak.scatter_rows(self.values, rows, self.to_raw(values))

    def _scatter_slots(self, rows: np.ndarray, slots: np.ndarray) -> None:
        ak.scatter_rows(self.slots, rows, slots)

    # --- per-row metadata (every write goes through these) ---------------------------------------
    def bump_freq(self, rows: np.ndarray, mseq: int) -> None:
        """Count one sighting per occurrence of each row (``-1`` skipped); stamp ``mseq``."""
        self.before_write(rows)
        ak.bump_freq(self.freq, self.seq, rows, mseq)

    def set_meta(self, rows: np.ndarray, step: int, mseq: int) -> None:
        """Record the last-update ``step`` and change sequence ``mseq`` of ``rows``."""
        self.before_write(rows)
        ak.set_meta(self.version, self.seq, rows, step, mseq)

    def add_freq(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Add ``counts`` to the frequency of distinct ``rows``."""
        self.before_write(rows)
        self.freq[rows] += counts

    def set_fields(self, rows: np.ndarray, freq: np.ndarray, version: np.ndarray,
                   seq: int) -> None:
        """Set the frequency and version of ``rows`` (a later duplicate wins), and ``seq``."""
        self.before_write(rows)
        self.freq[rows] = freq
        self.version[rows] = version
        self.seq[rows] = seq

    def keys(self) -> np.ndarray:
        """All stored keys, in row order."""
        hw = self.high_water
        return self.row_key[:hw][self.live[:hw].view(np.bool_)].copy()

    def iterate(self, chunk_rows: int = 65536, since: int = -1) -> Iterator[np.ndarray]:
        """Yield arrays of live rows (row order) whose change sequence is ``> since``.

        Every yielded array is non-empty and has at most ``chunk_rows`` rows.
        """
        start = 0
        hw = self.high_water
        pending: list[np.ndarray] = []
        n_pending = 0
        while start < hw:
            stop = min(hw, start + chunk_rows)
            rows = ak.live_rows(self.live, self.seq, start, stop, since)
            start = stop
            if rows.size:
                pending.append(rows)
                n_pending += rows.size
            while n_pending >= chunk_rows:
                cat = np.concatenate(pending)
                yield cat[:chunk_rows]
                rest = cat[chunk_rows:]
                pending = [rest] if rest.size else []
                n_pending = rest.size
        if n_pending:
            yield np.concatenate(pending)

    def clear(self) -> None:
        """Drop every key and shrink back to the initial capacity."""
        if self.snap is not None:  # the arrays go: an open snapshot copies what it still needs
            self.snap.preserve_from(0)
        with self.resize_guard:
            self._alloc(self._initial)

    def probe_stats(self) -> tuple[float, int]:
        """(mean, max) probe length of stored keys."""
        mean, worst = hk.index_probe_stats(self.index)
        return float(mean), int(worst)

    # --- where the rows live: what a device arena overrides -------------------------------------
    def init_rows(self, initializer: Any, rows: np.ndarray, keys: np.ndarray, seed: int,
                  slot_init: np.ndarray) -> None:
        """Write the initial value of ``keys`` into ``rows``, initial slots, and zero counts.

        Parameters
        ----------
        initializer
            The table's :class:`~tensorkv.embedding.initializers.Initializer`.
        rows, keys
            New rows and their keys.
        seed
            The table's seed.
        slot_init
            float32 initial value of each optimizer slot (one per slot).
        """
        self.before_write(rows)
        self._init_rows(initializer, rows, keys, seed, slot_init)

    def _init_rows(self, initializer: Any, rows: np.ndarray, keys: np.ndarray, seed: int,
                   slot_init: np.ndarray) -> None:
        if self.raw:
            self.scatter(rows, initializer.values(keys, self.dim, seed))
        else:
            initializer.fill(self.values, rows, keys, seed)
        if self.slot_width:
            ak.fill_slots(self.slots, rows, slot_init, self.dim)
        self.freq[rows] = 0

    def apply_optimizer(self, optimizer: Any, rows: np.ndarray, grads: np.ndarray, step: int,
                        parallel: bool | None = None, split: Any = None) -> None:
        """One optimizer step on distinct ``rows`` with summed ``grads`` (float32 ``[m, dim]``).

        16-bit rows are updated as float32 copies and rounded back into storage. ``parallel``
        and ``split`` are passed to :meth:`~tensorkv.embedding.optimizers.TableOptimizer.apply`.
        """
        if rows.size == 0:
            return
        self.before_write(rows)
        self._apply_optimizer(optimizer, rows, grads, step, parallel, split)

    def _apply_optimizer(self, optimizer: Any, rows: np.ndarray, grads: np.ndarray, step: int,
                         parallel: bool | None, split: Any) -> None:
        if self.raw:
            vals, slots = self.gather_f32(rows), self.gather_slots(rows)
            optimizer.apply(vals, slots, np.arange(rows.size, dtype=np.int64), grads, step)
            self.scatter(rows, vals)
            self.scatter_slots(rows, slots)
        else:
            optimizer.apply(self.values, self.slots, rows, grads, step, parallel=parallel,
                            split=split)

    def torch_rows(self, keys: np.ndarray, values: np.ndarray, torch: Any) -> Any:
        """A lookup's result as a torch tensor: ``values`` (float32 ``[n, dim]``) shared.

        ``values`` hold every key's row already; a device arena gathers the rows of present
        keys on its device instead and takes only the others from ``values``.
        """
        return torch.from_numpy(values)

    def host_view(self) -> Any:
        """The arena as :meth:`~tensorkv.embedding.filters.Eviction.select` reads it (itself)."""
        return self

    def write_records(self, layout: Any, word: np.dtype,
                      pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                      split: Any = None) -> None:
        """Copy records into rows: every field but the key (see ``RowSink.write_many``).

        ``pieces`` are ``(src, src_rows, rows)``: records ``src[src_rows]`` of a C-contiguous
        ``uint8[m, width]`` buffer go to rows ``rows``. ``word`` is the widest integer type
        that copies the value and slot fields whole; ``split(fn, n)`` shares the copy with
        the helper thread (each row written by one range).
        """
        if self.snap is not None:
            for _, _, rows in pieces:
                self.before_write(rows)
        self._write_records(layout, word, pieces, split)

    def _write_records(self, layout: Any, word: np.dtype,
                       pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                       split: Any = None) -> None:
        args = (layout.values_offset // word.itemsize, layout.slots_offset // word.itemsize,
                self.values.view(word), self.slots.view(word), self.freq, self.version,
                self.seq)
        views = [(src.view(word), src.view(np.int64), src_rows, rows)
                 for src, src_rows, rows in pieces if rows.shape[0]]
        if split is None:
            for s, s64, src_rows, rows in views:
                kr.records_to_rows(s, s64, src_rows, rows, *args)
            return
        bounds = np.cumsum([0] + [v[3].shape[0] for v in views]).tolist()

        def copy(lo: int, hi: int) -> None:  # rows [lo, hi) of the pieces laid end to end
            k = bisect.bisect_right(bounds, lo) - 1  # holds the GIL: no hand-off mid-copy
            while k < len(views) and bounds[k] < hi:
                s, s64, src_rows, rows = views[k]
                i, j = max(lo, bounds[k]) - bounds[k], min(hi, bounds[k + 1]) - bounds[k]
                kr.records_to_rows(s, s64, src_rows[i:j], rows[i:j], *args)
                k += 1

        split(copy, bounds[-1])

    def read_records(self, layout: Any, word: np.dtype, keys: np.ndarray, rows: np.ndarray,
                     out: np.ndarray) -> None:
        """Pack ``rows`` (keys ``keys``) into records ``out`` (``uint8[n, >= record_bytes]``).

        Padding inside a record is zeroed; bytes past ``record_bytes`` are left alone. The
        caller keeps the arrays from moving meanwhile (see ``RowSource.pack``).
        """
        end_v = layout.values_offset + layout.values_bytes
        if end_v < layout.slots_offset:
            out[:, end_v:layout.slots_offset] = 0
        end_s = layout.slots_offset + 4 * layout.slot_width
        if end_s < layout.record_bytes:
            out[:, end_s:layout.record_bytes] = 0
        kr.rows_to_records(self.values.view(word), self.slots.view(word), self.freq,
                           self.version, self.seq, keys, rows, out.view(word),
                           out.view(np.int64), layout.values_offset // word.itemsize,
                           layout.slots_offset // word.itemsize)

    # --- bulk loads ------------------------------------------------------------------------------
    @classmethod
    def for_bulk_load(cls, like: RowArena, rows: int) -> RowArena:
        """An empty arena with ``like``'s settings and ``rows`` rows, filled by position.

        The row arrays are zero pages until written (the rows copied into them touch them);
        there is no index yet: fill rows by position, :meth:`set_index` an empty index,
        map ranges of rows with :meth:`index_rows` and end with :meth:`finish_bulk_load`.
        """
        a = cls(like.dim, like.slot_width, capacity=1, growth=like.growth,
                max_load=like.max_load, dtype=like.dtype)
        cap = max(int(rows), like._initial, 1)
        a.values = np.zeros((cap, a.dim), np.uint16 if a.raw else np.float32)
        a.slots = np.zeros((cap, a.slot_width), np.float32)
        for name in ("freq", "version", "seq", "row_key"):
            setattr(a, name, np.zeros(cap, np.int64))
        a.live = np.zeros(cap, np.uint8)
        a.max_rows, a._initial = like.max_rows, like._initial
        return a

    @property
    def row_arrays(self) -> tuple[np.ndarray, ...]:
        """The per-row arrays: values, slots, freq, version, seq, row_key, live."""
        return (self.values, self.slots, self.freq, self.version, self.seq, self.row_key,
                self.live)

    def index_size(self) -> int:
        """Slots of an index sized for the arena's capacity (rows of ``int64[2]``)."""
        return pow2_at_least(int(self.capacity / self.max_load) + 1)

    def set_index(self, index: np.ndarray) -> None:
        """Install an index array (``int64[index_size(), 2]``), emptied here."""
        index[:, 0] = 0
        index[:, 1] = -1
        self.index = index
        self.note_moves()

    def index_rows(self, start: int, stop: int) -> int:
        """Map the keys of rows ``start .. stop-1`` to those rows; returns keys mapped before.

        A key mapped before moves to its new row (a later duplicate wins); the earlier row
        is freed by :meth:`finish_bulk_load`.
        """
        self.note_moves()
        return int(ak.bulk_index(self.index, self.row_key, self.live, start, stop, self.state))

    def finish_bulk_load(self) -> None:
        """Put every row below :attr:`high_water` that holds no key on the free list."""
        ak.rebuild_free_list(self.live, self.row_key, self.state)
