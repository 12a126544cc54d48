"""The helper thread that shares row kernels with the training thread (embedding.assist)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tensorkv import config
from tensorkv.embedding import EmbeddingTable
from tensorkv.embedding.chain import assist
from tensorkv.embedding.optimizers import get_optimizer
from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.errors import ConfigError
from tensorkv.kernels import arena as ak

from .test_exactness import assert_same, chain, train


def _ranges(n: int, slow_caller: float = 0.0) -> list[tuple[int, int, str]]:
    seen: list[tuple[int, int, str]] = []
    lock = threading.Lock()

    def fn(lo: int, hi: int) -> None:
        name = threading.current_thread().name
        if slow_caller and name != "tensorkv-assist":
            time.sleep(slow_caller)  # leaves the helper time to claim chunks
        with lock:
            seen.append((lo, hi, name))

    assist.run_split(fn, n)
    return seen


@pytest.mark.parametrize("n", [0, 1, assist.MIN_SPLIT_ROWS - 1, assist.MIN_SPLIT_ROWS, 100_003])
def test_chunks_cover_every_row_once(n):
    seen = _ranges(n, slow_caller=0.02)
    covered = np.zeros(n, np.int64)
    for lo, hi, _ in seen:
        covered[lo:hi] += 1
    assert (covered == 1).all()
    if n < assist.MIN_SPLIT_ROWS:
        assert len(seen) == 1 and seen[0][2] == threading.current_thread().name
    else:
        assert len(seen) == assist.CHUNKS


def test_helper_takes_chunks_the_caller_leaves():
    seen = _ranges(100_000, slow_caller=0.05)
    assert {s[2] for s in seen} == {threading.current_thread().name, "tensorkv-assist"}


@pytest.mark.parametrize("where", ["caller", "helper"])
def test_a_failing_chunk_raises_in_the_caller(where):
    ran: list[str] = []

    def fn(lo: int, hi: int) -> None:
        name = threading.current_thread().name
        on_helper = name == "tensorkv-assist"
        if not on_helper:
            time.sleep(0.05)
        ran.append(name)
        if on_helper == (where == "helper"):
            raise ValueError(f"chunk {lo}:{hi} failed on {name}")

    with pytest.raises(ValueError, match="failed on"):
        assist.run_split(fn, 100_000)
    # the helper is still serving later splits
    assert len(_ranges(100_000, slow_caller=0.05)) == assist.CHUNKS


@pytest.mark.parametrize("name", ["adagrad", "adam", "ftrl", "sgd"])
def test_optimizer_split_is_bit_identical(name):
    rng = np.random.default_rng(1)
    m, dim, n_rows = 10_000, 16, 30_000
    rows = rng.choice(n_rows, m, replace=False).astype(np.int64)
    grads = rng.standard_normal((m, dim)).astype(np.float32)
    outs = []
    for split in (None, assist.run_split):
        opt = get_optimizer(name)
        values = np.full((n_rows, dim), 0.5, np.float32)
        slots = np.full((n_rows, max(opt.num_slots, 1) * dim), 0.1, np.float32)
        for step in range(1, 4):
            opt.apply(values, slots if opt.num_slots else None, rows, grads, step,
                      parallel=False, split=split)
        outs.append((values, slots))
    assert np.array_equal(outs[0][0], outs[1][0])
    assert np.array_equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("name", ["DRAM_SSDHASH", "DRAM_PMEM_SSDHASH"])
def test_tiered_training_with_the_helper_is_bit_identical(tmp_path, monkeypatch, name):
    """Promotions and optimizer steps split over the helper train exactly as DRAM-only."""
    monkeypatch.setattr(assist, "MIN_SPLIT_ROWS", 1)  # split even the small test batches
    dim = 8
    ref = EmbeddingTable(dim, optimizer="adagrad", seed=3)
    lay = RecordLayout(dim, num_slots=1)
    opts = chain(name, tmp_path, lay, tier1_rows=300 if "PMEM" in name else None)
    with EmbeddingTable(dim, optimizer="adagrad", seed=3, **opts) as t:
        calls = []
        real = assist.run_split

        def counting(fn, n):
            calls.append(n)
            real(fn, n)

        t._rows.split = t._rows.chain.split = counting  # also where cores are plenty
        train([ref, t], string_keys=False, steps=120)
        assert t.stats()["tiers"][1]["promotions"] > 0
        assert len(calls) > 120  # every optimizer step and the promotions went through it
        assert_same(ref, t)


def _child_split(out) -> None:
    names = {name for _, _, name in _ranges(100_000, slow_caller=0.05)}
    out.put(sorted(names))


def test_a_forked_child_gets_its_own_helper():
    """After fork the parent's helper thread is gone: the child starts its own."""
    import multiprocessing

    _ranges(100_000)  # the parent's helper exists before the fork
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_child_split, args=(out,))
    p.start()
    names = out.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert "tensorkv-assist" in names


