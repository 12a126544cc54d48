"""Victim selection and the offline LRU simulator."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from tensorkv.kernels.cache import lru_hit_ratio, lru_hits, select_victims


def reference_lru(keys, capacity):
    cache: OrderedDict[int, None] = OrderedDict()
    hits = []
    for k in keys.tolist():
        if k in cache:
            cache.move_to_end(k)
            hits.append(True)
        else:
            hits.append(False)
            cache[k] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return np.array(hits, bool)


@pytest.mark.parametrize("capacity", [1, 2, 7, 50, 1000])
def test_lru_simulator_matches_reference(capacity):
    rng = np.random.default_rng(capacity)
    keys = (rng.zipf(1.3, 5000) % 300).astype(np.int64) * 7919 - 10**12
    np.testing.assert_array_equal(lru_hits(keys, capacity), reference_lru(keys, capacity))
    assert lru_hit_ratio(keys, capacity) == pytest.approx(reference_lru(keys, capacity).mean())


def test_lru_simulator_edges():
    assert lru_hits(np.empty(0, np.int64), 3).size == 0
    assert lru_hit_ratio([], 3) == 0.0
    with pytest.raises(ValueError, match="capacity=0"):
        lru_hits(np.arange(3), 0)


def test_select_victims_lru_and_lfu():
    live = np.array([1, 1, 0, 1, 1, 1], np.uint8)
    tick = np.array([5, 1, 0, 3, 9, 2], np.int64)
    freq = np.array([1, 9, 0, 2, 0, 7], np.int64)
    # row 4 has the current tick: protected; row 2 is not live
    assert sorted(select_victims(live, tick, freq, 6, 9, 2, "lru").tolist()) == [1, 5]
    assert sorted(select_victims(live, tick, freq, 6, 9, 2, "lfu").tolist()) == [0, 3]
    assert sorted(select_victims(live, tick, freq, 6, 9, 10, "lru").tolist()) == [0, 1, 3, 5]
    assert select_victims(live, tick, freq, 6, 9, 0, "lru").size == 0
    # LFU ties broken by age
    freq2 = np.ones(6, np.int64)
    assert sorted(select_victims(live, tick, freq2, 6, 9, 2, "lfu").tolist()) == [1, 5]


@pytest.mark.parametrize("seed", range(5))
def test_lru_selection_matches_a_sort(seed):
    rng = np.random.default_rng(seed)
    hw = 2000
    live = (rng.random(hw) < 0.8).astype(np.uint8)
    tick = rng.integers(0, 50, hw).astype(np.int64)
    freq = rng.integers(0, 9, hw).astype(np.int64)
    cur = 49
    cand = np.flatnonzero(live.astype(bool) & (tick != cur))
    for n in (1, 10, 300, cand.size - 1, cand.size, cand.size + 5):
        got = select_victims(live, tick, freq, hw, cur, n, "lru")
        assert got.size == min(n, cand.size) == np.unique(got).size
        assert set(got.tolist()) <= set(cand.tolist())
        # every chosen row is at least as old as every row left behind
        left = np.setdiff1d(cand, got)
        if got.size and left.size:
            assert tick[got].max() <= tick[left].min()


def test_recency_log_takes_least_recently_used_rows_exactly():
    """The log gives the rows in exact LRU order (ties: touch order), never a protected one."""
    from tensorkv.kernels.cache import RecencyLog

    rng = np.random.default_rng(3)
    n_rows = 200
    live = np.zeros(n_rows, np.uint8)
    tick = np.zeros(n_rows, np.int64)
    log = RecencyLog(capacity=16)  # tiny: forces many compactions and growths
    order: OrderedDict[int, None] = OrderedDict()  # reference: least recent first
    for cur in range(1, 400):
        new = rng.choice(n_rows, rng.integers(0, 6), replace=False)
        live[new] = 1
        batch = rng.choice(np.flatnonzero(live), rng.integers(0, 30)) if live.any() else []
        batch = np.concatenate([np.asarray(batch, np.int64), new.astype(np.int64), [-1]])
        log.touch(live, tick, batch, cur)
        seen = set()
        for r in batch.tolist():  # a batch is one tick: its rows rank by first touch
            if r >= 0 and r not in seen:
                seen.add(r)
                order.pop(r, None)
                order[r] = None
        want = int(rng.integers(0, 8))
        protect = cur if rng.random() < 0.8 else -1
        expect = [r for r in order if r not in seen or protect < 0][:want]
        got = log.take(live, tick, want, protect)
        assert got.tolist() == expect
        for r in got.tolist():
            live[r] = 0
            del order[r]
        gone = rng.choice(np.flatnonzero(live), min(2, int(live.sum())), replace=False) \
            if rng.random() < 0.2 and live.any() else []
        for r in np.asarray(gone, np.int64).tolist():  # removed by other means
            live[r] = 0
            del order[r]
    assert len(log) <= 4 * n_rows + 64


def test_arena_detach_attach_and_free_rows():
    from tensorkv.embedding.arena import RowArena

    a = RowArena(2, 0, capacity=8)
    rows, _ = a.insert(np.array([10, 11, 12], np.int64))
    a.values[rows] = [[1, 1], [2, 2], [3, 3]]
    held = a.detach(np.array([11, 99], np.int64))
    assert held.tolist() == [rows[1], -1]
    assert len(a) == 2 and a.find(np.array([11], np.int64))[0] == -1
    new, _ = a.insert(np.array([13], np.int64))  # a held row is never handed out
    assert new[0] not in rows.tolist()
    a.attach(np.array([11], np.int64), held[:1])  # back, with its data
    r = a.find(np.array([11], np.int64))[0]
    assert r == rows[1] and a.values[r].tolist() == [2, 2] and len(a) == 4
    held = a.detach(np.array([12], np.int64))
    a.free_rows(held)
    again, _ = a.insert(np.array([14], np.int64))  # the freed row is reused
    assert again[0] == held[0]
    assert sorted(a.keys().tolist()) == [10, 11, 13, 14]
