"""LMDB backend: a memory-mapped B+tree shared by many threads and processes.

``lmdb:///abs/path`` opens (or creates) the directory ``/abs/path`` holding ``data.mdb`` and
``lock.mdb``. Every write call is one LMDB write transaction, so batches are atomic even
if the process is killed; with ``sync=true`` (the default) a write is on disk when it
returns. The memory map grows by doubling when full, up to ``max_map_size``. ``data.mdb``
is checked against its meta pages before it is mapped (see :mod:`.lmdb_file`), so a
truncated file raises CorruptStoreError instead of killing the process with SIGBUS.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from itertools import groupby, islice, repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any, TypeVar, cast

import lmdb

from tensorkv import config, pages
from tensorkv.errors import (
    ConfigError,
    KeyTooLargeError,
    StoreError,
    StoreFullError,
    StoreLockedError,
)
from tensorkv.stores import lmdb_file, lmdb_views
from tensorkv.stores.base import Capabilities, KVStore, WriteOp, check_keys
from tensorkv.stores.embedded import (
    as_bool,
    as_int,
    as_size,
    chunked_scan,
    disk_nearly_full,
    prepare_directory,
    store_path,
    take_options,
)
from tensorkv.stores.lmdb_errors import damage_error as _damage_error
from tensorkv.stores.lmdb_errors import open_error as _open_error

if TYPE_CHECKING:
    from tensorkv.stores.url import StoreURL

_T = TypeVar("_T")

_OPTIONS = {
    "readonly": (as_bool, False),
    "create": (as_bool, True),
    "map_size": (as_size, config.LMDB_INITIAL_MAP_SIZE),
    "max_map_size": (as_size, config.LMDB_MAX_MAP_SIZE),
    "sync": (as_bool, True),
    "readahead": (as_bool, False),
    "max_readers": (as_int, config.LMDB_MAX_READERS),
}

_first = itemgetter(0)
_value = itemgetter(1)


def _is_delete(op: WriteOp) -> bool:
    return op[1] is None


class _TxnGate:
    """Any number of transactions at once, or one map resize while none runs.

    LMDB may change the map size only while this process has no active transaction.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._exclusive = False

    def enter(self) -> None:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def enter_exclusive(self) -> None:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._active:
                self._cond.wait()

    def leave_exclusive(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()


class _SharedEnv:
    """One LMDB environment per directory per process, shared by every store opened on it.

    LMDB forbids opening the same environment twice in one process (its file locks would
    be released by the second close), so stores on the same path share this object.
    """

    def __init__(
        self, key: str, env: lmdb.Environment, readonly: bool, sync: bool, readahead: bool
    ) -> None:
        self.key = key
        self.env = env
        self.readonly = readonly
        self.sync = sync
        self.readahead = readahead
        self.bulk_readers = 0  # bulk reads running with readahead on
        self.bulk_ranges: list[tuple[int, int]] = []  # the map's address ranges meanwhile
        self.bulk_lock = threading.Lock()
        self.gate = _TxnGate()
        self.write_lock = threading.Lock()
        self.views = lmdb_views.ViewState()  # get_many_views: pins, the second map
        self.pid = os.getpid()
        self.refs = 1


#: Values at least this large make the rest of a batch read with readahead on the map.
BULK_VALUE_BYTES = 256 * 1024
#: A batch with a value this large among its first lets glibc keep freed blocks (pages.py).
LARGE_WRITE_VALUE_BYTES = 32 * 1024

_ENVS: dict[tuple[int, str], _SharedEnv] = {}
_ENVS_LOCK = threading.Lock()
#: Environments being closed (out of ``_ENVS``, not closed yet): an open of the same path waits.
_CLOSING: dict[tuple[int, str], threading.Event] = {}


def _open_env(path: str, *, readonly: bool, create: bool, sync: bool, map_size: int,
              readahead: bool, max_readers: int) -> lmdb.Environment:
    """``lmdb.open`` after :func:`lmdb_file.check_data_file`, errors turned into ours.

    ``lmdb.open`` begins a transaction after opening the environment; a map that another
    process grows in between raises ``MDB_MAP_RESIZED``, and opening again reads the new size.
    """
    lmdb_file.check_data_file(path, empty_ok=create and not readonly)
    for attempt in range(8):
        try:
            env = lmdb.open(path, map_size=map_size, subdir=True, readonly=readonly,
                            create=create and not readonly, metasync=sync, sync=sync,
                            readahead=readahead, lock=True, max_readers=max_readers,
                            max_dbs=0, max_spare_txns=4)
            break
        except lmdb.MapResizedError as exc:
            if attempt == 7:
                raise _open_error(path, exc) from exc
        except lmdb.Error as exc:
            raise _open_error(path, exc) from exc
    with contextlib.suppress(lmdb.Error):
        env.reader_check()  # free reader slots left by killed processes
    return env


def _acquire_env(path: str, *, readonly: bool, create: bool, sync: bool, map_size: int,
                 readahead: bool, max_readers: int) -> _SharedEnv:
    key = os.path.realpath(path)
    while True:  # LMDB refuses a second open of an environment this process has not closed
        with _ENVS_LOCK:
            closing = _CLOSING.get((os.getpid(), key))
            if closing is None:
                return _shared_env(path, key, readonly=readonly, create=create, sync=sync,
                                   map_size=map_size, readahead=readahead,
                                   max_readers=max_readers)
        closing.wait()


def _shared_env(path: str, key: str, *, readonly: bool, create: bool, sync: bool,
                map_size: int, readahead: bool, max_readers: int) -> _SharedEnv:
    """The process's environment of ``path`` (opened here if none; under ``_ENVS_LOCK``)."""
    shared = _ENVS.get((os.getpid(), key))
    if shared is not None:
        if shared.readonly and not readonly:
            raise StoreLockedError(
                errno.EBUSY,
                f"the lmdb store {path!r} is already open read-only in this process; close "
                "that store before opening it for writing",
                path,
            )
        if shared.sync != sync and not readonly:
            raise ConfigError(
                f"the lmdb store {path!r} is already open in this process with "
                f"sync={shared.sync}; open it again with the same sync setting"
            )
        shared.refs += 1
        return shared
    env = _open_env(path, readonly=readonly, create=create, sync=sync, map_size=map_size,
                    readahead=readahead, max_readers=max_readers)
    shared = _SharedEnv(key, env, readonly, sync, readahead)
    _ENVS[(shared.pid, key)] = shared
    return shared


def _release_env(shared: _SharedEnv) -> None:
    with _ENVS_LOCK:
        shared.refs -= 1
        if shared.refs > 0:
            return
        _ENVS.pop((shared.pid, shared.key), None)
        if os.getpid() != shared.pid:
            return  # never close a parent's environment from a forked child
        closed = _CLOSING[(shared.pid, shared.key)] = threading.Event()
    try:
        shared.gate.enter_exclusive()
        try:
            shared.env.close()
        finally:
            shared.gate.leave_exclusive()
    finally:
        with _ENVS_LOCK:
            _CLOSING.pop((shared.pid, shared.key), None)
        closed.set()


class LMDBStore(KVStore):
    """A store in an LMDB environment (one directory), shared by threads and processes.

    Parameters
    ----------
    path
        Absolute path of the environment directory (created when missing, unless readonly).
    url
        The URL it was opened with.
    readonly
        Open read-only; the environment must exist.
    create
        Create the environment when the path holds none (default). ``False``: raise
        :class:`~tensorkv.errors.StoreNotFoundError` and create nothing.
    map_size
        Initial map size in bytes (default 64 MiB); the map doubles whenever a write
        transaction finds it full.
    max_map_size
        The map never grows beyond this (default 1 TiB); a write that needs more raises
        :class:`~tensorkv.errors.StoreFullError` and changes nothing.
    sync
        ``True`` (default): fsync on every commit, so writes are durable on return.
        ``False``: leave flushing to the OS (much faster bulk loads); a process crash loses
        nothing, a power loss may lose the last writes. Call :meth:`flush` to sync.
    readahead
        OS readahead on the map. Off by default: lookups of embedding rows and tensors are
        random access, and readahead would evict hot pages for cold ones.
    max_readers
        Read transactions that may be open at once across every process sharing the store.

    Notes
    -----
    Keys are at most 511 bytes (LMDB's compile-time limit). An open store must not be used
    in a child created by ``fork``; open the URL again in the child.
    """

    scheme = "lmdb"
    capabilities = Capabilities(
        ordered_scans=True, atomic_batches=True, durable_on_return=True, multi_process=True
    )
    max_value_size = 0xFFFF_FFFF  # LMDB stores node data sizes in 32 bits
    zero_copy_reads = True  # get_many_buffers yields views of the memory map

    def __init__(
        self,
        path: str,
        url: str = "",
        *,
        readonly: bool = False,
        create: bool = True,
        map_size: int = config.LMDB_INITIAL_MAP_SIZE,
        max_map_size: int = config.LMDB_MAX_MAP_SIZE,
        sync: bool = True,
        readahead: bool = False,
        max_readers: int = config.LMDB_MAX_READERS,
    ) -> None:
        super().__init__(url or f"lmdb://{path}", readonly=readonly)
        if map_size <= 0:
            raise ConfigError(f"map_size={map_size} must be positive, e.g. '64MiB'")
        if max_map_size < map_size:
            raise ConfigError(
                f"max_map_size={max_map_size} is smaller than map_size={map_size}; raise "
                "max_map_size or lower map_size"
            )
        self.path = path
        self.max_map_size = max_map_size
        self.sync = bool(sync)
        if not self.sync:
            self.capabilities = replace(type(self).capabilities, durable_on_return=False)
        prepare_directory(path, readonly=readonly, create=create, marker="data.mdb", scheme="lmdb")
        shared = _acquire_env(
            path,
            readonly=readonly,
            create=create,
            sync=self.sync,
            map_size=map_size,
            readahead=readahead,
            max_readers=max_readers,
        )
        self._shared = shared
        self._finalizer = weakref.finalize(self, _release_env, shared)
        self._env = shared.env
        self._gate = shared.gate
        self._write_lock = shared.write_lock
        self._pid = shared.pid
        self._max_key = self._env.max_key_size()
        self.resizes = 0
        self._views = threading.local()  # .depth: get_many_buffers blocks open in a thread
        self._close_pending = False

    @classmethod
    def from_url(cls, parsed: StoreURL, **options: Any) -> LMDBStore:
        """Open from a parsed URL; see the class for the options."""
        path = store_path(parsed)
        opts = take_options("lmdb", options, _OPTIONS)
        return cls(path, parsed.url, **opts)

    # ----------------------------------------------------------------- transactions
    def _enter(self) -> None:
        if os.getpid() != self._pid:
            raise StoreError(
                f"lmdb store {self.url!r} was opened in process {self._pid} and cannot be used "
                "after fork; open the URL again in the child process"
            )
        self._gate.enter()
        if self._closed:
            self._gate.leave()
            self._check_open()
        if self._shared.views.dead_txns:
            lmdb_views.drain(self._shared.views)

    def _values(self, get: Any, keys: list[bytes], ahead: contextlib.ExitStack) -> Iterator[Any]:
        """``get`` each key in turn; once a large value turns up, readahead is on in ``ahead``.

        A store opened with ``readahead=False`` has its map advised ``MADV_RANDOM`` (lookups
        of small rows are random), so each page of a value not in the page cache costs a read
        of its own: 4 KiB at a time, 60 s for a 2.8 GB restore from a cold cache instead of
        1 s. From the first value of ``BULK_VALUE_BYTES`` or more, the rest are read under
        :meth:`_readahead`, entered into ``ahead`` (the caller closes it).
        """
        bulk = False
        for k in keys:
            v = get(k)
            if not bulk and v is not None and len(v) >= BULK_VALUE_BYTES:
                bulk = True
                ahead.enter_context(self._readahead())
            yield v

    @contextmanager
    def _readahead(self) -> Iterator[None]:
        """The map advised ``MADV_NORMAL`` while any bulk read of this environment runs.

        ``MADV_RANDOM`` again after the last one (see :meth:`_values`).
        """
        sh = self._shared
        if sh.readahead:
            yield
            return

        with sh.bulk_lock:
            sh.bulk_readers += 1
            if sh.bulk_readers == 1:  # the map cannot move while a transaction is open
                sh.bulk_ranges = sh.views.lmdb_ranges(os.path.join(self.path, "data.mdb"))
                pages.madvise_ranges(sh.bulk_ranges, pages.MADV_NORMAL)
        try:
            yield
        finally:
            with sh.bulk_lock:
                sh.bulk_readers -= 1
                if not sh.bulk_readers:
                    pages.madvise_ranges(sh.bulk_ranges, pages.MADV_RANDOM)

    def _adopt_map_size(self) -> None:
        """Another process grew the map: adopt its size (needs no active transaction)."""
        self._gate.enter_exclusive()
        try:
            lmdb_views.freeze_moved(self._shared.views, self.path, self._env)
            self._env.set_mapsize(0)  # ends every transaction: renew the pins
            lmdb_views.renew(self._shared.views, self._env)
        finally:
            self._gate.leave_exclusive()

    def _grow(self, needed: BaseException) -> None:
        self._gate.enter_exclusive()
        try:
            current = self._env.info()["map_size"]
            if current >= self.max_map_size:
                raise StoreFullError(
                    errno.ENOSPC,
                    f"lmdb store {self.path!r} is full: the map has reached max_map_size="
                    f"{current} bytes ({current / 2**20:.1f} MiB) and the write needs more; "
                    "nothing was written. Open it with a larger max_map_size (e.g. "
                    f"?max_map_size={max(2 * current, 1 << 30)}) or delete data",
                ) from needed
            lmdb_views.freeze_moved(self._shared.views, self.path, self._env)
            self._env.set_mapsize(min(2 * current, self.max_map_size))
            self.resizes += 1
            lmdb_views.renew(self._shared.views, self._env)
        finally:
            self._gate.leave_exclusive()

    def _key_too_large(self, keys: list[bytes]) -> KeyTooLargeError | None:
        bad = next((k for k in keys if len(k) > self._max_key), None)
        if bad is None:
            return None
        return KeyTooLargeError(
            f"key {bad[:40]!r}... is {len(bad)} bytes; LMDB keys are at most "
            f"{self._max_key} bytes: hash or shorten long keys"
        )

    # ----------------------------------------------------------------- primitives
    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        while True:
            self._enter()
            try:
                with self._env.begin(buffers=False) as txn, contextlib.ExitStack() as ahead:
                    return list(self._values(txn.get, keys, ahead))
            except lmdb.MapResizedError:
                pass
            except lmdb.BadValsizeError:
                break  # a key longer than LMDB allows: handled below, outside the gate
            except lmdb.Error as exc:
                raise _damage_error(self.path, exc) from exc
            finally:
                self._gate.leave()
            self._adopt_map_size()
        # keys LMDB cannot hold are absent by definition
        limit = self._max_key
        short = [k for k in keys if len(k) <= limit]
        found = iter(self._get_many(short) if short else [])
        return [next(found) if len(k) <= limit else None for k in keys]

    @contextmanager
    def get_many_buffers(self, keys: Sequence[bytes]) -> Iterator[list[memoryview | None]]:
        """Values of several keys as memoryviews into the memory map, without copying.

        All values come from one read transaction (one consistent snapshot), which stays
        open until the ``with`` block exits, so the views stay valid until then. Meanwhile a
        map resize in this process (a write that needs a larger map, another process's
        growth adopted) waits for the block to end, and so does :meth:`close` from another
        thread; closing from inside the block is deferred to its end. On exit every view is
        released, so using one afterwards raises ``ValueError`` instead of reading pages
        LMDB may have reused; arrays made from a view (``np.frombuffer``) are not covered:
        copy what must outlive the block. Keys longer than LMDB allows read as absent.
        """
        with self.iter_buffers(keys) as values:
            yield list(values)

    @contextmanager
    def iter_buffers(self, keys: Sequence[bytes]) -> Iterator[Iterator[memoryview | None]]:
        """Like :meth:`get_many_buffers`, but each value is looked up as the iterator reaches it.

        Lending a value walks its pages, reading from disk those the page cache lost, so a
        consumer that works on each value as it comes (a restore) overlaps that reading with
        its own work. One read transaction serves the whole iteration; the views stay valid
        until the ``with`` block exits. Large values turn readahead on (see
        :meth:`_values`).
        """
        self._check_open()
        ks = check_keys(keys)
        limit = self._max_key
        while True:
            self._enter()
            try:
                txn = self._env.begin(buffers=True)
                break
            except lmdb.MapResizedError:
                self._gate.leave()
            except lmdb.Error as exc:
                self._gate.leave()
                raise _damage_error(self.path, exc) from exc
            except BaseException:
                self._gate.leave()
                raise
            self._adopt_map_size()
        lent: list[memoryview] = []
        ahead = contextlib.ExitStack()

        def get(k: bytes, get: Any = txn.get) -> memoryview | None:
            try:
                v = get(k) if len(k) <= limit else None
            except lmdb.Error as exc:
                raise _damage_error(self.path, exc) from exc
            if v is not None:
                lent.append(v)
            return v

        self._views.depth = getattr(self._views, "depth", 0) + 1
        try:
            yield self._values(get, ks, ahead)
        finally:
            ahead.close()
            for v in lent:
                with contextlib.suppress(BufferError):  # a view still exported
                    v.release()
            txn.abort()
            self._views.depth -= 1
            self._gate.leave()
            if self._close_pending and not self._views.depth:
                self._close_pending = False
                self._finalizer()

    def get_many_views(self, keys: Sequence[bytes]) -> list[Any]:
        """Values as read-only uint8 arrays over the data file, valid for as long as they live.

        No copy; the read snapshot stays pinned meanwhile (see :mod:`.lmdb_views`).
        """
        if not lmdb_views.SUPPORTED:  # pragma: no cover - not Linux: copies
            return super().get_many_views(keys)
        self._check_open()
        ks = check_keys(keys)
        return self._reading(lambda: lmdb_views.read(self._shared.views, self.path, self._env,
                                                     ks, self._max_key))

    def _reading(self, read: Callable[[], _T]) -> _T:
        """``read()`` inside the gate, again after a map resize; LMDB errors name the damage."""
        while True:
            self._enter()
            try:
                return read()
            except lmdb.MapResizedError:
                pass
            except lmdb.Error as exc:
                raise _damage_error(self.path, exc) from exc
            finally:
                self._gate.leave()
            self._adopt_map_size()

    @staticmethod
    def _apply(txn: lmdb.Transaction, ops: list[WriteOp]) -> None:
        cursor = txn.cursor()
        if None not in map(_value, ops):  # only puts: one C call
            cursor.putmulti(cast("list[tuple[bytes, bytes | memoryview]]", ops))
            return
        delete = txn.delete
        for is_del, run in groupby(ops, key=_is_delete):
            if is_del:
                for k, _ in run:
                    delete(k)
            else:
                cursor.putmulti(cast("Iterator[tuple[bytes, bytes | memoryview]]", run))

    def _write(self, ops: list[WriteOp], *, atomic: bool) -> None:
        if not pages.freed_memory_decided() and any(
                v is not None and len(v) >= LARGE_WRITE_VALUE_BYTES for _, v in ops[:8]):
            pages.retain_freed_memory()  # large values: LMDB mallocs a block for each
        self._in_write_txn(lambda txn: self._apply(txn, ops), ops)

    def _compare_and_set(
        self, key: bytes, expected: bytes | None, value: bytes | memoryview | None
    ) -> bool:
        def step(txn: lmdb.Transaction) -> bool:
            # LMDB allows one write transaction at a time over all processes
            cur = txn.get(key)
            if (None if cur is None else bytes(cur)) != expected:
                return False
            if value is None:
                txn.delete(key)
            else:
                txn.put(key, value)
            return True

        return bool(self._in_write_txn(step, [(key, value)]))

    def _put_first_absent(self, prefix: bytes, start: int, value: bytes | memoryview,
                          before: list[tuple[bytes, bytes | memoryview]]) -> int:
        def step(txn: lmdb.Transaction) -> int:
            for k, v in before:
                txn.put(k, v)
            seq = start
            while not txn.put(prefix + b"%012d" % seq, value, overwrite=False):
                seq += 1
            return seq

        return int(self._in_write_txn(step, [*before, (prefix, value)]))

    def _in_write_txn(self, fn: Any, ops: list[WriteOp]) -> Any:
        """Run ``fn(txn)`` in one write transaction, growing the map and replaying as needed."""
        with self._write_lock:
            while True:
                self._enter()
                try:
                    with self._env.begin(write=True) as txn:
                        return fn(txn)
                except (lmdb.MapFullError, lmdb.MapResizedError) as exc:
                    retry: BaseException = exc
                except lmdb.BadValsizeError as exc:
                    # the transaction was aborted, so nothing of the batch was written
                    err = self._key_too_large([k for k, _ in ops])
                    if err is None:
                        raise
                    raise err from exc
                except lmdb.Error as exc:
                    # a short write on a full disk surfaces as EIO from mdb_txn_commit
                    if "No space left" in str(exc) or (
                        "Input/output error" in str(exc) and disk_nearly_full(self.path)
                    ):
                        raise StoreFullError(
                            errno.ENOSPC,
                            f"the disk under lmdb store {self.path!r} is full; nothing was "
                            "written: free space and retry",
                        ) from exc
                    raise _damage_error(self.path, exc) from exc
                finally:
                    self._gate.leave()
                # the transaction was aborted: fix the map, then replay every op
                if isinstance(retry, lmdb.MapFullError):
                    self._grow(retry)
                else:
                    self._adopt_map_size()

    def _read_chunk(
        self, start: bytes | None, n: int, stop: bytes | None, keys_only: bool
    ) -> list[tuple[bytes, bytes | None]]:
        def read() -> list[tuple[bytes, bytes | None]]:
            with self._env.begin(buffers=False) as txn:
                cur = txn.cursor()
                positioned = cur.first() if start is None else cur.set_range(start)
                if not positioned:
                    return []
                if keys_only:
                    keys = list(islice(cur.iternext(keys=True, values=False), n))
                    if stop is not None:
                        del keys[bisect.bisect_left(keys, stop) :]
                    return list(zip(keys, repeat(None)))
                items: list[tuple[bytes, bytes | None]]
                items = list(islice(cur.iternext(keys=True, values=True), n))
                if stop is not None:
                    del items[bisect.bisect_left(items, stop, key=_first) :]
                return items

        return self._reading(read)

    def _scan(
        self, start: bytes | None, stop: bytes | None, keys_only: bool, limit: int | None
    ) -> Iterator[tuple[bytes, bytes | None]]:
        def read(pos: bytes | None, n: int) -> list[tuple[bytes, bytes | None]]:
            return self._read_chunk(pos, n, stop, keys_only)

        return chunked_scan(read, start, limit, self._check_open)

    def count(self, prefix: bytes = b"") -> int:
        """Number of keys starting with ``prefix`` (O(1) for the whole store)."""
        if prefix:
            return super().count(prefix)
        self._check_open()
        self._enter()
        try:
            return int(self._env.stat()["entries"])
        finally:
            self._gate.leave()

    def _flush(self) -> None:
        if not self.sync:
            self._enter()
            try:
                self._env.sync(True)
            except lmdb.Error as exc:
                raise _damage_error(self.path, exc) from exc
            finally:
                self._gate.leave()

    def _compact(self) -> tuple[int, int]:
        """Copy the live pages to a new file and swap it in (see :meth:`KVStore.compact`).

        Refused while another process has the environment open: every process holding it
        open keeps a shared ``fcntl`` lock on byte 0 of ``lock.mdb``, so an exclusive lock
        on that byte, taken through LMDB's own descriptor, proves this process alone has it
        open, and makes processes that open it meanwhile wait. The compacted copy
        (``env.copy(compact=True)``, a consistent snapshot) is written to a temporary
        directory inside the store, its meta pages continue the environment's transaction
        ids (see :func:`lmdb_file.restamp_metas`), it is fsynced, and ``os.replace`` swaps
        it in; then this process reopens the environment on the new file.
        """
        if os.getpid() != self._pid:
            self._enter()  # raises the after-fork error
        sh = self._shared
        if sh.refs > 1:
            raise StoreLockedError(
                errno.EBUSY,
                f"the lmdb store {self.path!r} is open {sh.refs} times in this process; close "
                "the other store objects on it, then compact",
                self.path,
            )
        data = os.path.join(self.path, "data.mdb")
        with self._write_lock:
            self._gate.enter_exclusive()
            try:
                before = os.path.getsize(data)
                if self._exclusive_copy(data):
                    self._reopen()
            finally:
                self._gate.leave_exclusive()
        return before, os.path.getsize(data)

    def _exclusive_copy(self, data: str) -> bool:
        """Swap a compacted copy in under the exclusive lock; False: nothing to compact."""
        import fcntl  # POSIX only; the rest of the backend also runs on Windows

        lock_fd = lmdb_file.lock_descriptor(os.path.join(self.path, "lock.mdb"))
        try:
            fcntl.lockf(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)
        except OSError as exc:
            raise StoreLockedError(
                errno.EBUSY,
                f"cannot compact the lmdb store {self.path!r}: another process has it open "
                "(it holds a lock on lock.mdb); close the store in every other process, then "
                "compact",
                self.path,
            ) from exc
        swapped = False
        tmp = tempfile.mkdtemp(prefix=".compact-", dir=self.path)
        try:
            txnid = int(self._env.info()["last_txnid"])
            if not txnid:
                return False  # nothing was ever committed
            try:
                self._env.copy(tmp, compact=True)
            except lmdb.Error as exc:
                raise _damage_error(self.path, exc) from exc
            copy = os.path.join(tmp, "data.mdb")
            lmdb_file.restamp_metas(copy, txnid)
            os.replace(copy, data)
            swapped = True
            pages.fsync_path(self.path)
            return True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if not swapped:  # back to the shared lock every open environment holds
                fcntl.lockf(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)

    def _reopen(self) -> None:
        """Close the environment (its map holds the old file) and open the new data.mdb."""
        sh = self._shared
        old = sh.env
        map_size, max_readers = old.info()["map_size"], old.max_readers()
        old.close()  # drops this process's locks: processes waiting to open it go on
        try:
            sh.env = _open_env(
                self.path,
                readonly=False,
                create=False,
                sync=sh.sync,
                map_size=map_size,
                readahead=sh.readahead,
                max_readers=max_readers,
            )
        except BaseException:
            self._closed = True
            raise
        self._env = sh.env
        lmdb_views.renew(sh.views, sh.env)

    def _close(self) -> None:
        if getattr(self._views, "depth", 0):
            # closed inside a get_many_buffers block of this thread: the environment goes
            # when the block exits (waiting for it here would wait for ourselves)
            self._close_pending = True
            return
        self._finalizer()

    def _stats(self) -> dict[str, Any]:
        self._enter()
        try:
            info = self._env.info()
            st = self._env.stat()
        finally:
            self._gate.leave()
        page = st["psize"]
        return {
            "path": self.path,
            "keys": st["entries"],
            "map_size": info["map_size"],
            "max_map_size": self.max_map_size,
            "used_bytes": (info["last_pgno"] + 1) * page,
            "page_size": page,
            "depth": st["depth"],
            "readers": info["num_readers"],
            "max_readers": info["max_readers"],
            "resizes": self.resizes,
            "sync": self.sync,
        }
