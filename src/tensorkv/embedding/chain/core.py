"""The records a tier chain keeps, and the part of it its helpers work on.

:class:`Lower` is one lower tier of a chain with its row budget; :class:`BatchRows` the tier-0
rows an operation's keys had when the chain last looked them up. :class:`ChainCore` is what
the snapshot guard (:mod:`~tensorkv.embedding.chain.guard`) and prefetching
(:mod:`~tensorkv.embedding.chain.prefetch`) use of a
:class:`~tensorkv.embedding.chain.tierchain.TierChain`: tier 0, the lower tiers, the locks and
the rows in flight. A leaf module, so those helpers name the chain's interface without
importing ``tierchain.py``, which imports them.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Protocol

import numpy as np

from tensorkv.embedding.arena import RowArena
from tensorkv.embedding.chain.pending import Pending
from tensorkv.embedding.chain.writeback import WriteQueue
from tensorkv.embedding.tiers.base import LowerTier, RecordLayout


class Lower(NamedTuple):
    """One lower tier of a chain, fastest first."""

    #: The tier engine.
    tier: LowerTier
    #: Rows it keeps before its excess cascades to the next tier (None: unbounded).
    budget: int | None


class BatchRows(NamedTuple):
    """The tier-0 rows of an operation's keys, valid while tier 0 is as it was then."""

    #: The operation's keys.
    keys: np.ndarray
    #: Their tier-0 rows.
    rows: np.ndarray
    #: Tier 0's state array when they were found (a new array after a reallocation).
    state: np.ndarray
    #: A copy of that state's values, or None while a deferred demotion runs (it moves other
    #: rows only; settling it fills the copy in).
    state_copy: np.ndarray | None
    #: The rows carry the current tick already (a repeated batch): no touch needed.
    touched: bool = False


class ChainCore(Protocol):
    """Tier 0, lower tiers, locks and rows in flight of a tier chain (see the module doc)."""

    arena: RowArena
    layout: RecordLayout
    lowers: list[Lower]
    lock: threading.RLock
    pack_lock: threading.Lock
    pending: list[Pending]
    stale: list[np.ndarray]
    queue: WriteQueue
    #: The open snapshot of the lower tiers (a :class:`.guard.LowerSnapshot`), or None.
    snap: Any

    def drop_lower(self, keys: np.ndarray) -> None:
        """Delete promoted keys' copies from every lower tier."""

    def records_of(self, keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Records of tier-0 ``rows`` under ``keys``."""


__all__ = ["BatchRows", "ChainCore", "Lower"]
