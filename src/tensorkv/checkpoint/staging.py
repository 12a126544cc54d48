"""Sharded saves into single-writer stores (LevelDB, RocksDB): a stage per shard, turns on main.

LevelDB and RocksDB let one process at a time open a database. A shard of a sharded save
into such a store (:func:`shard_store`) therefore writes its records (table blocks, key
lists, dense chunks) into a private *stage* database beside the main one
(``<path>.stage/<pid>-<random>/db``), and opens the main store only for short *turns*, waiting
while another process holds it: to claim its shard and join the run (reading the manifests
it needs), and, at the end, to move its records in and write its shard manifest (and the
tag's manifest if it is the last shard). LevelDB copies the records in batches; RocksDB
writes them into SST files, sorted, before its turn and *ingests* the files (moves them into
the database) during it. Data still lands before the manifest that references it, so a tag
is all or nothing as with every other store. Loads read the main store as always.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tensorkv import config
from tensorkv.checkpoint import claims, layout
from tensorkv.checkpoint.access import using_store
from tensorkv.errors import StoreLockedError
from tensorkv.stores.base import Capabilities, KVStore, WriteOp

SINGLE_WRITER = ("leveldb", "rocksdb")
STAGE_SUFFIX = ".stage"
OWNER_FILE = "owner.json"
_COPY_GROUP = 16  # records read from the stage at once (blocks are up to ~9 MB)
_COPY_BATCH_BYTES = 64 << 20  # bytes per write into the main LevelDB store

_TURNS: dict[str, threading.Lock] = {}
_TURNS_GUARD = threading.Lock()


def _scheme(url: str | KVStore) -> str | None:
    if not isinstance(url, str):
        return None
    from tensorkv.stores.registry import parse_url

    return parse_url(url).scheme


def _path(url: str) -> str:
    from tensorkv.stores.embedded import store_path
    from tensorkv.stores.registry import parse_url

    return store_path(parse_url(url))


def _turn_lock(path: str) -> threading.Lock:
    with _TURNS_GUARD:
        return _TURNS.setdefault(os.path.realpath(path), threading.Lock())


def open_turn(url: str, *, create: bool = True) -> tuple[KVStore, threading.Lock]:
    """Open the single-writer store ``url``, waiting while another process holds it.

    Threads of this process take turns on a lock per path (returned, held: release it after
    closing the store). Another process's hold is waited out by retrying the open, for up to
    ``config.CHECKPOINT_TURN_WAIT_SECONDS``.

    Raises
    ------
    StoreLockedError
        A store object of this process keeps the store open (waiting would never end), or
        the wait timed out.
    """
    from tensorkv.stores import open_store
    from tensorkv.stores.embedded import open_in_this_process

    path = _path(url)
    wait = config.CHECKPOINT_TURN_WAIT_SECONDS
    lock = _turn_lock(path)
    if not lock.acquire(timeout=wait):
        raise StoreLockedError(
            errno.EAGAIN, f"waited {wait:g} s for a turn on {url!r}: other threads of this "
            "process kept it (config.CHECKPOINT_TURN_WAIT_SECONDS)", path)
    deadline = time.monotonic() + wait
    delay = 0.005
    try:
        while True:
            try:
                return open_store(url, create=create), lock
            except StoreLockedError as exc:
                if open_in_this_process(path):
                    raise StoreLockedError(
                        errno.EAGAIN, f"{url!r} is kept open by a store object of this "
                        "process, so the shard cannot take its turn on it: close that store, "
                        "or pass it to tensorkv.save instead of the URL", path) from exc
                if time.monotonic() >= deadline:
                    raise StoreLockedError(
                        errno.EAGAIN, f"waited {wait:g} s for a turn on {url!r}, which another "
                        f"process keeps open ({exc}); close it there, or raise "
                        "config.CHECKPOINT_TURN_WAIT_SECONDS", path) from exc
                time.sleep(delay)  # another process's turn: a save's turns are short
                delay = min(2 * delay, 0.25)
    except BaseException:
        lock.release()
        raise


@contextmanager
def main_store(url: str | KVStore, *, create: bool = True) -> Iterator[KVStore]:
    """:func:`~tensorkv.checkpoint.access.using_store`, waiting for a turn on LevelDB/RocksDB."""
    if _scheme(url) not in SINGLE_WRITER:
        with using_store(url, create=create) as store:
            yield store
        return
    assert isinstance(url, str)
    store, lock = open_turn(url, create=create)
    try:
        with using_store(store):
            yield store
    finally:
        try:
            store.close()
        finally:
            lock.release()


@contextmanager
def shard_store(url: str | KVStore, sharded: bool) -> Iterator[KVStore]:
    """The store a save writes into (a :class:`StagedStore` for a shard into LevelDB/RocksDB).

    Shards (``sharded``) given the URL of a single-writer store write through a
    :class:`StagedStore`; every other save uses the store itself (see :func:`using_store`).
    """
    if not sharded or _scheme(url) not in SINGLE_WRITER:
        with using_store(url) as store:
            yield store
        return
    assert isinstance(url, str)
    staged = StagedStore(url)
    try:
        yield staged
    except BaseException as exc:
        try:
            staged.close()
        except Exception as close_exc:
            exc.add_note(f"closing {url!r} afterwards failed too: {close_exc}")
        raise
    staged.close()


def _is_data(key: bytes) -> bool:
    return key.startswith(layout.TABLE) or key.startswith(layout.CHUNK)


def _in_data(lo: bytes | None, hi: bytes | None) -> bool:
    """Whether the key range [lo, hi) lies inside the table or chunk records."""
    for prefix in (layout.TABLE, layout.CHUNK):
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        if lo is not None and hi is not None and lo >= prefix and hi <= end:
            return True
    return False


class StagedStore(KVStore):
    """The store one shard of a sharded save writes into a single-writer store through.

    Table and chunk records go to the shard's stage; every other key (markers, run record,
    manifests) to the main store, opened on demand (:func:`open_turn`) and closed as soon
    as data records are written. Writing a manifest first moves the stage into the main
    store. Reads of data records look in the stage, then the main store.
    """

    capabilities = Capabilities(
        ordered_scans=True, atomic_batches=False, durable_on_return=False, multi_process=True
    )

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.scheme = _scheme(url) or ""
        self.path = _path(url)
        self._lock = threading.RLock()
        self._main: KVStore | None = None
        self._turn: threading.Lock | None = None
        self._stage: KVStore | None = None
        self._stage_dir: str | None = None
        self._moved = False  # the stage was moved into the main store (or is being)

    # ------------------------------------------------------------------ the two stores
    def _main_store(self) -> KVStore:
        if self._main is None:
            self._main, self._turn = open_turn(self.url)
        return self._main

    def _end_turn(self) -> None:
        if self._main is None:
            return
        try:
            self._main.close()
        finally:
            self._main = None
            if self._turn is not None:
                self._turn.release()
                self._turn = None

    def _stage_store(self) -> KVStore:
        if self._stage is None:
            from tensorkv.stores import open_store

            d = _new_stage_dir(self.path + STAGE_SUFFIX, self.url)
            self._stage_dir = d
            self._stage = open_store(f"{self.scheme}://{d}/db", sync=False)
        return self._stage

    def _staging(self) -> bool:
        return not self._moved

    # ------------------------------------------------------------------ primitives
    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        with self._lock:
            if self._stage is not None and self._staging():
                idx = [i for i, k in enumerate(keys) if _is_data(k)]
                if idx:
                    for i, v in zip(idx, self._stage.get_many([keys[i] for i in idx]),
                                    strict=True):
                        out[i] = v
            rest = [i for i, v in enumerate(out) if v is None]
            if rest:
                vals = self._main_store().get_many([keys[i] for i in rest])
                for i, v in zip(rest, vals, strict=True):
                    out[i] = v
        return out

    def _write(self, ops: list[WriteOp], *, atomic: bool) -> None:
        data = [op for op in ops if _is_data(op[0])]
        meta = [op for op in ops if not _is_data(op[0])]
        with self._lock:
            if data and self._staging():
                puts = [op for op in data if op[1] is not None]
                if puts:
                    self._end_turn()  # writing data: give the main store back meanwhile
                    self._apply(self._stage_store(), puts)
                dels = [op for op in data if op[1] is None]
                if dels:  # delete wherever the records are
                    if self._stage is not None:
                        self._apply(self._stage, dels)
                    meta += dels
            elif data:
                meta = ops
            if meta:
                self._apply(self._main_store(), meta)

    @staticmethod
    def _apply(store: KVStore, ops: list[WriteOp]) -> None:
        with store.batch() as b:
            for k, v in ops:
                if v is None:
                    b.delete(k)
                else:
                    b.put(k, v)

    def _compare_and_set(
        self, key: bytes, expected: bytes | None, value: bytes | memoryview | None
    ) -> bool:
        with self._lock:
            if value is not None and key.startswith((layout.MANIFEST, layout.SHARD_MANIFEST)):
                self._move_stage()  # the data lands before the manifest that references it
            return self._main_store().compare_and_set(key, expected, value)

    def _scan(
        self, start: bytes | None, stop: bytes | None, keys_only: bool, limit: int | None
    ) -> Iterator[tuple[bytes, bytes | None]]:
        with self._lock:
            stores = [self._main_store()]
            if self._stage is not None and self._staging() and _in_data(start, stop):
                stores.append(self._stage)
            merged: dict[bytes, bytes | None] = {}
            for s in stores:
                if keys_only:
                    for k in s.scan(b"", start=start, stop=stop, keys_only=True, limit=limit):
                        merged[bytes(k)] = None
                else:
                    for k, v in s.scan(b"", start=start, stop=stop, limit=limit):
                        merged[bytes(k)] = v
        items = sorted(merged.items())
        return iter(items if limit is None else items[:limit])

    def _flush(self) -> None:
        with self._lock:
            if self._stage is not None and self._staging():
                self._stage.flush()
            if self._main is not None:
                self._main.flush()

    def _close(self) -> None:
        with self._lock:
            try:
                self._end_turn()
            finally:
                stage, self._stage = self._stage, None
                try:
                    if stage is not None:
                        stage.close()
                finally:
                    if self._stage_dir is not None:
                        shutil.rmtree(self._stage_dir, ignore_errors=True)
                        with contextlib.suppress(OSError):  # the last stage: remove the root
                            os.rmdir(self.path + STAGE_SUFFIX)

    # ------------------------------------------------------------------ moving the stage
    def _move_stage(self) -> None:
        """Move the stage's records into the main store (during one turn), then flush it."""
        if self._stage is None or self._moved:
            return
        stage = self._stage
        stage.flush()
        keys = [bytes(k) for k in stage.keys(b"")]
        self._moved = True  # from here on, data records are written to (and deleted from) main
        if not keys:
            return
        if self.scheme == "rocksdb":
            from tensorkv.stores.rocksdb import RocksDBStore, write_sst_files

            assert self._stage_dir is not None
            self._end_turn()  # sort into files before the turn: the turn only moves them in
            files = write_sst_files(self._records(stage, keys), self._stage_dir)
            main = self._main_store()
            assert isinstance(main, RocksDBStore)
            main.ingest_files(files)
        else:
            main = self._main_store()
            batch: list[tuple[bytes, bytes]] = []
            size = 0
            for kv in self._records(stage, keys):
                batch.append(kv)
                size += len(kv[1])
                if size >= _COPY_BATCH_BYTES:
                    main.put_many(batch)
                    batch, size = [], 0
            if batch:
                main.put_many(batch)
        main.flush()

    @staticmethod
    def _records(stage: KVStore, keys: list[bytes]) -> Iterator[tuple[bytes, bytes]]:
        for lo in range(0, len(keys), _COPY_GROUP):
            group = keys[lo : lo + _COPY_GROUP]
            for k, v in zip(group, stage.get_many(group), strict=True):
                if v is not None:
                    yield k, v

    def _stats(self) -> dict[str, Any]:
        return {"path": self.path, "stage": self._stage_dir}


