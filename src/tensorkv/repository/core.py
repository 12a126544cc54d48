"""What the repository's helpers need of a :class:`~tensorkv.repository.repo.Repository`.

:class:`RepositoryCore` is the part of a repository that its put writer
(:mod:`~tensorkv.repository.write`) and its maintenance (:mod:`~tensorkv.repository.maintenance`:
gc, check, stats, rebalance) work on: the stores, the model index, the lock and the thread
pool, and the few reads they share. A leaf module, so those helpers name the repository's
interface without importing ``repo.py``, which imports them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from tensorkv.repository import refs
from tensorkv.repository.index import ModelIndex
from tensorkv.stores.base import KVStore


class RepositoryCore(Protocol):
    """The stores, index and shared reads of a repository (see the module docstring)."""

    providers: list[KVStore]
    meta: KVStore
    provider_ids: list[str]
    index: ModelIndex
    lock: threading.RLock
    pool: ThreadPoolExecutor
    chunk_bytes: int

    def refresh(self) -> None:
        """Bring the model index up to date with the log."""

    def manifest(self, mid: str) -> dict[str, Any]:
        """The stored manifest of model ``mid``."""

    def absent(self, tids: list[str], entries: Mapping[str, dict[str, Any]]) -> list[str]:
        """The tensors of ``tids`` whose chunks no provider holds in full."""

    def delete_data(self, tids: Sequence[str], chunks: Mapping[str, int] | None = None,
                    fence: refs.Fence | None = None) -> None:
        """Delete the chunks of tensors ``tids`` from every provider."""

    def read_tensor(self, mid: str, name: str, index: Any = None, *,
                    as_numpy: bool = False, copy: bool = True, verify: bool = True) -> Any:
        """Read one tensor of a model."""


__all__ = ["RepositoryCore"]
