"""Conformance tests of table snapshots, part of :class:`tensorkv.testing.TableTests`.

A snapshot (``table.snapshot()``) must export exactly the rows the table held when it was
taken, while the table goes on changing. :class:`SnapshotTests` runs seeded random operation
sequences on the table under test and the DRAM reference, takes snapshots at random points,
reads each one a few chunks at a time between later operations (so every kind of write
lands while the snapshot is half read: updates, inserts into freed rows, removals,
evictions, promotions and demotions between tiers, cascades, clears, imports), and compares
what it exported, bit for bit, with the reference's rows at the moment it was taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tensorkv.testing.tablecheck import assert_same_rows, table_rows


class SnapshotTests:
    """The snapshot checks (group ``"snapshot"`` of :attr:`TableTests.checks`).

    Mixed into :class:`~tensorkv.testing.tables.TableTests`; uses its ``pair``, ``need``,
    ``random_table_kwargs``, ``random_operations`` and ``random_seeds``.
    """

    #: Operations run per snapshot sequence.
    snapshot_ops: int = 150

    need: Callable[..., None]
    random_table_kwargs: Callable[[int], dict[str, Any]]
    random_operations: Callable[..., list[tuple[Callable[[], None], float]]]
    supports: frozenset[str]

    def test_snapshots_during_random_operations(self, pair, random_seed: int) -> None:
        """Snapshots read a few chunks at a time between random operations equal the reference.

        Each snapshot is compared with the reference's rows (keys, values, slots, freq,
        version, change sequence) and its ``meta`` with the reference's step and mutation
        sequence at the moment it was taken; some export only the rows changed after a
        mutation sequence (``since``), as incremental saves do.
        """
        self.need("export", check="snapshot")
        seed = random_seed
        kw = self.random_table_kwargs(seed)
        t, ref = pair(**kw)
        if not callable(getattr(t, "snapshot", None)):
            pytest.skip(f"{type(self).__name__}: the table has no snapshot()")
        with t.snapshot() as probe:
            if not probe.isolated:
                pytest.skip(f"{type(self).__name__}: the table offers no isolated snapshot "
                            "(its snapshot reads rows as they change)")
        rng = np.random.default_rng(3000 + seed)
        ops = self.random_operations(t, ref, rng, kw)
        weights = np.array([w for _, w in ops])
        open_: dict[str, Any] | None = None
        done: list[str] = []
        taken = 0

        def finish(state: dict[str, Any], where: str) -> None:
            got = list(state["it"])
            chunks = state["got"] + got
            rows = table_rows(_Chunks(chunks), state["chunk"])
            assert_same_rows(rows, state["want"], f"snapshot taken {where}")
            snap = state["snap"]
            assert (snap.step, snap.mutation_seq) == state["meta"], (
                f"snapshot taken {where}: meta (step, mutation_seq) "
                f"{(snap.step, snap.mutation_seq)} != reference {state['meta']}")
            assert len(snap) == state["n"], f"snapshot taken {where}: len {len(snap)}"
            assert set(np.asarray(snap.keys()).tolist()) == state["keys"], (
                f"snapshot taken {where}: keys() differ from the reference's")

        for i in range(self.snapshot_ops):
            where = f"after operation {i} of seed {seed} ({' '.join(done[-6:])})"
            if open_ is None and rng.random() < 0.2:
                since = None if rng.random() < 0.7 else int(
                    rng.integers(-1, ref.mutation_seq + 1))
                snap = t.snapshot()
                chunk = int(rng.integers(1, 9))
                open_ = {
                    "snap": snap, "where": where, "got": [],
                    "want": table_rows(ref, chunk_rows=1 << 30, since=since),
                    "meta": (ref.step, ref.mutation_seq), "n": len(ref),
                    "keys": set(np.asarray(ref.keys()).tolist()),
                    "it": iter(snap.export(chunk_rows=chunk, since=since)), "chunk": chunk,
                }
                taken += 1
            fn = ops[int(rng.choice(len(ops), p=weights / weights.sum()))][0]
            done.append(fn.__name__[3:])
            fn()
            if open_ is not None:
                for _ in range(int(rng.integers(0, 3))):
                    ch = next(open_["it"], None)
                    if ch is None:
                        break
                    open_["got"].append(ch)
                if rng.random() < 0.1:
                    finish(open_, open_["where"])
                    open_ = None
        if open_ is not None:
            finish(open_, open_["where"])
        assert taken > 0


class _Chunks:
    """Exported chunks shaped like a table for :func:`table_rows`."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks

    def export(self, chunk_rows: int, since: int | None = None) -> list[Any]:
        return self.chunks


__all__ = ["SnapshotTests"]
