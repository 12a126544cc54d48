"""Shared-memory buffers of the same-node data path (tensorkv.distributed.shm), in-process."""

import os

import numpy as np
import pytest

import tensorkv
from tensorkv.distributed import shm
from tensorkv.distributed.shard import BEHIND, ShardServer
from tensorkv.distributed.table import Split
from tensorkv.kernels import shards as sk


def test_buffers_grow_map_on_the_other_side_and_go_away(tmp_path):
    d = str(tmp_path)
    link = shm.Link(2, d)
    q = link.request[1]
    q.ensure(100)
    first = q.path
    q.array(0, np.int64, (3,))[...] = [4, 5, 6]
    side = shm.Mapped()
    np.testing.assert_array_equal(side.array(shm.descriptor(q, 0, np.int64, (3,))), [4, 5, 6])
    q.ensure(q.size + 1)  # a new, larger file; the shard maps the new one
    assert q.path != first and not os.path.exists(first)
    q.array(8, np.float32, (2, 2))[...] = 1.5
    got = side.array(shm.descriptor(q, 8, np.float32, (2, 2)))
    assert got.shape == (2, 2) and (got == 1.5).all() and len(side.maps) == 1
    link.close()
    assert os.listdir(d) == []


def test_files_of_dead_processes_are_swept(tmp_path):
    dead = tmp_path / "tkv-999999999-x-0q-1"
    alive = tmp_path / f"tkv-{os.getpid()}-x-0q-1"
    other = tmp_path / "other"
    for f in (dead, alive, other):
        f.write_bytes(b"x")
    assert shm.sweep(str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == sorted([alive.name, other.name])
    assert shm.available(str(tmp_path)) and not shm.available(str(tmp_path / "none"))


def test_a_shard_serves_buffers_as_it_serves_arrays(tmp_path):
    link = shm.Link(1, str(tmp_path))
    s, ref = ShardServer("u", 0, 1), tensorkv.EmbeddingTable(4, optimizer="adagrad", seed=2)
    s.create("t", {"dim": 4, "optimizer": "adagrad", "seed": 2})
    q, r = link.request[0], link.reply[0]
    keys = np.array([3, 9, 3, 12])
    sp = Split(keys, 1)
    kc = np.stack([sp.uniq, sp.counts])
    q.ensure(kc.nbytes)
    q.array(0, np.int64, kc.shape)[...] = kc
    r.ensure(kc.shape[1] * 16)
    rows, ck, delta, _ = s.pull_shm("t", "w", 1, shm.descriptor(q, 0, np.int64, kc.shape),
                                    shm.descriptor(r, 0, np.float32, (3, 4)), True)
    assert rows == shm.Rows(3, 4) and ck == 0 and delta > 0
    want = ref.lookup(keys)
    np.testing.assert_array_equal(r.array(0, np.float32, (3, 4))[sp.inverse], want)
    g = np.arange(12, dtype=np.float32).reshape(3, 4)
    q.ensure(64 + g.nbytes)
    q.array(0, np.int64, (3,))[...] = sp.uniq
    q.array(64, np.float32, g.shape)[...] = g
    out = s.push_shm("t", "w", 2, shm.descriptor(q, 0, np.int64, (3,)),
                     shm.descriptor(q, 64, np.float32, g.shape), None, False)
    assert out[0] == (3, 1)
    ref.apply_gradients(sp.uniq, g)
    np.testing.assert_array_equal(s.tables["t"].lookup(sp.uniq, insert=False),
                                  ref.lookup(sp.uniq, insert=False))
    # a retry is not applied again; a gap is noticed; a buffer not here is said so
    assert s.push_shm("t", "w", 2, shm.descriptor(q, 0, np.int64, (3,)),
                      shm.descriptor(q, 64, np.float32, g.shape), None)[0] == (0, 1)
    assert s.pull_shm("t", "w", 5, shm.descriptor(q, 0, np.int64, kc.shape),
                      shm.descriptor(r, 0, np.float32, (3, 4)), True) == BEHIND
    gone = (str(tmp_path / "tkv-1-gone-0q-1"), 4096, 0, "<i8", (2, 1))
    assert s.pull_shm("t", "w", 3, gone, gone, True) == shm.NO_SHM
    assert s.push_shm("t", "w", 3, gone, gone, None) == shm.NO_SHM
    assert s.applied_seq("w") == (2, 0)
    link.close()


def test_rows_scatter_straight_into_batch_order():
    keys = np.array([7, 1, 7, 30, 1, 2])
    sp = Split(keys, 3)
    urows = np.arange(sp.uniq.shape[0] * 2, dtype=np.float32).reshape(-1, 2)
    out = np.empty((keys.size, 2), np.float32)
    for s in range(3):
        lo, hi = int(sp.bounds[s]), int(sp.bounds[s + 1])
        sk.gather_part(urows[sp.order][lo:hi], sp.dest, lo, hi, out)
    np.testing.assert_array_equal(out, urows[sp.inverse])


def test_split_by_shard_matches_the_checkpoint_hash_ranges():
    from tensorkv.checkpoint.layout import shard_of_keys

    rng = np.random.default_rng(0)
    keys = np.concatenate([rng.integers(-2**63, 2**63 - 1, 3000, dtype=np.int64),
                           np.array([0, -1, 2**63 - 1, -2**63]), np.arange(50)])
    batch = np.concatenate([keys, keys[::3]])
    for n in (1, 2, 3, 7, 100):
        sp = Split(batch, n)
        sid = shard_of_keys(sp.uniq, n)
        want = np.argsort(sid, kind="stable")
        np.testing.assert_array_equal(sp.order, want)
        np.testing.assert_array_equal(sp.bounds, np.searchsorted(sid[want], np.arange(n + 1)))
        np.testing.assert_array_equal(sp.counts, np.bincount(sp.inverse))
        rank = np.empty_like(want)
        rank[want] = np.arange(want.size)
        np.testing.assert_array_equal(sp.dest, rank[sp.inverse])
    empty = Split(np.empty(0, np.int64), 2)
    assert empty.bounds.tolist() == [0, 0, 0] and empty.dest.size == 0


def test_arrays_inside_a_buffer_are_found_by_address(tmp_path):
    b = shm.Buffer(str(tmp_path), "x")
    assert b.offset_of(np.zeros(3)) == -1  # not mapped yet
    b.ensure(1 << 20)
    a = b.array(128, np.float32, (4, 4))
    assert b.offset_of(a) == 128 and b.offset_of(a[1:]) == 128 + 16
    assert b.offset_of(a[:, :2]) == -1  # not contiguous
    assert b.offset_of(np.zeros(4)) == -1
    b.close()


def test_repeated_keys_are_looked_up_once_each_then_counted_again():
    """Rows per key come first in the room given; counters match the single-process table."""
    s = ShardServer("u", 0, 1)
    s.create("t", {"dim": 4, "optimizer": "sgd", "initializer": "normal", "seed": 1})
    ref = tensorkv.EmbeddingTable(4, optimizer="sgd", initializer="normal", seed=1)
    for seq, (counts, room) in enumerate((([1, 3, 2], 6), ([2, 2, 2], 3), ([1, 2, 1], 0)), 1):
        k = np.array([4, 5, 6]) + seq
        out = np.empty((room, 4), np.float32) if room else None
        rows, *_ = s.pull("t", "w", seq, np.stack([k, counts]), True, out=out)
        want = ref.lookup(np.repeat(k, counts))[np.cumsum([0, *counts[:-1]])]
        np.testing.assert_array_equal(rows, want)
        if out is not None:
            np.testing.assert_array_equal(out[:3], want)
        np.testing.assert_array_equal(s.tables["t"].frequency(k), ref.frequency(k))
    assert_same = s.tables["t"].stats()
    assert (assert_same["hits"], assert_same["misses"], assert_same["inserts"]) == \
        (ref.stats()["hits"], ref.stats()["misses"], ref.stats()["inserts"])
    assert s.tables["t"].mutation_seq == ref.mutation_seq


def test_a_shard_unmaps_the_buffers_of_clients_gone(tmp_path):
    side = shm.Mapped()
    links = [shm.Link(1, str(tmp_path)) for _ in range(2)]
    for link in links:
        link.request[0].ensure(64)
        side.array(shm.descriptor(link.request[0], 0, np.int64, (2,)))
    assert len(side.maps) == 2
    links[0].close()
    third = shm.Link(1, str(tmp_path))
    third.request[0].ensure(64)
    side.array(shm.descriptor(third.request[0], 0, np.int64, (2,)))
    assert len(side.maps) == 2  # the first client's buffer is unmapped
    links[1].close()
    third.close()


def test_only_the_process_that_made_the_buffers_removes_them(tmp_path):
    link = shm.Link(1, str(tmp_path))
    link.request[0].ensure(64)
    shm._close_all(os.getpid() + 1, link.request)  # as a forked child collecting its copy
    assert os.path.exists(link.request[0].path)
    link.close()
    assert os.listdir(tmp_path) == []


def test_with_an_admission_filter_sightings_are_looked_up_grouped_by_key():
    """The grouped lookup of every sighting; rows per key unless sightings read apart."""
    from tensorkv.embedding.filters import CounterFilter

    spec = {"dim": 4, "optimizer": "sgd", "initializer": "normal", "seed": 2}
    s = ShardServer("u", 0, 1)
    s.create("t", {**spec, "admission": CounterFilter(min_count=2), "default_value": 0.0})
    ref = tensorkv.EmbeddingTable(4, optimizer="sgd", initializer="normal", seed=2,
                                  admission=CounterFilter(min_count=2), default_value=0.0)
    k, counts = np.array([1, 2, 3]), np.array([1, 3, 2])
    want = ref.lookup(np.repeat(k, counts))
    out = np.empty((6, 4), np.float32)
    rows, *_ = s.pull("t", "w", 1, np.stack([k, counts]), True, out=out)
    first = np.cumsum([0, *counts[:-1]])
    np.testing.assert_array_equal(rows, want if rows.shape[0] == 6 else want[first])
    k2 = np.array([2, 3])
    rows, *_ = s.pull("t", "w", 2, np.stack([k2, [2, 2]]), True, out=out)
    np.testing.assert_array_equal(rows, ref.lookup(np.repeat(k2, 2))[[0, 2]])
    np.testing.assert_array_equal(s.tables["t"].frequency(k), ref.frequency(k))


def test_a_full_dev_shm_is_an_error_at_once_not_a_crash_later(tmp_path, monkeypatch):
    def full(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    b = shm.Buffer(str(tmp_path), "x")
    with pytest.raises(OSError, match="No space"):
        b.ensure(1 << 20)
    assert b.size == 0 and os.listdir(tmp_path) == []