def _new_stage_dir(root: str, url: str) -> str:
    """Create a stage directory holding its owner record (it appears with the record in it)."""
    for _ in range(8):
        os.makedirs(root, exist_ok=True)
        try:  # ".<pid>-" while being prepared: stage_dirs tells its owner from the name
            tmp = tempfile.mkdtemp(prefix=f".{os.getpid()}-", dir=root)
        except FileNotFoundError:  # the last stage's saver removed the root meanwhile
            continue
        with open(os.path.join(tmp, OWNER_FILE), "w") as f:
            json.dump(claims.owner_record(f"stage of a shard saved into {url}"), f)
        final = os.path.join(root, os.path.basename(tmp)[1:])
        os.rename(tmp, final)
        return final
    raise OSError(errno.ENOENT, f"cannot create a stage directory under {root!r}", root)


def stage_dirs(url: str | KVStore, grace: float | None = None) -> list[dict[str, Any]]:
    """The stages of shards saving into the single-writer store ``url``, with their owners.

    Each entry: ``path``, ``pid``, ``host``, ``started``, ``stale`` (the owner is gone, or,
    where that cannot be told, older than ``grace``; see
    :func:`tensorkv.checkpoint.claims.is_stale`).
    """
    scheme: str | None
    if isinstance(url, KVStore):
        scheme, path = url.scheme, getattr(url, "path", None)
    else:
        scheme = _scheme(url)
        path = _path(url) if scheme in SINGLE_WRITER else None
    if scheme not in SINGLE_WRITER or not isinstance(path, str):
        return []
    root = path + STAGE_SUFFIX
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    out = []
    for name in names:
        d = os.path.join(root, name)
        try:
            with open(os.path.join(d, OWNER_FILE), "rb") as f:
                info = claims.parse_marker(f.read())
        except OSError:
            info = {}
        if not info and name.startswith("."):  # being prepared by the pid in its name
            pid = name[1:].split("-", 1)[0]
            info = {"pid": int(pid) if pid.isdigit() else None, "host": socket.gethostname()}
        if not info.get("started"):
            with contextlib.suppress(OSError):
                info["started"] = os.path.getmtime(d)
        out.append({"path": d, "pid": info.get("pid"), "host": info.get("host"),
                    "started": info.get("started"), "stale": claims.is_stale(info, grace)})
    return out


def remove_stale_stages(url: str | KVStore, grace: float | None = None) -> list[str]:
    """Remove the stages of shards whose savers are gone (see :func:`stage_dirs`)."""
    removed = []
    for st in stage_dirs(url, grace):
        if st["stale"]:
            shutil.rmtree(st["path"], ignore_errors=True)
            removed.append(st["path"])
    return removed
