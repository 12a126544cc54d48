import numpy as np
import pytest
import xxhash

from tensorkv.embedding.arena import RowArena
from tensorkv.errors import CapacityError
from tensorkv.kernels import hashindex as hk
from tensorkv.kernels.hashing import hash_keys

I64 = np.iinfo(np.int64)
EXTREMES = np.array([I64.min, I64.min + 1, -1, 0, 1, I64.max - 1, I64.max], np.int64)


def test_sequential_keys_spread_over_home_slots():
    mask = np.int64(1023)
    homes = np.array([hk.home_slot(np.int64(k), mask) for k in range(20_000)])
    counts = np.bincount(homes, minlength=1024)
    assert counts.min() > 0 and counts.max() < 3 * 20_000 / 1024


def test_insert_find_remove_with_extremes_and_growth():
    a = RowArena(4, 0, capacity=16)
    rng = np.random.default_rng(0)
    keys = np.unique(np.concatenate([EXTREMES, rng.integers(I64.min, I64.max, 50_000,
                                                            dtype=np.int64)]))
    rng.shuffle(keys)
    rows, is_new = a.insert(keys)
    assert is_new.all() and len(a) == keys.size
    assert np.unique(rows).size == keys.size
    assert a.n_slots >= keys.size / a.max_load  # grew across many rehashes
    np.testing.assert_array_equal(a.find(keys), rows)
    # second insert finds every key again
    rows2, is_new2 = a.insert(keys)
    assert not is_new2.any()
    np.testing.assert_array_equal(rows2, rows)
    # absent keys
    absent = np.setdiff1d(rng.integers(I64.min, I64.max, 1000, dtype=np.int64), keys)
    assert (a.find(absent) == -1).all()
    # remove half, the rest stays findable (backward-shift deletion keeps clusters intact)
    gone, kept = keys[::2], keys[1::2]
    freed = a.remove(gone)
    np.testing.assert_array_equal(freed, rows[::2])
    assert (a.find(gone) == -1).all()
    np.testing.assert_array_equal(a.find(kept), rows[1::2])
    assert len(a) == kept.size
    # removed rows are reused, no new capacity needed
    cap, hw = a.capacity, a.high_water
    new_keys = np.setdiff1d(np.arange(gone.size, dtype=np.int64) * 7 + 3, keys)[: gone.size]
    new_rows, is_new = a.insert(new_keys)
    assert is_new.all()
    assert a.capacity == cap and a.high_water == hw
    assert set(new_rows.tolist()) <= set(freed.tolist())
    np.testing.assert_array_equal(a.find(kept), rows[1::2])
    assert sorted(a.keys().tolist()) == sorted(np.concatenate([kept, new_keys]).tolist())


def test_extreme_keys_alone():
    a = RowArena(2, 0, capacity=4)
    rows, is_new = a.insert(EXTREMES)
    assert is_new.all()
    np.testing.assert_array_equal(a.find(EXTREMES), rows)
    assert (a.remove(EXTREMES[[0, -1]]) >= 0).all()
    assert (a.find(EXTREMES[[0, -1]]) == -1).all()
    assert (a.find(EXTREMES[1:-1]) >= 0).all()


def test_duplicates_in_one_insert_get_one_row():
    a = RowArena(2, 0)
    rows, is_new = a.insert(np.array([5, 5, -5, 5, -5], np.int64))
    assert rows[0] == rows[1] == rows[3] and rows[2] == rows[4]
    assert is_new.tolist() == [True, False, True, False, False]
    assert len(a) == 2


def test_remove_absent_and_duplicate_is_harmless():
    a = RowArena(2, 0)
    a.insert(np.array([1, 2, 3], np.int64))
    freed = a.remove(np.array([2, 2, 99], np.int64))
    assert freed[0] >= 0 and freed[1] == -1 and freed[2] == -1
    assert len(a) == 2


def test_random_ops_match_a_dict():
    rng = np.random.default_rng(1)
    a = RowArena(1, 0, capacity=8)
    ref: dict[int, int] = {}
    for _ in range(200):
        keys = rng.integers(-300, 300, rng.integers(1, 64), dtype=np.int64)
        if rng.random() < 0.6:
            rows, _ = a.insert(keys)
            for k, r in zip(keys.tolist(), rows.tolist(), strict=True):
                assert ref.setdefault(k, r) == r
        else:
            a.remove(keys)
            for k in keys.tolist():
                ref.pop(k, None)
        probe = np.arange(-300, 300, dtype=np.int64)
        found = a.find(probe)
        expect = np.array([ref.get(k, -1) for k in probe.tolist()])
        np.testing.assert_array_equal(found, expect)
    assert len(a) == len(ref)


def test_iterate_chunks_and_since():
    a = RowArena(1, 0)
    rows, _ = a.insert(np.arange(1000, dtype=np.int64))
    a.seq[rows] = np.arange(1000)
    got = list(a.iterate(chunk_rows=300))
    assert [g.size for g in got] == [300, 300, 300, 100]
    np.testing.assert_array_equal(np.concatenate(got), np.sort(rows))
    since = np.concatenate(list(a.iterate(chunk_rows=128, since=899)))
    assert since.size == 100


def test_no_growth_raises_capacity_error():
    a = RowArena(2, 0, capacity=10, growth=False)
    a.insert(np.arange(10, dtype=np.int64))
    with pytest.raises(CapacityError, match="capacity=10"):
        a.check_room(1)


