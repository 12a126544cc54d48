"""``save(..., blocking=False)``: the handle, one save per table, cancels, step scopes, errors."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest

import tensorkv
from tensorkv.checkpoint import handle as handle_mod
from tensorkv.embedding.snapshot import LiveSnapshot
from tensorkv.errors import (
    CheckpointError,
    ConfigError,
    SaveCancelledError,
    SaveInProgressError,
    StepScopeError,
    TagExistsError,
)
from tensorkv.stores.lmdb import LMDBStore

from .conftest import make_url


def _table(n: int = 2000) -> tensorkv.EmbeddingTable:
    t = tensorkv.EmbeddingTable(8, optimizer="adagrad", seed=1)
    t.lookup(np.arange(n))
    return t


@pytest.fixture
def gate(monkeypatch):
    """An Event: LMDB's claim of a tag (a save's first store write) waits until it is set."""
    ev = threading.Event()
    cas = LMDBStore.compare_and_set

    def gated(self: Any, key: bytes, expected: Any, value: Any) -> bool:
        ev.wait()
        return cas(self, key, expected, value)

    monkeypatch.setattr(LMDBStore, "compare_and_set", gated)
    yield ev
    ev.set()  # a save a failed test left waiting goes on (the process waits for it at exit)


def test_the_handle_reports_and_returns_the_tag(tmp_path, request, gate):
    url = make_url("lmdb", tmp_path, request)
    t = _table()
    h = tensorkv.save({"t": t, "w": np.ones(100)}, url, "a", blocking=False)
    assert isinstance(h, tensorkv.SaveHandle) and h.tag == "a" and not h.done()
    st = h.stats()
    assert st["state"] == "writing" and st["snapshot_bytes"] >= 9 * 2000 + 800
    assert st["snapshot_seconds"] >= 0 and "writing" in repr(h)
    t.apply_gradients(np.arange(500), np.ones((500, 8), np.float32))  # rows copied aside
    assert h.stats()["snapshot_bytes"] >= 500 * 8 * 4 * 2
    with pytest.raises(TimeoutError, match="still writing"):
        h.result(timeout=0.01)
    gate.set()
    assert h.result() == "a" and h.done() and h.exception() is None
    st = h.stats()
    assert st["state"] == "done" and st["snapshot_bytes"] == 0
    assert st["peak_snapshot_bytes"] >= 500 * 8 * 4 * 2
    assert h.cancel() is False  # published already
    assert t.arena.snap is None  # the snapshot was released
    rows = tensorkv.load(None, url, "a")["t"]
    assert (rows.version(np.arange(500)) == 0).all()  # the state of the call, not after


def test_cancel_publishes_nothing_and_leaves_nothing(tmp_path, request, gate):
    url = make_url("lmdb", tmp_path, request)
    t = _table()
    gate.set()
    tensorkv.save({"t": t}, url, "base")
    gate.clear()
    h = tensorkv.save({"t": t}, url, "c", blocking=False)
    dense_only = tensorkv.save({"w": np.ones(10)}, url, "d", blocking=False)  # no chunks
    assert h.cancel() is True and h.cancelled() and dense_only.cancel()
    gate.set()
    for handle in (h, dense_only):
        with pytest.raises(SaveCancelledError, match="cancelled"):
            handle.result()
    assert h.stats()["state"] == "cancelled" and t.arena.snap is None
    assert tensorkv.list_tags(url) == ["base"]
    rep = tensorkv.check(url, verify=True)
    assert not rep.pending and not rep.corrupt, rep.as_dict()
    tensorkv.gc(url, grace=0)  # dense chunks are shared: gc removes those nothing references
    assert tensorkv.check(url, grace=0).ok
    tensorkv.save({"t": t}, url, "c")  # the tag name is free, the table too


def test_one_save_per_table_waits_or_raises(tmp_path, request, gate, monkeypatch):
    url = make_url("lmdb", tmp_path, request)
    t, other = _table(), _table(100)
    first = tensorkv.save({"t": t}, url, "one", blocking=False)
    with pytest.raises(SaveInProgressError, match=r"\(tag 'one'\) is still being written"):
        tensorkv.save({"t": t}, url, "two", blocking=False, on_pending="error")
    monkeypatch.setenv("TENSORKV_SAVE_PENDING", "error")
    with pytest.raises(SaveInProgressError):
        tensorkv.save({"t": t}, url, "two")
    monkeypatch.delenv("TENSORKV_SAVE_PENDING")
    assert handle_mod.pending() == [first]
    # another table is not held up (its claim waits for the gate like every save)
    h_other = tensorkv.save({"o": other}, url, "other", blocking=False, on_pending="error")
    got: list[Any] = []
    second = threading.Thread(target=lambda: got.append(
        tensorkv.save({"t": t}, url, "two", blocking=False)))  # default: waits for "one"
    second.start()
    gate.set()
    second.join()
    assert first.result() == "one" and h_other.result() == "other"
    assert got[0].result() == "two"
    assert sorted(tensorkv.list_tags(url)) == ["one", "other", "two"]


def test_a_failed_background_save_raises_from_result_and_frees_the_table(tmp_path, request):
    url = make_url("lmdb", tmp_path, request)
    t = _table()
    tensorkv.save({"t": t}, url, "a")
    h = tensorkv.save({"t": t}, url, "a", blocking=False)
    with pytest.raises(TagExistsError, match="already exists"):
        h.result()
    assert isinstance(h.exception(), TagExistsError) and h.stats()["state"] == "failed"
    assert t.arena.snap is None and not handle_mod.pending()
    assert tensorkv.save({"t": t}, url, "b", blocking=False, on_pending="error").result() == "b"


def test_a_save_inside_its_own_step_is_refused(tmp_path, request):
    url = make_url("lmdb", tmp_path, request)
    t = _table()
    scope = tensorkv.StepScope()
    with scope.step(), pytest.raises(StepScopeError, match="inside a training step"):
        tensorkv.save({"t": t}, url, "a", step_scope=scope)
    assert t.arena.snap is None and not handle_mod.pending()
    with tensorkv.training_step():  # another scope's step does not matter
        tensorkv.save({"t": t}, url, "a", step_scope=scope)
        with pytest.raises(StepScopeError):
            tensorkv.save({"t": t}, url, "b")  # the default scope
    tensorkv.save({"t": t}, url, "b", step_scope=False)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"on_pending": "later"}, ConfigError, "on_pending='later' is not one of wait, error"),
    ({"blocking": "no"}, CheckpointError, "blocking='no' must be True or False"),
    ({"step_scope": 3}, CheckpointError, "step_scope=3 must be True, False or a StepScope"),
])
def test_bad_arguments_are_refused_before_anything_happens(tmp_path, request, kwargs, error,
                                                           match):
    url = make_url("lmdb", tmp_path, request)
    t = _table()
    with pytest.raises(error, match=match):
        tensorkv.save({"t": t}, url, "a", **kwargs)
    assert t.arena.snap is None and not handle_mod.pending()
    with pytest.raises(tensorkv.errors.StoreNotFoundError):  # nothing was written
        tensorkv.list_tags(url)


def test_bad_settings_in_the_environment_are_named(tmp_path, request, monkeypatch):
    url = make_url("lmdb", tmp_path, request)
    monkeypatch.setenv("TENSORKV_SAVE_PENDING", "never")
    with pytest.raises(ConfigError, match="TENSORKV_SAVE_PENDING='never'"):
        tensorkv.save({"t": _table()}, url, "a")
    monkeypatch.setenv("TENSORKV_SAVE_AT_EXIT", "sometimes")
    with pytest.raises(ConfigError, match="TENSORKV_SAVE_AT_EXIT='sometimes'"):
        tensorkv.config.save_at_exit()


def test_one_table_under_two_names_is_refused(tmp_path, request):
    url = make_url("lmdb", tmp_path, request)
    t = _table()
    with pytest.raises(CheckpointError, match="under two names"):
        tensorkv.save({"a": t, "b": t}, url, "x")
    assert t.arena.snap is None


def test_a_table_without_snapshots_is_saved_live(tmp_path, request, redis_server):
    """A Redis-resident table offers no isolated snapshot: its rows are read as they are."""
    url = make_url("lmdb", tmp_path, request)
    opt = tensorkv.StorageOption("REDIS", storage_path=f"redis://127.0.0.1:{redis_server.port}"
                                 f"/5", redis_options={"model_tag_runtime": "snapcase"})
    with tensorkv.EmbeddingTable(4, storage=opt) as t:
        t.lookup(np.arange(10))
        snap = t.snapshot()
        assert isinstance(snap, LiveSnapshot) and not snap.isolated
        assert tensorkv.save({"t": t}, url, "r", blocking=False).result() == "r"
        assert len(tensorkv.load(None, url, "r")["t"]) == 10


def test_a_background_save_runs_at_a_lower_cpu_priority(tmp_path, request, monkeypatch):
    """Its threads yield to training (Linux: ``TENSORKV_SAVE_NICE``); a blocking save's not."""
    if not hasattr(os, "getpriority"):
        pytest.skip("no thread priorities here")
    url = make_url("lmdb", tmp_path, request)
    seen: dict[str, set[int]] = {}  # tag -> niceness of the threads that claimed/published it
    cas = LMDBStore.compare_and_set

    def noting(self: Any, key: bytes, expected: Any, value: Any) -> bool:
        tag = key.decode().split("/")[2]
        seen.setdefault(tag, set()).add(os.getpriority(os.PRIO_PROCESS,
                                                       threading.get_native_id()))
        return cas(self, key, expected, value)

    monkeypatch.setattr(LMDBStore, "compare_and_set", noting)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = _table()
    tensorkv.save({"t": t}, url, "a", blocking=False).result()
    tensorkv.save({"t": t}, url, "b")
    monkeypatch.setenv("TENSORKV_SAVE_NICE", "17")
    tensorkv.save({"t": t}, url, "c", blocking=False).result()
    assert seen == {"a": {max(mine, 10)}, "b": {mine}, "c": {max(mine, 17)}}, seen
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    monkeypatch.setenv("TENSORKV_SAVE_NICE", "25")
    with pytest.raises(tensorkv.errors.ConfigError, match="TENSORKV_SAVE_NICE=25 is above 19"):
        tensorkv.save({"t": t}, url, "d", blocking=False)
    assert t.arena.snap is None and not handle_mod.pending()  # refused before anything


