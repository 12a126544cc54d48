"""Saves from another thread while a table trains: every tag is one state of the table.

A trainer thread runs seeded batches (lookup with inserts, then apply_gradients) on the table
under test and, in lockstep, on a DRAM reference table, and records the reference's rows
after every operation, keyed by the table's mutation sequence. A saver thread saves the table
into a real LMDB store at seeded operation counts (``random.Random(seed)``), blocking and
non-blocking in turn, while training goes on. Each tag must equal, bit for bit, the recorded
state of the operation boundary its manifest names (values, slots, frequency, version, step):
no rows of two states, none missing. Tier 0 holds a few dozen rows, so rows move between the
tiers during every save. The step-aligned cut of two tables and a dense tensor, and a
non-blocking save against the blocking save of the same state, follow.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pytest

import tensorkv
from tensorkv.testing.tablecheck import assert_same_rows, table_rows

from .conftest import make_url

DIM = 4
IDS = 3000
BATCH = 48
TIER0 = 40  # rows of tier 0
OPS = 160
SAVES = 4
SEED = 20251


def _storage(kind: str, path: str, request) -> dict[str, Any]:
    """Table arguments of one table kind, tier 0 of ``TIER0`` rows."""
    if kind == "DRAM":
        return {}
    rb = tensorkv.embedding.tiers.base.RecordLayout(DIM, "float32", 1).record_bytes
    sizes: list[Any] = [TIER0 * rb]
    kw: dict[str, Any] = {}
    if kind.startswith("HBM"):
        kw["device"] = "cpu"
    if kind.count("_") == 2:  # a middle tier of 200 rows: cascades to the last one
        sizes.append(200 * rb)
    if kind == "HBM_DRAM":
        sizes.append(None)
    if kind == "DRAM_REDIS":
        server = request.getfixturevalue("ckpt_redis")
        path = f"redis://127.0.0.1:{server.port}/3?prefix=snap-{random.getrandbits(40)}/"
    opt = tensorkv.StorageOption(kind, storage_path=None if kind == "HBM_DRAM" else path,
                                 storage_size=sizes, cache_strategy="lfu")
    return {"storage": opt, **kw}


KINDS = ["DRAM", "DRAM_SSDHASH", "DRAM_PMEM", "DRAM_LEVELDB", "DRAM_ROCKSDB", "DRAM_LMDB",
         "DRAM_REDIS", "HBM_SSDHASH", "HBM_DRAM", "DRAM_PMEM_SSDHASH"]


class Trainer:
    """Seeded batches on the table and the reference; the reference's rows after each op."""

    def __init__(self, table: Any, ref: Any, seed: int) -> None:
        self.table, self.ref = table, ref
        self.rng = np.random.default_rng(seed)
        self.states: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        self.ops = 0
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.record()

    def record(self) -> None:
        rows = table_rows(self.ref, chunk_rows=1 << 30)
        self.states[self.ref.mutation_seq] = (self.ref.step, rows)
        with self.cond:
            self.ops += 1
            self.cond.notify_all()

    def run(self, n: int, prefetch: bool = True) -> None:
        try:
            for _ in range(n):
                keys = self.rng.integers(0, IDS, BATCH)
                grads = self.rng.standard_normal((BATCH, DIM)).astype(np.float32)
                for t in (self.table, self.ref):
                    t.lookup(keys)
                assert self.table.mutation_seq == self.ref.mutation_seq
                self.record()
                if prefetch:
                    self.table.prefetch(self.rng.integers(0, IDS, BATCH))
                for t in (self.table, self.ref):
                    t.apply_gradients(keys, grads)
                self.record()
        except BaseException as e:  # reported by the test
            self.error = e
            with self.cond:
                self.ops = 1 << 60
                self.cond.notify_all()

    def wait_ops(self, n: int) -> None:
        with self.cond:
            while self.ops < n:
                self.cond.wait()


