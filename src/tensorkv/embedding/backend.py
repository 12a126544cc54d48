"""The row backend of a table: :class:`RowBackend`, the hooks a table runs around its logic.

:class:`~tensorkv.embedding.table.EmbeddingTable` runs its logic (lookups, optimizer steps,
inserts, removals) on tier 0, an arena, and asks its backend for everything that depends on
what lies below: making keys resident before an operation, moving rows down after it, rows
below tier 0 (counts, keys, export, eviction, removal), snapshots, flushing and closing. It
never branches on which backend it has. The three backends:

- :class:`~tensorkv.embedding.rows.ArenaBackend`: every row in one arena (DRAM or HBM only),
  every hook trivial;
- :class:`~tensorkv.embedding.chain.rows.ChainBackend`: tier 0 over a tier chain
  (:mod:`tensorkv.embedding.chain`);
- :class:`~tensorkv.embedding.redis.rows.RedisBackend`: rows in Redis, tier 0 a working set
  per operation (:mod:`tensorkv.embedding.redis`).

A leaf module: it names the interface, the backends implement it. See docs/internals.md
("Where the code lives") and docs/tiers.md ("Tier chains").
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tensorkv.embedding.arena import RowArena
from tensorkv.embedding.chunks import ExportChunk, Place
from tensorkv.embedding.filters import Eviction
from tensorkv.embedding.snapshot import RowsSnapshot


class RowBackend(ABC):
    """Where a table's rows live: the hooks the table runs (see the module docstring).

    Attributes
    ----------
    arena
        Tier 0, where every read and update happens.
    lock
        The table's readers-writer lock.
    op
        A context manager entered around each whole operation.
    parallel, split
        How the optimizer kernel runs (``TableOptimizer.apply`` arguments).
    tiered
        Whether rows may live below tier 0.
    """

    arena: RowArena
    lock: Any
    op: Any
    parallel: bool | None
    split: Any
    tiered: bool = False

    # --- around one operation -------------------------------------------------------------------
    @abstractmethod
    def begin_write(self, table: Any, what: str, *args: Any) -> None:
        """The table starts ``what``, a call that may change rows (inside :attr:`op`)."""

    @abstractmethod
    def promote_lookup(self, keys: np.ndarray) -> np.ndarray | None:
        """Make a lookup's keys resident; every key's tier-0 row if known (else None)."""

    @abstractmethod
    def promote_update(self, keys: np.ndarray) -> np.ndarray | None:
        """Make an update's keys resident; their tier-0 rows if all are present."""

    @abstractmethod
    def promote(self, keys: np.ndarray) -> None:
        """Make ``keys`` resident before an operation that inserts, removes or overwrites."""

    @abstractmethod
    def note_lookup(self, keys: np.ndarray, rows: np.ndarray, moves: int) -> None:
        """Remember a lookup's rows for the update that follows it."""

    @abstractmethod
    def known_rows(self, keys: np.ndarray) -> np.ndarray | None:
        """Tier-0 rows of ``keys`` remembered from the last lookup (None: unknown)."""

    @abstractmethod
    def holding_meta(self) -> contextlib.AbstractContextManager[None]:
        """Let the operation hold its metadata writes for :meth:`after_batch`."""

    @abstractmethod
    def meta_write(self, kernel: Callable[..., Any], *args: Any) -> None:
        """Run (or hold) one metadata write."""

    @abstractmethod
    def run_held_meta(self) -> None:
        """Run the metadata writes held so far."""

    @abstractmethod
    def after_batch(self, keys: np.ndarray) -> None:
        """The end of a batch operation: move tier 0's excess down."""

    @abstractmethod
    def after(self, keys: np.ndarray, protect: bool = True) -> None:
        """The end of any other operation."""

    @abstractmethod
    def start_prefetch(self, keys: np.ndarray) -> None:
        """Start moving the rows of the next batch's keys up."""

    # --- rows below tier 0 -----------------------------------------------------------------------
    @abstractmethod
    def read_lower(self, keys: np.ndarray) -> tuple[np.ndarray, Any]:
        """Rows of ``keys`` below tier 0, without moving them."""

    @abstractmethod
    def lower_len(self) -> int:
        """Rows below tier 0."""

    @abstractmethod
    def lower_keys(self) -> np.ndarray:
        """Keys of the rows below tier 0."""

    @abstractmethod
    def export_lower(self, chunk_rows: int, since: int) -> Iterator[ExportChunk]:
        """Rows below tier 0 as export chunks."""

    @abstractmethod
    def evict_keys(self, eviction: Eviction, step: int) -> np.ndarray:
        """Keys below tier 0 that ``eviction`` removes."""

    @abstractmethod
    def remove_lower(self, keys: np.ndarray) -> int:
        """Remove ``keys`` below tier 0; how many were there."""

    @abstractmethod
    def clear_lower(self) -> None:
        """Drop every row below tier 0."""

    # --- export ----------------------------------------------------------------------------------
    @property
    @abstractmethod
    def exports_in_place(self) -> bool:
        """Whether :meth:`export_into` gathers every row straight from a host arena."""

    @property
    def rows_in_checkpoint(self) -> bool:
        """Whether :meth:`export` carries the rows (a Redis table may keep them in Redis)."""
        return True

    @abstractmethod
    def export(self, chunk_rows: int, since: int | None) -> Iterator[ExportChunk]:
        """Every row (changed after ``since``) as export chunks."""

    @abstractmethod
    def export_into(self, place: Place, chunk_rows: int, since: int | None) -> Iterator[int]:
        """Every row gathered into caller-owned buffers; yields rows per chunk."""

    # --- snapshots -------------------------------------------------------------------------------
    @abstractmethod
    def frozen(self) -> contextlib.AbstractContextManager[None]:
        """No operation runs inside (waits for those running, holds new ones off)."""

    @abstractmethod
    def quiesce(self) -> None:
        """Settle background work that changes rows (inside :meth:`frozen`)."""

    @abstractmethod
    def open_snapshot(self, meta: dict[str, Any]) -> RowsSnapshot | None:
        """The snapshot of the rows now (inside :meth:`frozen`); None: none here."""

    # --- lifecycle -------------------------------------------------------------------------------
    @abstractmethod
    def sync(self) -> None:
        """Land every background write."""

    @abstractmethod
    def wait_writes(self) -> None:
        """Block until every background write has landed."""

    @abstractmethod
    def flush(self) -> None:
        """Land background writes and make the lower tiers durable."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release the lower tiers."""

    @property
    @abstractmethod
    def device(self) -> Any:
        """The torch device of tier 0's rows."""

    @abstractmethod
    def add_stats(self, stats: dict[str, Any]) -> None:
        """Add per-tier figures to the table's ``stats()``."""

    @abstractmethod
    def spill_locations(self) -> list[str]:
        """Where the lower tiers keep rows (absolute paths or URLs)."""

    @abstractmethod
    def add_meta(self, meta: dict[str, Any]) -> None:
        """Add the storage description to the table's metadata."""

    def check_restore(self, meta: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Refuse a checkpoint's table metadata that needs rows these rows lost.

        Called before a load changes anything; a backend whose rows a checkpoint does not
        carry (a Redis table with ``table_store_mode=2``) raises ``TableLostError``.
        """


__all__ = ["RowBackend"]
