"""A parsed store URL (:class:`StoreURL`): what every backend's ``from_url`` receives.

:func:`~tensorkv.stores.registry.parse_url` makes one from a URL string; the registry
(:mod:`tensorkv.stores.registry`) picks the backend by its scheme. A leaf module, so the
backends and :class:`~tensorkv.stores.base.KVStore` can name it without importing the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL.

    Attributes
    ----------
    scheme
        Lower-case scheme, e.g. ``"lmdb"`` or ``"redis+cluster"``.
    hosts
        ``[(host, port)]`` for network stores (several for cluster and sentinel).
    path
        The path part (absolute file path for embedded stores; ``"/0"`` or ``"/master"``
        for Redis).
    username, password
        Credentials from the netloc, if any.
    options
        Options from the query string, converted to bool/int/float where they look so.
    """

    url: str
    scheme: str
    hosts: list[tuple[str, int | None]] = field(default_factory=list)
    path: str = ""
    username: str | None = None
    password: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


__all__ = ["StoreURL"]
