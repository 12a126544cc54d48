"""KV tier: any :class:`~tensorkv.stores.KVStore` (LevelDB, RocksDB, LMDB, Redis...) as a tier.

:class:`KVTier` stores the records under order-preserving 8-byte keys (:func:`encode_keys`),
a batch at a time. Key encoding, layout metadata and batching: docs/tiers.md ("KV tier").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, cast

import numpy as np

from tensorkv.embedding.tiers.base import LowerTier, RecordLayout, as_keys, check_chunk_rows
from tensorkv.errors import ConfigError, CorruptRecordError, ShapeError
from tensorkv.stores import KVStore, open_store

_SIGN = np.uint64(1 << 63)
META_PREFIX = b"\x00tensorkv-tier/"
DEFAULT_BATCH_ROWS = 8192


def encode_keys(prefix: bytes, keys: np.ndarray) -> list[bytes]:
    """Store keys for int64 ``keys``: ``prefix`` + big-endian key with the sign bit flipped."""
    p = len(prefix)
    buf = np.empty((keys.size, p + 8), np.uint8)
    if p:
        buf[:, :p] = np.frombuffer(prefix, np.uint8)
    buf[:, p:] = ((keys.view(np.uint64) ^ _SIGN).astype(">u8")).view(np.uint8).reshape(-1, 8)
    return buf.view(f"V{p + 8}").ravel().tolist()


def decode_keys(prefix_len: int, raw: list[bytes]) -> np.ndarray:
    """Inverse of :func:`encode_keys` for keys all of length ``prefix_len + 8``."""
    if not raw:
        return np.empty(0, np.int64)
    buf = np.frombuffer(b"".join(raw), np.uint8).reshape(len(raw), prefix_len + 8)
    be = np.ascontiguousarray(buf[:, prefix_len:]).view(">u8")[:, 0]
    return (be.astype(np.uint64) ^ _SIGN).view(np.int64)


class KVTier(LowerTier):
    r"""Rows stored in a key-value store as fixed-width records.

    Parameters
    ----------
    store
        A store URL (opened with :func:`tensorkv.open_store` and closed with the tier) or an
        open :class:`~tensorkv.stores.KVStore` (left open on close).
    layout
        Record layout.
    prefix
        Key prefix of this table's rows (non-empty; must not start with ``b"\\x00"``).
    batch_rows
        Records per ``get_many`` / ``put_many`` call.
    overwrite
        Delete this tier's rows and layout (everything under ``prefix``) from the store
        first; other keys are left alone.
    **store_options
        Options for ``open_store`` when ``store`` is a URL.
    """

    kind = "kv"

    def __init__(
        self,
        store: str | KVStore,
        layout: RecordLayout,
        *,
        prefix: bytes | str = b"emb/",
        batch_rows: int = DEFAULT_BATCH_ROWS,
        overwrite: bool = False,
        **store_options: Any,
    ) -> None:
        super().__init__(layout)
        if isinstance(prefix, str):
            prefix = prefix.encode()
        if not isinstance(prefix, bytes) or not prefix or prefix.startswith(b"\x00"):
            raise ConfigError(
                f"prefix={prefix!r} must be non-empty bytes not starting with a zero byte, "
                "e.g. b'emb/'"
            )
        if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
            raise ConfigError(f"batch_rows={batch_rows!r} must be a positive integer")
        self.prefix = prefix
        self.batch_rows = batch_rows
        if isinstance(store, KVStore):
            self.store, self._owns = store, False
            if store_options:
                raise ConfigError(f"store options {sorted(store_options)} need a URL, not a store")
        elif isinstance(store, str):
            self.store, self._owns = open_store(store, **store_options), True
        else:
            raise ConfigError(f"store={store!r} must be a store URL or an open KVStore")
        # A private memory:// store vanishes on close; every other store keeps its rows.
        self.persistent = self.store.url.rstrip("/") != "memory:"
        self._counters = {"reads": 0, "writes": 0, "deletes": 0, "store_calls": 0}
        try:
            if overwrite:
                self.store.delete_prefix(self.prefix)
                self.store.delete(META_PREFIX + self.prefix)
            self._check_meta()
        except BaseException:
            if self._owns:
                self.store.close()
            raise

    def __repr__(self) -> str:
        return f"<KVTier {self.store.url!r} prefix={self.prefix!r}>"

    @property
    def location(self) -> str:
        """The store's URL."""
        return str(self.store.url)

    def _check_meta(self) -> None:
        mk = META_PREFIX + self.prefix
        raw = self.store.get(mk)
        if raw is None:
            if not self.store.readonly:
                meta = {"format": "tensorkv-kvtier", "version": 1, "layout": self.layout.to_dict()}
                self.store.put(mk, json.dumps(meta).encode())
            return
        stored = RecordLayout.from_dict(json.loads(raw)["layout"])
        if stored != self.layout:
            raise ShapeError(
                f"store {self.store.url!r} holds rows under {self.prefix!r} with {stored}; "
                f"this tier was opened with {self.layout}; use the same layout or another prefix"
            )

    # ----------------------------------------------------------------- writes
    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Store one record per key; later duplicates in the batch win."""
        keys, records = self._check_put(keys, records)
        n = keys.size
        if n == 0:
            return
        rb = self.record_bytes
        with self._lock:
            self._check_open()
            for i in range(0, n, self.batch_rows):
                ks = encode_keys(self.prefix, keys[i : i + self.batch_rows])
                vs = records[i : i + self.batch_rows].view(f"V{rb}").ravel().tolist()
                self.store.put_many(zip(ks, vs, strict=True))
                self._counters["store_calls"] += 1
            self._counters["writes"] += n

    def delete(self, keys: np.ndarray) -> int:
        """Remove keys; return how many were present."""
        keys = as_keys(keys)
        if keys.size == 0:
            return 0
        with self._lock:
            self._check_open()
            present = self.contains(keys)
            keys = np.unique(keys[present])
            for i in range(0, keys.size, self.batch_rows):
                self.store.delete_many(encode_keys(self.prefix, keys[i : i + self.batch_rows]))
                self._counters["store_calls"] += 1
            self._counters["deletes"] += int(keys.size)
            return int(keys.size)

    def flush(self) -> None:
        """Flush the store."""
        with self._lock:
            self._check_open()
            self.store.flush()

    # ----------------------------------------------------------------- reads
    def _decode_values(self, got: list[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
        arr = np.array(got, dtype=object)
        found = arr != None  # noqa: E711 - elementwise comparison on an object array
        blob = b"".join(arr[found].tolist())
        nf = int(found.sum())
        if len(blob) != nf * self.record_bytes:
            lens = [len(v) for v in arr[found].tolist() if len(v) != self.record_bytes]
            raise CorruptRecordError(
                f"store {self.store.url!r} holds values of {lens[:3]} bytes under {self.prefix!r};"
                f" records of this layout are {self.record_bytes} bytes"
            )
        out = np.zeros((found.size, self.record_bytes), np.uint8)
        out[found] = np.frombuffer(blob, np.uint8).reshape(nf, self.record_bytes)
        return found, out

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(found, records)``; absent rows are zero."""
        keys = as_keys(keys)
        n = keys.size
        found = np.zeros(n, bool)
        out = np.zeros((n, self.record_bytes), np.uint8)
        with self._lock:
            self._check_open()
            for i in range(0, n, self.batch_rows):
                got = self.store.get_many(encode_keys(self.prefix, keys[i : i + self.batch_rows]))
                f, r = self._decode_values(got)
                found[i : i + f.size] = f
                out[i : i + f.size] = r
                self._counters["store_calls"] += 1
            self._counters["reads"] += n
        return found, out

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """``bool[n]``: which keys are stored."""
        return self.get(keys)[0]

    def _scan_raw(self, chunk_rows: int, keys_only: bool) -> Iterator[tuple[list[bytes], list]]:
        ks: list[bytes] = []
        vs: list[bytes | None] = []
        want = len(self.prefix) + 8
        it = self.store.scan(self.prefix, keys_only=keys_only)
        for item in it:
            k, v = (cast(bytes, item), None) if keys_only else cast(tuple[bytes, bytes], item)
            if len(k) != want:
                continue
            ks.append(k)
            vs.append(v)
            if len(ks) >= chunk_rows:
                yield ks, vs
                ks, vs = [], []
        if ks:
            yield ks, vs

    def keys(self) -> np.ndarray:
        """All stored keys (ascending for stores with ordered scans)."""
        with self._lock:
            self._check_open()
            parts = [decode_keys(len(self.prefix), ks) for ks, _ in self._scan_raw(65536, True)]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def __len__(self) -> int:
        with self._lock:
            self._check_open()
            return self.store.count(self.prefix)

    def scan(self, chunk_rows: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys, records)`` chunks in store order."""
        chunk_rows = check_chunk_rows(chunk_rows)
        self._check_open()
        for ks, vs in self._scan_raw(chunk_rows, False):
            _, recs = self._decode_values(vs)
            yield decode_keys(len(self.prefix), ks), recs

    # ----------------------------------------------------------------- checks
    def check(self) -> list[str]:
        """Verify every row: value width and the record's key field equal the store key."""
        problems: list[str] = []
        with self._lock:
            self._check_open()
            want = len(self.prefix) + 8
            for ks, vs in self._scan_raw(65536, False):
                bad_len = [k for k, v in zip(ks, vs, strict=True) if len(v) != self.record_bytes]
                if bad_len:
                    problems.append(f"{len(bad_len)} values are not {self.record_bytes} bytes "
                                    f"(keys {bad_len[:3]})")  # fmt: skip
                    continue
                keys = decode_keys(want - 8, ks)
                _, recs = self._decode_values(vs)
                rk = self.layout.record_keys(recs)
                wrong = np.flatnonzero(rk != keys)
                if wrong.size:
                    problems.append(
                        f"{wrong.size} records hold another key (keys {keys[wrong[:5]].tolist()})"
                    )
        return problems

    def stats(self) -> dict[str, Any]:
        """Counters plus the store's own statistics under ``store``."""
        with self._lock:
            self._check_open()
            rows = len(self)
            return {
                "kind": self.kind,
                "url": self.store.url,
                "rows": rows,
                "bytes": rows * (self.record_bytes + len(self.prefix) + 8),
                "record_bytes": self.record_bytes,
                "compactions": 0,
                **self._counters,
                "store": self.store.stats(),
            }

    def _close(self) -> None:
        if self._owns:
            self.store.close()
        elif not self.store.closed:
            self.store.flush()
