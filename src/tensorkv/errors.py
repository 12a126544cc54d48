"""One exception hierarchy for tensorkv.

Every error derives from :class:`TensorKVError` and, where a built-in exception fits,
from that built-in too, so ``except KeyError`` or ``except ValueError`` keeps working.
Messages say what was refused, why, and what to do instead.
"""

from __future__ import annotations

import importlib
from typing import Any


class TensorKVError(Exception):
    """Base class of every tensorkv error."""


# --- configuration and addressing -------------------------------------------------------
class InvalidURLError(TensorKVError, ValueError):
    """A store URL could not be parsed or names an impossible location."""


class UnknownSchemeError(InvalidURLError):
    """A store URL uses a scheme no backend is registered for."""


class MissingDependencyError(TensorKVError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def import_optional(module: str, what: str, extra: str) -> Any:
    """Import ``module``, or raise :class:`MissingDependencyError` naming the extra to install.

    ``what`` says what needs it (``"the HBM tier"``); ``extra`` is the ``tensorkv[...]`` extra.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f'{what} needs {module}, which is not installed: pip install "tensorkv[{extra}]"'
        ) from exc


class ConfigError(TensorKVError, ValueError):
    """A setting or option has an invalid value."""


class UnknownNameError(ConfigError, KeyError):
    """A name (of a kernel, optimizer, initializer...) is not one of the known names."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


# --- key-value stores --------------------------------------------------------------------
class StoreError(TensorKVError):
    """A key-value store refused or failed an operation."""


class StoreClosedError(StoreError, ValueError):
    """An operation was attempted on a store that has been closed."""


class ReadOnlyError(StoreError, PermissionError):
    """A write was attempted on a store opened read-only."""


class StoreFullError(StoreError, OSError):
    """The store (or the disk under it) has no room left for the write."""


class StoreUnavailableError(StoreError, ConnectionError):
    """The store's server could not be reached within its timeout."""


class StoreRestartedError(StoreUnavailableError):
    """The server restarted, failed over or lost writes during an operation; retry it.

    Raised before a checkpoint becomes visible, so nothing half-written is published.
    """

    retryable = True


class TableLostError(StoreRestartedError):
    """Rows of a table that lives in a shared store were lost or replaced under it.

    A Redis-resident table records an identity (an epoch) in every bucket and a version that
    only grows; a restart without persistence, a flush, an eviction, a failover to a replica
    that lacks the rows (or missed the last writes), or another process re-creating the table
    is detected on the next operation, which reads and writes nothing. Retrying does not help:
    the message says how to restore the rows (docs/redis_table.md, "Lost data").
    """

    retryable = False


class MigrationUnfinishedError(ConfigError):
    """A table's rows are being copied or rehashed into another layout and it has not finished.

    The message says how to finish the migration (reopen with its import options) or abandon it.
    """


class RowLockError(StoreUnavailableError):
    """A Redis-resident table's row lock was busy too long, or lost before the commit; retry."""

    retryable = True


class ReplicationError(StoreUnavailableError):
    """Fewer replicas than asked acknowledged the writes within the timeout; retry it."""

    retryable = True


class KeyNotFoundError(StoreError, KeyError):
    """``store[key]`` of a key the store does not hold (``get_many`` returns None instead)."""


class KeyTypeError(TensorKVError, TypeError):
    """A key or value has the wrong type."""


class EmptyKeyError(TensorKVError, ValueError):
    """An empty key was given; every backend needs keys of at least one byte."""


class ValueTooLargeError(StoreError, ValueError):
    """A value exceeds the backend's size limit."""


# --- tensor records ------------------------------------------------------------------------
class CodecError(TensorKVError, ValueError):
    """A tensor record could not be encoded or decoded."""


class CorruptRecordError(CodecError):
    """A record is truncated or fails its checksum."""


# --- embedding tables ----------------------------------------------------------------------
class TableError(TensorKVError):
    """An embedding table refused an operation."""


class ShapeError(TableError, ValueError):
    """An array has the wrong shape or dtype for the operation."""


class NonFiniteGradientError(TableError, FloatingPointError):
    """A gradient holds NaN or Inf values and the table is set to raise."""


class NonFiniteValueError(TableError, FloatingPointError):
    """Rows given to ``upsert`` or imported hold NaN or Inf and the table is set to raise."""


class KeyRangeError(TableError, ValueError):
    """An integer key lies outside int64, the keys a table stores (uint64 keys >= 2**63...)."""


class SpillDataExistsError(ConfigError, FileExistsError):
    """A tiered table's spill path already holds tier data and ``overwrite=True`` was not given."""


class CapacityError(TableError, MemoryError):
    """The table (or a tier) has no room for the rows and may not grow."""


class WriteBackError(TableError):
    """A background write of evicted rows to a lower tier failed.

    The rows stay in the table's pending buffer (readable, not lost); the next flush retries.
    """


class UnsupportedOperationError(TableError, TypeError):
    """The table's kind does not offer this operation; the message names the one to use."""


class ConcurrentUseError(TableError, RuntimeError):
    """A dynamic embedding module was called from a second thread while it was busy."""


class SnapshotInProgressError(TableError, RuntimeError):
    """The table has a snapshot open already (a save still writing it); one at a time."""


# --- parameter server ----------------------------------------------------------------------
class ShardUnavailableError(TensorKVError, ConnectionError):
    """A parameter-server shard is gone (or lost updates) and could not be brought back."""


class ReshardedError(ShardUnavailableError):
    """The parameter server was resharded after this client attached: attach again."""


# --- checkpoints ---------------------------------------------------------------------------
class CheckpointError(TensorKVError):
    """A checkpoint could not be saved or loaded."""


class BadIndexError(CheckpointError, IndexError):
    """An index into a stored tensor is out of bounds or not a basic index."""


class TagExistsError(CheckpointError, FileExistsError):
    """A tag of that name exists already, or another process is saving it right now."""


class ShardRunError(CheckpointError):
    """A shard does not belong to the sharded save of its tag, or that save cannot finish.

    Raised when a shard (or a merge) meets a sharded save of the same tag made by another run
    (another run id, ``num_shards``, step or parent), a run one of whose savers died, or
    shards left by an earlier save. The message names both runs and what to do.
    """


class SaveInProgressError(CheckpointError, RuntimeError):
    """A save of the same table is still being written, and the policy says not to wait."""


class SaveCancelledError(CheckpointError):
    """A save was cancelled (or abandoned at exit) before its tag became visible."""


class StepScopeError(CheckpointError, RuntimeError):
    """A save was asked to wait for a training step that its own thread holds open."""


class TagNotFoundError(CheckpointError, KeyError):
    """No checkpoint tag of that name exists in the store."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class VariableNotFoundError(CheckpointError, KeyError):
    """A tag holds no variable (dense tensor or table) of that name; the message lists them."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


# --- the viewer ----------------------------------------------------------------------------
class QueryError(TensorKVError, ValueError):
    """A viewer query (predicate, key list, slice, vector, option) is malformed.

    ``position`` is the 0-based character offset in ``text`` where the problem is, or None.
    """

    def __init__(self, message: str, text: str | None = None, position: int | None = None):
        super().__init__(message)
        self.text = text
        self.position = position


class RowNotFoundError(TensorKVError, KeyError):
    """A table holds no row for a key a query needs (e.g. the key to search near)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


# --- store locations (embedded backends) --------------------------------------------------
class StorePathError(StoreError, OSError):
    """A store's path cannot be used (a parent is a file, it is not a directory, ...)."""


class StorePermissionError(StorePathError, PermissionError):
    """A store's directory cannot be created or written by this process."""


class StoreNotFoundError(StorePathError, FileNotFoundError):
    """No store exists at the path and the store may not create one (e.g. read-only)."""


class StoreLockedError(StoreError, OSError):
    """Another process (or another open in this process) holds the store's lock."""


class KeyTooLargeError(StoreError, ValueError):
    """A key exceeds the backend's key size limit."""


class CorruptStoreError(StoreError, OSError):
    """A store's files are damaged (truncated, overwritten or missing a part).

    The message names the file, what is wrong with it and how to recover (restore from a
    backup or replica; for RocksDB and LevelDB, their repair tools).
    """


# --- network stores ------------------------------------------------------------------------
class StoreAuthError(StoreError, PermissionError):
    """A server refused the credentials (wrong user or password, or missing ACL rights)."""


# --- benchmarks ----------------------------------------------------------------------------
class BenchmarkError(TensorKVError, RuntimeError):
    """A benchmark's own check of what it measured failed (data read back wrong or missing)."""


# --- model repository ----------------------------------------------------------------------
class RepositoryError(TensorKVError):
    """The model repository refused or failed an operation."""


class ModelNotFoundError(RepositoryError, KeyError):
    """No model with that id is stored (or it was deleted); the message lists some that are."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class GraphError(RepositoryError, ValueError):
    """A graph description is malformed, or a model cannot be captured as a graph."""


class TensorNotFoundError(RepositoryError, KeyError):
    """A stored model has no tensor of that name; the message lists the names it has."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""
