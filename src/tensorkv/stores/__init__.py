"""Byte-level key-value stores behind one API, opened by URL.

``base`` holds :class:`KVStore` (the API every backend implements), ``url`` the parsed URL
(:class:`StoreURL`), ``registry`` the scheme -> backend table (:func:`open_store`); then one
module per backend (``memory``, ``lmdb*``, ``leveldb``, ``rocksdb``, ``redis*``, with
``embedded`` shared by the file-backed ones). See docs/backends.md.
"""

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
