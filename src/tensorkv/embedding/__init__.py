"""Dynamic embedding tables.

:class:`EmbeddingTable` (``table.py``) is the one table class: DRAM-only, tiered, on a GPU or
in Redis; every table satisfies :class:`~tensorkv.embedding.protocol.Table`. It holds its
rows through a row backend (``backend.py``): one arena (``rows.py``, tier 0 in ``arena.py``),
a tier chain (``chain/``, tier engines in ``tiers/``) or Redis (``redis/``). Optimizers,
initializers, admission filters, eviction rules and storage options plug into it. See
docs/internals.md ("Where the code lives") and docs/tiers.md.
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
    RMSProp,
    TableOptimizer,
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
    "RMSProp",
    "SSDHash",
    "StorageOption",
    "TableOptimizer",
    "TruncatedNormal",
    "Uniform",
    "Zeros",
    "get_initializer",
    "get_optimizer",
]

# Names kept importable for one release; each access warns.
_DEPRECATED = {
    "KVTier": ("KV", "tensorkv.KV (the KV tier spec)"),
    "Optimizer": ("TableOptimizer", "tensorkv.embedding.TableOptimizer (tensorkv.torch.Optimizer "
                  "is the optimizer of a torch model)"),
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
