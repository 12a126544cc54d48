"""Dynamic embedding tables.

:class:`EmbeddingTable` is the public object (one class for every kind: DRAM-only, tiered,
on a GPU); initializers, sparse optimizers, admission filters, eviction policies and storage
options plug into it. Where the code lives: ``table.py`` (the table), ``arena.py`` (tier 0),
``rows.py`` and ``chain/`` (where rows live: one arena or a tier chain), ``tiers/`` (the tier
engines), ``optimizers.py``, ``initializers.py``, ``filters.py``.
"""

from tensorkv.embedding.chain.specs import DRAM, HBM, KV, PMEM, SSDHash, StorageOption
from tensorkv.embedding.chunks import ExportChunk
from tensorkv.embedding.filters import BloomFilter, CounterFilter, Eviction
from tensorkv.embedding.initializers import (
    Constant,
    Initializer,
    Normal,
    TruncatedNormal,
    Uniform,
    Zeros,
    get_initializer,
)
from tensorkv.embedding.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    AdamW,
    Optimizer,
    RMSProp,
    get_optimizer,
)
from tensorkv.embedding.table import EmbeddingTable

__all__ = [
    "DRAM",
    "FTRL",
    "HBM",
    "KV",
    "PMEM",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "BloomFilter",
    "Constant",
    "CounterFilter",
    "EmbeddingTable",
    "Eviction",
    "ExportChunk",
    "Initializer",
    "Normal",
    "Optimizer",
    "RMSProp",
    "SSDHash",
    "StorageOption",
    "TruncatedNormal",
    "Uniform",
    "Zeros",
    "get_initializer",
    "get_optimizer",
]

# Names kept importable for one release; each access warns.
_DEPRECATED = {
    "KVTier": ("KV", "tensorkv.KV (the KV tier spec)"),
    "TieredEmbeddingTable": ("EmbeddingTable", "tensorkv.EmbeddingTable(dim, storage=...)"),
}


def __getattr__(name: str) -> object:
    if name in _DEPRECATED:
        import warnings

        new, hint = _DEPRECATED[name]
        warnings.warn(f"tensorkv.embedding.{name} is deprecated and will be removed in the next "
                      f"release; use {hint}", DeprecationWarning, stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module 'tensorkv.embedding' has no attribute {name!r}")
