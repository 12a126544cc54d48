"""The lower-tier contract: fixed-size row records and the :class:`LowerTier` ABC.

:class:`RecordLayout` describes the record that carries a whole row (key, freq, version,
change sequence, values, slots) and packs batches of them; :class:`LowerTier` and
:class:`IndexedTier` are the tier interface, :class:`RowSink` / :class:`RowSource` the copies
into and out of tier 0. Record layout and interface: docs/tiers.md ("Records").
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from tensorkv.errors import ConfigError, KeyTypeError, ShapeError, StoreClosedError
from tensorkv.kernels import records as kr

#: The record header: one int64 word per field, in this order.
HEADER_WORDS = {"keys": 0, "freq": 1, "version": 2, "change_seq": 3}
HEADER_BYTES = 8 * len(HEADER_WORDS)
#: Header fields a cascade ranks rows by (LFU: freq, LRU: change_seq).
SCORE_FIELDS = ("freq", "change_seq")

_VALUE_DTYPES = ("float32", "float16", "bfloat16")


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def value_dtype(name: str | np.dtype | type) -> np.dtype:
    """Resolve a storage dtype name (``float32``, ``float16`` or ``bfloat16``) to a numpy dtype."""
    if isinstance(name, str) and name.lower() in ("bfloat16", "bf16"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(name)
    except TypeError:
        raise ConfigError(
            f"value_dtype={name!r} is not a dtype; use one of {', '.join(_VALUE_DTYPES)}"
        ) from None
    if dt.name not in _VALUE_DTYPES:
        raise ConfigError(
            f"value_dtype={dt.name!r} is not a storage dtype; use one of {', '.join(_VALUE_DTYPES)}"
        )
    return dt


class RecordFields(NamedTuple):
    """The fields of a batch of records, as numpy views into the record buffer.

    Attributes
    ----------
    keys, freq, version, change_seq
        ``int64[n]``.
    values
        ``[n, dim]`` in the storage dtype.
    slots
        ``float32[n, num_slots * dim]``.
    """

    keys: np.ndarray
    freq: np.ndarray
    version: np.ndarray
    change_seq: np.ndarray
    values: np.ndarray
    slots: np.ndarray


@dataclass(frozen=True)
class RecordLayout:
    """The fixed-size record of one embedding row.

    Parameters
    ----------
    dim
        Embedding dimension (values per row), at least 1.
    value_dtype
        Storage dtype of the values: ``"float32"`` (default), ``"float16"`` or ``"bfloat16"``.
    num_slots
        Optimizer slots per row (each ``dim`` float32), e.g. 1 for Adagrad, 2 for Adam.

    Examples
    --------
    >>> layout = RecordLayout(dim=64, num_slots=1)
    >>> layout.record_bytes
    544
    """

    dim: int
    value_dtype: str = "float32"
    num_slots: int = 0

    def __post_init__(self) -> None:
        if (
            isinstance(self.dim, bool)
            or not isinstance(self.dim, (int, np.integer))
            or self.dim < 1
        ):
            raise ConfigError(f"dim={self.dim!r} must be a positive integer")
        if (
            isinstance(self.num_slots, bool)
            or not isinstance(self.num_slots, (int, np.integer))
            or self.num_slots < 0
        ):
            raise ConfigError(f"num_slots={self.num_slots!r} must be a non-negative integer")
        dt = value_dtype(self.value_dtype)
        object.__setattr__(self, "dim", int(self.dim))
        object.__setattr__(self, "num_slots", int(self.num_slots))
        object.__setattr__(self, "value_dtype", dt.name)

    # ----------------------------------------------------------------- geometry
    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype of the values."""
        return value_dtype(self.value_dtype)

    @property
    def values_offset(self) -> int:
        """Byte offset of the values in a record."""
        return HEADER_BYTES

    @property
    def values_bytes(self) -> int:
        """Bytes of the values (without padding)."""
        return self.dim * self.dtype.itemsize

    @property
    def slots_offset(self) -> int:
        """Byte offset of the slots in a record."""
        return HEADER_BYTES + _pad8(self.values_bytes)

    @property
    def slot_width(self) -> int:
        """float32 columns of slot state per row (``num_slots * dim``)."""
        return self.num_slots * self.dim

    @property
    def record_bytes(self) -> int:
        """Bytes of one record (a multiple of 8)."""
        return _pad8(self.slots_offset + 4 * self.slot_width)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description (for tier metadata files)."""
        return {
            "dim": self.dim,
            "value_dtype": self.value_dtype,
            "num_slots": self.num_slots,
            "record_bytes": self.record_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecordLayout:
        """Rebuild from :meth:`to_dict` output."""
        return cls(int(d["dim"]), str(d["value_dtype"]), int(d["num_slots"]))

    # ----------------------------------------------------------------- packing
    def empty(self, n: int) -> np.ndarray:
        """A zeroed ``uint8[n, record_bytes]`` buffer."""
        return np.zeros((int(n), self.record_bytes), dtype=np.uint8)

    def pack(
        self,
        keys: np.ndarray,
        values: np.ndarray,
        slots: np.ndarray | None = None,
        freq: np.ndarray | int = 0,
        version: np.ndarray | int = 0,
        seq: np.ndarray | int = 0,
    ) -> np.ndarray:
        """Pack a batch of rows into ``uint8[n, record_bytes]``.

        Parameters
        ----------
        keys
            ``int64[n]``.
        values
            ``[n, dim]``, cast to the storage dtype.
        slots
            ``float32[n, num_slots * dim]`` (None: zeros).
        freq, version, seq
            ``int64[n]`` arrays or one scalar for every row.

        Returns
        -------
        numpy.ndarray
            A new C-contiguous record buffer.
        """
        keys = as_keys(keys)
        n = keys.shape[0]
        values = np.asarray(values)
        if values.shape != (n, self.dim):
            raise ShapeError(
                f"values have shape {values.shape}; expected ({n}, {self.dim}) for {n} keys of dim "
                f"{self.dim}"
            )
        if slots is None:
            slots = np.zeros((n, self.slot_width), np.float32)
        slots = np.asarray(slots)
        if slots.shape != (n, self.slot_width):
            raise ShapeError(
                f"slots have shape {slots.shape}; expected ({n}, {self.slot_width}) "
                f"(num_slots={self.num_slots} x dim={self.dim})"
            )
        buf = self.empty(n)
        f = self.unpack(buf)
        f.keys[:] = keys
        f.freq[:] = freq
        f.version[:] = version
        f.change_seq[:] = seq
        f.values[:] = values.astype(self.dtype, copy=False)
        f.slots[:] = slots
        return buf

    def unpack(self, buf: np.ndarray) -> RecordFields:
        """Views of the fields of ``buf`` (``uint8[n, record_bytes]``); writes go through."""
        buf = self.check_records(buf, None)
        vo, so = self.values_offset, self.slots_offset
        head = {f: buf[:, 8 * w:8 * w + 8].view(np.int64)[:, 0] for f, w in HEADER_WORDS.items()}
        return RecordFields(
            **head,
            values=buf[:, vo : vo + self.values_bytes].view(self.dtype),
            slots=buf[:, so : so + 4 * self.slot_width].view(np.float32),
        )

    def record_keys(self, buf: np.ndarray) -> np.ndarray:
        """The key column of a record buffer (a view)."""
        w = HEADER_WORDS["keys"]
        return buf[:, 8 * w:8 * w + 8].view(np.int64)[:, 0]

    def check_records(self, records: object, n: int | None) -> np.ndarray:
        """Validate a record batch: ``uint8[n, record_bytes]``; returns it C-contiguous."""
        if not isinstance(records, np.ndarray):
            raise ShapeError(
                f"records must be a numpy uint8 array of shape (n, {self.record_bytes}), got "
                f"{type(records).__name__}; build them with RecordLayout.pack"
            )
        if records.dtype != np.uint8 or records.ndim != 2 or records.shape[1] != self.record_bytes:
            raise ShapeError(
                f"records have dtype {records.dtype} and shape {records.shape}; this layout "
                f"(dim={self.dim}, {self.value_dtype}, num_slots={self.num_slots}) needs uint8 "
                f"records of shape (n, {self.record_bytes}); build them with RecordLayout.pack"
            )
        if n is not None and records.shape[0] != n:
            raise ShapeError(
                f"{records.shape[0]} records given for {n} keys; pass one record per key"
            )
        if not records.flags.c_contiguous:
            records = np.ascontiguousarray(records)
        return records


def as_keys(keys: object) -> np.ndarray:
    """Validate a key batch and return it as a C-contiguous ``int64[n]`` array.

    Integer arrays that cast safely to int64 (int8..int64, uint8..uint32) and lists of Python
    ints are accepted; anything else raises :class:`~tensorkv.errors.KeyTypeError`.
    """
    if isinstance(keys, np.ndarray):
        arr = keys
    elif isinstance(keys, (list, tuple)):
        try:
            arr = np.asarray(keys) if keys else np.empty(0, np.int64)
        except (ValueError, OverflowError):
            raise KeyTypeError(f"keys {keys!r:.80} are not int64 values") from None
    else:
        raise KeyTypeError(
            f"keys must be a numpy int64 array, got {type(keys).__name__}; "
            "pass np.asarray(keys, dtype=np.int64)"
        )
    if arr.dtype != np.int64:
        if arr.dtype.kind not in "iu" or not np.can_cast(arr.dtype, np.int64, "safe"):
            raise KeyTypeError(
                f"keys have dtype {arr.dtype}; keys are int64: hash strings first and pass "
                "np.asarray(keys, dtype=np.int64)"
            )
        arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise ShapeError(f"keys have shape {arr.shape}; pass a 1-D int64 array (keys.ravel())")
    return np.ascontiguousarray(arr)


class LowerTier(ABC):
    """A storage tier below the table's DRAM/HBM tier, keyed by int64, storing records.

    Every method takes and returns batches. Writes of one batch apply in order, so a key given
    twice in one ``put`` keeps its last record. Implementations are thread-safe: one lock
    (``self._lock``) serialises mutations and reads; kernels release the GIL.

    Parameters
    ----------
    layout
        The record layout every record of this tier has.
    """

    #: Data survives :meth:`close` and reopening the same location.
    persistent: bool = True
    #: Short name for stats and messages (``ssdhash``, ``pmem``, ``kv``).
    kind: str = ""

    def __init__(self, layout: RecordLayout) -> None:
        if not isinstance(layout, RecordLayout):
            raise ConfigError(
                f"layout must be a RecordLayout, got {type(layout).__name__}: "
                "RecordLayout(dim, value_dtype, num_slots)"
            )
        self.layout = layout
        self.record_bytes = layout.record_bytes
        self._lock = threading.RLock()
        self._closed = False
        self._remove_dir: weakref.finalize | None = None

    # ----------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self!r} is closed; open it again")

    def _check_put(self, keys: object, records: object) -> tuple[np.ndarray, np.ndarray]:
        k = as_keys(keys)
        r = self.layout.check_records(records, k.shape[0])
        rk = self.layout.record_keys(r)
        if not np.array_equal(rk, k):
            i = int(np.flatnonzero(rk != k)[0])
            raise ShapeError(
                f"record {i} holds key {int(rk[i])} but is put under key {int(k[i])}; the key "
                "field of each record must equal its key (RecordLayout.pack sets it)"
            )
        return k, r

    # ----------------------------------------------------------------- contract
    @abstractmethod
    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Store one record per key (insert or overwrite)."""

    @abstractmethod
    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(found bool[n], records uint8[n, record_bytes])``; absent rows are zero."""

    @abstractmethod
    def delete(self, keys: np.ndarray) -> int:
        """Remove the keys (absent ones are ignored); return how many were present."""

    @abstractmethod
    def contains(self, keys: np.ndarray) -> np.ndarray:
        """``bool[n]``: which keys are stored."""

    @abstractmethod
    def keys(self) -> np.ndarray:
        """All stored keys as ``int64[len(self)]`` (no promised order)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of stored rows."""

    @abstractmethod
    def flush(self) -> None:
        """Make every acknowledged write durable."""

    @abstractmethod
    def _close(self) -> None:
        """Release resources (called once, under the lock)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: at least ``rows``, ``bytes``, ``reads``, ``writes``, ``compactions``."""

    @abstractmethod
    def check(self) -> list[str]:
        """Verify stored data; return a list of problems (empty: consistent)."""

    @abstractmethod
    def scan(self, chunk_rows: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys, records)`` chunks covering every row once.

        Writes may run between chunks (snapshots of a tiered table read the tier while the
        table trains): every row that none of them touches while the scan runs must be
        yielded with its record, at least once (a key may come twice); rows written or
        deleted meanwhile may be yielded or not, with either record. Compaction and other
        internal moves must keep this (``TierTests`` checks it).
        """

    def scores(self, field: str) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, values)``: one int64 header field of every stored row.

        ``field`` is ``"freq"`` or ``"change_seq"`` (what LFU / LRU cascades rank rows by).
        This default reads whole records through :meth:`scan`; tiers whose records sit in
        memory read the column alone.
        """
        word = score_word(field)
        keys, vals = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
        for k, r in self.scan():
            keys.append(np.array(k, np.int64))
            vals.append(r[:, 8 * word:8 * word + 8].copy().view(np.int64)[:, 0])
        return np.concatenate(keys), np.concatenate(vals)

    #: :meth:`read_into` with ``take=True`` removes the rows it read (else the caller must).
    takes_on_read: bool = False

    def read_into(self, keys: np.ndarray, alloc: Callable[[np.ndarray], np.ndarray],
                  sink: RowSink, take: bool = False) -> np.ndarray:
        """Copy the records of ``keys`` that are stored here straight into tier-0 rows.

        ``alloc(found)`` is called once, with the ``bool[n]`` mask of stored keys, and
        returns the tier-0 rows for ``keys[found]``; the records then land in those rows
        through ``sink``. Returns ``found``. This default reads through :meth:`get`; tiers
        that can read their records in place (SSDHASH's mmap) copy them without a buffer.
        With ``take``, a tier whose :attr:`takes_on_read` is True also removes the rows it
        read (a move, not a copy); others ignore it and the caller deletes them.
        """
        found, recs = self.get(keys)
        if found.any():
            rows = alloc(found)
            sink.write(recs if found.all() else recs[found], None, rows)
        return found

    def put_rows(self, keys: np.ndarray, source: RowSource) -> None:
        """Store tier-0 rows: :meth:`put` of ``source``'s records under ``keys``.

        Tiers that can pack the rows straight into their own write buffers (SSDHASH)
        override this to save a copy.
        """
        self.put(keys, source.pack())

    # ----------------------------------------------------------------- lifecycle
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    @property
    def location(self) -> str | None:
        """The absolute path (or the store URL) of the tier's data; None for a memory tier."""
        return getattr(self, "path", None)

    @property
    def temporary(self) -> bool:
        """Whether the tier lives in a temporary directory removed on close."""
        return self._remove_dir is not None

    def remove_on_close(self, directory: str) -> None:
        """Delete ``directory`` (a temporary one holding the tier) once the tier is closed.

        Also when the tier is garbage-collected or the interpreter exits unclosed.
        """
        self._remove_dir = weakref.finalize(self, shutil.rmtree, directory, ignore_errors=True)

    def close(self) -> None:
        """Flush and release the tier; closing twice is harmless."""
        with self._lock:
            if self._closed:
                return
            try:
                self._close()
            finally:
                self._closed = True
                if self._remove_dir is not None:
                    self._remove_dir()

    def __enter__(self) -> LowerTier:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def clear(self) -> None:
        """Remove every row."""
        self.delete(self.keys())


class _RowCopier:
    """Tier 0 and the record layout, with the word type their kernels copy in."""

    def __init__(self, arena: Any, layout: RecordLayout) -> None:
        self.arena = arena
        self.layout = layout
        self.word = kr.word_dtype(layout.values_offset, layout.values_bytes,
                                  layout.slots_offset, 4 * layout.slot_width)


class RowSink(_RowCopier):
    """Where promoted records land: the row arrays of tier 0 (a DRAM or HBM arena).

    Parameters
    ----------
    arena
        Tier 0 (:class:`~tensorkv.embedding.arena.RowArena` or an HBM arena).
    layout
        The record layout of the lower tiers.
    split
        ``split(fn, n)`` runs ``fn(start, stop)`` over ranges covering ``[0, n)``
        (:func:`tensorkv.embedding.chain.assist.run_split`); None: one call.
    """

    def __init__(self, arena: Any, layout: RecordLayout, split: Any = None) -> None:
        super().__init__(arena, layout)
        self.split = split

    def write(self, src: np.ndarray, src_rows: np.ndarray | None, rows: np.ndarray) -> None:
        """Copy records ``src[src_rows]`` (all of ``src`` when None) into tier-0 ``rows``.

        ``src`` is a C-contiguous ``uint8[m, width]`` buffer whose rows start with a record
        (``width >= record_bytes``, a multiple of 8), e.g. a memory-mapped SSDHASH segment.
        Every field but the key is written (the arena already maps the key to its row).
        """
        if src_rows is None:
            src_rows = np.arange(rows.shape[0], dtype=np.int64)
        self.write_many([(src, src_rows, rows)])

    def write_many(self, pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """:meth:`write` for several ``(src, src_rows, rows)`` at once (e.g. one per segment).

        With ``split``, the rows of all pieces together are cut into ranges shared with the
        helper thread; each tier-0 row is written by one range, so the result is the same.
        """
        self.arena.write_records(self.layout, self.word, pieces, self.split)


class RowSource(_RowCopier):
    """Tier-0 rows on their way down: packs them into records (the reverse of a RowSink).

    Parameters
    ----------
    arena
        Tier 0 (:class:`~tensorkv.embedding.arena.RowArena` or an HBM arena).
    layout
        The record layout of the lower tiers.
    keys, rows
        The keys and their tier-0 rows (``int64[n]``); a row must not change while it is
        packed.
    guard
        Held while the rows are read (a tiered table's lock against tier 0's arrays moving).
    """

    def __init__(self, arena: Any, layout: RecordLayout, keys: np.ndarray, rows: np.ndarray,
                 guard: Any = None) -> None:
        super().__init__(arena, layout)
        self.keys = keys
        self.rows = rows
        self.guard = guard

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def pack(self, out: np.ndarray | None = None) -> np.ndarray:
        """Write the records into ``out`` and return it.

        ``out`` is ``uint8[n, width]`` with ``width`` a multiple of 8 and at least
        ``record_bytes``; bytes past the record are left alone. Without ``out`` a new
        ``uint8[n, record_bytes]`` buffer is returned. Padding inside the record is zeroed.
        """
        n = self.rows.shape[0]
        if out is None:
            out = np.empty((n, self.layout.record_bytes), np.uint8)
        with self.guard or contextlib.nullcontext():  # tier 0's arrays cannot move meanwhile
            self.arena.read_records(self.layout, self.word, self.keys, self.rows, out)
        return out


def score_word(field: str) -> int:
    """The int64 word of header field ``field`` (``"freq"`` or ``"change_seq"``)."""
    if field not in SCORE_FIELDS:
        raise ConfigError(f"field={field!r} is not a score field; use one of "
                          f"{list(SCORE_FIELDS)}")
    return HEADER_WORDS[field]


def check_chunk_rows(chunk_rows: object) -> int:
    """Validate a scan chunk size."""
    if (
        isinstance(chunk_rows, bool)
        or not isinstance(chunk_rows, (int, np.integer))
        or chunk_rows < 1
    ):
        raise ConfigError(f"chunk_rows={chunk_rows!r} must be a positive integer")
    return int(chunk_rows)


class IndexedTier(LowerTier):
    """A tier whose rows are found through an in-memory ``HashIndex`` key -> location.

    Subclasses set ``self.index`` (:class:`tensorkv.kernels.ssdhash.HashIndex`), ``self._lock``
    and implement ``get``; the membership, key listing and scan methods below come for free.
    Scans visit rows in location order (on-disk order for segment files).
    """

    index: Any
    _lock: Any

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """``bool[n]``: which keys are stored."""
        keys = as_keys(keys)
        with self._lock:
            self._check_open()
            return self.index.lookup(keys) >= 0

    def keys(self) -> np.ndarray:
        """All stored keys."""
        with self._lock:
            self._check_open()
            return self.index.items()[0]

    def __len__(self) -> int:
        return len(self.index)

    def scan(self, chunk_rows: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys, records)`` chunks in location order; safe against concurrent writes."""
        chunk_rows = check_chunk_rows(chunk_rows)
        with self._lock:
            self._check_open()
            keys, locs = self.index.items()
        keys = keys[np.argsort(locs)]  # locations are distinct: any sort gives one order
        for i in range(0, keys.size, chunk_rows):
            ck = keys[i : i + chunk_rows]
            found, recs = self.get(ck)
            if not found.all():
                ck, recs = ck[found], recs[found]
            if ck.size:
                yield ck, recs
