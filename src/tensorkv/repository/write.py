"""The write path of a put: one hashing pass, dedup, writes from the tensors' own memory.

A put hands its tensors to :class:`PutWriter`, which takes them in groups of about
:data:`GROUP_BYTES`. For each group the calling thread

1. hashes the tensors: one pass over their bytes gives each chunk's checksum and the tensor's
   id (:func:`tensors.stage <tensorkv.repository.tensors.stage>`);
2. counts a reference to each of them (:func:`refs.incref
   <tensorkv.repository.refs.incref>`: one short lock, one read, one batch), the put's intent
   record riding ahead of the counts in the same batch. From then on no delete can retire
   them, so what the put writes next stays;
3. writes the tensors nobody counted before (new ones, or retired meanwhile) and those
   counted but missing from every provider (one size probe per provider; a parent's tensors
   skip the probe while the parent is live);
4. hands those chunks to one writer per provider (the repository's thread pool), which sends
   them as batches of up to :data:`WRITE_BATCH_BYTES` (one LMDB write transaction, one
   pipelined Redis round trip), each value a view of the tensor's own memory: nothing is
   copied on the way to the store.

While the providers write group ``g``, the calling thread hashes and counts group ``g + 1``
(hashing holds the GIL, the stores' writes release it). Small tensors travel together: one
group, one count batch and one write batch per provider, however many tensors it holds,
each still its own content-addressed chunks.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np

from tensorkv.errors import StoreFullError
from tensorkv.repository import refs, tensors
from tensorkv.repository.core import RepositoryCore
from tensorkv.repository.layout import intent_key, manifest_key

#: Tensor bytes hashed and counted per group: the unit of overlap with the writes.
GROUP_BYTES = 64 << 20
#: Chunk bytes one batch (one store call) carries at most; bounds what a store holds in memory
#: for one write (LMDB keeps a transaction's pages in memory until it commits).
WRITE_BATCH_BYTES = 256 << 20

#: tensor id -> (its bytes, its manifest entry)
Staged = dict[str, tuple[memoryview, dict[str, Any]]]


class PutWriter:
    """Hash, count and write the tensors of one put (see the module docstring).

    Parameters
    ----------
    repo
        The repository.
    mid
        The id of the model being put (names its intent record).
    parent
        The id of the model this one derives from, or None.
    parent_tids
        The parent's tensor ids: stored, as long as the parent is live.
    """

    def __init__(self, repo: RepositoryCore, mid: str, parent: str | None = None,
                 parent_tids: set[str] | frozenset[str] = frozenset()) -> None:
        self.repo = repo
        self.mid = mid
        self.parent = parent
        self.parent_tids = parent_tids
        #: every tensor of the put, by id, in first-seen order
        self.by_tid: Staged = {}
        #: the tensors this put added a reference to (what a failed put must drop)
        self.counted: list[str] = []
        self._full: set[int] = set()
        self._last_full: StoreFullError | None = None
        self._inflight: list[tuple[int, list[str], Future[None]]] = []

    # ----------------------------------------------------------------- driving
    def send(self, arrays: Mapping[str, tuple[np.ndarray, str | None]]) -> dict[str, Any]:
        """Hash and count every tensor, hand the missing ones to the providers.

        Returns name -> manifest entry. The writes of the last group may still be running:
        call :meth:`finish` next (the caller builds its manifest meanwhile).
        """
        entries: dict[str, Any] = {}
        group: list[str] = []
        size = 0
        chunk_bytes = self.repo.chunk_bytes
        try:
            for name, (arr, tdt) in arrays.items():
                e, flat = tensors.stage(arr, tdt, chunk_bytes)
                entries[name] = e
                tid = e["id"]
                if tid in self.by_tid:
                    continue
                self.by_tid[tid] = (flat, e)
                group.append(tid)
                size += e["nbytes"]
                if size >= GROUP_BYTES:
                    self._group(group)
                    group, size = [], 0
            self._group(group)
        except BaseException:
            self._settle()
            raise
        return entries

    def finish(self) -> None:
        """Wait for every write: on return every tensor of the put is counted and stored.

        Raises what a write raised (:class:`StoreFullError` once every provider refused).
        """
        try:
            self._drain()
        finally:
            self._settle()

    # ----------------------------------------------------------------- steps
    def _group(self, tids: list[str]) -> None:
        """Count a group's tensors, find which to write, hand them out (see the docstring)."""
        if not tids:
            return
        before = self._count(tids)
        probe = [t for t, b in zip(tids, before, strict=True) if b > 0]
        if self.parent is not None and any(t in self.parent_tids for t in probe) \
                and self._parent_live():
            # the parent counted these when we counted ours, so their data is complete
            probe = [t for t in probe if t not in self.parent_tids]
        entries = {t: self.by_tid[t][1] for t in probe}
        missing = [t for t, b in zip(tids, before, strict=True) if b == 0]
        missing += self.repo.absent(probe, entries)
        self._drain()
        if missing:
            self._dispatch(missing)

    def _count(self, tids: list[str]) -> list[int]:
        """:func:`refs.incref` the tensors; the intent, naming every tensor seen, goes first.

        The intent lands before the counts (gc leaves counted tensors of a live intent
        alone) and before any data (gc leaves their chunks alone): in the same batch as the
        counts where batches are atomic, else in a write of its own just before.
        """
        meta = self.repo.meta
        doc = {"tids": sorted(self.by_tid), "time": time.time()}
        item = (intent_key(self.mid), json.dumps(doc).encode())
        if not meta.capabilities.atomic_batches:
            meta.put(*item)
            return refs.incref(meta, tids, done=self.counted)
        return refs.incref(meta, tids, done=self.counted, first=[item])

    def _parent_live(self) -> bool:
        """Whether the parent's manifest is still stored (no delete has begun)."""
        assert self.parent is not None
        return bool(self.repo.meta.value_sizes([manifest_key(self.parent)])[0] >= 0)

    def _dispatch(self, tids: list[str]) -> None:
        """Hand each tensor to the first provider in its rendezvous order not known full."""
        repo = self.repo
        groups: dict[int, list[str]] = {}
        for t in tids:
            p = next((i for i in tensors.rank(t, repo.provider_ids) if i not in self._full),
                     None)
            if p is None:
                raise StoreFullError(
                    f"every provider refused tensor data ({len(tids)} tensors left): "
                    f"{self._last_full}") from self._last_full
            groups.setdefault(p, []).append(t)
        for p, ts in groups.items():
            self._inflight.append((p, ts, repo.pool.submit(self._write_to, p, ts)))

    def _write_to(self, p: int, tids: list[str]) -> None:
        """Write the chunks of ``tids`` to provider ``p``, at most a batch per store call."""
        store = self.repo.providers[p]
        batch: list[tuple[bytes, Any]] = []
        size = 0
        for t in tids:
            flat, e = self.by_tid[t]
            for key, value in tensors.chunk_values(flat, e):
                n = value.nbytes
                if batch and size + n > WRITE_BATCH_BYTES:
                    store.put_many(batch)
                    batch, size = [], 0
                batch.append((key, value))
                size += n
        if batch:
            store.put_many(batch)

    def _drain(self) -> None:
        """Wait for the writes in flight; send what a full provider refused to the next one."""
        while self._inflight:
            inflight, self._inflight = self._inflight, []
            retry: list[str] = []
            error: BaseException | None = None
            for p, ts, fut in inflight:
                try:
                    fut.result()
                except StoreFullError as exc:
                    self._full.add(p)
                    self._last_full = exc
                    retry.extend(ts)
                except BaseException as exc:  # wait for every writer before raising
                    error = error or exc
            if error is not None:
                raise error
            if retry:
                self._dispatch(retry)

    def _settle(self) -> None:
        """Wait for every write in flight, errors ignored (a failed put's cleanup follows)."""
        inflight, self._inflight = self._inflight, []
        for _, _, fut in inflight:
            with contextlib.suppress(BaseException):  # the caller is already failing
                fut.result()
