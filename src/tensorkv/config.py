"""Settings: one home for defaults and the environment variables that override them.

=====================================  ==========  =========================================
Environment variable                   Default     Meaning
=====================================  ==========  =========================================
``TENSORKV_EVICTION_THREADS``          1           threads in the shared tier write-back pool
                                                   (DeepRec's name:
                                                   ``TF_MULTI_TIER_EV_EVICTION_THREADS``)
``TENSORKV_SSDHASH_ASYNC_COMPACTION``  0           1: SSDHASH compacts on its own thread
                                                   (DeepRec's: ``TF_SSDHASH_ASYNC_COMPACTION``)
``TENSORKV_REDIS_CONFIG_PATH``         (unset)     JSON file with Redis connection options
                                                   (and Redis-resident table options)
``TFRA_REDIS_CONFIG_PATH``             (unset)     TFRA's name of the table's config file,
                                                   read after ``TENSORKV_REDIS_CONFIG_PATH``
``TENSORKV_PROGRESS``                  auto        ``0`` disables progress bars everywhere
``TENSORKV_PARALLEL_KERNELS``          1           ``0``: optimizer kernels always run serial
``TENSORKV_ASSIST_THREAD``             1           ``0``: tiered tables never share kernels
                                                   with the helper thread
                                                   (embedding.chain.assist)
``TENSORKV_PREFAULT``                  1           ``0``: growing tables do not fault their
                                                   next rows' memory in ahead, on a
                                                   background thread (embedding.growable)
``TENSORKV_MALLOC_RETAIN``             1           ``0``: leave glibc's malloc thresholds
                                                   as they are when LMDB first writes large
                                                   values (pages.retain_freed_memory)
``TENSORKV_SAVE_AT_EXIT``              wait        what a process that exits does with saves
                                                   still writing (``blocking=False``):
                                                   ``wait`` for them or ``abandon`` them
``TENSORKV_SAVE_PENDING``              wait        a save of a table whose previous save is
                                                   still writing: ``wait`` for it, or
                                                   ``error`` (``SaveInProgressError``)
``TENSORKV_SAVE_NICE``                 10          CPU niceness of a background save's
                                                   threads (0-19; higher yields more to
                                                   training, and the save takes longer)
=====================================  ==========  =========================================
"""

from __future__ import annotations

import os
import re
from typing import Any

from tensorkv.errors import ConfigError

# ==== settings, by subsystem (units in the comments) ========================================

# --- key-value stores: common --------------------------------------------------------------
DEFAULT_EMBEDDED_SCHEME = "lmdb"  # embedded backend used where none is named (docs/backends.md)
DEFAULT_WRITE_CHUNK = 1024  # records per backend write call in bulk paths
STORE_SCAN_CHUNK = 1024  # records read per step of a scan; no snapshot is held between steps

# --- key-value stores: LMDB ------------------------------------------------------------------
LMDB_INITIAL_MAP_SIZE = 64 * 1024 * 1024  # bytes; the map doubles when full
LMDB_MAX_MAP_SIZE = 1 << 40  # bytes (1 TiB); growth stops here with StoreFullError
LMDB_MAX_READERS = 1024  # concurrent read transactions across all processes sharing an env
# glibc malloc thresholds set once a process writes large LMDB values (pages.py): blocks up
# to MALLOC_MMAP_THRESHOLD bytes come from the heap, and up to MALLOC_TRIM_THRESHOLD bytes of
# freed heap are kept for reuse; these are the largest values glibc's own adaptive thresholds
# reach (32 MiB and twice that on 64-bit)
ENV_MALLOC_RETAIN = "TENSORKV_MALLOC_RETAIN"
MALLOC_MMAP_THRESHOLD = 32 * 1024 * 1024  # bytes
MALLOC_TRIM_THRESHOLD = 64 * 1024 * 1024  # bytes

# --- key-value stores: RocksDB and LevelDB -------------------------------------------------
ROCKSDB_WRITE_BUFFER_SIZE = 64 * 1024 * 1024  # bytes per memtable before it is flushed
ROCKSDB_MAX_WRITE_BUFFERS = 4  # memtables kept in memory while older ones flush
ROCKSDB_BLOCK_CACHE_SIZE = 128 * 1024 * 1024  # bytes of uncompressed blocks cached for reads
LEVELDB_WRITE_BUFFER_SIZE = 32 * 1024 * 1024  # bytes per memtable before it is flushed
LEVELDB_BLOCK_CACHE_SIZE = 64 * 1024 * 1024  # bytes of uncompressed blocks cached for reads