def check_tag(url: str, tag: str, states: dict[int, tuple[int, dict]], name: str = "t") -> int:
    """The tag's table equals the recorded state its manifest names; returns that seq."""
    info = tensorkv.tag_manifest(url, tag)
    meta = info["tables"][name]["meta"]
    seq = int(meta["mutation_seq"])
    assert seq in states, f"{tag}: mutation_seq {seq} is no operation boundary"
    step, want = states[seq]
    assert int(meta["step"]) == step, f"{tag}: step {meta['step']} != {step} at seq {seq}"
    got = tensorkv.load(None, url, tag)[name]
    rows = table_rows(got, chunk_rows=1 << 30)
    missing = np.setdiff1d(want["keys"], rows["keys"])
    assert missing.size == 0, f"{tag}: {missing.size} keys of the state are missing"
    assert_same_rows(rows, want, f"tag {tag} (seq {seq})", seq=False)
    return seq


@pytest.mark.parametrize("kind", KINDS)
def test_saves_from_another_thread_record_one_state(kind, tmp_path, request):
    table = tensorkv.EmbeddingTable(DIM, optimizer="adagrad", seed=7,
                                    **_storage(kind, str(tmp_path / "tiers"), request))
    ref = tensorkv.EmbeddingTable(DIM, optimizer="adagrad", seed=7)
    url = make_url("lmdb", tmp_path, request)
    trainer = Trainer(table, ref, SEED)
    pick = random.Random(f"{SEED}:{kind}")
    targets = sorted(pick.sample(range(10, 2 * OPS), SAVES))
    tags: list[str] = []

    def saver() -> None:
        for i, n in enumerate(targets):
            trainer.wait_ops(n)
            tag = f"s{i}"
            blocking = i % 2 == 0
            out = tensorkv.save({"t": table}, url, tag, block_rows=16, bucket_bits=0,
                                step_scope=False, blocking=blocking)
            if not blocking:
                assert out.result() == tag
            tags.append(tag)

    with table:
        th = threading.Thread(target=saver)
        th.start()
        trainer.run(OPS)
        th.join()
        assert trainer.error is None, trainer.error
        assert len(tags) == SAVES
        for tag in tags:  # two may hold one state (the trainer may be done before a save)
            check_tag(url, tag, trainer.states)
        if kind != "DRAM":
            tiers = table.stats()["tiers"]
            assert tiers[0]["evictions"] > 1000 and sum(t["promotions"] for t in tiers) > 500


def test_step_aligned_cut_of_two_tables_and_a_dense_tensor(tmp_path, request):
    """With a step scope, a tag holds both tables and the dense tensor of one training step."""
    scope = tensorkv.StepScope()
    a = tensorkv.EmbeddingTable(DIM, optimizer="adagrad", seed=1)
    b = tensorkv.EmbeddingTable(DIM, optimizer="sgd", seed=2,
                                **_storage("DRAM_SSDHASH", str(tmp_path / "b"), request))
    w = np.zeros((64, 8), np.float32)
    url = make_url("lmdb", tmp_path, request)
    rng = np.random.default_rng(3)
    states: dict[int, tuple[int, int, np.ndarray]] = {}  # step -> (seq a, seq b, w)
    stepped = threading.Semaphore(0)
    errors: list[BaseException] = []

    def train() -> None:
        try:
            for _ in range(150):
                ka, kb = rng.integers(0, IDS, BATCH), rng.integers(0, IDS, BATCH)
                g = rng.standard_normal((BATCH, DIM)).astype(np.float32)
                with scope.step():
                    a.lookup(ka)
                    b.lookup(kb)
                    a.apply_gradients(ka, g)
                    b.apply_gradients(kb, g)
                    w[...] += 1.0  # the dense step, in place
                states[a.step] = (a.mutation_seq, b.mutation_seq, w.copy())
                stepped.release()
        except BaseException as e:  # reported below; the saver must not wait for steps
            errors.append(e)
            stepped.release(1000)

    with b:
        th = threading.Thread(target=train)
        th.start()
        tags = []
        pick = random.Random(SEED)
        for i in range(4):
            for _ in range(pick.randint(5, 30)):
                stepped.acquire()
            h = tensorkv.save({"a": a, "b": b, "w": w}, url, f"c{i}", block_rows=16,
                              bucket_bits=0, step_scope=scope, blocking=False)
            tags.append(h.result())
        th.join()
    assert not errors, errors
    for tag in tags:
        meta = tensorkv.tag_manifest(url, tag)["tables"]
        step_a, step_b = meta["a"]["meta"]["step"], meta["b"]["meta"]["step"]
        assert step_a == step_b, f"{tag}: table a at step {step_a}, b at {step_b}"
        seq_a, seq_b, want_w = states[step_a]
        assert (meta["a"]["meta"]["mutation_seq"], meta["b"]["meta"]["mutation_seq"]) == (
            seq_a, seq_b), f"{tag}: the tables are not at the end of step {step_a}"
        np.testing.assert_array_equal(tensorkv.load(None, url, tag)["w"], want_w)