def test_assist_setting(monkeypatch):
    monkeypatch.setenv(config.ENV_ASSIST_THREAD, "0")
    assert config.assist_thread() is False
    monkeypatch.setenv(config.ENV_ASSIST_THREAD, "maybe")
    with pytest.raises(ConfigError, match="TENSORKV_ASSIST_THREAD"):
        config.assist_thread()


def test_a_task_runs_once_on_the_helper_or_on_the_joiner():
    ran: list[str] = []
    gate = threading.Event()
    blocker = assist.start(lambda: gate.wait(10))  # keeps the helper busy
    task = assist.start(lambda: ran.append(threading.current_thread().name) or 7)
    assert task.join() == 7  # not started by the busy helper: runs here, at once
    gate.set()
    blocker.join()
    assert ran == [threading.current_thread().name]
    late = assist.start(lambda: threading.current_thread().name)
    late.done.wait(10)
    assert late.join() == "tensorkv-assist" and late.join() == "tensorkv-assist"

    def boom():
        raise ValueError("demotion failed")

    failed = assist.start(boom)
    for _ in range(2):  # every join re-raises
        with pytest.raises(ValueError, match="demotion failed"):
            failed.join()


def _deferring(t) -> list[str]:
    """Record on which thread each of ``t``'s deferred demotions ran."""
    where: list[str] = []
    real = t._rows.chain._detach_victims

    def detach(*args):
        where.append(threading.current_thread().name)
        return real(*args)

    t._rows.chain._detach_victims = detach
    return where


def test_deferred_demotions_are_exact_and_never_seen_half_done(tmp_path):
    """A lookup's demotion runs on the helper while gradients are summed: the same rows
    move as when it runs inline, and reads between lookup and apply see a whole table."""
    dim = 8
    lay = RecordLayout(dim, num_slots=1)
    ref = EmbeddingTable(dim, optimizer="adagrad", seed=3)
    inline = EmbeddingTable(dim, optimizer="adagrad", seed=3,
                                  **chain("DRAM_SSDHASH", tmp_path / "a", lay))
    inline._rows._defer = None
    deferred = EmbeddingTable(dim, optimizer="adagrad", seed=3,
                                    **chain("DRAM_SSDHASH", tmp_path / "b", lay))
    assert deferred._rows._defer is not None
    where = _deferring(deferred)
    rng = np.random.default_rng(0)
    with inline, deferred:
        for step in range(60):
            keys = rng.choice(2000, 300, replace=False).astype(np.int64)
            grads = rng.standard_normal((keys.size, dim)).astype(np.float32)
            outs = [t.lookup(keys) for t in (ref, inline, deferred)]
            assert np.array_equal(outs[0], outs[2]) and np.array_equal(outs[1], outs[2])
            if step % 10 == 3:  # reads while the demotion may still run
                probe = rng.choice(2500, 200, replace=False).astype(np.int64)
                assert len(deferred) == len(ref)
                assert np.array_equal(deferred.contains(probe), ref.contains(probe))
                assert np.array_equal(deferred.frequency(probe), ref.frequency(probe))
            for t in (ref, inline, deferred):
                t.apply_gradients(keys, grads)
        assert "tensorkv-assist" in where  # some demotions did run on the helper
        assert_same(ref, deferred)
        assert_same(inline, deferred)
        a, b = inline.stats()["tiers"], deferred.stats()["tiers"]
        for x, y in zip(a, b, strict=True):
            for f in ("rows", "hits", "misses", "promotions", "evictions"):
                assert x[f] == y[f], f


