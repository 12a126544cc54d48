"""Opening the store a checkpoint call names (a URL or an already open KVStore)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tensorkv.stores.base import KVStore


@contextmanager
def using_store(url: str | KVStore, **options: Any) -> Iterator[KVStore]:
    """Yield an open store; close it afterwards only if it was opened here."""
    if isinstance(url, KVStore):
        yield url
        return
    from tensorkv.stores import open_store

    store = open_store(url, **options)
    try:
        yield store
    finally:
        store.close()
