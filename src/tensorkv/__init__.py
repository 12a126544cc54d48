"""tensorkv: deep-learning parameters in key-value storage.

Dynamic embedding tables that spill from GPU memory to DRAM to SSD, checkpoints written
straight into LMDB, RocksDB, LevelDB or Redis, and one byte-level store API under them. This
module is the public surface: tables and their options, storage specs, stores, checkpoints.
Errors live in :mod:`tensorkv.errors`, conformance suites in :mod:`tensorkv.testing`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from tensorkv.checkpoint import CheckReport as CheckReport
from tensorkv.checkpoint import (
    SaveHandle,
    check,
    compact,
    copy_tag,
    delete_tag,
    dump_tag,
    expire_tag,
    gc,
    import_dump,
    latest_tag,
    list_tags,
    load,
    read_tensor,
    save,
    tag_manifest,
    training_step,
)
from tensorkv.checkpoint import StepScope as StepScope
from tensorkv.errors import TensorKVError
from tensorkv.stores import KVStore, open_store

if TYPE_CHECKING:
    from tensorkv.embedding import (
        DRAM,
        FTRL,
        HBM,
        KV,
        PMEM,
        SGD,
        Adagrad,
        Adam,
        AdamW,
        BloomFilter,
        Constant,
        CounterFilter,
        EmbeddingTable,
        Eviction,
        Normal,
        RMSProp,
        SSDHash,
        StorageOption,
        TruncatedNormal,
        Uniform,
        Zeros,
    )
    from tensorkv.embedding import ExportChunk as ExportChunk
    from tensorkv.embedding import get_initializer as get_initializer
    from tensorkv.embedding import get_optimizer as get_optimizer
    from tensorkv.repository import Repository

try:
    __version__ = version("tensorkv")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

# Names kept importable for one release (the docs used them); each access warns.
_DEPRECATED = {"KVTier": "KV", "TieredEmbeddingTable": "EmbeddingTable"}
_RENAMED = {"restore_tag": "import_dump", "tag_info": "tag_manifest"}


def __getattr__(name: str) -> object:
    if name == "Repository":  # the model repository, imported on first use
        from tensorkv.repository import Repository

        return Repository
    if name in _EMBEDDING:
        from tensorkv import embedding

        return getattr(embedding, name)
    if name in _DEPRECATED:
        import warnings

        from tensorkv import embedding

        new = _DEPRECATED[name]
        warnings.warn(f"tensorkv.{name} is deprecated and will be removed in the next release;"
                      f" use tensorkv.{new}", DeprecationWarning, stacklevel=2)
        return getattr(embedding, new)
    if name in _RENAMED:
        import warnings

        new = _RENAMED[name]
        warnings.warn(f"tensorkv.{name} is deprecated and will be removed in the next release;"
                      f" use tensorkv.{new}", DeprecationWarning, stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module 'tensorkv' has no attribute {name!r}")


__all__ = [
    # embedding tables and their options
    "EmbeddingTable",
    "Zeros",
    "Constant",
    "Uniform",
    "Normal",
    "TruncatedNormal",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "FTRL",
    "RMSProp",
    "CounterFilter",
    "BloomFilter",
    "Eviction",
    # storage specs
    "StorageOption",
    "DRAM",
    "HBM",
    "PMEM",
    "SSDHash",
    "KV",
    # stores
    "KVStore",
    "open_store",
    # checkpoints
    "save",
    "load",
    "read_tensor",
    "list_tags",
    "latest_tag",
    "tag_manifest",
    "copy_tag",
    "import_dump",
    "delete_tag",
    "expire_tag",
    "dump_tag",
    "compact",
    "check",
    "gc",
    "SaveHandle",
    "training_step",
    # the model repository
    "Repository",
    # errors and version
    "TensorKVError",
    "__version__",
]

# Importable from tensorkv without being in __all__ (see CONTRIBUTING.md, "The root
# namespace"): helpers a user rarely names.
_UNLISTED_EMBEDDING = ("ExportChunk", "get_initializer", "get_optimizer")

# The names of __all__ not imported above come from tensorkv.embedding on first use, so
# `import tensorkv` stays free of numba.
_EMBEDDING = frozenset([*(n for n in __all__ if n not in globals() and n != "Repository"),
                        *_UNLISTED_EMBEDDING])
