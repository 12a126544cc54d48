"""The tier-chain runtime: a table's rows spread over tiers, fastest first.

``specs`` holds the storage options (:class:`StorageOption`, :class:`DRAM`, :class:`HBM`,
:class:`PMEM`, :class:`SSDHash`, :class:`KV`), ``build`` opens a table's row backend,
``rows`` the chain's backend (:class:`ChainBackend`, the table's hooks), ``tierchain`` the
chain (:class:`TierChain`), ``core`` its records and the interface its helpers use,
``pending`` the rows in flight; ``writeback``, ``prefetch``, ``assist`` and ``guard`` the
write-back pool, prefetching, the helper thread and the snapshot guard of the lower tiers.
The tier engines live in :mod:`tensorkv.embedding.tiers`, the Redis-resident table (which
``build`` opens too) in :mod:`tensorkv.embedding.redis`; docs/tiers.md describes the design.
"""

from tensorkv.embedding.chain.build import open_rows, resolve_storage
from tensorkv.embedding.chain.rows import ChainBackend
from tensorkv.embedding.chain.specs import (
    DRAM,
    HBM,
    KV,
    PMEM,
    STORAGE_TYPES,
    SSDHash,
    StorageOption,
    TierSpec,
)
from tensorkv.embedding.chain.tierchain import TierChain

__all__ = [
    "DRAM",
    "HBM",
    "KV",
    "PMEM",
    "STORAGE_TYPES",
    "ChainBackend",
    "SSDHash",
    "StorageOption",
    "TierChain",
    "TierSpec",
    "open_rows",
    "resolve_storage",
]


def __getattr__(name: str) -> object:
    if name == "ChainRows":  # the old name, kept importable for one release
        import warnings

        warnings.warn("tensorkv.embedding.chain.ChainRows is deprecated and will be removed in "
                      "the next release; use ChainBackend", DeprecationWarning, stacklevel=2)
        return ChainBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
