"""Backends addressed by URL: scheme -> backend class, imported on first use.

Each entry names a dotted path and the optional extra that provides its dependency, so a
missing dependency raises an ImportError that says what to install.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from tensorkv.config import parse_scalar
from tensorkv.errors import (
    ConfigError,
    InvalidURLError,
    MissingDependencyError,
    UnknownSchemeError,
)
from tensorkv.stores.base import KVStore
from tensorkv.stores.url import StoreURL


@dataclass(frozen=True)
class Backend:
    """A registered backend: where its class lives and which extra installs its dependency."""

    target: str  # "module:Class"
    extra: str | None  # pip extra, e.g. "redis"
    requires: tuple[str, ...] = ()  # top-level modules the backend imports
    creates: bool = False  # takes the ``create`` option (stores that live in files)


_REGISTRY: dict[str, Backend] = {
    "memory": Backend("tensorkv.stores.memory:MemoryStore", None),
    "lmdb": Backend("tensorkv.stores.lmdb:LMDBStore", "lmdb", ("lmdb",), creates=True),
    "rocksdb": Backend(
        "tensorkv.stores.rocksdb:RocksDBStore", "rocksdb", ("rocksdict",), creates=True
    ),
    "leveldb": Backend(
        "tensorkv.stores.leveldb:LevelDBStore", "leveldb", ("plyvel",), creates=True
    ),
    "redis": Backend("tensorkv.stores.redis:RedisStore", "redis", ("redis",)),
    "rediss": Backend("tensorkv.stores.redis:RedisStore", "redis", ("redis",)),
    "redis+cluster": Backend("tensorkv.stores.redis:RedisStore", "redis", ("redis",)),
    "rediss+cluster": Backend("tensorkv.stores.redis:RedisStore", "redis", ("redis",)),
    "redis+sentinel": Backend("tensorkv.stores.redis:RedisStore", "redis", ("redis",)),
    "rediss+sentinel": Backend("tensorkv.stores.redis:RedisStore", "redis", ("redis",)),
}


def register_backend(
    scheme: str,
    target: str,
    extra: str | None = None,
    requires: tuple[str, ...] = (),
    creates: bool = False,
) -> None:
    """Register (or replace) the backend serving ``scheme``.

    Parameters
    ----------
    scheme
        URL scheme, lower case.
    target
        ``"package.module:ClassName"`` of a :class:`KVStore` subclass with a ``from_url``
        classmethod.
    extra
        The pip extra that installs its dependency, named in the ImportError when missing.
    requires
        Top-level modules the backend imports; an ImportError for one of them becomes a
        :class:`~tensorkv.errors.MissingDependencyError` naming ``extra``.
    creates
        The backend's ``from_url`` takes the ``create`` option; for the others
        :func:`open_store` accepts and drops it.
    """
    _REGISTRY[scheme.lower()] = Backend(target, extra, tuple(requires), creates)


def schemes() -> list[str]:
    """All registered URL schemes."""
    return sorted(_REGISTRY)


def parse_url(url: str) -> StoreURL:
    """Parse a store URL into its parts (see :class:`StoreURL`)."""
    if not isinstance(url, str):
        raise InvalidURLError(
            f"store URL {url!r} must be a str such as 'lmdb:///abs/path' or 'redis://host:6379/0'"
        )
    if "://" not in url:
        example = url if url.startswith("/") else "/abs/path"
        raise InvalidURLError(
            f"store URL {url!r} has no scheme; write e.g. 'lmdb://{example}'"
            f" (schemes: {', '.join(schemes())})"
        )
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    # urlsplit does not understand comma-separated host lists; split the netloc by hand.
    parts = urlsplit("x://" + rest)
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    username = password = None
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        if ":" in cred:
            u, p = cred.split(":", 1)
            username, password = unquote(u) or None, unquote(p)
        else:
            username = unquote(cred) or None
    hosts: list[tuple[str, int | None]] = []
    if netloc:
        for item in netloc.split(","):
            item = item.strip()
            if not item:
                raise InvalidURLError(f"store URL {url!r} has an empty host in its host list")
            if item.startswith("["):  # IPv6 literal
                host, _, port_s = item[1:].partition("]")
                port_s = port_s.lstrip(":")
            elif item.count(":") == 1:
                host, port_s = item.split(":")
            else:
                host, port_s = item, ""
            port: int | None = None
            if port_s:
                try:
                    port = int(port_s)
                except ValueError:
                    raise InvalidURLError(
                        f"store URL {url!r}: port {port_s!r} of host {host!r} is not a number"
                    ) from None
                if not 0 < port < 65536:
                    raise InvalidURLError(f"store URL {url!r}: port {port} is out of range")
            hosts.append((host, port))
    options = {k: parse_scalar(v) for k, v in parse_qsl(parts.query, keep_blank_values=True)}
    return StoreURL(url, scheme, hosts, unquote(parts.path), username, password, options)


def backend_class(scheme: str) -> type[KVStore]:
    """Import and return the class serving ``scheme``."""
    entry = _REGISTRY.get(scheme)
    if entry is None:
        raise UnknownSchemeError(
            f"no backend for scheme {scheme!r}; known schemes: {', '.join(schemes())}"
        )
    module_name, _, cls_name = entry.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        if entry.extra is not None and (
            missing in entry.requires or any(r in str(exc) for r in entry.requires)
        ):
            raise MissingDependencyError(
                f"the {scheme!r} backend needs the Python package {missing!r}, which is not "
                f'installed; install it with: pip install "tensorkv[{entry.extra}]"'
            ) from exc
        raise
    return getattr(module, cls_name)


def open_store(url: str, **options: Any) -> KVStore:
    """Open a key-value store by URL.

    Parameters
    ----------
    url
        ``memory://[name]``, ``lmdb:///abs/path``, ``rocksdb:///abs/path``,
        ``leveldb:///abs/path``, ``redis://[user:pass@]host:port/db``, ``rediss://...`` (TLS),
        ``redis+cluster://h1:p1,h2:p2``, ``redis+sentinel://s1:p1,s2:p2/master_name``.
        Options may follow as a query string (``?readonly=true&map_size=1GiB``).
    **options
        Backend options; these override the query string. ``readonly=True`` works everywhere,
        and so does ``create=False``: a store kept in files (LMDB, RocksDB, LevelDB) that
        does not exist raises :class:`~tensorkv.errors.StoreNotFoundError` and nothing is
        created; the other backends ignore it.

    Returns
    -------
    KVStore
        The open store; use it as a context manager or call ``close()``.

    Examples
    --------
    >>> import tensorkv
    >>> with tensorkv.open_store("memory://") as store:
    ...     store.put(b"k", b"v")
    ...     store.get(b"k")
    b'v'
    """
    parsed = parse_url(url)
    cls = backend_class(parsed.scheme)
    merged = {**parsed.options, **options}
    if "create" in merged and not _REGISTRY[parsed.scheme].creates:
        create = merged.pop("create")
        if not isinstance(create, bool):
            raise ConfigError(f"option create={create!r} is not a boolean; use true or false")
    return cls.from_url(parsed, **merged)
