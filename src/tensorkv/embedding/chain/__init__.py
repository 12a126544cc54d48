"""The tier-chain runtime: a table's rows spread over tiers, fastest first.

- :mod:`~tensorkv.embedding.chain.specs`: storage options (:class:`StorageOption` and the
  tier specs :class:`DRAM`, :class:`HBM`, :class:`PMEM`, :class:`SSDHash`, :class:`KV`);
- :mod:`~tensorkv.embedding.chain.build`: opening a chain for a table;
- :mod:`~tensorkv.embedding.chain.rows`: :class:`ChainRows`, the hooks a tiered table runs
  around every operation;
- :mod:`~tensorkv.embedding.chain.tierchain`: :class:`TierChain`, promotion, demotion and
  cascades; :mod:`~tensorkv.embedding.chain.pending` the rows in flight;
- :mod:`~tensorkv.embedding.chain.writeback`, :mod:`~tensorkv.embedding.chain.prefetch`,
  :mod:`~tensorkv.embedding.chain.assist`: the background write-back pool, prefetching, and
  the helper thread.

The tier engines themselves live in :mod:`tensorkv.embedding.tiers`; docs/tiers.md describes
the whole design.
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
