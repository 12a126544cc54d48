"""Lower storage tiers below an embedding table's DRAM/HBM tier.

Every tier implements :class:`~tensorkv.embedding.tiers.base.LowerTier` over fixed-size row
records: :class:`~tensorkv.embedding.tiers.ssdhash.SSDHashTier` (SSDHASH, segment files on
local disk), :class:`~tensorkv.embedding.tiers.pmem.PMEMTier` (a slot file on a DAX mount),
:class:`~tensorkv.embedding.tiers.kv.KVTier` (any key-value store URL). Tier modules are
imported on first use of their class, so importing this package is cheap. See docs/tiers.md.
"""

from __future__ import annotations

from typing import Any

from tensorkv.embedding.tiers.base import LowerTier, RecordFields, RecordLayout, as_keys

__all__ = [
    "KVTier",
    "LowerTier",
    "PMEMTier",
    "RecordFields",
    "RecordLayout",
    "SSDHashTier",
    "as_keys",
]

_LAZY = {
    "SSDHashTier": "tensorkv.embedding.tiers.ssdhash",
    "PMEMTier": "tensorkv.embedding.tiers.pmem",
    "KVTier": "tensorkv.embedding.tiers.kv",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tensorkv.embedding.tiers' has no attribute {name!r}")