# --- key-value stores: Redis -----------------------------------------------------------------
REDIS_KEYS_SENDING_SIZE = 1024  # keys per pipelined Redis round trip
REDIS_MAX_VALUE_BYTES = 512 * 1024 * 1024  # Redis's hard limit on one string value (bytes)
REDIS_MAX_COMMAND_BYTES = 64 * 1024 * 1024  # bytes of values per MSET before it is split
REDIS_CONNECT_TIMEOUT = 5.0  # seconds
REDIS_SOCKET_TIMEOUT = 30.0  # seconds
REDIS_RETRIES = 3  # attempts after the first on connection errors
REDIS_RETRY_BACKOFF = 0.05  # seconds, doubled after each retry
REDIS_WAIT_TIMEOUT = 10.0  # seconds flush() waits for wait_replicas acknowledgements
REDIS_STATS_COUNT_LIMIT = 1_000_000  # stats() counts namespace keys only below this db size
ENV_REDIS_CONFIG_PATH = "TENSORKV_REDIS_CONFIG_PATH"

# --- Redis-resident embedding tables (docs/redis_table.md) ---------------------------------
REDIS_TABLE_NAME = "default"  # table name in the bucket keys <model_tag>:<table>{<tag>}
REDIS_TABLE_MODEL_TAG = "default"  # model tag of the rows (model_tag_runtime)
REDIS_TABLE_STORAGE_SLICE = 16  # buckets (Redis hashes) per table
REDIS_TABLE_READ_CACHE_SECONDS = 10.0  # seconds a read-only table's DRAM cache keeps rows
REDIS_TABLE_LOCK_TTL = 30.0  # seconds before an exact-mode bucket lock expires by itself
REDIS_TABLE_LOCK_WAIT = 60.0  # seconds an exact-mode writer waits for a bucket lock

# --- embedding tables and optimizer kernels --------------------------------------------------
TABLE_INITIAL_CAPACITY = 1024  # rows
TABLE_MAX_LOAD_FACTOR = 0.5  # hash slots in use / slots before the index doubles
ENV_PREFAULT = "TENSORKV_PREFAULT"  # 0: no background prefault of a table's next rows
PREFAULT_AHEAD = 8  # growth steps of a row array whose memory is faulted in ahead
OPTIMIZER_PARALLEL_MIN_ELEMENTS = 1 << 16  # rows*dim of one update before rows run on threads
LOOKUP_PARALLEL_MIN_KEYS = 1 << 13  # keys of one index probe before it runs on threads
ENV_PARALLEL_KERNELS = "TENSORKV_PARALLEL_KERNELS"  # 0: optimizer kernels always run serially

# --- tier chains -------------------------------------------------------------------------------
DEEPREC_TIER_SIZE = 1 << 30  # bytes a tier holds when storage_size gives it none (DeepRec's)
ENV_EVICTION_THREADS = "TENSORKV_EVICTION_THREADS"
ENV_ASSIST_THREAD = "TENSORKV_ASSIST_THREAD"
ENV_SSDHASH_ASYNC_COMPACTION = "TENSORKV_SSDHASH_ASYNC_COMPACTION"
# DeepRec's names of the two above; where both are set and differ, ours win with a warning
ENV_TF_EVICTION_THREADS = "TF_MULTI_TIER_EV_EVICTION_THREADS"
ENV_TF_SSDHASH_ASYNC_COMPACTION = "TF_SSDHASH_ASYNC_COMPACTION"

# --- checkpoints -------------------------------------------------------------------------------
CHECKPOINT_CHUNK_BYTES = 4 * 1024 * 1024  # bytes per dense tensor chunk
CHECKPOINT_GC_GRACE_SECONDS = 3600.0  # gc leaves data of saves started less than this ago
# seconds a shard of a sharded save waits for its turn on a LevelDB/RocksDB store that
# another process has open (docs/backends.md)
CHECKPOINT_TURN_WAIT_SECONDS = 600.0

# --- command line and progress bars ------------------------------------------------------------
PROGRESS_MIN_SECONDS = 2.0  # show a progress bar only for work longer than this
ENV_PROGRESS = "TENSORKV_PROGRESS"
ENV_SAVE_AT_EXIT = "TENSORKV_SAVE_AT_EXIT"
SAVE_AT_EXIT = "wait"  # "wait": an exiting process finishes its background saves; "abandon"
ENV_SAVE_PENDING = "TENSORKV_SAVE_PENDING"
SAVE_PENDING = "wait"  # a save of a table still being saved: "wait" for it, or "error"
ENV_SAVE_NICE = "TENSORKV_SAVE_NICE"
SAVE_NICE = 10  # niceness added to a background save's threads (Linux; 0-19, 19: lowest priority)


# ==== parsing helpers and readers of the environment ==========================================

def parse_scalar(text: str) -> Any:
    """Turn option text into a bool, int or float where it reads as one (else the text).

    Used for URL query strings and ``-p KEY=VALUE`` command-line options.
    """
    low = text.lower()
    if low in {"true", "yes", "on"}:
        return True
    if low in {"false", "no", "off"}:
        return False
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    """Read an integer environment variable, with a clear error for bad values."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; set it to e.g. {default}") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} is below the minimum {minimum}")
    return value


def env_bool(name: str, default: bool) -> bool:
    """Read a boolean environment variable (1/0, true/false, yes/no, on/off)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    low = raw.strip().lower()
    if low in {"1", "true", "yes", "on"}:
        return True
    if low in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use 1 or 0")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "mi": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4,
    "p": 1000**5, "pb": 1000**5, "pib": 1024**5, "pi": 1024**5,
}


