"""The :class:`Table` protocol: what every embedding table offers, whatever holds its rows.

:class:`~tensorkv.embedding.table.EmbeddingTable` (rows in DRAM, on a GPU, in a tier chain or
in Redis) and :class:`~tensorkv.distributed.table.ShardedEmbeddingTable` (rows on parameter
server shards) both satisfy it, and so does any table a torch module holds. Checkpoints, the
torch modules, the viewer and the parameter server accept a :class:`Table` and recognise one
with ``isinstance(x, Table)``. A leaf module: it imports nothing of tensorkv.

``isinstance`` looks the members up on the object without running them (as Python 3.12 does
for every runtime protocol), so recognising a sharded table never calls its shards.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, _ProtocolMeta, runtime_checkable

import numpy as np

_MISSING = object()
#: The members ``isinstance(x, Table)`` looks for (every member of the protocol).
TABLE_MEMBERS = (
    "dim", "dtype", "nan_policy", "step", "mutation_seq", "device", "as_keys", "lookup",
    "lookup_torch", "apply_gradients", "upsert", "remove", "clear", "contains", "keys",
    "__len__", "export", "import_", "state_dict_meta", "stats", "flush", "close",
)


class _StaticMembers(_ProtocolMeta):
    """A protocol metaclass whose ``isinstance`` finds members without running properties."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return not isinstance(instance, type) and all(
            inspect.getattr_static(instance, name, _MISSING) is not _MISSING
            for name in TABLE_MEMBERS)


@runtime_checkable
class Table(Protocol, metaclass=_StaticMembers):
    """An embedding table: rows of ``dim`` values keyed by int64 ids, trained in place.

    Attributes and methods as :class:`~tensorkv.embedding.table.EmbeddingTable` documents
    them; see docs/internals.md ("Where the code lives") for the classes that satisfy it.
    """

    dim: int
    dtype: str
    #: ``"raise"`` or ``"skip"``: what happens to rows holding NaN or Inf.
    nan_policy: str

    @property
    def step(self) -> int:
        """The last ``apply_gradients`` step (settable: a restore sets it)."""

    @step.setter
    def step(self, value: int) -> None: ...

    @property
    def mutation_seq(self) -> int:
        """Counter bumped by every mutating call."""

    def as_keys(self, keys: Any) -> np.ndarray:
        """Keys as the table stores them (int64, one dimension)."""

    @property
    def device(self) -> Any:
        """Where :meth:`lookup_torch` puts its rows (``"cpu"`` unless tier 0 is on a GPU)."""

    def lookup(self, keys: Any, insert: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``keys`` (inserted with their initial value unless ``insert=False``)."""

    def lookup_torch(self, keys: Any, insert: bool = True) -> Any:
        """:meth:`lookup` as a torch tensor on :attr:`device`."""

    def apply_gradients(self, keys: Any, grads: Any, step: int | None = None, *,
                        unique: bool = False) -> int:
        """One optimizer step on the rows of ``keys``."""

    def upsert(self, keys: Any, values: Any) -> int:
        """Set the values of ``keys``."""

    def remove(self, keys: Any) -> int:
        """Remove ``keys``; returns how many were present."""

    def clear(self) -> None:
        """Remove every row."""

    def contains(self, keys: Any) -> np.ndarray:
        """Whether each key has a row."""

    def keys(self) -> np.ndarray:
        """Every key with a row."""

    def __len__(self) -> int:
        """Rows held."""

    def export(self, chunk_rows: int = 65536, since: int | None = None) -> Iterator[Any]:
        """Rows as export chunks (those changed after ``since``)."""

    def import_(self, chunks: Iterable[Any]) -> int:
        """Upsert exported rows exactly; returns rows written."""

    def state_dict_meta(self) -> dict[str, Any]:
        """JSON-serialisable settings, enough to rebuild an empty twin."""

    def stats(self) -> dict[str, Any]:
        """Counters and sizes."""

    def flush(self) -> None:
        """Write what is pending below tier 0."""

    def close(self) -> None:
        """Release the table's resources."""


__all__ = ["TABLE_MEMBERS", "Table"]
