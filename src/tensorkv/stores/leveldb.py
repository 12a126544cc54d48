"""LevelDB backend through ``plyvel``: a small, dependable LSM store for one process.

``leveldb:///abs/path`` opens (or creates) the database directory ``/abs/path``. Every write
call is one LevelDB write batch appended to the log as a single record, so batches are atomic
even if the process is killed. The log is not fsynced per write unless ``sync=true``.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from dataclasses import replace
from itertools import islice, repeat
from typing import TYPE_CHECKING, Any

import plyvel

from tensorkv import config
from tensorkv.errors import ConfigError, StoreClosedError, StoreError, StoreFullError
from tensorkv.stores.base import Capabilities, KVStore, WriteOp
from tensorkv.stores.embedded import (
    SingleWriter,
    as_bool,
    as_int,
    as_size,
    binding_message,
    check_lsm_files,
    check_same_process,
    chunked_scan,
    claim_path,
    close_on_collect,
    damage_error,
    directory_bytes,
    locked_error,
    permission_error,
    prepare_directory,
    release_path,
    store_path,
    take_options,
    write_error,
)

if TYPE_CHECKING:
    from tensorkv.stores.url import StoreURL


_HIGH_KEY = b"\xff" * 64  # see LevelDBStore._compact


def _as_compression(name: str, value: Any) -> str:
    low = str(value).strip().lower()
    if low not in ("none", "snappy"):
        raise ConfigError(f"option {name}={value!r} is not a compression; use none or snappy")
    return low


_DATA_FILES = ("*.ldb", "*.sst", "*.log")  # tables and logs: data a missing CURRENT orphans
_REPAIR = "plyvel.repair_db(path)"

_OPTIONS = {
    "readonly": (as_bool, False),
    "create": (as_bool, True),
    "sync": (as_bool, False),
    "compression": (_as_compression, "none"),
    "write_buffer_size": (as_size, config.LEVELDB_WRITE_BUFFER_SIZE),
    "block_cache_size": (as_size, config.LEVELDB_BLOCK_CACHE_SIZE),
    "bloom_bits": (lambda n, v: as_int(n, v, minimum=0), 10),
    "max_open_files": (as_int, 1000),
}


class LevelDBStore(SingleWriter, KVStore):
    """A store in a LevelDB database (one directory), used by one process at a time.

    Parameters
    ----------
    path
        Absolute path of the database directory (created when missing, unless readonly).
    url
        The URL it was opened with.
    readonly
        Refuse writes. LevelDB has no read-only mode of its own, so the database is still
        locked against other processes while open.
    create
        Create the store when the path holds none (default). ``False``: raise
        :class:`~tensorkv.errors.StoreNotFoundError` and create nothing.
    sync
        ``False`` (default): the log is written on every call but not fsynced, so data
        survives a process crash but maybe not a power loss. ``True``: fsync each write.
    compression
        ``"none"`` (default; float data barely compresses) or ``"snappy"``.
    write_buffer_size
        Bytes per memtable (default 32 MiB).
    block_cache_size
        Bytes of uncompressed blocks cached for reads (default 64 MiB).
    bloom_bits
        Bloom filter bits per key (default 10; 0 disables).
    max_open_files
        Table files kept open.
    """

    scheme = "leveldb"
    capabilities = Capabilities(
        ordered_scans=True, atomic_batches=True, durable_on_return=False, multi_process=False
    )
    max_value_size = 0xFFFF_FFFF  # record lengths in the log are 32-bit varints

    def __init__(
        self,
        path: str,
        url: str = "",
        *,
        readonly: bool = False,
        create: bool = True,
        sync: bool = False,
        compression: str = "none",
        write_buffer_size: int = config.LEVELDB_WRITE_BUFFER_SIZE,
        block_cache_size: int = config.LEVELDB_BLOCK_CACHE_SIZE,
        bloom_bits: int = 10,
        max_open_files: int = 1000,
    ) -> None:
        super().__init__(url or f"leveldb://{path}", readonly=readonly)
        self.path = path
        self.sync = bool(sync)
        if self.sync:
            self.capabilities = replace(type(self).capabilities, durable_on_return=True)
        prepare_directory(
            path,
            readonly=readonly,
            create=create,
            marker="CURRENT",
            scheme="leveldb",
            data_files=_DATA_FILES,
            repair=_REPAIR,
        )
        check_lsm_files("leveldb", path, _REPAIR)
        # LevelDB locks even read-only opens, and a second open in one process would drop
        # the first one's lock: refuse it before plyvel is called.
        self._claim = claim_path("leveldb", path)
        try:
            self._db = plyvel.DB(
                path,
                create_if_missing=create and not readonly,
                paranoid_checks=True,  # a damaged log or table fails the open, not skipped
                write_buffer_size=write_buffer_size,
                lru_cache_size=block_cache_size,
                bloom_filter_bits=bloom_bits,
                compression=None if compression == "none" else compression,
                max_open_files=max_open_files,
            )
        except plyvel.Error as exc:
            release_path(self._claim)
            raise self._open_error(exc) from exc
        self._finalizer = close_on_collect(self, self._db.close, self._claim)
        self._pid = os.getpid()
        self._cas_lock = threading.RLock()

    def _open_error(self, exc: BaseException) -> Exception:
        text = binding_message(exc)
        if "LOCK" in text and ("temporarily unavailable" in text or "already held" in text):
            return locked_error("leveldb", self.path, exc)
        if "Permission denied" in text or "Read-only file system" in text:
            return permission_error("leveldb", self.path, exc)
        if "No space left" in text:  # LevelDB writes a new log (and table) on every open
            return write_error("leveldb", self.path, "opening it, which LevelDB does by "
                               "writing a new log file, even to read", exc)
        damaged = damage_error("leveldb", self.path, exc, _REPAIR)
        if damaged is not None:
            return damaged
        return StoreError(f"cannot open the leveldb store {self.path!r}: {text}")

    def _damaged(self, exc: plyvel.Error) -> Exception:
        """The error to raise for a binding error met while reading or writing."""
        damaged = damage_error("leveldb", self.path, exc, _REPAIR)
        if damaged is not None:
            return damaged
        return StoreError(f"leveldb store {self.path!r}: {binding_message(exc)}")

    @classmethod
    def from_url(cls, parsed: StoreURL, **options: Any) -> LevelDBStore:
        """Open from a parsed URL; see the class for the options."""
        path = store_path(parsed)
        opts = take_options("leveldb", options, _OPTIONS)
        return cls(path, parsed.url, **opts)

    # ----------------------------------------------------------------- primitives
    def _closed_error(self, exc: RuntimeError) -> Exception:
        if self._closed or "closed" in str(exc):
            return StoreClosedError(f"store {self.url!r} is closed; open it again with open_store")
        return exc

    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        check_same_process(self._pid, self.url)
        try:
            snap = self._db.snapshot()  # one consistent view for the whole batch
        except RuntimeError as exc:
            raise self._closed_error(exc) from None
        try:
            get = snap.get
            return [get(k, verify_checksums=True) for k in keys]
        except plyvel.Error as exc:
            raise self._damaged(exc) from exc
        finally:
            snap.close()

    def _write_batch(self, ops: list[WriteOp]) -> None:
        check_same_process(self._pid, self.url)
        try:
            wb = self._db.write_batch(transaction=True, sync=self.sync)
        except RuntimeError as exc:
            raise self._closed_error(exc) from None
        put, delete = wb.put, wb.delete
        try:
            for k, v in ops:
                if v is None:
                    delete(k)
                else:
                    put(k, v)
        except BaseException:
            wb.clear()
            raise
        try:
            wb.write()
        except plyvel.Error as exc:
            if "No space left" in str(exc):
                raise StoreFullError(
                    errno.ENOSPC,
                    f"the disk under leveldb store {self.path!r} is full ({exc}); free space "
                    "and retry",
                ) from exc
            raise self._damaged(exc) from exc
        except RuntimeError as exc:
            raise self._closed_error(exc) from None

    def _read_chunk(
        self, start: bytes | None, n: int, stop: bytes | None, keys_only: bool
    ) -> list[tuple[bytes, bytes | None]]:
        check_same_process(self._pid, self.url)
        try:
            it = self._db.iterator(
                start=start, stop=stop, include_value=not keys_only, verify_checksums=True
            )
        except RuntimeError as exc:
            raise self._closed_error(exc) from None
        except plyvel.Error as exc:
            raise self._damaged(exc) from exc
        try:
            items: list[Any] = (
                list(zip(islice(it, n), repeat(None))) if keys_only else list(islice(it, n))
            )
            if len(items) < n:  # the end of the range, or an error plyvel does not raise
                probe = self._db.raw_iterator(verify_checksums=True)
                try:  # plyvel checks the status after a seek, not at the end of iteration
                    probe.seek(items[-1][0] + b"\x00") if items else probe.seek(start or b"")
                finally:
                    probe.close()
            return items
        except plyvel.Error as exc:
            raise self._damaged(exc) from exc
        finally:
            it.close()

    def _scan(
        self, start: bytes | None, stop: bytes | None, keys_only: bool, limit: int | None
    ) -> Iterator[tuple[bytes, bytes | None]]:
        def read(pos: bytes | None, n: int) -> list[tuple[bytes, bytes | None]]:
            return self._read_chunk(pos, n, stop, keys_only)

        return chunked_scan(read, start, limit, self._check_open)

    def _flush(self) -> None:
        if os.getpid() != self._pid:
            return
        # LevelDB has no call to sync the log on its own; an empty synced batch does it.
        if not self.sync:
            try:
                self._db.write_batch(sync=True).write()
            except plyvel.Error as exc:
                raise write_error("leveldb", self.path, "syncing the log", exc) from exc

    def _compact(self) -> tuple[int, int]:
        check_same_process(self._pid, self.url)
        before = directory_bytes(self.path)
        try:
            # An open-ended range (CompactRange with a null end) can leave level-0 files
            # alone while background flushes run (seen under CPU load); a bounded range does
            # not. Keys above the bound (64 bytes of 0xff) get an open-ended pass of their own.
            self._db.compact_range(start=b"\x00", stop=_HIGH_KEY)
            self._db.compact_range(start=_HIGH_KEY)
        except plyvel.Error as exc:
            raise self._damaged(exc) from exc
        except RuntimeError as exc:
            raise self._closed_error(exc) from None
        return before, directory_bytes(self.path)

    def _close(self) -> None:
        self._finalizer()

    def _stats(self) -> dict[str, Any]:
        raw = self._db.get_property(b"leveldb.approximate-memory-usage")
        return {
            "path": self.path,
            "memory_bytes": int(raw) if raw else None,
            "sync": self.sync,
        }
