"""The checkpoint record writer: :class:`BlockWriter` batches records onto a store.

Block records (:mod:`tensorkv.checkpoint.tables`), key lists (:mod:`~.keylists`) and dense
tensors (:mod:`~.dense`) are queued on one writer, which writes them in batches on a helper
thread and reuses the record buffers once the store copied them (kept with the table that
filled them for its next save). A leaf module: the code that fills records imports it, and it
imports none of them.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tensorkv.checkpoint.progress import OnBytes
from tensorkv.stores.base import KVStore

# Bytes of records per store write (one LMDB transaction, one Redis pipeline). A default
# 8.8 MB block is a batch of its own: LMDB commits of 64 MB batches measured 4-10x slower
# than one block per commit (the transaction's dirty pages are malloc'd and freed each time).
WRITE_BATCH_BYTES = 8 * 1024 * 1024
# Bytes of batches queued for the writer thread: an export chunk of default blocks (16 x 8.8 MB)
# fits, so the next chunk is gathered while the store writes this one.
QUEUE_BYTES = 160 * 1024 * 1024
# Bytes written between ``after_write`` calls: every batch, so the disk writes the data back
# while the next batch is encoded and the final fsync finds little left to write.
WRITEBACK_BYTES = WRITE_BATCH_BYTES


class BlockWriter:
    """Buffers block and key-list records and writes them in batches on a helper thread.

    Batches of ``WRITE_BATCH_BYTES`` queue up for one writer thread, up to ``QUEUE_BYTES`` of
    them, so the caller gathers the next export chunk while the store writes the previous one
    (with one batch in flight at a time, the two took turns). ``after_write`` (if given) runs
    on the writer thread after every ``WRITEBACK_BYTES`` (see
    :func:`tensorkv.checkpoint.access.writeback_starter`). Record buffers from :meth:`alloc`
    are reused once the store has copied them, so a save touches fresh memory only for the
    first ``QUEUE_BYTES`` plus one chunk.
    """

    def __init__(self, store: KVStore, prefix: bytes, hash_tag: str | None,
                 on_bytes: OnBytes | None, after_write: Callable[[], None] | None = None,
                 owner: Any = None):
        self.store = store
        self.after_write = after_write
        self.prefix = prefix
        self.hash_tag = hash_tag
        self.on_bytes = on_bytes
        self.owner = owner
        self._batch: list[tuple[bytes, Any]] = []
        self._bytes = 0
        self.written = 0
        # buffers the store has copied, for reuse (those ``owner`` kept from its last save)
        self._pool: list[np.ndarray] = _take_kept(owner)
        self._out: dict[int, np.ndarray] = {}  # id -> buffer: handed out, not yet put
        self._lent: list[np.ndarray] = []  # buffers of the records in the batch being filled
        # (future, bytes) oldest first
        self._queue: deque[tuple[Future[tuple[int, list[np.ndarray]]], int]] = deque()
        self._queued = 0
        self._executor: ThreadPoolExecutor | None = None
        self._since_after = 0  # bytes written since after_write last ran (writer thread)

    def alloc(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of ``nbytes`` (reused after the batch holding it was written)."""
        while self._queue and self._queue[0][0].done():
            self._retire()
        fits = [i for i, b in enumerate(self._pool) if b.nbytes >= nbytes]
        if fits:  # the smallest that fits: a larger buffer's unused tail is never touched
            base = self._pool.pop(min(fits, key=lambda i: self._pool[i].nbytes))
        else:
            base = np.empty(nbytes, dtype=np.uint8)
        self._out[id(base)] = base
        return base[:nbytes]

    def put(self, key: bytes, value: Any) -> None:
        """Queue one record (bytes, or a uint8 array, which may be a buffer from :meth:`alloc`).

        A buffer from :meth:`alloc` is reused only after the batch holding its record was
        written.
        """
        base = getattr(value, "base", None)
        if base is not None and id(base) in self._out:
            self._lent.append(self._out.pop(id(base)))
        self._batch.append((key, value))
        self._bytes += len(value)
        if self._bytes >= WRITE_BATCH_BYTES:
            self._submit()

    def send(self) -> None:
        """Start writing the records put so far (a partial batch too); do not wait."""
        self._submit()

    def _retire(self) -> None:
        """Wait for the oldest batch in flight; its buffers become reusable."""
        fut, n = self._queue.popleft()
        self._queued -= n
        nbytes, lent = fut.result()  # re-raises the store's error here
        self.written += nbytes
        if self.on_bytes:
            self.on_bytes(nbytes)
        self._pool.extend(lent)
        keep = 0
        for i in range(len(self._pool) - 1, -1, -1):  # newest first, up to KEEP_BYTES
            keep += self._pool[i].nbytes
            if keep > KEEP_BYTES:
                del self._pool[: i + 1]
                break

    def _wait(self) -> None:
        """Wait for every batch in flight."""
        while self._queue:
            self._retire()

    def _submit(self) -> None:
        """Hand the batch being filled to the writer thread, first making room in the queue."""
        if not self._batch:
            return
        batch, nbytes, lent = self._batch, self._bytes, self._lent
        self._batch, self._bytes, self._lent = [], 0, []
        while self._queue and self._queued + nbytes > QUEUE_BYTES:
            self._retire()

        def write() -> tuple[int, list[np.ndarray]]:
            self.store.put_many(batch)  # every backend copies the values
            if self.after_write is not None:
                self._since_after += nbytes
                if self._since_after >= WRITEBACK_BYTES:
                    self._since_after = 0
                    self.after_write()
            return nbytes, lent

        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tensorkv-ckpt-write")
        self._queue.append((self._executor.submit(write), nbytes))
        self._queued += nbytes

    def _shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def abort(self) -> None:
        """Drop what is queued and wait for the batch being written (errors are ignored)."""
        self._batch, self._bytes, self._lent = [], 0, []
        self._out.clear()
        try:
            self._shutdown()  # cancels batches not started, waits for the one running
        finally:
            self._queue.clear()
            self._queued = 0

    def flush(self) -> None:
        """Write everything queued and wait until the store has it."""
        try:
            self._submit()
            self._wait()
        finally:
            self._shutdown()
        _keep(self.owner, self._pool)
        self._pool = []


