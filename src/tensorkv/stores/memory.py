"""In-process memory store: a sorted dict, for tests, caches and the reference behaviour."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tensorkv.errors import InvalidURLError
from tensorkv.stores.base import Capabilities, KVStore, WriteOp

if TYPE_CHECKING:
    from tensorkv.stores.url import StoreURL


class _Data:
    """A dict plus a sorted key list that is rebuilt lazily, on the first scan after a write.

    Keeping the list sorted on every insert (``bisect.insort``) makes bulk loads quadratic;
    sorting once per scan after writes keeps puts O(1) and scans O(n log n) at worst.
    """

    def __init__(self) -> None:
        self.items: dict[bytes, bytes] = {}
        self._sorted: list[bytes] = []
        self._dirty = False
        self.lock = threading.RLock()  # shared by every store object of a named store

    def sorted_keys(self) -> list[bytes]:
        if self._dirty:
            self._sorted = sorted(self.items)
            self._dirty = False
        return self._sorted


# Named memory stores live for the life of the process, so two open_store("memory://x")
# calls see the same data (like a shared in-memory database).
_NAMED: dict[str, _Data] = {}
_NAMED_LOCK = threading.Lock()


class MemoryStore(KVStore):
    """A store in this process's memory.

    ``memory://`` opens a private store; ``memory://NAME`` opens a named one shared by every
    ``open_store`` call in the process.
    """

    scheme = "memory"
    capabilities = Capabilities(
        ordered_scans=True, atomic_batches=True, durable_on_return=False, multi_process=False
    )

    def __init__(self, url: str = "memory://", *, name: str | None = None, readonly: bool = False):
        super().__init__(url, readonly=readonly)
        if name:
            with _NAMED_LOCK:
                self._store = _NAMED.setdefault(name, _Data())
        else:
            self._store = _Data()
        self._data = self._store.items
        self._lock = self._store.lock

    @classmethod
    def from_url(cls, parsed: StoreURL, **options: Any) -> MemoryStore:
        """Open from a parsed URL."""
        name = parsed.hosts[0][0] if parsed.hosts else None
        readonly = bool(options.pop("readonly", False))
        if options:
            raise InvalidURLError(
                f"memory store does not take options {sorted(options)}; only readonly"
            )
        return cls(parsed.url, name=name, readonly=readonly)

    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        d = self._data
        with self._lock:
            return [d.get(k) for k in keys]

    def _write(self, ops: list[WriteOp], *, atomic: bool) -> None:
        # Copy values first so nothing changes if a conversion fails.
        staged = [(k, None if v is None else bytes(v)) for k, v in ops]
        with self._lock:
            d = self._data
            changed = False
            for k, v in staged:
                if v is None:
                    changed |= d.pop(k, None) is not None
                else:
                    changed |= k not in d
                    d[k] = v
            if changed:
                self._store._dirty = True

    def _compare_and_set(
        self, key: bytes, expected: bytes | None, value: bytes | memoryview | None
    ) -> bool:
        with self._lock:
            if self._data.get(key) != expected:
                return False
            self._write([(key, value)], atomic=True)
            return True

    def _scan(
        self, start: bytes | None, stop: bytes | None, keys_only: bool, limit: int | None
    ) -> Iterator[tuple[bytes, bytes | None]]:
        with self._lock:
            ks = self._store.sorted_keys()
            i = 0 if start is None else bisect.bisect_left(ks, start)
            j = len(ks) if stop is None else bisect.bisect_left(ks, stop)
            if limit is not None:
                j = min(j, i + limit)
            sel = ks[i:j]
            items = [(k, None if keys_only else self._data[k]) for k in sel]
        return iter(items)

    def count(self, prefix: bytes = b"") -> int:
        """Number of keys starting with ``prefix`` (O(log n))."""
        self._check_open()
        from tensorkv.stores.base import prefix_upper_bound

        with self._lock:
            ks = self._store.sorted_keys()
            if not prefix:
                return len(ks)
            hi = prefix_upper_bound(bytes(prefix))
            j = len(ks) if hi is None else bisect.bisect_left(ks, hi)
            return j - bisect.bisect_left(ks, bytes(prefix))

    def _close(self) -> None:
        pass

    def _compact(self) -> tuple[int, int]:
        """Nothing to give back: a deleted key's memory is freed at once."""
        n = self._stats()["bytes"]
        return n, n

    def _stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "keys": len(self._data),
                "bytes": sum(len(k) + len(v) for k, v in self._data.items()),
            }
