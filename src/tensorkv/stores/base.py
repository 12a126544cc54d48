"""The KVStore abstract base class: one byte-level key-value API over every backend.

A backend implements five primitives (``_get_many``, ``_write``, ``_scan``, ``_close`` and
``_stats``) and declares its :class:`Capabilities`. Everything public here validates its
arguments first, so a bad key never reaches a backend and a refused write changes nothing.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast, overload

import numpy as np

from tensorkv.errors import (
    ConfigError,
    EmptyKeyError,
    KeyNotFoundError,
    KeyTypeError,
    ReadOnlyError,
    StoreClosedError,
    UnsupportedOperationError,
    ValueTooLargeError,
)

if TYPE_CHECKING:
    from tensorkv.stores.url import StoreURL

#: A value handed to a store: any contiguous bytes-like object (numpy arrays included).
Buffer = bytes | bytearray | memoryview | np.ndarray
#: A value handed out by :meth:`KVStore.get_many_buffers`.
ReadBuffer = bytes | memoryview
WriteOp = tuple[bytes, "bytes | memoryview | None"]  # value None means delete


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees; the conformance tests check each claim.

    Attributes
    ----------
    ordered_scans
        ``scan`` yields keys in ascending byte order (otherwise in no promised order).
    atomic_batches
        A ``batch()`` is applied all or nothing, even if the process is killed mid-way.
    durable_on_return
        Data written is on stable storage (or replicated) when the write call returns.
    multi_process
        Several processes may open the same store at once and see each other's writes.
    distributed
        The store may span several machines.
    """

    ordered_scans: bool
    atomic_batches: bool
    durable_on_return: bool
    multi_process: bool
    distributed: bool = False

    def as_dict(self) -> dict[str, bool]:
        """Return the flags as a plain dict."""
        return asdict(self)


def check_key(key: object) -> bytes:
    """Validate one key: non-empty bytes (bytearray/memoryview are converted)."""
    if isinstance(key, bytes):
        if not key:
            raise EmptyKeyError("empty key b''; keys must be at least one byte long")
        return key
    if isinstance(key, (bytearray, memoryview)):
        return check_key(bytes(key))
    if isinstance(key, str):
        raise KeyTypeError(
            f"key {key!r} is a str; keys are bytes: pass {key.encode()!r} or key.encode()"
        )
    raise KeyTypeError(f"key {key!r} has type {type(key).__name__}; keys must be bytes")


def check_value(key: bytes, value: object, max_size: int | None) -> bytes | memoryview:
    """Validate one value: any contiguous bytes-like object within the backend's limit."""
    if isinstance(value, bytes):
        size = len(value)
    elif isinstance(value, (bytearray, memoryview)):
        value = memoryview(value)
        if not value.contiguous:
            raise KeyTypeError(f"value for key {key!r} is a non-contiguous buffer; copy it first")
        value = value.cast("B") if value.format != "B" or value.ndim != 1 else value
        size = value.nbytes
    elif isinstance(value, str):
        raise KeyTypeError(
            f"value for key {key!r} is a str; values are bytes: encode it "
            "(or store tensors with tensorkv.codec.encode)"
        )
    else:
        # numpy arrays and other buffer exporters; anything else raises TypeError
        try:
            value = memoryview(value).cast("B")  # type: ignore[arg-type]
        except TypeError:
            raise KeyTypeError(
                f"value for key {key!r} has type {type(value).__name__}; values must be "
                "bytes-like (bytes, bytearray, memoryview, or a contiguous numpy array)"
            ) from None
        size = value.nbytes
    if max_size is not None and size > max_size:
        raise ValueTooLargeError(
            f"value for key {key!r} is {size} bytes; this backend stores at most {max_size} "
            "bytes per value: split it (tensorkv.save chunks tensors for you)"
        )
    return value


def check_keys(keys: object) -> list[bytes]:
    """Return ``keys`` (a sequence of keys, not one key) as a list of checked ``bytes`` keys."""
    if isinstance(keys, (bytes, bytearray, str)):
        raise KeyTypeError(
            f"expected a sequence of keys, got a single {type(keys).__name__} {keys!r}; "
            "wrap it in a list"
        )
    try:
        # a non-iterable raises TypeError, turned into KeyTypeError below
        return [check_key(k) for k in cast("Iterable[object]", keys)]
    except TypeError as exc:
        if isinstance(exc, KeyTypeError):
            raise
        raise KeyTypeError(
            f"expected a sequence of bytes keys, got {type(keys).__name__}"
        ) from None


