"""Deprecated location of the storage specs; import them from :mod:`tensorkv` instead.

Kept for one release: ``from tensorkv.embedding.storage import DRAM, SSDHash, KVTier,
StorageOption`` still works (``KVTier`` is now :class:`~tensorkv.embedding.chain.specs.KV`)
and warns once.
"""

import warnings

from tensorkv.embedding.chain.specs import DRAM, HBM, KV, PMEM, SSDHash, StorageOption

KVTier = KV

warnings.warn("tensorkv.embedding.storage is deprecated and will be removed in the next release;"
              " import StorageOption, DRAM, HBM, PMEM, SSDHash and KV (formerly KVTier) from "
              "tensorkv", DeprecationWarning, stacklevel=2)

__all__ = ["DRAM", "HBM", "KV", "PMEM", "KVTier", "SSDHash", "StorageOption"]
