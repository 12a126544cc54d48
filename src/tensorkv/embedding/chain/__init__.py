"""The tier-chain runtime: a table's rows spread over tiers, fastest first.

``specs`` holds the storage options (:class:`StorageOption`, :class:`DRAM`, :class:`HBM`,
:class:`PMEM`, :class:`SSDHash`, :class:`KV`), ``build`` opens a chain, ``rows`` the table's
hooks (:class:`ChainRows`), ``tierchain`` the chain (:class:`TierChain`), ``pending`` the rows
in flight; ``writeback``, ``prefetch`` and ``assist`` the write-back pool, prefetching and the
helper thread. The tier engines live in :mod:`tensorkv.embedding.tiers`; docs/tiers.md
describes the whole design.
"""

from tensorkv.embedding.chain.build import open_rows, resolve_storage
from tensorkv.embedding.chain.rows import ChainRows
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
    "ChainRows",
    "SSDHash",
    "StorageOption",
    "TierChain",
    "TierSpec",
    "open_rows",
    "resolve_storage",
]