def parse_size(value: int | str, *, what: str = "size") -> int:
    """Parse a byte size given as an int or a string such as ``"512MiB"`` or ``"4GB"``.

    Parameters
    ----------
    value
        Bytes as an integer, or a number followed by a unit (B, KB, KiB, MB, MiB, ...).
    what
        Name used in the error message.

    Returns
    -------
    int
        The size in bytes.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}={value!r} is not a size; give bytes or a string like '512MiB'")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what}={value} is negative")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            unit = (m.group(2) or "").lower()
            if unit in _SIZE_UNITS:
                return int(float(m.group(1)) * _SIZE_UNITS[unit])
    raise ConfigError(
        f"{what}={value!r} is not a size; give bytes or a string like '512MiB', '4GB', '1TiB'"
    )


def _env_twin(ours: str, theirs: str, read: Any) -> Any:
    """Our variable ``ours`` or DeepRec's twin ``theirs`` (None: neither set).

    Both set to different values: ours wins, and a warning names both.
    """
    def get(name: str) -> Any:
        raw = os.environ.get(name)
        return None if raw is None or raw.strip() == "" else read(name)

    a, b = get(ours), get(theirs)
    if a is not None and b is not None and a != b:
        import warnings

        warnings.warn(f"{ours}={os.environ[ours]!r} and {theirs}={os.environ[theirs]!r} "
                      f"differ; using {ours}", UserWarning, stacklevel=3)
    return a if a is not None else b


def eviction_threads() -> int:
    """Threads in the shared write-back pool, default 1.

    ``TENSORKV_EVICTION_THREADS``, else DeepRec's ``TF_MULTI_TIER_EV_EVICTION_THREADS``.
    """
    value = _env_twin(ENV_EVICTION_THREADS, ENV_TF_EVICTION_THREADS,
                      lambda name: env_int(name, 1, minimum=1))
    return 1 if value is None else int(value)


def ssdhash_async_compaction() -> bool:
    """Whether SSDHASH compacts on its own thread, default no.

    ``TENSORKV_SSDHASH_ASYNC_COMPACTION``, else DeepRec's ``TF_SSDHASH_ASYNC_COMPACTION``.
    """
    value = _env_twin(ENV_SSDHASH_ASYNC_COMPACTION, ENV_TF_SSDHASH_ASYNC_COMPACTION,
                      lambda name: env_bool(name, False))
    return bool(value)


def malloc_retain() -> bool:
    """Whether large LMDB writes may set glibc's malloc thresholds (``TENSORKV_MALLOC_RETAIN``)."""
    return env_bool(ENV_MALLOC_RETAIN, True)


def assist_thread() -> bool:
    """Whether tiered tables share row kernels with a helper thread (``TENSORKV_ASSIST_THREAD``).

    Promoted-record copies always; the optimizer step where it runs serially (the write-back
    pool shares the cores).
    """
    return env_bool(ENV_ASSIST_THREAD, True)


def _choice(name: str, value: str | None, default: str, allowed: tuple[str, ...],
            what: str) -> str:
    raw = value if value is not None else os.environ.get(name, "").strip().lower() or default
    if raw not in allowed:
        source = f"{what}={raw!r}" if value is not None else f"{name}={raw!r}"
        raise ConfigError(f"{source} is not one of {', '.join(allowed)}")
    return raw


def save_at_exit(value: str | None = None) -> str:
    """What an exiting process does with unfinished background saves: ``wait`` or ``abandon``.

    ``value`` if given, else ``TENSORKV_SAVE_AT_EXIT``, else :data:`SAVE_AT_EXIT`.
    """
    return _choice(ENV_SAVE_AT_EXIT, value, SAVE_AT_EXIT, ("wait", "abandon"), "at_exit")


def save_nice() -> int:
    """Niceness of a background save's threads (``TENSORKV_SAVE_NICE``, default 10, 0-19)."""
    value = env_int(ENV_SAVE_NICE, SAVE_NICE, minimum=0)
    if value > 19:
        raise ConfigError(f"{ENV_SAVE_NICE}={value} is above 19, the lowest CPU priority")
    return value


def save_pending(value: str | None = None) -> str:
    """A save of a table whose previous save is still writing: ``wait`` or ``error``.

    ``value`` if given, else ``TENSORKV_SAVE_PENDING``, else :data:`SAVE_PENDING`.
    """
    return _choice(ENV_SAVE_PENDING, value, SAVE_PENDING, ("wait", "error"), "on_pending")


def progress_enabled(progress: bool | None) -> bool:
    """Decide whether to draw progress bars: explicit argument, then env, then is-a-tty."""
    import sys

    if progress is not None:
        return bool(progress)
    raw = os.environ.get(ENV_PROGRESS, "auto").strip().lower()
    if raw in {"0", "false", "no", "off"}:
        return False
    if raw in {"1", "true", "yes", "on"}:
        return True
    return sys.stderr.isatty()
