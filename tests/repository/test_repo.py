"""Repository round trips on every backend, dedup, reference counts, gc, check, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorkv import Repository, open_store
from tensorkv.errors import (
    BadIndexError,
    ConfigError,
    CorruptRecordError,
    GraphError,
    ModelNotFoundError,
    TensorNotFoundError,
)
from tensorkv.repository import tensors

from .models import CNN, Untraceable, assert_state_equal, mlp


def test_round_trip_on_every_backend(any_url):
    with Repository(any_url, chunk_bytes=1024) as repo:
        m = CNN()
        m.bn.running_mean.uniform_()
        mid = repo.put(m, name="cnn", metrics={"val_acc": 0.5})
        assert_state_equal(repo.get(mid), m.state_dict())
        w = m.conv1.weight
        assert torch.equal(repo.read_tensor(mid, "conv1.weight", index=slice(2, 5)), w[2:5])
        got = repo.read_tensors(mid, ["head.bias", "bn.num_batches_tracked"])
        assert got["bn.num_batches_tracked"].dtype == torch.int64
        fresh = CNN(seed=9)
        repo.load_into(fresh, mid)
        assert_state_equal(fresh.state_dict(), m.state_dict())
        assert repo.check(verify=True)["ok"]


def test_dtypes_round_trip_exactly(lmdb_url):
    sd = {"bf": torch.randn(5, 3).to(torch.bfloat16), "h": torch.randn(4).half(),
          "i8": torch.arange(-3, 3, dtype=torch.int8), "b": torch.tensor([True, False]),
          "s": torch.tensor(3.5, dtype=torch.float64), "e": torch.zeros(0, 4)}
    g = {"nodes": [{"name": "x", "op": "input", "type": "input"}]}
    with Repository(lmdb_url) as repo:
        mid = repo.put(g, sd)
        assert_state_equal(repo.get(mid), sd)


def test_slices_read_only_their_chunks(lmdb_url):
    arr = np.arange(64 * 100, dtype=np.float32).reshape(100, 64)
    g = {"nodes": [{"name": "x", "op": "input", "type": "input"},
                   {"name": "fc", "type": "Dense", "inputs": ["x"],
                    "params": {"w": {"shape": [100, 64], "dtype": "float32"}}}]}
    with Repository(lmdb_url, chunk_bytes=1024) as repo:  # 4 rows per chunk
        mid = repo.put(g, {"fc.w": arr})
        e = repo.manifest(mid)["tensors"]["fc.w"]
        assert e["rows"] == 4 and e["chunks"] == 25
        for index in [slice(10, 13), slice(None, None, -3), 7, -1, (slice(5, 50, 7), 3),
                      (Ellipsis, 2), slice(99, 200), slice(5, 5)]:
            np.testing.assert_array_equal(repo.read_tensor(mid, "fc.w", index), arr[index])
        r, _, _ = tensors.chunk_range(e, slice(10, 13))
        assert list(r) == [2, 3]  # rows 8..15: two chunks, not 25
        with pytest.raises(BadIndexError, match="out of bounds"):
            repo.read_tensor(mid, "fc.w", 100)
        with pytest.raises(BadIndexError, match="basic index"):
            repo.read_tensor(mid, "fc.w", [1, 2])


def test_children_store_only_what_differs(lmdb_url):
    with Repository(lmdb_url) as repo:
        parent = mlp((32, 64, 64, 64, 10))
        pid = repo.put(parent)
        before = repo.stats()
        child = mlp((32, 64, 64, 64, 5))
        child.load_state_dict({k: v for k, v in parent.state_dict().items()
                               if not k.startswith("6.")}, strict=False)
        cid = repo.put(child, parent=pid)
        after = repo.stats()
        new = sum(v.numel() * 4 for k, v in child.state_dict().items() if k.startswith("6."))
        assert after["bytes_stored"] - before["bytes_stored"] < new + 1024
        assert after["bytes_referenced"] == before["bytes_referenced"] * 2 - (
            parent[6].weight.numel() + 10 - child[6].weight.numel() - 5) * 4
        assert repo.list()[1]["parent"] == pid
        assert_state_equal(repo.get(cid), child.state_dict())


def test_delete_retires_only_unshared_tensors_and_gc_is_clean(lmdb_url):
    with Repository(lmdb_url) as repo:
        a = mlp((8, 16, 4))
        b = mlp((8, 16, 5))
        b[0].load_state_dict(a[0].state_dict())
        ida, idb = repo.put(a), repo.put(b)
        assert repo.stats()["tensors"] == 6
        assert repo.delete(ida) == 2  # a's head; its first layer is b's too
        assert_state_equal(repo.get(idb), b.state_dict())
        with pytest.raises(ModelNotFoundError, match=f"no model '{ida}'.*1 stored"):
            repo.get(ida)
        with pytest.raises(ModelNotFoundError):
            repo.delete(ida)
        assert repo.gc(grace=0) == {"manifests_removed": 0, "deletes_finished": 0,
                                    "counts_fixed": 0, "tensors_retired": 0,
                                    "orphans_deleted": 0, "intents_removed": 0}
        assert repo.delete(idb) == 4
        s = repo.stats()
        assert (s["models"], s["tensors"], s["bytes_stored"]) == (0, 0, 0)


def test_gc_reclaims_a_killed_put(lmdb_url):
    """A writer killed after counting and writing, before its manifest and log entry."""
    with Repository(lmdb_url) as repo:
        keep = repo.put(mlp((4, 4)))
        m = mlp((4, 6, 3), seed=1)
        from tensorkv.repository import refs
        from tensorkv.repository.layout import intent_key

        arrs = {k: v.numpy() for k, v in m.state_dict().items()}
        staged = {k: tensors.stage(a, "float32", repo.chunk_bytes) for k, a in arrs.items()}
        ents = {k: e for k, (e, _) in staged.items()}
        repo.meta.put(intent_key("dead"), b'{"tids": [], "time": 0}')
        for e, flat in staged.values():
            repo.providers[0].put_many(tensors.chunk_values(flat, e))
        refs.incref(repo.meta, [e["id"] for e in ents.values()])
        assert not repo.check()["ok"]
        assert len(repo.list()) == 1
        report = repo.gc(grace=0)
        assert report["tensors_retired"] == 4 and report["intents_removed"] == 1
        assert repo.check()["ok"] and repo.stats()["tensors"] == 2
        assert len(repo.get(keep)) == 2


def test_corrupt_chunk_is_named_by_key(lmdb_url):
    with Repository(lmdb_url) as repo:
        mid = repo.put(mlp((4, 4)))
        e = repo.manifest(mid)["tensors"]["0.weight"]
        key = tensors.chunk_key(e["id"], 0)
        raw = bytearray(repo.meta.get(key))
        raw[-1] ^= 0xFF
        repo.meta.put(key, bytes(raw))
        with pytest.raises(CorruptRecordError, match=key.decode()):
            repo.read_tensor(mid, "0.weight")
        report = repo.check(verify=True)
        assert not report["ok"] and key.decode() in report["problems"][0]


def test_bad_inputs_are_refused_clearly(lmdb_url):
    with Repository(lmdb_url) as repo:
        mid = repo.put(mlp((4, 4)))
        with pytest.raises(TensorNotFoundError, match="no tensor 'nope'; it has 2: 0.bias"):
            repo.read_tensor(mid, "nope")
        with pytest.raises(ModelNotFoundError, match="model ids are str"):
            repo.get(7)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="metric 'acc'"):
            repo.put(mlp((4, 4)), metrics={"acc": float("nan")})
        with pytest.raises(GraphError, match="needs its state_dict"):
            repo.put({"nodes": []})
        with pytest.raises(GraphError, match="names tensor 'fc.w'"):
            repo.put({"nodes": [{"name": "fc", "type": "D",
                                 "params": {"w": {"shape": [2], "dtype": "float32"}}}]}, {})
        with pytest.raises(GraphError, match="shape"):
            repo.put({"nodes": [{"name": "fc", "type": "D",
                                 "params": {"w": {"shape": [2], "dtype": "float32"}}}]},
                     {"fc.w": np.zeros(3, np.float32)})
        with pytest.raises(GraphError, match="expected a Graph"):
            repo.put(42, {})
        with pytest.raises(ModelNotFoundError):
            repo.put(mlp((4, 4)), parent="nope")
        with pytest.raises(ConfigError, match="one str"):
            repo.read_tensors(mid, "0.bias")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="where="):
            repo.list(where=3)
        assert len(repo.list()) == 1
    with pytest.raises(ConfigError, match="at least one"):
        Repository([])
    with pytest.raises(ConfigError, match="chunk_bytes"):
        Repository("memory://x", chunk_bytes=10)
    st = open_store("memory://repo-same")
    with pytest.raises(ConfigError, match="same store"):
        Repository([st, st])


def test_untraceable_model_round_trips_and_transfers(lmdb_url):
    with Repository(lmdb_url) as repo:
        m = Untraceable()
        mid = repo.put(m, example_inputs=torch.randn(2, 4))
        assert [n["name"] for n in repo.manifest(mid)["graph"]["nodes"]] == ["input", "a", "b"]
        fresh = Untraceable(seed=3)
        copied = repo.transfer(fresh, example_inputs=torch.randn(2, 4))
        assert sorted(copied) == ["a.bias", "a.weight", "b.bias", "b.weight"]
        assert_state_equal(fresh.state_dict(), m.state_dict())


def test_transfer_copies_only_the_shared_prefix(lmdb_url):
    with Repository(lmdb_url) as repo:
        old = mlp((8, 16, 16, 4))
        mid = repo.put(old, metrics={"val_acc": 0.8})
        new = mlp((8, 16, 16, 7), seed=5)
        got_mid, layers = repo.longest_prefix(new)
        assert got_mid == mid and len(layers) == 5  # input, 0, 1, 2, 3 (head differs)
        copied = repo.transfer(new)
        assert sorted(copied) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert torch.equal(new[2].weight, old[2].weight)
        assert not torch.equal(new[4].bias[:4], old[4].bias)


def test_corrupt_manifest_and_log_are_named_by_key(lmdb_url):
    from tensorkv.repository.index import log_key
    from tensorkv.repository.layout import manifest_key

    with Repository(lmdb_url) as repo:
        mid = repo.put(mlp((4, 4)))
        repo.meta.put(manifest_key(mid), b"{not json")
        repo.manifests.clear()
        with pytest.raises(CorruptRecordError, match=f"repo/m/{mid} is not valid JSON"):
            repo.get(mid)
        repo.meta.put(log_key(1), b"\xff")
    with Repository(lmdb_url) as again, pytest.raises(CorruptRecordError,
                                                      match="repo/log/000000000001"):
        again.list()


def test_a_reader_sees_another_clients_delete(lmdb_url):
    with Repository(lmdb_url) as writer, Repository(lmdb_url) as reader:
        m = mlp((4, 4))
        keep = writer.put(m)
        gone = writer.put(m)  # same tensors: deleting it retires none of them
        assert_state_equal(reader.get(gone), m.state_dict())  # the reader caches it
        writer.delete(gone)
        with pytest.raises(ModelNotFoundError, match=f"no model '{gone}'"):
            reader.get(gone)
        assert_state_equal(reader.get(keep), m.state_dict())
        new = writer.put(mlp((4, 5)))
        assert len(reader.get(new)) == 2  # and another client's put


def test_zero_copy_reads(lmdb_url, any_url):
    arr = np.arange(64 * 100, dtype=np.float32).reshape(100, 64)
    g = {"nodes": [{"name": "x", "op": "input", "type": "input"},
                   {"name": "fc", "type": "Dense", "inputs": ["x"],
                    "params": {"w": {"shape": [100, 64], "dtype": "float32"},
                               "b": {"shape": [64], "dtype": "float32"}}}]}
    sd = {"fc.w": arr, "fc.b": torch.arange(64.0)}
    for url, chunk in ((lmdb_url, 1024), (any_url, 1024), (lmdb_url + "-one", 1 << 20)):
        with Repository(url, chunk_bytes=chunk) as repo:
            mid = repo.put(g, sd)
            b = repo.read_tensor(mid, "fc.b", copy=False)
            assert isinstance(b, np.ndarray) and not b.flags.writeable
            np.testing.assert_array_equal(b, np.arange(64.0, dtype=np.float32))
            for index in [None, slice(9, 11), 7, slice(10, 30), (slice(None, None, -3), 2)]:
                got = repo.read_tensor(mid, "fc.w", index, copy=False, verify=False)
                np.testing.assert_array_equal(got, arr if index is None else arr[index])
            whole = repo.get(mid, copy=False)
            np.testing.assert_array_equal(whole["fc.w"], arr)
            if chunk > 1024 and url.startswith("lmdb"):  # one chunk: a view of the file
                assert whole["fc.w"].base is not None and not whole["fc.w"].flags.owndata


def test_zero_copy_read_verifies_checksums(lmdb_url):
    arr = np.arange(256, dtype=np.float32)
    g = {"nodes": [{"name": "x", "op": "input", "type": "input"},
                   {"name": "fc", "type": "Dense", "inputs": ["x"],
                    "params": {"w": {"shape": [256], "dtype": "float32"}}}]}
    with Repository(lmdb_url) as repo:
        mid = repo.put(g, {"fc.w": arr})
        key = tensors.chunk_key(repo.manifest(mid)["tensors"]["fc.w"]["id"], 0)
        rec = bytearray(repo.meta.get(key))
        rec[-1] ^= 0xFF
        repo.meta.put(key, bytes(rec))
        with pytest.raises(CorruptRecordError, match="checksum"):
            repo.read_tensor(mid, "fc.w", copy=False)
        got = repo.read_tensor(mid, "fc.w", copy=False, verify=False)
        assert got[-1] != arr[-1]
        repo.meta.delete(key)
        with pytest.raises(CorruptRecordError, match="missing from every provider"):
            repo.read_tensor(mid, "fc.w", copy=False)


def test_reads_share_one_block_when_large(lmdb_url):
    sd = {f"t{i}": np.full((512, 1024), i, np.float32) for i in range(3)}
    g = {"nodes": [{"name": "x", "op": "input", "type": "input"}]}
    with Repository(lmdb_url) as repo:
        mid = repo.put(g, sd)
        got = repo.get(mid)
        for k, v in sd.items():
            np.testing.assert_array_equal(got[k], v)
        assert got["t0"].base is not None and got["t0"].base is got["t2"].base


class _InlinePool:
    """Runs what is submitted at once, in the submitting thread: a deterministic order."""

    def submit(self, fn, *args):
        from concurrent.futures import Future

        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait=True):
        pass


@pytest.mark.parametrize("providers", [1, 2])
def test_a_put_writes_from_tensor_memory_in_bounded_batches_behind_its_intent(
        lmdb_url, monkeypatch, providers):
    """Chunks go to the stores as views of the tensors (no copy), in batches of bounded size,
    and never before an intent record naming their tensor (gc leaves them alone)."""
    import json

    from tensorkv.repository import write

    monkeypatch.setattr(write, "GROUP_BYTES", 6000)  # several groups: hashing overlaps writing
    monkeypatch.setattr(write, "WRITE_BATCH_BYTES", 8192)
    sd = {"small": np.arange(100, dtype=np.float32), "mid": np.ones((3, 500), np.float32),
          "big": np.arange(5000, dtype=np.float64),  # 40 kB: larger than a batch
          "more": np.arange(3000, dtype=np.int32), "last": np.arange(7.0)}
    g = {"nodes": [{"name": "x", "op": "input", "type": "input"}]}
    urls = [f"{lmdb_url}-{i}" for i in range(providers)]
    with Repository(urls, chunk_bytes=1 << 20) as repo:
        repo.pool.shutdown()
        repo.pool = _InlinePool()  # type: ignore[assignment]
        calls: list[list] = []
        for st in repo.providers:
            def record_many(items, put_many=st.put_many):
                calls.append(list(items))
                return put_many(calls[-1])

            def record_put(key, value, put=st.put):
                calls.append([(key, value)])
                return put(key, value)

            monkeypatch.setattr(st, "put_many", record_many)
            monkeypatch.setattr(st, "put", record_put)
        mid = repo.put(g, sd)
        ents = repo.manifest(mid)["tensors"]
        name_of = {e["id"]: n for n, e in ents.items()}
        covered: set[str] = set()
        data_batches = 0
        for batch in calls:
            data = [(k, v) for k, v in batch if k.startswith(tensors.DATA)]
            for key, value in batch:
                if key.startswith(b"repo/p/"):
                    covered |= set(json.loads(bytes(value))["tids"])
                elif key.startswith(tensors.DATA):
                    tid = key[len(tensors.DATA):].split(b"/")[0].decode()
                    assert tid in covered, f"{key!r} written before an intent names it"
                    mine = np.ascontiguousarray(sd[name_of[tid]]).reshape(-1).view(np.uint8)
                    assert np.shares_memory(np.frombuffer(value, np.uint8), mine)
            if data:
                data_batches += 1
                assert len(data) == 1 or sum(memoryview(v).nbytes for _, v in data) <= 8192
        assert data_batches >= 3
        if providers > 1:
            assert all(any(b"repo/t/" in k for k in p.keys(tensors.DATA))
                       for p in repo.providers)
        sd2 = {k: v + 1 for k, v in sd.items()}
        mid2 = repo.put(g, sd2)
        for want, m in ((sd, mid), (sd2, mid2)):
            got = repo.get(m)
            for k, v in want.items():
                np.testing.assert_array_equal(got[k], v)
        assert repo.check(verify=True)["ok"]


def test_a_put_behind_other_writers_is_applied_in_log_order(lmdb_url):
    g = {"nodes": [{"name": "x", "op": "input", "type": "input"}]}
    with Repository(lmdb_url) as a, Repository(lmdb_url) as b:
        first = a.put(g, {}, name="first")
        second = b.put(g, {}, name="second")  # b has not seen a's entry: applied later
        assert b.index.get(second) is None
        assert [r["id"] for r in b.list()] == [first, second]
        assert [r["id"] for r in a.list()] == [first, second]
        assert b.read_tensors(second) == {}


def test_a_model_with_dynamic_tables_round_trips(lmdb_url):
    """The table of a dynamic module is stored with the model: rows, slots, counts, step."""
    import tensorkv.torch as tt
    from tensorkv.checkpoint.objects import TABLE_STATE, gather_tables, spread_tables
    from tensorkv.errors import CheckpointError

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(tt.DynamicEmbeddingBag(4, mode="sum", optimizer="adagrad"),
                                   torch.nn.Linear(4, 1))

    model = make()
    opt = tt.Optimizer(model, dense=torch.optim.SGD(model[1].parameters(), lr=0.1))
    ids = torch.tensor([[1, 2], [3, 4], [2, 9]])
    for _ in range(3):
        opt.zero_grad()
        model(ids).pow(2).sum().backward()
        opt.step()
    repo = Repository(lmdb_url)
    mid = repo.put(model, name="dyn", example_inputs=(ids,))
    assert any(n.endswith("_extra_state/values") for n in repo.read_tensors(mid, None))
    fresh = make()
    repo.load_into(fresh, mid)
    with torch.no_grad():
        assert torch.equal(fresh(ids), model(ids))
    a, b = model[0].table, fresh[0].table
    assert len(a) == len(b) == 5 and a.step == b.step == 3
    keys = np.arange(10)
    np.testing.assert_array_equal(a.frequency(keys), b.frequency(keys))
    state = repo.get(mid, as_numpy=True)
    assert state["0._extra_state"][TABLE_STATE] == 1
    assert sorted(gather_tables(spread_tables(state))) == sorted(state)
    with pytest.raises(CheckpointError, match="placeholder"):
        spread_tables({"t": {TABLE_STATE: 0}})