def test_a_forked_child_is_not_held_by_the_parents_background_save(tmp_path, request, gate):
    url, child_url = make_url("lmdb", tmp_path, request), make_url("lmdb", tmp_path, request)
    t = _table()
    h = tensorkv.save({"t": t}, url, "parent", blocking=False)  # waits at the gate
    pid = os.fork()
    if pid == 0:  # the child: the parent's save thread does not exist here
        code = 1
        try:
            gate.set()  # the child's own saves must not wait either
            code = 0 if tensorkv.save({"t": t}, child_url, "child", on_pending="error",
                                      step_scope=True) == "child" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    gate.set()
    assert h.result() == "parent" and tensorkv.list_tags(child_url) == ["child"]


def test_dense_chunks_are_copied_only_when_the_store_lacks_them(tmp_path, request, gate):
    """The snapshot copies the dense chunks not stored yet; stored ones are read if needed."""
    url = make_url("lmdb", tmp_path, request)
    gate.set()
    w = np.arange(3 * 4096, dtype=np.float32).reshape(3, 4096)  # three 16 KiB chunks
    opts = {"chunk_bytes": 16384, "step_scope": False}
    first = tensorkv.save({"w": w}, url, "a", blocking=False, **opts)
    assert first.stats()["snapshot_bytes"] == w.nbytes  # a new store: every chunk copied
    first.result()
    w[1] += 1  # one chunk changes
    h = tensorkv.save({"w": w}, url, "b", blocking=False, **opts)
    assert h.stats()["snapshot_bytes"] == 16384  # the changed chunk only
    h.result()
    np.testing.assert_array_equal(tensorkv.load(None, url, "b")["w"], w)
    # the store loses tag b's chunks; this process still counts them as stored
    tensorkv.delete_tag(url, "b")
    tensorkv.delete_tag(url, "a")
    tensorkv.gc(url, grace=0)
    gate.clear()
    h = tensorkv.save({"w": w}, url, "c", blocking=False, **opts)  # nothing copied
    assert h.stats()["snapshot_bytes"] == 0
    gate.set()
    assert h.result() == "c"  # written from the live tensor, unchanged
    np.testing.assert_array_equal(tensorkv.load(None, url, "c")["w"], w)
    tensorkv.delete_tag(url, "c")
    tensorkv.gc(url, grace=0)
    gate.clear()
    h = tensorkv.save({"w": w}, url, "d", blocking=False, **opts)
    w[2] += 1  # changed before the save read it, and the store lacks the snapshot's chunk
    gate.set()
    with pytest.raises(CheckpointError, match="changed since the save's snapshot"):
        h.result()
    assert tensorkv.list_tags(url) == []
    assert tensorkv.save({"w": w}, url, "d", **opts) == "d"  # saving again works
