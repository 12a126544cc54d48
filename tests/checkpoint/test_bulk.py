"""The restore fast path: bulk imports into new row arenas, zero-copy reads from LMDB."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tensorkv
from tensorkv.checkpoint import bulk, layout
from tensorkv.embedding.table import EmbeddingTable
from tensorkv.errors import ConfigError, CorruptRecordError, ShapeError

from .helpers import assert_tables_equal, make_table, rows_of


def _arena_consistent(t: EmbeddingTable) -> None:
    """Every row below the high-water mark is live or on the free list, exactly once."""
    a = t.arena
    hw = a.high_water
    free = []
    r = int(a.state[2])
    while r >= 0:
        free.append(r)
        r = int(a.row_key[r])
    assert len(free) == int(a.state[3]) == len(set(free))
    live = np.flatnonzero(a.live[:hw])
    assert len(live) == len(t)
    assert set(free).isdisjoint(live.tolist()) and len(free) + len(live) == hw
    assert (a.find(a.row_key[live]) == live).all()


def _train(t: EmbeddingTable, seed: int) -> None:
    rng = np.random.default_rng(seed)
    have = np.sort(t.keys())  # (row order differs between tables with the same rows)
    keys = np.concatenate([rng.choice(have, 40), np.arange(7, dtype=np.int64) + 10**12])
    t.lookup(keys)
    t.apply_gradients(keys, rng.standard_normal((len(keys), t.dim)).astype(np.float32))
    t.remove(have[:5])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_lmdb_round_trip_bit_identical(tmp_path, dtype):
    t = EmbeddingTable(8, optimizer="adam", dtype=dtype, seed=3)
    t.lookup(np.arange(3000, dtype=np.int64) * 31 - 7000)
    t.apply_gradients(np.arange(0, 3000, 3, dtype=np.int64) * 31 - 7000,
                      np.ones((1000, 8), np.float32), step=4)
    t.remove(np.arange(10, dtype=np.int64) * 31 - 7000)  # free rows in the source
    url = f"lmdb://{tmp_path}/db"
    dense = np.arange(24.0, dtype=np.float32).reshape(4, 6)
    tensorkv.save({"emb": t, "w": dense}, url, "a", block_rows=128)
    got = tensorkv.load(None, url, "a")
    assert got["w"].tobytes() == dense.tobytes() and got["w"].flags.writeable
    g = got["emb"]
    assert g.dtype == dtype and len(g) == len(t)
    assert_tables_equal(t, g)
    _arena_consistent(g)
    assert g.mutation_seq == t.state_dict_meta()["mutation_seq"] + 1
    # the restored table trains exactly like the original
    _train(t, 1)
    _train(g, 1)
    assert_tables_equal(t, g)
    _arena_consistent(g)


def test_load_into_target_replaces_rows_and_keeps_settings(tmp_path):
    src = make_table(4000, 8, "adagrad")
    url = f"lmdb://{tmp_path}/db"
    tensorkv.save({"emb": src}, url, "a", block_rows=100)
    target = EmbeddingTable(8, optimizer="adagrad", seed=9, capacity=50)
    target.lookup(np.arange(10**6, 10**6 + 300, dtype=np.int64))  # stale rows must go
    seq = target.mutation_seq
    removed = target.stats()["removed"]
    tensorkv.load({"emb": target}, url, "a")
    assert_tables_equal(src, target)
    _arena_consistent(target)
    assert target.mutation_seq > seq and target.stats()["removed"] == removed + 300
    assert target.seed == 9
    # the loaded state is known: an incremental save stores only the rows changed since
    target.apply_gradients(target.keys()[:3], np.ones((3, 8), np.float32))
    tensorkv.save({"emb": target}, url, "b", incremental=True)
    assert tensorkv.checkpoint.tag_manifest(url, "b")["tables"]["emb"]["shards"]["0"]["rows"] == 3
    assert_tables_equal(target, tensorkv.load(None, url, "b")["emb"])
    target.clear()  # back to the table's own initial capacity, not the restored size
    assert target.stats()["capacity"] == 50


def _corrupt_one(url: str, prefix: bytes, at: int = -5) -> None:
    with tensorkv.open_store(url) as store:
        k = next(iter(store.scan(prefix, keys_only=True)))
        v = bytearray(store.get(k))
        v[at] ^= 0xFF
        store.put(k, bytes(v))


@pytest.mark.parametrize("where", ["block", "dense"])
def test_lmdb_corrupted_record_leaves_every_target_unchanged(tmp_path, where):
    url = f"lmdb://{tmp_path}/db"
    d = {"emb": make_table(3000, 8), "w": np.arange(5000.0)}
    tensorkv.save(d, url, "t", block_rows=64)
    _corrupt_one(url, layout.TABLE + b"t/emb/000000/b/" if where == "block" else layout.CHUNK)
    target = {"emb": make_table(500, 8, seed=4), "w": np.zeros(5000)}
    before = rows_of(target["emb"])
    match = r"table 'emb' .*block .*checksum" if where == "block" else r"'w': chunk 0 .*checksum"
    with pytest.raises(CorruptRecordError, match=match):
        tensorkv.load(target, url, "t")
    assert all(a.tobytes() == b.tobytes()
               for a, b in zip(before, rows_of(target["emb"]), strict=True))
    assert not target["w"].any()
    with pytest.raises(CorruptRecordError, match=match):
        tensorkv.load(None, url, "t")


def test_lmdb_missing_and_truncated_blocks(tmp_path):
    url = f"lmdb://{tmp_path}/db"
    tensorkv.save({"emb": make_table(1000, 8)}, url, "t", block_rows=64)
    with tensorkv.open_store(url) as store:
        keys = list(store.scan(layout.TABLE, keys_only=True))
        blocks = [k for k in keys if b"/b/" in k]
        store.put(blocks[0], store.get(blocks[0])[:-8])
        store.delete(blocks[1])
    with pytest.raises(CorruptRecordError, match="truncated|bytes more|missing"):
        tensorkv.load(None, url, "t")


def test_block_with_wrong_row_count_is_refused(mem_url):
    t = make_table(300, 4)
    tensorkv.save({"e": t}, mem_url, "t", block_rows=64)
    with tensorkv.open_store(mem_url) as store:
        keys = [k for k in store.scan(layout.TABLE, keys_only=True) if b"/b/" in k]
        a, b = store.get(keys[0]), store.get(keys[1])
        store.put(keys[0], b)  # a valid block, but not the one the manifest describes
        store.put(keys[1], a)
    with pytest.raises(CorruptRecordError, match="holds .* rows, expected"):
        tensorkv.load(None, mem_url, "t")


def test_resharded_restore_leaves_no_lost_rows(url):
    t = make_table(5000, 4)
    tensorkv.save({"e": t}, url, "t", block_rows=256)
    want = rows_of(t)
    parts = []
    for s in range(3):
        part = EmbeddingTable(4, optimizer="adagrad")
        tensorkv.load({"e": part}, url, "t", shard=s, num_shards=3)
        _arena_consistent(part)  # rows of blocks filtered at shard boundaries are free rows
        assert (layout.shard_of_keys(part.keys(), 3) == s).all()
        parts.append(rows_of(part))
        part.lookup(np.arange(200, dtype=np.int64) + 10**15)  # reuses the free rows
        _arena_consistent(part)
    order = np.argsort(np.concatenate([p[0] for p in parts]))
    for i, w in enumerate(want):
        got = np.concatenate([p[i] for p in parts])[order]
        assert got.tobytes() == w.tobytes()


def test_chain_with_updates_and_removals(tmp_path):
    url = f"lmdb://{tmp_path}/db"
    t = make_table(2000, 4)
    tensorkv.save({"e": t}, url, "s0", block_rows=128)
    rng = np.random.default_rng(5)
    for i in range(1, 4):
        keys = t.keys()
        t.apply_gradients(rng.choice(keys, 100), np.ones((100, 4), np.float32), step=10 + i)
        gone = rng.choice(keys, 30, replace=False)
        t.remove(gone)
        t.lookup(gone[:10])  # removed, then back with a fresh value in the same delta
        tensorkv.save({"e": t}, url, f"s{i}", incremental=True, block_rows=128)
    got = tensorkv.load(None, url, "s3")["e"]
    assert_tables_equal(t, got)
    _arena_consistent(got)


def test_progress_counts_every_byte(tmp_path, monkeypatch):
    import importlib

    load_mod = importlib.import_module("tensorkv.checkpoint.load")

    seen = []

    class Bar:
        def __init__(self, total, desc, progress):
            self.total, self.n = total, 0
            seen.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(load_mod, "bar", Bar)
    url = f"lmdb://{tmp_path}/db"
    tensorkv.save({"e": make_table(2000, 8), "w": np.ones(3000)}, url, "t", block_rows=100)
    tensorkv.load(None, url, "t", progress=True)
    assert seen and seen[0].n == seen[0].total


# ----------------------------------------------------------------------------- BulkImport
def _chunk(keys, dim=4, slots=4, fill=1.0):
    m = len(keys)
    return (np.asarray(keys, np.int64), np.full((m, dim), fill, np.float32),
            np.full((m, slots), fill, np.float32), np.arange(m, dtype=np.int64),
            np.arange(m, dtype=np.int64) + 100)


def test_bulk_import_duplicates_removals_and_gaps():
    t = EmbeddingTable(4, optimizer="adagrad")
    t.lookup(np.array([99], np.int64))
    imp = t.bulk_import(20)
    assert imp.put(0, _chunk([1, 2, 3], fill=1.0)) == 3
    assert imp.put(10, _chunk([2, 4], fill=2.0)) == 2  # positions 3..9 stay free
    assert len(t) == 1 and 99 in t  # nothing visible before commit
    imp.index(0, 3)
    assert imp.remove(np.array([3, 5], np.int64)) == 1
    assert imp.duplicates == 0
    imp.index(10, 12)  # key 2 again: the later row wins
    imp.commit()
    assert imp.duplicates == 1
    assert sorted(t.keys().tolist()) == [1, 2, 4]
    np.testing.assert_array_equal(t[np.array([1, 2, 4])][:, 0], [1.0, 2.0, 2.0])
    np.testing.assert_array_equal(t.frequency(np.array([1, 2, 4])), [0, 0, 1])
    np.testing.assert_array_equal(t.version(np.array([1, 2, 4])), [100, 100, 101])
    _arena_consistent(t)
    t.lookup(np.arange(1000, 1010, dtype=np.int64))  # inserts reuse the free rows
    assert t.stats()["capacity"] == 1024  # the table's initial capacity, no growth
    assert t.arena.high_water == 13  # 9 of the 10 new keys took free rows
    _arena_consistent(t)
    with pytest.raises(ConfigError, match="committed"):
        imp.commit()


def test_bulk_import_dropped_leaves_table_unchanged():
    t = make_table(100, 4)
    before = rows_of(t)
    imp = t.bulk_import(10)
    imp.put(0, _chunk(range(10)))
    imp.index(0, 10)
    del imp
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, rows_of(t), strict=True))


def test_bulk_import_bad_input():
    t = EmbeddingTable(4, optimizer="adagrad")
    imp = t.bulk_import(8)
    with pytest.raises(ShapeError, match="outside the 8 positions"):
        imp.put(6, _chunk(range(3)))
    with pytest.raises(ShapeError, match="dim=4"):
        imp.put(0, _chunk(range(3), dim=5))
    with pytest.raises(ShapeError, match="optimizer 'adagrad' needs"):
        imp.put(0, _chunk(range(3), slots=8))
    k, v, s, f, ver = _chunk(range(3))
    with pytest.raises(ShapeError, match="3 keys but 3 value rows, 2 freq"):
        imp.put(0, (k, v, s, f[:2], ver))
    with pytest.raises(ShapeError, match="dtype int64"):
        imp.put(0, (k, v.astype(np.int64), s, f, ver))
    with pytest.raises(ShapeError, match="ExportChunk"):
        imp.put(0, 5)
    with pytest.raises(ShapeError, match="outside"):
        imp.index(4, 9)
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError):
            t.bulk_import(bad)
    imp.commit()  # nothing was put: an empty table
    assert len(t) == 0
    _arena_consistent(t)


def test_bulk_import_capacity_limit():
    t = EmbeddingTable(4, optimizer="adagrad", capacity=4, growth=False)
    imp = t.bulk_import(6)
    imp.put(0, _chunk(range(6)))
    imp.index(0, 6)
    with pytest.raises(MemoryError, match="capacity=4"):
        imp.commit()
    assert len(t) == 0


def test_bulk_import_refused_for_tiered_tables(tmp_path):
    t = EmbeddingTable(4, storage="DRAM_SSDHASH", storage_path=str(tmp_path / "t"),
                       storage_size=[64 * 1024])
    try:
        assert not t.can_bulk_import
        with pytest.raises(TypeError, match="import_"):
            t.bulk_import(10)
    finally:
        t.close()


def test_bulk_import_puts_from_threads():
    t = EmbeddingTable(8, optimizer="adam")
    n, step = 40_000, 1000
    imp = t.bulk_import(n)
    rng = np.random.default_rng(0)
    keys = rng.permutation(np.arange(n, dtype=np.int64) * 7919 - 10**6)
    vals = rng.standard_normal((n, 8)).astype(np.float32)
    slots = rng.standard_normal((n, 16)).astype(np.float32)

    def put(lo):
        imp.put(lo, (keys[lo:lo + step], vals[lo:lo + step], slots[lo:lo + step],
                     keys[lo:lo + step] % 7, keys[lo:lo + step] % 5))

    threads = [threading.Thread(target=lambda i=i: [put(lo) for lo in range(i * step, n,
                                                                           4 * step)])
               for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    imp.index(0, n)
    imp.commit()
    got = rows_of(t)
    order = np.argsort(keys)
    for a, b in zip(got, (keys, vals, slots, keys % 7, keys % 5), strict=True):
        assert a.tobytes() == np.ascontiguousarray(b[order]).tobytes()


def test_restore_stops_workers_before_raising(tmp_path):
    url = f"lmdb://{tmp_path}/db"
    tensorkv.save({"emb": make_table(3000, 8)}, url, "t", block_rows=32)
    _corrupt_one(url, layout.TABLE + b"t/emb/000000/b/", at=60)
    with pytest.raises(CorruptRecordError):
        tensorkv.load(None, url, "t")
    assert not [th for th in threading.enumerate() if "ckpt-restore" in th.name]
    assert bulk.RESTORE_THREADS >= 2