@pytest.mark.parametrize("kind", ["DRAM", "DRAM_SSDHASH"])
def test_a_non_blocking_save_equals_the_blocking_save_of_the_same_state(kind, tmp_path,
                                                                        request, monkeypatch):
    """Twin tables trained alike; one saved in the background while it trains on, one not.

    The background save's first store write (its claim of the tag) waits until the training
    after it is done, so all of it happens before that save has read a row.
    """
    from tensorkv.stores.lmdb import LMDBStore

    gate = threading.Event()
    cas = LMDBStore.compare_and_set

    def gated(self: Any, key: bytes, expected: Any, value: Any) -> bool:
        gate.wait()
        return cas(self, key, expected, value)

    monkeypatch.setattr(LMDBStore, "compare_and_set", gated)
    twins = [tensorkv.EmbeddingTable(DIM, optimizer="adam", seed=5,
                                     **_storage(kind, str(tmp_path / f"t{i}"), request))
             for i in range(2)]
    rng = np.random.default_rng(9)
    batches = [(rng.integers(0, IDS, BATCH), rng.standard_normal((BATCH, DIM)).astype(
        np.float32)) for _ in range(80)]
    url = make_url("lmdb", tmp_path, request)
    dense = {"w": np.arange(12.0).reshape(3, 4)}
    try:
        for keys, g in batches[:40]:
            for t in twins:
                t.lookup(keys)
                t.apply_gradients(keys, g)
        h = tensorkv.save({"t": twins[0], **dense}, url, "bg", block_rows=8, bucket_bits=0,
                          blocking=False, metadata={"m": 1})
        dense["w"] += 100  # changed while the background save writes: not in its tag
        for keys, g in batches[40:]:  # training goes on under the background save
            twins[0].lookup(keys)
            twins[0].apply_gradients(keys, g)
        assert not h.done() and h.stats()["snapshot_bytes"] > 0
        gate.set()
        assert h.result() == "bg" and h.done() and h.stats()["state"] == "done"
        dense["w"] -= 100
        tensorkv.save({"t": twins[1], **dense}, url, "fg", block_rows=8, bucket_bits=0,
                      metadata={"m": 1})
        bg, fg = tensorkv.load(None, url, "bg"), tensorkv.load(None, url, "fg")
        np.testing.assert_array_equal(bg["w"], fg["w"])
        assert_same_rows(table_rows(bg["t"]), table_rows(fg["t"]), "bg against fg")
        ib, if_ = tensorkv.tag_manifest(url, "bg"), tensorkv.tag_manifest(url, "fg")
        mb, mf = (dict(i["tables"]["t"]["meta"]) for i in (ib, if_))
        mb.pop("storage", None), mf.pop("storage", None)  # the twins' spill paths differ
        assert mb == mf
        assert ib["metadata"] == if_["metadata"] and ib["dense"] == if_["dense"]
    finally:
        for t in twins:
            t.close()
