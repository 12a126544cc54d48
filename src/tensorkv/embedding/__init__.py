"""Dynamic embedding tables.

:class:`EmbeddingTable` is the public object; :class:`RowArena` is its row storage (tier 0);
initializers, sparse optimizers, admission filters and eviction policies plug into it.
"""

from tensorkv.embedding.arena import RowArena
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
from tensorkv.embedding.storage import DRAM, HBM, PMEM, KVTier, SSDHash, StorageOption
from tensorkv.embedding.table import EmbeddingTable, ExportChunk
from tensorkv.embedding.tiered_table import TieredEmbeddingTable

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "BloomFilter",
    "DRAM",
    "HBM",
    "PMEM",
    "Constant",
    "CounterFilter",
    "EmbeddingTable",
    "Eviction",
    "ExportChunk",
    "KVTier",
    "SSDHash",
    "StorageOption",
    "TieredEmbeddingTable",
    "Initializer",
    "Normal",
    "Optimizer",
    "RMSProp",
    "RowArena",
    "TruncatedNormal",
    "Uniform",
    "Zeros",
    "get_initializer",
    "get_optimizer",
]
