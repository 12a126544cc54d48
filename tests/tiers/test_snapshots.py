"""Snapshots of tiered tables: the chain changes lower tiers only through chain/guard.py.

The behaviour (snapshots read between random operations equal the DRAM reference) is checked
for every chain by ``TableTests`` (``tests/embedding/test_table_conformance.py``, group
"snapshot"); these tests pin the structure that makes it hold, and the cases a random
sequence rarely reaches.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import tensorkv
from tensorkv.embedding.chain import guard
from tensorkv.errors import SnapshotInProgressError
from tensorkv.testing.tablecheck import assert_same_rows, table_rows

CHAIN = pathlib.Path(guard.__file__).parent


def _tier_mutations(path: pathlib.Path) -> list[tuple[str, int, str]]:
    """(function, line, method) of every call of a LowerTier mutator outside guard.py."""
    out = []
    tree = ast.parse(path.read_text())

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else func
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) \
                    and child.func.attr in guard.MUTATORS:
                owner = ast.unparse(child.func.value)
                if "tier" in owner or "lowers" in owner:
                    out.append((func, child.lineno, f"{owner}.{child.func.attr}"))
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) \
                    and child.func.id == "getattr" and len(child.args) > 1 \
                    and isinstance(child.args[1], ast.Constant) \
                    and child.args[1].value in guard.MUTATORS:
                out.append((func, child.lineno, f"getattr(..., {child.args[1].value!r})"))
            visit(child, name)

    visit(tree, "<module>")
    return out


@pytest.mark.parametrize("module", sorted(p.name for p in CHAIN.glob("*.py")
                                          if p.name != "guard.py"))
def test_the_chain_changes_lower_tiers_only_through_the_guard(module):
    calls = _tier_mutations(CHAIN / module)
    assert not calls, (
        f"{module} changes a lower tier directly ({calls}); call the function of "
        "tensorkv.embedding.chain.guard that settles the keys for open snapshots first")


def test_the_structural_check_sees_a_direct_call(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def land(self, tier, keys, src):\n    tier.put_rows(keys, src)\n"
                 "def drop(self, keys):\n    for t, _ in self.lowers:\n"
                 "        getattr(t, 'discard', t.delete)(keys)\n")
    assert [c[0] for c in _tier_mutations(p)] == ["land", "drop"]


def _tiered(path, rows0: int = 8, kind: str = "DRAM_SSDHASH", **kw) -> tensorkv.EmbeddingTable:
    rb = 32 + 8 * 4 * 2  # dim 4 + Adagrad: about a record
    return tensorkv.EmbeddingTable(4, optimizer="adagrad", seed=3, storage=kind,
                                   storage_path=str(path), storage_size=[rows0 * rb], **kw)


def test_one_snapshot_at_a_time_and_release_stops_the_copying(tmp_path):
    t = _tiered(tmp_path / "t")
    with t:
        t.lookup(np.arange(200))
        snap = t.snapshot()
        with pytest.raises(SnapshotInProgressError, match="snapshot open already"):
            t.snapshot()
        assert t.arena.snap is not None and t._rows.chain.snap is not None
        snap.release()
        assert t.arena.snap is None and t._rows.chain.snap is None
        snap.release()  # twice is harmless
        with pytest.raises(RuntimeError, match="released"):
            list(snap.export())
        with t.snapshot() as again:  # a new one after the release
            assert len(list(again.export(chunk_rows=50))) > 0
        assert t.arena.snap is None


@pytest.mark.parametrize("what", ["clear", "close"])
def test_close_and_clear_keep_what_an_open_snapshot_still_needs(tmp_path, what):
    ref = tensorkv.EmbeddingTable(4, optimizer="adagrad", seed=3)
    t = _tiered(tmp_path / "t")
    keys = np.arange(300)
    for tab in (t, ref):
        tab.lookup(keys)
        tab.apply_gradients(keys[:100], np.ones((100, 4), np.float32))
    t.wait_writes()  # most rows in the SSDHASH tier when the snapshot is taken
    assert t.stats()["tiers"][1]["rows"] >= 150
    want = table_rows(ref)
    snap = t.snapshot()
    it = iter(snap.export(chunk_rows=16))
    first = [next(it)]
    if what == "clear":  # tier 0 and the lower tiers emptied while the export is a chunk in
        t.clear()
        t.lookup(np.arange(1000, 1040))
    t.close()  # the lower tiers closed
    assert_same_rows(table_rows(_Chunks(first + list(it)), 16), want, f"after {what}")
    assert len(snap) == len(ref)


def test_snapshot_memory_is_reported_and_given_back(tmp_path):
    t = tensorkv.EmbeddingTable(8, optimizer="adagrad", seed=1)
    t.lookup(np.arange(10_000))
    snap = t.snapshot()
    st = snap.stats()
    assert st["bytes"] >= 9 * 10_000 and st["preserved_rows"] == 0
    t.apply_gradients(np.arange(4000), np.ones((4000, 8), np.float32))  # before the export
    st = snap.stats()
    assert st["preserved_rows"] == 4000
    assert st["bytes"] >= 4000 * (8 * 4 * 2 + 24) and st["peak_bytes"] >= st["bytes"]
    t.apply_gradients(np.arange(4000), np.ones((4000, 8), np.float32))  # copied once only
    assert snap.stats()["preserved_rows"] == 4000
    rows = table_rows(snap)
    assert rows["keys"].size == 10_000 and (rows["version"] == 0).all()
    assert t.arena.snap is None  # the export ended the copying


class _Chunks:
    def __init__(self, chunks):
        self.chunks = chunks

    def export(self, chunk_rows, since=None):
        return self.chunks


def test_a_restore_into_the_table_keeps_an_open_snapshot(tmp_path):
    """``tensorkv.load`` into a DRAM table swaps its row arena (bulk import) under a snapshot."""
    url = f"lmdb://{tmp_path / 'ck'}"
    other = tensorkv.EmbeddingTable(4, optimizer="adagrad", seed=9)
    other.lookup(np.arange(5000, 5300))
    tensorkv.save({"t": other}, url, "other")
    t = tensorkv.EmbeddingTable(4, optimizer="adagrad", seed=3)
    t.lookup(np.arange(400))
    t.apply_gradients(np.arange(100), np.ones((100, 4), np.float32))
    want = table_rows(t)
    snap = t.snapshot()
    it = iter(snap.export(chunk_rows=32))
    first = [next(it)]
    tensorkv.load({"t": t}, url, "other")  # every row replaced by the other table's
    t.apply_gradients(np.arange(5000, 5100), np.ones((100, 4), np.float32))
    assert set(t.keys().tolist()) == set(range(5000, 5300))
    assert_same_rows(table_rows(_Chunks(first + list(it)), 32), want, "after a restore")


def test_a_table_reuses_its_last_snapshots_arrays():
    """The next snapshot copies tier 0's keys into the last one's (warm) arrays, and is right."""
    t = tensorkv.EmbeddingTable(4, optimizer="adagrad", seed=1)
    t.lookup(np.arange(1000))
    first = t.snapshot()
    arrays = first.tier0.keys
    assert table_rows(first)["keys"].size == 1000
    first.release()
    t.remove(np.arange(10))
    t.lookup(np.arange(1000, 1005))  # into freed rows: tier 0 spans no more rows
    t.apply_gradients(np.arange(50, 60), np.ones((10, 4), np.float32))
    want = table_rows(t)
    with t.snapshot() as second:
        assert np.shares_memory(second.tier0.keys, arrays)
        assert_same_rows(table_rows(second), want, "a snapshot in reused arrays")
    t.lookup(np.arange(5000, 9000))  # more rows than the arrays hold: new ones
    with t.snapshot() as third:
        assert not np.shares_memory(third.tier0.keys, arrays)
        assert table_rows(third)["keys"].size == len(t)