def test_metadata_writes_run_with_the_deferred_demotion(tmp_path, monkeypatch):
    """Frequency counts (lookup) and versions (update) are written by the batch's deferred
    task, and every read afterwards sees them, exactly as the DRAM-only table writes them."""
    dim = 8
    lay = RecordLayout(dim, num_slots=1)
    ref = EmbeddingTable(dim, optimizer="adagrad", seed=3)
    t = EmbeddingTable(dim, optimizer="adagrad", seed=3,
                             **chain("DRAM_SSDHASH", tmp_path, lay, tier0_rows=1000))
    held: list[str] = []
    real = ak.bump_freq, ak.set_meta

    def bump_freq(*args):
        held.append(f"freq:{threading.current_thread().name}")
        return real[0](*args)

    def set_meta(*args):
        held.append(f"version:{threading.current_thread().name}")
        return real[1](*args)

    keys = np.array([5, 7, 5, 9, 11], np.int64)
    grads = np.ones((keys.size, dim), np.float32)
    with t:
        for x in (ref, t):  # the first lookup inserts (the slow path writes at once)
            x.lookup(keys)
            x.apply_gradients(keys, grads, step=3)
        assert np.array_equal(t.version(keys), [3, 3, 3, 3, 3])  # settles the update's task
        with monkeypatch.context() as m:
            m.setattr(ak, "bump_freq", bump_freq)
            m.setattr(ak, "set_meta", set_meta)
            t.lookup(keys)
            assert t._rows.chain._demotion is not None  # the counts wait in the deferred task
            t.apply_gradients(keys, grads, step=8)
            assert t._rows.chain._demotion is not None  # so do the versions
            assert np.array_equal(t.version(keys), [8, 8, 8, 8, 8])  # settled by the read
            assert [h.split(":")[0] for h in held] == ["freq", "version"]
        ref.lookup(keys)
        ref.apply_gradients(keys, grads, step=8)
        assert np.array_equal(t.frequency(keys), ref.frequency(keys))
        assert np.array_equal(t.frequency(keys), [4, 2, 4, 2, 2])
        assert_same(ref, t)


def test_held_metadata_writes_land_when_the_demotion_step_fails(tmp_path):
    dim = 8
    lay = RecordLayout(dim, num_slots=1)
    t = EmbeddingTable(dim, optimizer="adagrad",
                             **chain("DRAM_SSDHASH", tmp_path, lay, tier0_rows=1000))
    keys = np.arange(20, dtype=np.int64)
    grads = np.ones((keys.size, dim), np.float32)
    with t:
        t.lookup(keys)
        real = t._rows.chain.after

        def broken(*args, **kwargs):
            raise RuntimeError("demotion step failed")

        t._rows.chain.after = broken
        with pytest.raises(RuntimeError, match="demotion step failed"):
            t.apply_gradients(keys, grads, step=5)
        t._rows.chain.after = real
        assert (t.version(keys) == 5).all()  # the update's held versions were written
        assert (t.frequency(keys) == 1).all()


def test_a_failed_deferred_demotion_raises_at_the_next_operation(tmp_path):
    dim = 8
    lay = RecordLayout(dim, num_slots=1)
    t = EmbeddingTable(dim, optimizer="adagrad",
                             **chain("DRAM_SSDHASH", tmp_path, lay, tier0_rows=50))
    keys = np.arange(200, dtype=np.int64)
    t.lookup(keys[:100])
    assert len(t) == 100  # settles the first lookup's demotion

    def broken(*args):
        raise MemoryError("no memory for the victims")

    t._rows.chain._detach_victims = broken
    t.lookup(keys[100:])  # its demotion fails in the background
    with pytest.raises(MemoryError, match="no memory"):
        t.apply_gradients(keys[100:], np.ones((100, dim), np.float32))
    del t._rows.chain._detach_victims  # the next lookup demotes again
    t.lookup(keys[:10])
    t.apply_gradients(keys[:10], np.ones((10, dim), np.float32))
    assert len(t) == 200
    t.close()