def test_probe_length_is_short():
    a = RowArena(1, 0)
    a.insert(np.arange(200_000, dtype=np.int64))
    mean, _ = a.probe_stats()
    assert mean < 2.0


# --- string hashing ------------------------------------------------------------------------
def test_xxh64_known_vectors():
    # published XXH64 vectors (seed 0)
    known = {b"": 0xEF46DB3751D8E999, b"a": 0xD24EC4F1A98C6E5B, b"abc": 0x44BC2CF5AD770999}
    got = hash_keys(list(known)).view(np.uint64)
    assert [int(v) for v in got] == list(known.values())


@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 8, 15, 31, 32, 33, 64, 100, 1000])
def test_xxh64_matches_reference_every_length(n):
    data = bytes(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8))
    for seed in (0, 1, 2**63 + 5):
        got = int(hash_keys([data], seed=seed).view(np.uint64)[0])
        assert got == xxhash.xxh64_intdigest(data, seed=seed)


def test_str_hashes_as_utf8_and_is_stable():
    h = hash_keys(["héllo", b"h\xc3\xa9llo", "user:42"])
    assert h[0] == h[1]
    assert h.dtype == np.int64
    # a fixed value: stable across processes and platforms
    assert int(h[2].view(np.uint64)) == xxhash.xxh64_intdigest(b"user:42")


def test_hash_rejects_non_strings():
    with pytest.raises(TypeError, match="neither str nor bytes"):
        hash_keys(["a", 3])


def test_backward_shift_deletion_across_the_wrap_around():
    a = RowArena(1, 0, capacity=4)  # 16 index slots
    assert a.n_slots == 16
    mask = np.int64(a.n_slots - 1)
    at_end = [k for k in range(5000) if hk.home_slot(np.int64(k), mask) == 15][:3]
    at_zero = [k for k in range(5000) if hk.home_slot(np.int64(k), mask) == 0][:1]
    keys = np.array(at_end + at_zero, np.int64)  # cluster 15, 0, 1, 2 wraps around
    rows, _ = a.insert(keys)
    for victim in range(4):
        b = RowArena(1, 0, capacity=4)
        rows, _ = b.insert(keys)
        b.remove(keys[victim:victim + 1])
        rest = np.delete(np.arange(4), victim)
        np.testing.assert_array_equal(b.find(keys[rest]), rows[rest])
        assert b.find(keys[victim:victim + 1])[0] == -1
        # every remaining key sits no further from home than before
        mean, worst = b.probe_stats()
        assert worst <= 3


@pytest.mark.parametrize("n", [0, 1, 5, 1000, 70_000])
def test_scratch_map_matches_numpy_unique(n):
    """``map_distinct`` (4-byte slots, keys compared in the distinct list) and ``map_find``."""
    rng = np.random.default_rng(n)
    keys = rng.integers(-(2**62), 2**62, max(n // 3, 1))[rng.integers(0, max(n // 3, 1), n)]
    keys[: min(n, 2)] = [np.iinfo(np.int64).min, np.iinfo(np.int64).max][: min(n, 2)]
    tab = np.empty(hk.map_slots(n), np.int32)
    uniq = np.empty(n, np.int64)
    inv = np.empty(n, np.int64)
    u = hk.map_distinct(keys, tab, uniq, inv)
    want, first = np.unique(keys, return_index=True)
    np.testing.assert_array_equal(uniq[:u], keys[np.sort(first)])  # order of first sight
    np.testing.assert_array_equal(uniq[:u][inv], keys)
    q = np.concatenate([keys[::7], rng.integers(2**62, 2**63 - 1, 50)])
    out = np.empty(q.size, np.int64)
    hk.map_find(tab, uniq[:u], q, out)
    hit = out >= 0
    np.testing.assert_array_equal(uniq[out[hit]], q[hit])
    assert np.isin(q[~hit], want, invert=True).all()
    assert hit[: keys[::7].size].all()


def test_parallel_probes_equal_serial_ones():
    """``find_parallel`` / ``find_gather_parallel`` (large lookups) give the serial results."""
    from tensorkv.embedding.arena import probe_parts
    from tensorkv.kernels import arena as ak

    a = RowArena(4, 0, capacity=1024)
    keys = np.arange(0, 60_000, 3, dtype=np.int64)
    rows, _ = a.insert(keys)
    a.values[rows] = np.arange(rows.size * 4, dtype=np.float32).reshape(-1, 4)
    q = np.concatenate([keys[::-2], np.arange(1, 30_000, 3)])  # hits and misses
    assert probe_parts(q.size) > 1 and probe_parts(100) == 1
    want_rows = np.empty(q.size, np.int64)
    hk.index_find(a.index, q, want_rows)
    want = np.full((q.size, 4), -7, np.float32)
    n_miss = ak.find_gather(a.index, q, a.values, want, np.empty(q.size, np.int64))
    for parts in (2, 3):
        got_rows = np.empty(q.size, np.int64)
        ak.find_parallel(a.index, q, got_rows, parts)
        np.testing.assert_array_equal(got_rows, want_rows)
        got = np.full((q.size, 4), -7, np.float32)
        assert ak.find_gather_parallel(a.index, q, a.values, got, got_rows, parts) == n_miss
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got_rows, want_rows)
    np.testing.assert_array_equal(a.find(q), want_rows)