def prefix_upper_bound(prefix: bytes) -> bytes | None:
    """Smallest key greater than every key starting with ``prefix`` (None: no bound)."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return None


class WriteBatch:
    """Writes collected by :meth:`KVStore.batch` and applied when the block exits.

    Later operations on the same key override earlier ones.
    """

    def __init__(self, store: KVStore) -> None:
        self._store = store
        self._ops: dict[bytes, bytes | memoryview | None] = {}

    def put(self, key: bytes, value: Buffer) -> None:
        """Queue a put."""
        k = check_key(key)
        self._ops[k] = check_value(k, value, self._store.max_value_size)

    def put_many(self, items: Mapping[bytes, Buffer] | Iterable[tuple[bytes, Buffer]]) -> None:
        """Queue several puts."""
        pairs = items.items() if isinstance(items, Mapping) else items
        for k, v in pairs:
            self.put(k, v)

    def delete(self, key: bytes) -> None:
        """Queue a delete."""
        self._ops[check_key(key)] = None

    def delete_many(self, keys: Iterable[bytes]) -> None:
        """Queue several deletes."""
        for k in check_keys(keys):
            self._ops[k] = None

    def __len__(self) -> int:
        return len(self._ops)

    def ops(self) -> list[WriteOp]:
        """The queued operations in order."""
        return list(self._ops.items())


class KVStore(ABC):
    """A byte-level key-value store.

    Batch methods (:meth:`get_many`, :meth:`put_many`, :meth:`delete_many`) are the primary
    API; single-key methods are conveniences over them. Open one with
    :func:`tensorkv.open_store`.

    Parameters
    ----------
    url
        The URL the store was opened with (for messages and ``repr``).
    readonly
        Refuse every write with :class:`~tensorkv.errors.ReadOnlyError`.
    """

    #: URL scheme this backend serves (an instance may say which of several opened it).
    scheme: str = ""
    #: What this backend guarantees (set on the class; an instance may narrow it, e.g. an
    #: LMDB store opened with ``sync=False`` is not ``durable_on_return``).
    capabilities: Capabilities
    #: Largest value in bytes the backend accepts (None: no limit beyond memory).
    max_value_size: ClassVar[int | None] = None
    #: Whether :meth:`get_many_buffers` hands out views of the backend's own memory (no copy).
    zero_copy_reads: ClassVar[bool] = False

    def __init__(self, url: str = "", *, readonly: bool = False) -> None:
        self.url = url
        self.readonly = bool(readonly)
        self._closed = False
        self._close_lock = threading.Lock()

    @classmethod
    def from_url(cls, parsed: StoreURL, **options: Any) -> KVStore:
        """Open the store a parsed URL names (what :func:`~tensorkv.stores.open_store` calls).

        ``options`` are the URL's query options updated with the caller's keyword options.
        Every backend implements it.
        """
        raise NotImplementedError(f"{cls.__name__} does not implement from_url")

    # ----------------------------------------------------------------- primitives
    @abstractmethod
    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Return the value of each key, or None where absent."""

    @abstractmethod
    def _write(self, ops: list[WriteOp], *, atomic: bool) -> None:
        """Apply puts (value given) and deletes (value None), in order.

        ``atomic`` asks for all-or-nothing; backends whose capabilities claim atomic batches
        must honour it.
        """

    @abstractmethod
    def _scan(
        self,
        start: bytes | None,
        stop: bytes | None,
        keys_only: bool,
        limit: int | None,
    ) -> Iterator[tuple[bytes, bytes | None]]:
        """Yield (key, value) for start <= key < stop (value None when keys_only)."""

    @abstractmethod
    def _close(self) -> None:
        """Release the backend's resources."""

    def _flush(self) -> None:
        """Push buffered writes to stable storage (default: nothing to do)."""
        return None

    def _stats(self) -> dict[str, Any]:
        """Backend-specific statistics."""
        return {}

    # ----------------------------------------------------------------- state checks
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.url!r} is closed; open it again with open_store")

    def _check_writable(self) -> None:
        self._check_open()
        if self.readonly:
            raise ReadOnlyError(
                f"store {self.url!r} was opened read-only; open it with readonly=False to write"
            )

    # ----------------------------------------------------------------- batch API
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Return the value of each key (None where absent), in the order given."""
        self._check_open()
        ks = check_keys(keys)
        if not ks:
            return []
        return self._get_many(ks)

    @contextmanager
    def get_many_buffers(self, keys: Sequence[bytes]) -> Iterator[Sequence[ReadBuffer | None]]:
        """Values of several keys as read-only buffers that are valid inside the ``with`` block.

        Backends with ``zero_copy_reads`` (LMDB) yield views of their own memory, read in one
        consistent snapshot, without copying the values; the others yield what
        :meth:`get_many` returns. Either way, use the buffers (and arrays made from them) only
        inside the block: copy what must outlive it.

        Examples
        --------
        >>> import tensorkv
        >>> store = tensorkv.open_store("memory://")
        >>> store.put_many({b"a": b"12", b"b": b"345"})
        >>> with store.get_many_buffers([b"a", b"b", b"c"]) as (a, b, c):
        ...     sum(memoryview(v).nbytes for v in (a, b, c) if v is not None)
        5
        >>> store.close()
        """
        yield self.get_many(keys)

    def get_many_views(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """Values as read-only uint8 arrays that stay valid for as long as they live.

        Backends with ``zero_copy_reads`` (LMDB) return views of their data file without
        copying, pinning the snapshot they were read in while any of them lives; the
        others return arrays over what :meth:`get_many` returns (no further copy).
        """
        out: list[np.ndarray | None] = []
        for v in self.get_many(keys):
            a = None if v is None else np.frombuffer(v, np.uint8)
            if a is not None and a.flags.writeable:
                a.flags.writeable = False
            out.append(a)
        return out

    def put_many(self, items: Mapping[bytes, Buffer] | Iterable[tuple[bytes, Buffer]]) -> None:
        """Store several key-value pairs. Values may be any contiguous bytes-like object."""
        self._check_writable()
        pairs = items.items() if isinstance(items, Mapping) else items
        ops: list[WriteOp] = []
        limit = self.max_value_size
        try:
            for k, v in pairs:
                ck = check_key(k)
                ops.append((ck, check_value(ck, v, limit)))
        except (TypeError, ValueError) as exc:
            if isinstance(exc, (KeyTypeError, EmptyKeyError, ValueTooLargeError)):
                raise
            raise KeyTypeError(
                "put_many takes a mapping or an iterable of (key, value) pairs of bytes"
            ) from exc
        if ops:
            self._write(ops, atomic=False)

    def delete_many(self, keys: Sequence[bytes]) -> None:
        """Delete several keys; absent keys are ignored."""
        self._check_writable()
        ks = check_keys(keys)
        if ks:
            self._write([(k, None) for k in ks], atomic=False)

    # ----------------------------------------------------------------- atomic updates
    def compare_and_set(self, key: bytes, expected: bytes | None, value: Buffer | None) -> bool:
        """Set ``key`` to ``value`` only if it holds ``expected``; return whether it did.

        ``expected=None`` means the key must be absent; ``value=None`` deletes it. The
        comparison and the write are one atomic step against every other write to the key,
        from any thread and, on multi-process backends, any process (Redis runs it as one
        server-side script; LMDB inside one write transaction).

        Examples
        --------
        >>> import tensorkv
        >>> store = tensorkv.open_store("memory://")
        >>> store.compare_and_set(b"lock", None, b"me")  # only if absent
        True
        >>> store.compare_and_set(b"lock", None, b"you")  # taken: nothing written
        False
        >>> store.get(b"lock")
        b'me'
        >>> store.close()
        """
        self._check_writable()
        k = check_key(key)
        old = None if expected is None else bytes(check_value(k, expected, None))
        new = None if value is None else check_value(k, value, self.max_value_size)
        return self._compare_and_set(k, old, new)

    def put_if_absent(self, key: bytes, value: Buffer) -> bool:
        """Store ``key`` only if it does not exist yet; return whether it was stored."""
        return self.compare_and_set(key, None, value)

    def put_first_absent(self, prefix: bytes, start: int, value: Buffer,
                         before: Sequence[tuple[bytes, Buffer]] = ()) -> int:
        """Write the items ``before``, then ``value`` under the first absent numbered key.

        The keys are ``prefix`` + a 12-digit number, from ``start`` up: an append-only log
        that writers in any process extend without overwriting each other. ``before`` is
        written either way and no later than the entry (whoever sees the entry sees it).
        Returns the entry's number. One round trip on Redis (one server-side script, which
        also keeps ``prefix + b"next"``, where the next search starts; a cluster makes
        several calls) and one transaction on LMDB.
        """
        self._check_writable()
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"start={start!r}: give an int >= 0")
        first = check_key(prefix + b"%012d" % start)
        v = check_value(first, value, self.max_value_size)
        items = []
        for bk, bv in before:
            ck = check_key(bk)
            items.append((ck, check_value(ck, bv, self.max_value_size)))
        return self._put_first_absent(prefix, start, v, items)

    def _put_first_absent(self, prefix: bytes, start: int, value: bytes | memoryview,
                          before: list[tuple[bytes, bytes | memoryview]]) -> int:
        if before:
            self._write(list(before), atomic=True)
        seq = start
        while not self._compare_and_set(prefix + b"%012d" % seq, None, value):
            seq += 1
        return seq

    def _compare_and_set(
        self, key: bytes, expected: bytes | None, value: bytes | memoryview | None
    ) -> bool:
        raise UnsupportedOperationError(
            f"{type(self).__name__} does not implement compare_and_set; checkpoints need it "
            "to create tags atomically: implement _compare_and_set in the backend"
        )

    def value_sizes(self, keys: Sequence[bytes]) -> np.ndarray:
        """Size in bytes of each key's value, -1 where the key is absent (int64 array).

        Cheaper than :meth:`get_many` where the backend can tell sizes without sending values
        (Redis ``STRLEN``; LMDB reads them in place).
        """
        self._check_open()
        ks = check_keys(keys)
        if not ks:
            return np.empty(0, np.int64)
        return self._value_sizes(ks)

    def _value_sizes(self, keys: list[bytes]) -> np.ndarray:
        with self.get_many_buffers(keys) as bufs:
            return np.fromiter(
                (-1 if b is None else memoryview(b).nbytes for b in bufs),
                dtype=np.int64, count=len(keys),
            )

    def identity(self) -> str | None:
        """A token naming the server process that holds the data; None for local stores.

        It changes when a server restarts or a replica takes over, so a writer that reads
        the same token before and after its writes knows one server received and kept them.
        """
        self._check_open()
        return None

    # ----------------------------------------------------------------- conveniences
    def get(self, key: bytes, default: bytes | None = None) -> bytes | None:
        """Return the value of ``key``, or ``default`` when absent."""
        v = self.get_many([key])[0]
        return default if v is None else v

    def put(self, key: bytes, value: Buffer) -> None:
        """Store one key-value pair."""
        self.put_many([(key, value)])

    def delete(self, key: bytes) -> None:
        """Delete one key (no error when absent)."""
        self.delete_many([key])

    def __contains__(self, key: object) -> bool:
        return self.get_many([check_key(key)])[0] is not None

    def __getitem__(self, key: bytes) -> bytes:
        v = self.get_many([key])[0]
        if v is None:
            raise KeyNotFoundError(key)
        return v

    def __setitem__(self, key: bytes, value: Buffer) -> None:
        self.put(key, value)

    def __delitem__(self, key: bytes) -> None:
        self.delete(key)

    # ----------------------------------------------------------------- scans
    @overload
    def scan(
        self,
        prefix: bytes = ...,
        *,
        start: bytes | None = ...,
        stop: bytes | None = ...,
        keys_only: Literal[False] = ...,
        limit: int | None = ...,
    ) -> Iterator[tuple[bytes, bytes]]: ...

    @overload
    def scan(
        self,
        prefix: bytes = ...,
        *,
        start: bytes | None = ...,
        stop: bytes | None = ...,
        keys_only: Literal[True],
        limit: int | None = ...,
    ) -> Iterator[bytes]: ...

    @overload
    def scan(
        self,
        prefix: bytes = ...,
        *,
        start: bytes | None = ...,
        stop: bytes | None = ...,
        keys_only: bool,
        limit: int | None = ...,
    ) -> Iterator[tuple[bytes, bytes]] | Iterator[bytes]: ...

    def scan(
        self,
        prefix: bytes = b"",
        *,
        start: bytes | None = None,
        stop: bytes | None = None,
        keys_only: bool = False,
        limit: int | None = None,
    ) -> Iterator[tuple[bytes, bytes]] | Iterator[bytes]:
        """Iterate over keys in a range, with their values unless ``keys_only``.

        Parameters
        ----------
        prefix
            Only keys starting with this prefix.
        start, stop
            Only keys with ``start <= key < stop`` (combined with ``prefix``).
        keys_only
            Yield keys alone, without reading values.
        limit
            Stop after this many items.

        Notes
        -----
        Keys come in ascending byte order where ``capabilities.ordered_scans`` is true.
        """
        self._check_open()
        if not isinstance(prefix, (bytes, bytearray)):
            raise KeyTypeError(f"prefix {prefix!r} must be bytes")
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ConfigError(f"limit={limit!r} must be a non-negative integer or None")
        lo: bytes | None = bytes(prefix) or None
        hi = prefix_upper_bound(bytes(prefix)) if prefix else None
        if start is not None:
            start = bytes(start)
            lo = start if lo is None or start > lo else lo
        if stop is not None:
            stop = bytes(stop)
            hi = stop if hi is None or stop < hi else hi
        if limit == 0 or (lo is not None and hi is not None and lo >= hi):
            return iter(())
        it = self._scan(lo, hi, keys_only, limit)
        if keys_only:
            return (k for k, _ in it)
        return cast("Iterator[tuple[bytes, bytes]]", it)  # values are None only if keys_only

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        """Iterate over the keys starting with ``prefix``."""
        return self.scan(prefix, keys_only=True)

    def count(self, prefix: bytes = b"") -> int:
        """Number of keys starting with ``prefix``."""
        return sum(1 for _ in self.scan(prefix, keys_only=True))

    def delete_prefix(self, prefix: bytes, *, chunk: int = 4096) -> int:
        """Delete every key starting with ``prefix``; return how many were deleted."""
        self._check_writable()
        if not isinstance(prefix, (bytes, bytearray)):
            raise KeyTypeError(f"prefix {prefix!r} must be bytes")
        total = 0
        while True:
            ks = list(self.scan(bytes(prefix), keys_only=True, limit=chunk))
            if not ks:
                return total
            self._write([(k, None) for k in ks], atomic=False)
            total += len(ks)

    # ----------------------------------------------------------------- batches
    @contextmanager
    def batch(self) -> Iterator[WriteBatch]:
        """Collect writes and apply them when the block exits without an exception.

        The batch is atomic (all or nothing, even on a crash) where
        ``capabilities.atomic_batches`` is true. An exception inside the block discards it.
        """
        self._check_writable()
        wb = WriteBatch(self)
        yield wb
        ops = wb.ops()
        if ops:
            self._check_writable()
            self._write(ops, atomic=True)

    # ----------------------------------------------------------------- lifecycle
    def flush(self) -> None:
        """Push buffered writes to stable storage."""
        self._check_open()
        if not self.readonly:
            self._flush()

    def compact(self) -> tuple[int, int]:
        """Give the space of deleted data back to the file system.

        LMDB copies its live pages to a new file and swaps it in (refused while another
        process has the store open); RocksDB and LevelDB compact every key range; memory
        stores have nothing to do.

        Returns
        -------
        tuple of int
            The store's size on disk in bytes before and after.

        Raises
        ------
        UnsupportedOperationError
            The backend cannot compact on request (Redis manages its own memory).
        """
        self._check_writable()
        return self._compact()

    def _compact(self) -> tuple[int, int]:
        from tensorkv.errors import UnsupportedOperationError

        raise UnsupportedOperationError(
            f"{self.scheme}:// stores ({type(self).__name__}) cannot compact on request; a "
            "server such as Redis reclaims the memory of deleted keys itself"
        )

    def close(self) -> None:
        """Close the store; later calls raise StoreClosedError. Closing twice is harmless."""
        with self._close_lock:
            if self._closed:
                return
            try:
                if not self.readonly:
                    self._flush()
            finally:
                self._closed = True
                self._close()

    def __enter__(self) -> KVStore:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """Statistics: backend name, capabilities, and backend-specific counters."""
        self._check_open()
        out: dict[str, Any] = {
            "backend": self.scheme,
            "url": self.url,
            "readonly": self.readonly,
            "capabilities": self.capabilities.as_dict(),
        }
        out.update(self._stats())
        return out

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("read-only" if self.readonly else "open")
        return f"<{type(self).__name__} {self.url!r} {state}>"
