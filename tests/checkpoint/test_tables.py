"""Embedding tables in checkpoints: round trips, modules, incremental chains, resharding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorkv
import tensorkv.checkpoint.layout
from tensorkv.checkpoint import layout
from tensorkv.embedding.table import EmbeddingTable
from tensorkv.errors import CheckpointError, CorruptRecordError, ShapeError

from .helpers import assert_tables_equal, make_table, rows_of


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam", "ftrl"])
def test_table_round_trip_bit_identical(mem_url, optimizer):
    t = make_table(3000, 8, optimizer)
    tensorkv.save(t, mem_url, "t", block_rows=100)
    got = tensorkv.load(None, mem_url, "t")["table"]
    assert_tables_equal(t, got)
    assert got.state_dict_meta()["optimizer"] == t.state_dict_meta()["optimizer"]
    assert got.step == t.step
    target = EmbeddingTable(8, optimizer=optimizer)
    target.lookup(np.arange(10**6, 10**6 + 50))  # stale rows must disappear
    tensorkv.load(target, mem_url, "t")
    assert_tables_equal(t, target)


def test_tables_every_backend(url):
    t = make_table(20000, 16, "adagrad")
    d = {"emb": t, "w": np.arange(12.0).reshape(3, 4)}
    tensorkv.save(d, url, "a", block_rows=512)
    got = tensorkv.load(None, url, "a")
    assert_tables_equal(t, got["emb"])
    assert np.array_equal(got["w"], d["w"])


class Tower(torch.nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.user = make_table(1000, dim, "adagrad", seed=1)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4))
        self.inner = torch.nn.Module()
        self.inner.items = make_table(500, dim, "adam", seed=2, start=10**6)


def test_module_with_tables(mem_url):
    torch.manual_seed(0)
    m = Tower()
    tensorkv.save(m, mem_url, "m")
    info = tensorkv.checkpoint.tag_manifest(mem_url, "m")
    assert set(info["tables"]) == {"user", "inner.items"}
    assert set(info["dense"]) == {"mlp.0.weight", "mlp.0.bias"}
    torch.manual_seed(1)
    m2 = Tower()
    m2.user = EmbeddingTable(8, optimizer="adagrad")
    m2.inner.items = EmbeddingTable(8, optimizer="adam")
    tensorkv.load(m2, mem_url, "m")
    assert_tables_equal(m.user, m2.user)
    assert_tables_equal(m.inner.items, m2.inner.items)
    assert torch.equal(m.mlp[0].weight, m2.mlp[0].weight)
    sub = tensorkv.load(None, mem_url, "m", variables=["inner.items"])
    assert list(sub) == ["inner.items"]


def test_dim_mismatch_leaves_target_unchanged(mem_url):
    tensorkv.save({"emb": make_table(100, 8), "w": np.ones(3)}, mem_url, "t")
    target = {"emb": make_table(50, 4, seed=5), "w": np.zeros(3)}
    before = rows_of(target["emb"])
    with pytest.raises(ShapeError, match="'emb'.*dim 8.*dim 4"):
        tensorkv.load(target, mem_url, "t")
    assert all(np.array_equal(a, b) for a, b in zip(before, rows_of(target["emb"]), strict=True))
    assert not target["w"].any()


def test_optimizer_mismatch_leaves_target_unchanged(mem_url):
    tensorkv.save({"emb": make_table(100, 8, "adam")}, mem_url, "t")
    target = {"emb": make_table(50, 8, "adagrad", seed=5)}
    before = rows_of(target["emb"])
    with pytest.raises(ShapeError, match="16 optimizer slot columns.*adagrad.*8"):
        tensorkv.load(target, mem_url, "t")
    assert all(np.array_equal(a, b) for a, b in zip(before, rows_of(target["emb"]), strict=True))


def test_corrupted_block_names_table(mem_url):
    tensorkv.save({"emb": make_table(2000, 8)}, mem_url, "t", block_rows=64)
    with tensorkv.open_store(mem_url) as store:
        k = next(iter(store.scan(layout.TABLE + b"t/emb/000000/b/", keys_only=True)))
        v = bytearray(store.get(k))
        v[-5] ^= 0xFF
        store.put(k, bytes(v))
    target = {"emb": EmbeddingTable(8, optimizer="adagrad")}
    with pytest.raises(CorruptRecordError, match=r"table 'emb' .*block .*checksum"):
        tensorkv.load(target, mem_url, "t")
    assert len(target["emb"]) == 0


def test_incremental_chain_and_compact(url):
    t = make_table(6000, 8, "adagrad")
    tensorkv.save({"emb": t}, url, "s0", step=0, block_rows=256)
    states = [rows_of(t)]
    rng = np.random.default_rng(0)
    for i in range(1, 4):
        keys = t.keys()
        ch = rng.choice(keys, 60, replace=False)
        t.apply_gradients(ch, rng.standard_normal((60, 8)).astype(np.float32), step=10 + i)
        t.lookup(np.arange(50, dtype=np.int64) + 10**9 * i)  # new keys
        t.remove(rng.choice(np.setdiff1d(keys, ch), 20, replace=False))  # removed keys
        tensorkv.save({"emb": t}, url, f"s{i}", step=i, incremental=True, block_rows=256)
        states.append(rows_of(t))
        info = tensorkv.checkpoint.tag_manifest(url, f"s{i}")["tables"]["emb"]["shards"]["0"]
        assert not info["full"] and info["rows"] == 110 and info["removed"] == 20
    for i, state in enumerate(states):
        got = rows_of(tensorkv.load(None, url, f"s{i}")["emb"])
        assert all(np.array_equal(a, b) for a, b in zip(state, got, strict=True)), i
    # load the chain into an existing table, then continue incrementally from it
    t2 = EmbeddingTable(8, optimizer="adagrad")
    tensorkv.load({"emb": t2}, url, "s3")
    t2.apply_gradients(t2.keys()[:5], np.ones((5, 8), np.float32), step=20)
    tensorkv.save({"emb": t2}, url, "s4", incremental=True)
    assert tensorkv.checkpoint.tag_manifest(url, "s4")["tables"]["emb"]["shards"]["0"]["rows"] == 5
    assert_tables_equal(t2, tensorkv.load(None, url, "s4")["emb"])
    # fold the chain; parents may then go
    tensorkv.compact(url, "s2")
    with pytest.raises(CheckpointError, match="parent of incremental"):
        tensorkv.delete_tag(url, "s0")
    tensorkv.delete_tag(url, "s0", force=True)
    tensorkv.delete_tag(url, "s1")
    got = rows_of(tensorkv.load(None, url, "s3")["emb"])
    assert all(np.array_equal(a, b) for a, b in zip(states[3], got, strict=True))
    assert tensorkv.checkpoint.check(url).ok


def test_incremental_from_another_table_falls_back_to_full(mem_url):
    tensorkv.save({"emb": make_table(500)}, mem_url, "a")
    with pytest.warns(UserWarning, match="did not write or load the parent.*in full"):
        tensorkv.save({"emb": make_table(500, seed=3)}, mem_url, "b", incremental=True)
    info = tensorkv.checkpoint.tag_manifest(mem_url, "b")["tables"]["emb"]["shards"]["0"]
    assert info["full"] and info["rows"] == 500 and "note" in info


@pytest.mark.parametrize("saved,restored", [(1, 3), (4, 2), (3, 3), (2, 5)])
def test_reshard_in_process(mem_url, saved, restored):
    full = make_table(8000, 4, "adagrad")
    keys, vals, slots, freq, ver = rows_of(full)
    owner = tensorkv.checkpoint.layout.shard_of_keys(keys, saved)
    for s in range(saved):
        part = EmbeddingTable(4, optimizer="adagrad")
        m = owner == s
        part.import_([(keys[m], vals[m], slots[m], freq[m], ver[m])])
        tensorkv.save({"emb": part}, mem_url, "x", shard=s, num_shards=saved, block_rows=128)
    seen = []
    for j in range(restored):
        got = tensorkv.load(None, mem_url, "x", shard=j, num_shards=restored)["emb"]
        gk = rows_of(got)
        assert (tensorkv.checkpoint.layout.shard_of_keys(gk[0], restored) == j).all()
        seen.append(gk)
    cat = [np.concatenate([s[i] for s in seen]) for i in range(5)]
    order = np.argsort(cat[0])
    for a, b in zip((keys, vals, slots, freq, ver), cat, strict=True):
        assert a.tobytes() == b[order].tobytes()


def test_splitmix64_reference_values():
    # reference outputs of the splitmix64 finaliser (documented in docs/format.md)
    h = tensorkv.checkpoint.layout.splitmix64(np.array([0, 1, -1], dtype=np.int64))
    assert [hex(int(x)) for x in h] == ["0xe220a8397b1dcdaf", "0x910a2dec89025cc1",
                                        "0xe4d971771b652c20"]
    s = tensorkv.checkpoint.layout.shard_of_keys(np.arange(100000), 7)
    assert s.min() == 0 and s.max() == 6
    assert abs(np.bincount(s).min() - 100000 / 7) < 600


def test_sharded_incremental_chain_reshards(mem_url):
    full = make_table(6000, 4, "adagrad")
    keys, vals, slots, freq, ver = rows_of(full)
    owner = tensorkv.checkpoint.layout.shard_of_keys(keys, 2)
    parts = []
    for s in range(2):
        part = EmbeddingTable(4, optimizer="adagrad")
        m = owner == s
        part.import_([(keys[m], vals[m], slots[m], freq[m], ver[m])])
        tensorkv.save({"emb": part}, mem_url, "s0", shard=s, num_shards=2, block_rows=128)
        parts.append(part)
    for s, part in enumerate(parts):  # each shard trains, then saves its delta
        k = part.keys()[:30]
        part.apply_gradients(k, np.ones((30, 4), np.float32), step=5)
        part.remove(part.keys()[-7:])
        tensorkv.save({"emb": part}, mem_url, "s1", shard=s, num_shards=2, incremental=True)
    info = tensorkv.checkpoint.tag_manifest(mem_url, "s1")["tables"]["emb"]["shards"]
    assert [(i["full"], i["rows"], i["removed"]) for i in info.values()] == [(False, 30, 7)] * 2
    want = [rows_of(p) for p in parts]
    want = [np.concatenate([w[i] for w in want]) for i in range(5)]
    order = np.argsort(want[0])
    for m in (1, 3):
        got = [rows_of(tensorkv.load(None, mem_url, "s1", shard=j, num_shards=m)["emb"])
               for j in range(m)]
        cat = [np.concatenate([g[i] for g in got]) for i in range(5)]
        o2 = np.argsort(cat[0])
        assert all(a[order].tobytes() == b[o2].tobytes() for a, b in zip(want, cat, strict=True))
    tensorkv.compact(mem_url, "s1")  # folds each shard's chain; the trainers can go on
    info = tensorkv.checkpoint.tag_manifest(mem_url, "s1")["tables"]["emb"]["shards"]
    assert sorted(info) == ["0", "1"] and all(i["full"] for i in info.values())
    tensorkv.delete_tag(mem_url, "s0")
    for s, part in enumerate(parts):
        part.apply_gradients(part.keys()[:3], np.ones((3, 4), np.float32), step=6)
        tensorkv.save({"emb": part}, mem_url, "s2", shard=s, num_shards=2, incremental=True)
    info = tensorkv.checkpoint.tag_manifest(mem_url, "s2")["tables"]["emb"]["shards"]
    assert [(i["full"], i["rows"]) for i in info.values()] == [(False, 3)] * 2
    got = rows_of(tensorkv.load(None, mem_url, "s2")["emb"])
    want = [rows_of(p) for p in parts]
    want = [np.concatenate([w[i] for w in want]) for i in range(5)]
    order = np.argsort(want[0])
    assert all(a[order].tobytes() == b.tobytes() for a, b in zip(want, got, strict=True))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "update", "remove", "save"]),
                          st.integers(1, 40), st.integers(0, 10**6)), min_size=1, max_size=12))
def test_incremental_random_histories(ops):
    from tensorkv.stores.memory import MemoryStore

    url = MemoryStore()  # private to this example
    t = make_table(200, 4, "adagrad")
    tensorkv.save({"e": t}, url, "t0")
    expected = {"t0": rows_of(t)}
    rng = np.random.default_rng(0)
    for i, (op, n, seed) in enumerate(ops, 1):
        keys = t.keys()
        if op == "insert":
            t.lookup(np.arange(seed, seed + n, dtype=np.int64))
        elif op == "update" and len(keys):
            k = rng.choice(keys, min(n, len(keys)), replace=False)
            t.apply_gradients(k, rng.standard_normal((len(k), 4)).astype(np.float32), step=i)
        elif op == "remove" and len(keys):
            t.remove(rng.choice(keys, min(n, len(keys)), replace=False))
        tag = f"t{i}"
        tensorkv.save({"e": t}, url, tag, incremental=True, block_rows=16)
        expected[tag] = rows_of(t)
    for tag, want in expected.items():
        got = rows_of(tensorkv.load(None, url, tag)["e"])
        # keys, values, slots, version (freq: see test_lookup_frequency_reaches_incremental)
        for i in (0, 1, 2, 4):
            assert want[i].tobytes() == got[i].tobytes(), (tag, i)


def test_lookup_frequency_reaches_incremental(mem_url):
    t = EmbeddingTable(4)
    t.lookup(np.array([0], np.int64))
    tensorkv.save({"e": t}, mem_url, "a")
    t.lookup(np.array([0], np.int64))  # frequency 1 -> 2, nothing else changes
    tensorkv.save({"e": t}, mem_url, "b", incremental=True)
    assert tensorkv.load(None, mem_url, "b")["e"].frequency(np.array([0]))[0] == 2


def test_capacity_too_small_leaves_target_unchanged(mem_url):
    tensorkv.save({"emb": make_table(500, 4)}, mem_url, "t")
    target = EmbeddingTable(4, optimizer="adagrad", capacity=100, growth=False)
    target.lookup(np.arange(10, dtype=np.int64))
    before = rows_of(target)
    with pytest.raises(MemoryError, match="capacity=100"):
        tensorkv.load({"emb": target}, mem_url, "t")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, rows_of(target), strict=True))
