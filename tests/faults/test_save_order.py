"""The order of a save's writes: its data is flushed before the manifest, the manifest after.

A recording store forwards every call to a real LMDB store (opened with ``sync=false``, as
saves open LMDB URLs: durability then comes from ``flush``) and logs each put, delete and
flush once the LMDB store has applied it. A tag is atomic only if every record it references
is on stable storage before its manifest is written, and durable when ``save`` returns only
if a flush follows the manifest.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import tensorkv
from tensorkv.checkpoint import layout
from tensorkv.stores.base import KVStore, WriteOp

from .model import SAVE_OPTIONS, assert_loads_as, expected, stages


class RecordingStore(KVStore):
    """A KVStore that forwards to ``inner`` and logs ``(op, key)``: put, delete, flush."""

    scheme = "recording"

    def __init__(self, inner: KVStore) -> None:
        super().__init__(f"recording+{inner.url}")
        self.inner = inner
        self.capabilities = inner.capabilities
        self.log: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()  # the log's order is the order of application

    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return self.inner.get_many(keys)

    def _write(self, ops: list[WriteOp], *, atomic: bool) -> None:
        with self._lock:
            target: Any = self.inner.batch() if atomic else contextlib.nullcontext(self.inner)
            with target as t:
                for k, v in ops:
                    if v is None:
                        t.delete(k)
                    else:
                        t.put(k, v)
            self.log += [("delete" if v is None else "put", k) for k, v in ops]

    def _compare_and_set(self, key: bytes, expected: bytes | None,
                         value: bytes | memoryview | None) -> bool:
        with self._lock:
            done = self.inner.compare_and_set(key, expected, value)
            if done:
                self.log.append(("delete" if value is None else "put", key))
            return done

    def _value_sizes(self, keys: list[bytes]) -> Any:
        return self.inner.value_sizes(keys)

    def identity(self) -> str | None:
        return self.inner.identity()

    def _flush(self) -> None:
        with self._lock:
            self.inner.flush()
            self.log.append(("flush", b""))

    def _scan(self, start: bytes | None, stop: bytes | None, keys_only: bool,
              limit: int | None) -> Iterator[tuple[bytes, bytes | None]]:
        it = self.inner.scan(start=start, stop=stop, keys_only=keys_only, limit=limit)
        return ((k, None) for k in it) if keys_only else iter(it)

    def _close(self) -> None:
        self.inner.close()


def _is_data(key: bytes) -> bool:
    return key.startswith((layout.CHUNK, layout.TABLE))


def test_data_flushed_before_the_manifest_and_the_manifest_after(tmp_path):
    store = RecordingStore(tensorkv.open_store(f"lmdb://{tmp_path}/db", sync=False))
    try:
        for tag, model in stages():  # t0 in full, t1 and t2 incremental
            start = len(store.log)
            tensorkv.save(model, store, tag, incremental=tag != "t0", **SAVE_OPTIONS)
            log = store.log[start:]
            manifest = layout.manifest_key(tag)
            at = [i for i, (op, k) in enumerate(log) if op == "put" and k == manifest]
            assert len(at) == 1, f"{tag}: the manifest was put {len(at)} times"
            m = at[0]
            data = [i for i, (op, k) in enumerate(log) if op == "put" and _is_data(k)]
            tables = [i for i in data if log[i][1].startswith(layout.tag_table_prefix(tag))]
            assert tables and len(data) > len(tables), f"{tag}: no blocks or no chunks written"
            flushes = [i for i, (op, _) in enumerate(log[:m]) if op == "flush"]
            assert flushes, f"{tag}: no flush between the data and the manifest"
            late = [log[i][1] for i in data if i > flushes[-1]]
            assert not late, (
                f"{tag}: {len(late)} records written after the last flush before the "
                f"manifest, e.g. {late[:3]}"
            )
            assert ("flush", b"") in log[m + 1 :], f"{tag}: no flush after the manifest"
        want = expected()
        for tag in ("t0", "t1", "t2"):
            assert_loads_as(tensorkv.load(None, store, tag), want[tag], tag)
    finally:
        store.close()
