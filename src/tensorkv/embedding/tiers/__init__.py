"""Tier engines: the storage of a tier chain's levels, one module per engine.

Every lower tier implements :class:`~tensorkv.embedding.tiers.base.LowerTier` over fixed-size
row records: :class:`~tensorkv.embedding.tiers.ssdhash.SSDHashTier` (SSDHASH, segment files on
local disk; its file format in ``ssdhash_files``), :class:`~tensorkv.embedding.tiers.pmem.PMEMTier`
(a slot file on a DAX mount), :class:`~tensorkv.embedding.tiers.kv.KVTier` (any key-value store
URL), :class:`~tensorkv.embedding.tiers.dram.DRAMTier` (host memory below HBM). Tier 0 on a GPU
is :class:`~tensorkv.embedding.tiers.hbm_arena.HBMArena`. The chain that runs them is
:mod:`tensorkv.embedding.chain`; the Redis-resident table is :mod:`tensorkv.embedding.redis`.
Tier modules are imported on first use of their class, so importing this package is cheap.
See docs/tiers.md.
"""

from __future__ import annotations

from typing import Any

from tensorkv.embedding.tiers.base import LowerTier, RecordFields, RecordLayout, as_keys

__all__ = [
    "DRAMTier",
    "HBMArena",
    "KVTier",
    "LowerTier",
    "PMEMTier",
    "RecordFields",
    "RecordLayout",
    "SSDHashTier",
    "as_keys",
]

_LAZY = {
    "DRAMTier": "tensorkv.embedding.tiers.dram",
    "HBMArena": "tensorkv.embedding.tiers.hbm_arena",
    "SSDHashTier": "tensorkv.embedding.tiers.ssdhash",
    "PMEMTier": "tensorkv.embedding.tiers.pmem",
    "KVTier": "tensorkv.embedding.tiers.kv",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tensorkv.embedding.tiers' has no attribute {name!r}")
