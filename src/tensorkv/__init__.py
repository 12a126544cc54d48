"""tensorkv: deep-learning parameters in key-value storage.

Dynamic embedding tables that spill from GPU memory to DRAM to SSD, checkpoints written
straight into LMDB, RocksDB, LevelDB or Redis, and one byte-level store API under them.
"""

from importlib.metadata import PackageNotFoundError, version

from tensorkv.errors import TensorKVError
from tensorkv.stores import KVStore, open_store

try:
    __version__ = version("tensorkv")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = ["KVStore", "TensorKVError", "__version__", "open_store"]
