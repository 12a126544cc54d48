"""Byte-level key-value stores behind one API, opened by URL."""

from tensorkv.stores.base import Capabilities, KVStore, WriteBatch
from tensorkv.stores.registry import open_store, parse_url, register_backend, schemes
from tensorkv.stores.url import StoreURL

__all__ = [
    "Capabilities",
    "KVStore",
    "StoreURL",
    "WriteBatch",
    "open_store",
    "parse_url",
    "register_backend",
    "schemes",
]
