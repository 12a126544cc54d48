"""Deprecated location of the storage specs; import them from :mod:`tensorkv` instead.

``from tensorkv.embedding.storage import DRAM, SSDHash, KVTier, StorageOption`` works until the
next release and warns once; ``KVTier`` is :class:`~tensorkv.embedding.chain.specs.KV`. See
docs/tiers.md ("StorageOption").
"""

import warnings

from tensorkv.embedding.chain.specs import DRAM, HBM, KV, PMEM, SSDHash, StorageOption

KVTier = KV

warnings.warn("tensorkv.embedding.storage is deprecated and will be removed in the next release;"
              " import StorageOption, DRAM, HBM, PMEM, SSDHash and KV (formerly KVTier) from "
              "tensorkv", DeprecationWarning, stacklevel=2)

__all__ = ["DRAM", "HBM", "KV", "PMEM", "KVTier", "SSDHash", "StorageOption"]