# Record buffers kept with the object whose rows filled them (weakly: they go with it), so
# its next save reuses memory instead of touching fresh pages: on machines where a fresh page
# costs a fault and a zero-fill (and a hypervisor round trip on VMs that hand free memory back
# to the host), that is most of the time of a small incremental save. At most KEEP_BYTES are
# kept in all; the tables saved most recently keep theirs.
KEEP_BYTES = 2 * QUEUE_BYTES
_KEPT: weakref.WeakKeyDictionary[Any, list[np.ndarray]] = weakref.WeakKeyDictionary()
_KEPT_LOCK = threading.Lock()


def _take_kept(owner: Any) -> list[np.ndarray]:
    if owner is None:
        return []
    with _KEPT_LOCK:
        try:
            return _KEPT.pop(owner, [])
        except TypeError:  # not weak-referenceable
            return []


def _keep(owner: Any, pool: list[np.ndarray]) -> None:
    """Keep the newest buffers of ``pool`` with ``owner``, within ``KEEP_BYTES`` in all."""
    if owner is None or not pool:
        return
    kept, total = [], 0
    for b in reversed(pool):
        total += b.nbytes
        if total > KEEP_BYTES:
            break
        kept.append(b)
    with _KEPT_LOCK, contextlib.suppress(TypeError):
        _KEPT.pop(owner, None)
        room = KEEP_BYTES - sum(b.nbytes for b in kept)
        for other in reversed(list(_KEPT.keys())):  # newest first (insertion order)
            bufs = _KEPT.get(other, [])
            size = sum(b.nbytes for b in bufs)
            if size > room:
                _KEPT.pop(other, None)
            else:
                room -= size
        _KEPT[owner] = kept[::-1]


__all__ = ["KEEP_BYTES", "QUEUE_BYTES", "WRITEBACK_BYTES", "WRITE_BATCH_BYTES", "BlockWriter"]
