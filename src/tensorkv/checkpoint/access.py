"""Opening the store a checkpoint call names (a URL or an already open KVStore).

Stores opened here are closed when the call returns; LMDB ones skip per-transaction fsyncs,
since checkpoint code flushes before each manifest (the order of writes that makes a tag
atomic is in the "Atomic tags" section of ``docs/format.md``). Also the writeback hint that
saves give an unsynced LMDB store after each batch.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tensorkv import pages
from tensorkv.errors import ConfigError, StoreError
from tensorkv.stores.base import KVStore


def _open_retrying(open_store: Callable[..., KVStore], url: str, **options: Any) -> KVStore:
    # An LMDB environment opened while another process grows its map can fail with
    # MDB_MAP_RESIZED; opening again a moment later sees the new size.
    for attempt in range(4):
        try:
            return open_store(url, **options)
        except StoreError as exc:
            if "MAP_RESIZED" not in str(exc):
                raise
            time.sleep(0.01 * (attempt + 1))
    return open_store(url, **options)  # the fifth and last try


@contextmanager
def using_store(url: str | KVStore, *, create: bool = True, **options: Any) -> Iterator[KVStore]:
    """Yield an open store; close it afterwards only if it was opened here.

    LMDB stores opened here skip the fsync of every transaction (``sync=false``) unless the
    URL sets ``sync``: the checkpoint code flushes before writing a manifest and the store is
    flushed on close, so data is durable before the tag is, and the tag when the call returns.

    Parameters
    ----------
    url
        A store URL, or an open store (yielded as it is).
    create
        False for calls that only read (or need existing data): a URL naming no store
        raises :class:`~tensorkv.errors.StoreNotFoundError` and nothing is created.
    **options
        Options for :func:`~tensorkv.stores.open_store`.
    """
    if isinstance(url, KVStore):
        yield url
        return
    from tensorkv.stores import open_store
    from tensorkv.stores.registry import parse_url

    store = None
    options["create"] = create
    if parse_url(url).scheme == "lmdb" and "sync" not in parse_url(url).options | options:
        # Group commit: checkpoint code flushes (fsyncs) explicitly before each manifest
        # and the store flushes on close, so per-transaction fsyncs would only cost time.
        try:
            store = _open_retrying(open_store, url, sync=False, **options)
        except ConfigError:  # already open in this process with another sync setting
            store = None
    if store is None:
        store = _open_retrying(open_store, url, **options)
    try:
        yield store
    except BaseException as exc:
        try:
            store.close()
        except Exception as close_exc:  # the first error says what went wrong
            exc.add_note(f"closing {store.url!r} afterwards failed too: {close_exc}")
        raise
    store.close()


def writeback_starter(store: KVStore) -> Callable[[], None] | None:
    """A callable that starts writeback of an unsynced LMDB store's data file, or None.

    Checkpoint saves open LMDB stores without per-transaction fsync and fsync once before the
    manifest. Left alone, the kernel starts writing the dirty pages back only once they exceed
    its background threshold, so that final fsync would write most of the checkpoint while
    nothing else runs. Calling this after each batch asks the kernel to start writing what is
    dirty now (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait), so the disk
    works while the next batch is encoded. Linux only; elsewhere None.
    """
    from tensorkv.stores.lmdb import LMDBStore

    if not isinstance(store, LMDBStore) or store.sync or not sys.platform.startswith("linux"):
        return None
    path = os.path.join(store.path, "data.mdb")

    def start() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            pages.start_writeback(fd)  # a hint: errors are ignored
        finally:
            os.close(fd)

    return start
