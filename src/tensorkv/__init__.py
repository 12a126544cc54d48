"""tensorkv: deep-learning parameters in key-value storage.

Dynamic embedding tables that spill from GPU memory to DRAM to SSD, checkpoints written
straight into LMDB, RocksDB, LevelDB or Redis, and one byte-level store API under them.
"""

from importlib.metadata import PackageNotFoundError, version

from tensorkv.checkpoint import (
    compact,
    copy_tag,
    delete_tag,
    dump_tag,
    latest_tag,
    list_tags,
    load,
    read_tensor,
    restore_tag,
    save,
)
from tensorkv.errors import TensorKVError
from tensorkv.stores import KVStore, open_store

try:
    __version__ = version("tensorkv")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

# The embedding API is imported on first use, so `import tensorkv` stays free of numba.
_EMBEDDING_NAMES = ("EmbeddingTable", "ExportChunk", "CounterFilter", "BloomFilter", "Eviction",
                    "Zeros", "Constant", "Uniform", "Normal", "TruncatedNormal",
                    "get_initializer", "SGD", "Adagrad", "Adam", "AdamW", "FTRL", "RMSProp",
                    "get_optimizer", "StorageOption", "DRAM", "HBM", "PMEM", "SSDHash",
                    "KVTier", "TieredEmbeddingTable")


def __getattr__(name: str):
    if name in _EMBEDDING_NAMES:
        from tensorkv import embedding

        return getattr(embedding, name)
    raise AttributeError(f"module 'tensorkv' has no attribute {name!r}")


__all__ = ["KVStore", "TensorKVError", "__version__", "open_store", *_EMBEDDING_NAMES]
__all__ += [
    "compact",
    "copy_tag",
    "delete_tag",
    "dump_tag",
    "latest_tag",
    "list_tags",
    "load",
    "read_tensor",
    "restore_tag",
    "save",
]
