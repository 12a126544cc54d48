"""RocksDB backend through ``rocksdict``: an LSM tree for write-heavy, larger-than-memory data.

``rocksdb:///abs/path`` opens (or creates) the database directory ``/abs/path``. Every write
call is one RocksDB ``WriteBatch`` written to the write-ahead log, so batches are atomic even
if the process is killed. The WAL is not fsynced per write unless ``sync=true``: data
survives a process crash, but a power loss or OS crash may lose the last writes.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import replace
from itertools import islice, repeat
from typing import TYPE_CHECKING, Any, cast

import rocksdict

from tensorkv import config
from tensorkv.errors import (
    ConfigError,
    CorruptStoreError,
    StoreClosedError,
    StoreError,
    StoreFullError,
)
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

_COMPRESSION = {
    "none": rocksdict.DBCompressionType.none,
    "lz4": rocksdict.DBCompressionType.lz4,
    "zstd": rocksdict.DBCompressionType.zstd,
    "snappy": rocksdict.DBCompressionType.snappy,
}


def _as_compression(name: str, value: Any) -> str:
    low = str(value).strip().lower()
    if low not in _COMPRESSION:
        raise ConfigError(
            f"option {name}={value!r} is not a compression; use one of {', '.join(_COMPRESSION)}"
        )
    return low


_DEFAULT_JOBS = max(2, min(8, os.cpu_count() or 2))  # flush + compaction threads

_DATA_FILES = ("*.sst", "*.log")  # tables and logs: data a missing CURRENT orphans
_REPAIR = "rocksdict.Rdict.repair(path)"

_OPTIONS = {
    "readonly": (as_bool, False),
    "create": (as_bool, True),
    "sync": (as_bool, False),
    "compression": (_as_compression, "none"),
    "write_buffer_size": (as_size, config.ROCKSDB_WRITE_BUFFER_SIZE),
    "max_write_buffers": (as_int, config.ROCKSDB_MAX_WRITE_BUFFERS),
    "block_cache_size": (as_size, config.ROCKSDB_BLOCK_CACHE_SIZE),
    "background_jobs": (as_int, _DEFAULT_JOBS),
    "bloom_bits": (lambda n, v: as_int(n, v, minimum=0), 10),
}


class RocksDBStore(SingleWriter, KVStore):
    """A store in a RocksDB database (one directory), used by one process at a time.

    Parameters
    ----------
    path
        Absolute path of the database directory (created when missing, unless readonly).
    url
        The URL it was opened with.
    readonly
        Open read-only (no lock taken; other read-only opens may run at once).
    create
        Create the store when the path holds none (default). ``False``: raise
        :class:`~tensorkv.errors.StoreNotFoundError` and create nothing.
    sync
        ``False`` (default): the WAL is written on every call but not fsynced, so data
        survives a process crash but maybe not a power loss. ``True``: fsync the WAL on
        every write call (durable on return, much slower).
    compression
        ``"none"`` (default: float tensors and embedding rows barely compress, so LZ4 costs
        CPU for nothing), ``"lz4"``, ``"zstd"`` or ``"snappy"``.
    write_buffer_size
        Bytes per memtable (default 64 MiB); larger buffers mean fewer, larger flushes.
    max_write_buffers
        Memtables kept while older ones flush (default 4), so bulk loads do not stall.
    block_cache_size
        Bytes of uncompressed blocks cached for reads (default 128 MiB).
    background_jobs
        Threads for flushes and compactions (default: CPU count, between 2 and 8).
    bloom_bits
        Bloom filter bits per key (default 10; 0 disables): lookups of absent keys skip
        most files.
    """

    scheme = "rocksdb"
    capabilities = Capabilities(
        ordered_scans=True, atomic_batches=True, durable_on_return=False, multi_process=False
    )
    max_value_size = 0xFFFF_FFFF  # record lengths in the WAL are 32-bit varints

    def __init__(
        self,
        path: str,
        url: str = "",
        *,
        readonly: bool = False,
        create: bool = True,
        sync: bool = False,
        compression: str = "none",
        write_buffer_size: int = config.ROCKSDB_WRITE_BUFFER_SIZE,
        max_write_buffers: int = config.ROCKSDB_MAX_WRITE_BUFFERS,
        block_cache_size: int = config.ROCKSDB_BLOCK_CACHE_SIZE,
        background_jobs: int = _DEFAULT_JOBS,
        bloom_bits: int = 10,
    ) -> None:
        super().__init__(url or f"rocksdb://{path}", readonly=readonly)
        self.path = path
        self.sync = bool(sync)
        if self.sync:
            self.capabilities = replace(type(self).capabilities, durable_on_return=True)
        prepare_directory(
            path,
            readonly=readonly,
            create=create,
            marker="CURRENT",
            scheme="rocksdb",
            data_files=_DATA_FILES,
            repair=_REPAIR,
        )
        check_lsm_files("rocksdb", path, _REPAIR)
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(create and not readonly)
        opts.increase_parallelism(background_jobs)
        opts.set_max_background_jobs(background_jobs)
        opts.set_write_buffer_size(write_buffer_size)
        opts.set_max_write_buffer_number(max_write_buffers)
        opts.set_compression_type(_COMPRESSION[compression]())
        opts.set_bottommost_compression_type(_COMPRESSION[compression]())
        opts.set_wal_recovery_mode(rocksdict.DBRecoveryMode.point_in_time())
        table = rocksdict.BlockBasedOptions()
        table.set_block_cache(rocksdict.Cache(block_cache_size))
        if bloom_bits:
            table.set_bloom_filter(bloom_bits, False)
        table.set_cache_index_and_filter_blocks(True)
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        opts.set_block_based_table_factory(table)
        self._claim = None if readonly else claim_path("rocksdb", path)
        try:
            access = (
                rocksdict.AccessType.read_only(False)
                if readonly
                else rocksdict.AccessType.read_write()
            )
            self._db = rocksdict.Rdict(path, opts, access_type=access)
        except Exception as exc:
            if self._claim is not None:
                release_path(self._claim)
            raise self._open_error(exc) from exc
        self._finalizer = close_on_collect(self, self._db.close, self._claim)
        self._pid = os.getpid()
        self._cas_lock = threading.RLock()
        self._wopt = rocksdict.WriteOptions()
        self._wopt.sync = self.sync
        self._db.set_write_options(self._wopt)

    def _open_error(self, exc: BaseException) -> Exception:
        text = binding_message(exc)
        if "LOCK" in text and ("Resource temporarily unavailable" in text or "lock" in text):
            return locked_error("rocksdb", self.path, exc)
        if "Permission denied" in text or "Read-only file system" in text:
            return permission_error("rocksdb", self.path, exc)
        damaged = damage_error("rocksdb", self.path, exc, _REPAIR)
        if damaged is not None:
            return damaged
        return StoreError(f"cannot open the rocksdb store {self.path!r}: {text}")

    @classmethod
    def from_url(cls, parsed: StoreURL, **options: Any) -> RocksDBStore:
        """Open from a parsed URL; see the class for the options."""
        path = store_path(parsed)
        opts = take_options("rocksdb", options, _OPTIONS)
        return cls(path, parsed.url, **opts)

    # ----------------------------------------------------------------- primitives
    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except rocksdict.DbClosedError:
            self._check_open()
            raise StoreClosedError(f"store {self.url!r} is closed") from None
        except Exception as exc:  # rocksdict raises plain Exception with RocksDB's status
            damaged = damage_error("rocksdb", self.path, exc, _REPAIR)
            if damaged is not None:
                raise damaged from exc
            raise

    def _read_all(self, it: Any, n: int) -> list[Any]:
        """Up to ``n`` items of a rocksdict iterator, with damage reported as for ``_call``."""
        return cast("list[Any]", self._call(lambda: list(islice(it, n))))

    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        check_same_process(self._pid, self.url)
        return self._call(self._db.get, keys)

    def _write_batch(self, ops: list[WriteOp]) -> None:
        check_same_process(self._pid, self.url)
        wb = rocksdict.WriteBatch(raw_mode=True)
        put, delete = wb.put, wb.delete
        for k, v in ops:
            if v is None:
                delete(k)
            else:
                put(k, v if type(v) is bytes else bytes(v))  # raw mode takes bytes only
        try:
            self._call(self._db.write, wb, self._wopt)
        except (StoreClosedError, CorruptStoreError):
            raise
        except Exception as exc:
            if "No space left" in str(exc):
                raise StoreFullError(
                    errno.ENOSPC,
                    f"the disk under rocksdb store {self.path!r} is full ({exc}); free space "
                    "and retry",
                ) from exc
            raise StoreError(f"rocksdb write to {self.path!r} failed: {exc}") from exc

    def _read_chunk(
        self, start: bytes | None, n: int, stop: bytes | None, keys_only: bool
    ) -> list[tuple[bytes, bytes | None]]:
        check_same_process(self._pid, self.url)
        ropt = rocksdict.ReadOptions()
        if stop is not None:
            ropt.set_iterate_upper_bound(stop)
        if keys_only:
            it = self._call(self._db.keys, False, start, ropt)
            items: list[Any] = list(zip(self._read_all(it, n), repeat(None)))
        else:
            it = self._call(self._db.items, False, start, ropt)
            items = self._read_all(it, n)
        if len(items) < n:  # the end of the range, or an error that rocksdict hides
            self._check_end(items[-1][0] + b"\x00" if items else start, ropt)
        return items

    def _check_end(self, pos: bytes | None, ropt: Any) -> None:
        """Raise if iterating from ``pos`` meets damage.

        rocksdict ends an iterator early, and silently, where RocksDB reports an error.
        """

        def probe() -> None:
            it = self._db.iter(ropt)
            it.seek_to_first() if pos is None else it.seek(pos)
            it.status()  # raises RocksDB's error

        self._call(probe)

    def _scan(
        self, start: bytes | None, stop: bytes | None, keys_only: bool, limit: int | None
    ) -> Iterator[tuple[bytes, bytes | None]]:
        def read(pos: bytes | None, n: int) -> list[tuple[bytes, bytes | None]]:
            return self._read_chunk(pos, n, stop, keys_only)

        return chunked_scan(read, start, limit, self._check_open)

    def _flush(self) -> None:
        if os.getpid() != self._pid:
            return
        try:
            self._db.flush_wal(True)
        except Exception as exc:  # rocksdict raises a bare Exception for I/O errors
            raise write_error("rocksdb", self.path, "syncing the write-ahead log", exc) from exc

    def ingest_files(self, paths: list[str]) -> None:
        """Add SST files written by :func:`write_sst_files` to the database (moved in).

        RocksDB links (or copies) the files into the database and assigns them one sequence
        number: the keys appear at once, later than every earlier write, with no write
        through the memtable and the write-ahead log. Files that overlap nothing go to the
        bottom level, so nothing is compacted again.
        """
        self._check_writable()
        check_same_process(self._pid, self.url)
        if not paths:
            return
        opts = rocksdict.IngestExternalFileOptions()
        opts.set_move_files(True)
        try:
            self._call(self._db.ingest_external_file, list(paths), opts)
        except (StoreClosedError, CorruptStoreError):
            raise
        except Exception as exc:
            raise write_error("rocksdb", self.path, f"ingesting {len(paths)} SST file(s)",
                              exc) from exc

    def _compact(self) -> tuple[int, int]:
        check_same_process(self._pid, self.url)
        before = directory_bytes(self.path)
        self._call(self._db.flush, True)  # the memtable too, so compaction sees every write
        self._call(self._db.compact_range, None, None)
        return before, directory_bytes(self.path)

    def _close(self) -> None:
        self._finalizer()

    def _stats(self) -> dict[str, Any]:
        prop = self._db.property_int_value
        return {
            "path": self.path,
            "estimated_keys": prop("rocksdb.estimate-num-keys"),
            "live_sst_bytes": prop("rocksdb.live-sst-files-size"),
            "memtable_bytes": prop("rocksdb.cur-size-all-mem-tables"),
            "sync": self.sync,
        }


def write_sst_files(
    items: Iterable[tuple[bytes, bytes]], directory: str, file_bytes: int = 256 << 20
) -> list[str]:
    """Write ``items`` (keys in strictly ascending order) into SST files for ``ingest_files``.

    A new file starts once one holds ``file_bytes`` of values, so the files follow one
    another in key order and overlap nothing. Returns the paths written, in order.
    """
    paths: list[str] = []
    writer: Any = None
    size = 0
    try:
        for k, v in items:
            if writer is None:
                path = os.path.join(directory, f"{len(paths):06d}.sst")
                writer = rocksdict.SstFileWriter(rocksdict.Options(raw_mode=True))
                writer.open(path)
                paths.append(path)
                size = 0
            writer[k] = v if type(v) is bytes else bytes(v)
            size += len(k) + len(v)
            if size >= file_bytes:
                writer.finish()
                writer = None
        if writer is not None:
            writer.finish()
            writer = None
    except Exception as exc:  # rocksdict raises a bare Exception for I/O errors
        raise write_error("rocksdb", directory, "writing SST files", exc) from exc
    return paths
