"""Snapshots below tier 0, and the only functions through which a tier chain changes a tier.

While a snapshot of a tiered table is open, :class:`LowerSnapshot` keeps the set of keys
whose lower-tier state it has *settled*: read by its export, copied aside before a change, or
not part of it (their lower-tier copy was stale or on its way down when it was taken, or
written after). The chain changes its lower tiers only through the functions of this module
(:func:`put_rows`, :func:`delete`, :func:`discard`, :func:`take_into`, :func:`move_down`,
:func:`clear`, :func:`closing`): each first settles the keys it touches, under the chain lock,
keeping the record a key had when the snapshot was taken if the export has not read it yet.
The export reads each tier with its ``scan`` (which yields every record that stays untouched
while it runs, see :class:`~tensorkv.embedding.tiers.base.LowerTier`) and keeps the records of
keys not settled yet, settling them, also under the chain lock. So every key below tier 0 at
the snapshot is exported once, with its record of that moment. docs/format.md ("What a tag is
a snapshot of") describes the guarantee.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from tensorkv.embedding.chain.core import ChainCore
from tensorkv.embedding.chunks import ExportChunk
from tensorkv.embedding.snapshot import KeySet, since_filter, split_chunk
from tensorkv.embedding.tiers.base import LowerTier, RowSink, RowSource


class LowerSnapshot:
    """The lower tiers of a tier chain at a snapshot (see the module docstring).

    Parameters
    ----------
    chain
        The tier chain.
    settled
        Keys whose lower-tier copies are not the snapshot's: rows held in tier 0 on their
        way down or fetched ahead (their tier-0 rows are), and promoted keys whose stale
        copies a queued job deletes.
    """

    def __init__(self, chain: ChainCore, settled: np.ndarray) -> None:
        self.chain = chain
        self.layout = chain.layout
        self.done: KeySet | None = KeySet(settled)
        self.saved: list[tuple[np.ndarray, np.ndarray]] = []
        self.saved_bytes = 0
        self.saved_rows = 0
        self.peak_bytes = 0
        self.open = True
        self.all_saved = False  # the tiers went away: every record still needed is in saved
        self._keys: list[np.ndarray] = []
        self._count = 0
        self._exported = False

    # --- the writers' side (under the chain lock) -----------------------------------------------
    def written(self, keys: np.ndarray) -> None:
        """``keys`` are about to be written below tier 0 from tier 0: not the snapshot's."""
        if self.done is not None:
            self.done.add(keys)

    def taken(self, keys: np.ndarray, records: np.ndarray) -> None:
        """``keys`` leave a tier with ``records``: keep those the snapshot still needs."""
        if self.done is None or keys.size == 0:
            return
        new = self.done.add(keys)
        if new.any():
            self._save(keys[new], records[new])

    def deleting(self, tier: LowerTier, keys: np.ndarray) -> None:
        """``keys`` are about to be deleted from ``tier``: keep those the snapshot needs."""
        if self.done is None or keys.size == 0:
            return
        want = np.flatnonzero(~self.done.contains(keys))
        if want.size:
            q = keys[want]
            found, recs = tier.get(q)
            if found.any():
                self.taken(q[found], recs[found])

    def save_all(self) -> None:
        """Keep every record the export has not read yet (the tiers are about to go)."""
        if self.done is None or self.all_saved:
            return
        for tier, _ in self.chain.lowers:
            for k, r in tier.scan():
                self.taken(k, r)
        self.all_saved = True

    def _save(self, keys: np.ndarray, records: np.ndarray) -> None:
        self.saved.append((np.array(keys, np.int64), np.array(records, np.uint8)))
        self.saved_rows += int(keys.size)
        self.saved_bytes += int(keys.nbytes + records.nbytes)
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    @property
    def nbytes(self) -> int:
        """Bytes held now: the settled-key set and the records kept aside."""
        return (0 if self.done is None else self.done.nbytes) + self.saved_bytes

    # --- the exporter's side --------------------------------------------------------------------
    def _chunk(self, keys: np.ndarray, recs: np.ndarray, since: int | None) -> ExportChunk | None:
        self._keys.append(keys)
        self._count += int(keys.size)
        f = self.layout.unpack(recs)
        ch = ExportChunk(keys, np.ascontiguousarray(f.values), np.ascontiguousarray(f.slots),
                         f.freq.copy(), f.version.copy(), f.change_seq.copy())
        return since_filter(ch, since)

    def _drain(self, chunk_rows: int, since: int | None) -> Iterator[ExportChunk]:
        with self.chain.lock:
            got, self.saved = self.saved, []
            self.saved_bytes = 0
        for keys, recs in got:
            ch = self._chunk(keys, recs, since)
            if ch is not None:
                yield from split_chunk(ch, chunk_rows)

    def _scan(self, tier: LowerTier, chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``tier.scan`` that stops once the tiers went away with every record saved."""
        it = iter(tier.scan(chunk_rows))
        while not self.all_saved:
            try:
                yield next(it)
            except StopIteration:
                return
            except Exception:
                if self.all_saved:  # closed or cleared underneath: what it needed is saved
                    return
                raise

    def chunks(self, chunk_rows: int, since: int | None) -> Iterator[ExportChunk]:
        """Chunks of the rows below tier 0 at the snapshot (changed after ``since``)."""
        if self._exported:
            raise RuntimeError("a snapshot is exported once; take a new one")
        self._exported = True
        try:
            for tier, _ in self.chain.lowers:
                for k, r in self._scan(tier, chunk_rows):
                    with self.chain.lock:
                        if self.done is None:
                            raise RuntimeError("the snapshot was released")
                        new = self.done.add(k)
                    if new.any():
                        sel = slice(None) if new.all() else new
                        ch = self._chunk(np.array(k[sel], np.int64), r[sel], since)
                        if ch is not None:
                            yield ch
                    yield from self._drain(chunk_rows, since)
            with self.chain.lock:
                self.open = False
                if self.chain.snap is self:
                    self.chain.snap = None
            yield from self._drain(chunk_rows, since)
        finally:
            self.release()

    def keys(self) -> np.ndarray:
        """Keys below tier 0 at the snapshot (those the export read)."""
        return np.concatenate(self._keys) if self._keys else np.empty(0, np.int64)

    def __len__(self) -> int:
        return self._count

    @property
    def approx_rows(self) -> int:
        """Rows in the lower tiers now (a progress bar's estimate)."""
        return int(sum(len(t) for t, _ in self.chain.lowers))

    def release(self) -> None:
        """Stop settling keys and drop what is held (the keys read stay for :meth:`keys`)."""
        with self.chain.lock:
            self.open = False
            if self.chain.snap is self:
                self.chain.snap = None
            self.done = None
            self.saved = []
            self.saved_bytes = 0


# --------------------------------------------------------------------------- the only writers
def _guard(chain: ChainCore) -> LowerSnapshot | None:
    return chain.snap


def put_rows(chain: ChainCore, tier: LowerTier, keys: np.ndarray, source: RowSource) -> None:
    """Write tier-0 rows down into ``tier`` (a write-back; the write runs without the lock)."""
    if _guard(chain) is not None:
        with chain.lock:
            g = _guard(chain)
            if g is not None:
                g.written(keys)
    tier.put_rows(keys, source)


def delete(chain: ChainCore, tier: LowerTier, keys: np.ndarray, discard: bool = False) -> int:
    """Delete ``keys`` from ``tier`` (``discard``: its index-only drop where it has one)."""
    if _guard(chain) is not None:
        with chain.lock:
            g = _guard(chain)
            if g is not None:
                g.deleting(tier, keys)
    if discard:
        return int(getattr(tier, "discard", tier.delete)(keys) or 0)
    return int(tier.delete(keys))


def take_into(chain: ChainCore, tier: LowerTier, keys: np.ndarray,
              alloc: Callable[[np.ndarray], np.ndarray], sink: RowSink) -> np.ndarray:
    """``tier.read_into(keys, alloc, sink, take=True)``: move rows up into tier 0 (a promotion).

    With a snapshot open, the read and the settling of the keys happen under the chain lock;
    the records kept aside are packed from the tier-0 rows they landed in.
    """
    if _guard(chain) is None:
        return tier.read_into(keys, alloc, sink, take=True)
    with chain.lock:
        g = _guard(chain)
        placed: list[np.ndarray] = []

        def alloc_noted(found: np.ndarray) -> np.ndarray:
            rows = alloc(found)
            placed.append(rows)
            return rows

        found = tier.read_into(keys, alloc_noted, sink, take=True)
        if g is not None and placed:
            got = keys[found]
            g.taken(got, chain.records_of(got, placed[0]))
        return found


def move_down(chain: ChainCore, ti: int, keys: np.ndarray) -> int:
    """Move ``keys`` from lower tier ``ti`` to ``ti + 1`` (a cascade; call under the lock).

    A snapshot needs no copy: the record moves unchanged, into a tier its export reads after
    this one (it reads them top to bottom), and a key it read already is settled.
    """
    tier, below = chain.lowers[ti].tier, chain.lowers[ti + 1].tier
    found, recs = tier.get(keys)
    moved, recs = keys[found], recs[found]
    below.put(moved, recs)
    tier.delete(moved)
    return int(moved.size)


def clear(chain: ChainCore) -> None:
    """Remove every row of every lower tier (an open snapshot keeps what it still needs)."""
    closing(chain)
    for tier, _ in chain.lowers:
        tier.clear()


def closing(chain: ChainCore) -> None:
    """The lower tiers are about to go (cleared or closed): an open snapshot saves its rows."""
    if _guard(chain) is not None:
        with chain.lock:
            g = _guard(chain)
            if g is not None:
                g.save_all()


#: Names of the :class:`~tensorkv.embedding.tiers.base.LowerTier` methods that change a tier;
#: the chain calls them only through this module (``tests/tiers/test_snapshots.py`` checks).
MUTATORS = frozenset({"put", "put_rows", "delete", "discard", "read_into", "clear"})

__all__ = ["MUTATORS", "LowerSnapshot", "clear", "closing", "delete", "move_down",
           "put_rows", "take_into"]
