import numpy as np
import pytest

from tensorkv.embedding.filters import BloomFilter, CounterFilter, Eviction
from tensorkv.embedding.table import EmbeddingTable
from tensorkv.errors import ConfigError


def _ones(n, dim=4):
    return np.ones((n, dim), np.float32)


# --- admission ----------------------------------------------------------------------------------
def test_counter_filter_admits_after_min_count():
    t = EmbeddingTable(4, admission=CounterFilter(min_count=3), default_value=0.0)
    k = np.array([7, 8], np.int64)
    for _ in range(2):
        out = t.lookup(k)
        np.testing.assert_array_equal(out, 0.0)  # default value before admission
        assert len(t) == 0
        assert t.apply_gradients(k, _ones(2)) == 0  # gradients dropped
    assert t.stats()["admissions_rejected"] == 4
    assert t.stats()["gradients_dropped"] == 4
    t.lookup(k)  # third sighting
    assert len(t) == 2
    assert t.frequency(k).tolist() == [3, 3]  # sightings before admission carried over
    assert t.apply_gradients(k, _ones(2)) == 2


def test_counter_filter_counts_duplicates_within_a_batch():
    t = EmbeddingTable(4, admission=CounterFilter(min_count=2))
    out = t.lookup(np.array([5, 5, 6], np.int64))
    assert t.contains([5, 6]).tolist() == [True, False]
    # every occurrence of an admitted key reads its row
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0], t.lookup([5], insert=False)[0])


def test_not_admitted_key_reads_initial_value_without_default():
    t = EmbeddingTable(4, admission=CounterFilter(min_count=5), initializer="normal", seed=1)
    out = t.lookup([11])
    np.testing.assert_array_equal(out, t.initializer.values(np.array([11]), 4, 1))


def test_counter_filter_forgets_admitted_keys():
    f = CounterFilter(min_count=2)
    keys = np.arange(1000, dtype=np.int64)
    adm, counts = f.observe(keys)
    assert not adm.any() and (counts == 1).all() and len(f) == 1000
    adm, counts = f.observe(keys)
    assert adm.all() and (counts == 2).all()
    f.forget(keys[:500])
    assert len(f) == 500
    assert f.peek(keys[:3]).tolist() == [0, 0, 0]
    assert f.peek(keys[-2:]).tolist() == [2, 2]


def test_bloom_filter_admits_after_min_count():
    t = EmbeddingTable(4, admission=BloomFilter(min_count=2, capacity=10_000, fp_rate=0.001))
    k = np.arange(100, dtype=np.int64)
    t.lookup(k)
    assert len(t) == 0
    t.lookup(k)
    assert len(t) == 100
    assert t.stats()["bytes"] > 0


def test_bloom_never_admits_late():
    f = BloomFilter(min_count=3, capacity=1000, fp_rate=0.01)
    keys = np.arange(1000, dtype=np.int64) * 31
    for _ in range(3):
        adm, est = f.observe(keys)
    assert adm.all() and (est >= 3).all()


@pytest.mark.parametrize("min_count", [1, 2])
def test_bloom_false_positive_rate_matches_formula(min_count):
    cap, p = 20_000, 0.02
    f = BloomFilter(min_count=min_count, capacity=cap, fp_rate=p, seed=5)
    seen = np.random.default_rng(0).integers(0, 2**62, cap, dtype=np.int64)
    for _ in range(min_count):
        f.observe(seen)
    fresh = np.setdiff1d(np.random.default_rng(1).integers(-(2**62), 0, 200_000), seen)
    measured = float((f.peek(fresh) >= min_count).mean())
    expected = f.fp_rate(cap)
    assert expected == pytest.approx(p, rel=0.15)  # sizing hits the target
    assert measured == pytest.approx(expected, rel=0.2, abs=0.002)
    # memory is bounded by the sizing, not by the keys seen
    assert f.nbytes == f.num_counters
    f.observe(np.arange(100_000, dtype=np.int64))
    assert f.nbytes == f.num_counters


def test_bloom_counter_saturation():
    f = BloomFilter(min_count=3, capacity=100, fp_rate=0.01, counter_bits=2)
    k = np.array([1], np.int64)
    for _ in range(10):
        _, est = f.observe(k)
    assert est[0] == 3
    with pytest.raises(ConfigError, match="counter_bits=1 counts only up to 1"):
        BloomFilter(min_count=2, counter_bits=1)


def test_filter_config_round_trip_through_meta():
    for adm in (CounterFilter(4), BloomFilter(3, capacity=500, fp_rate=0.05)):
        t = EmbeddingTable(4, admission=adm, eviction=Eviction(max_rows=10, policy="lru"))
        t2 = EmbeddingTable.from_meta(t.state_dict_meta())
        assert t2.admission.config() == adm.config()
        assert t2.eviction.config() == t.eviction.config()


def test_bad_filter_configs():
    with pytest.raises(ConfigError, match="min_count=0"):
        CounterFilter(0)
    with pytest.raises(ConfigError, match="fp_rate"):
        BloomFilter(2, capacity=10, fp_rate=1.5)
    with pytest.raises(ConfigError, match="policy='mru'"):
        Eviction(max_rows=3, policy="mru")
    with pytest.raises(ConfigError, match="steps_to_live=0"):
        Eviction(steps_to_live=0)
    with pytest.raises(ConfigError, match="unknown admission filter"):
        EmbeddingTable(4, admission={"name": "nope"})


# --- eviction -------------------------------------------------------------------------------------
def test_steps_to_live():
    t = EmbeddingTable(4, eviction=Eviction(steps_to_live=2))
    t.apply_gradients([1, 2, 3], _ones(3), step=1)
    t.apply_gradients([2, 3], _ones(2), step=2)
    t.apply_gradients([3], _ones(1), step=4)
    assert t.version([1, 2, 3]).tolist() == [1, 2, 4]
    assert t.evict() == 1  # key 1: 4 - 1 > 2
    assert sorted(t.keys().tolist()) == [2, 3]
    assert t.stats()["evictions"] == 1


def test_l2_threshold():
    t = EmbeddingTable(2, eviction=Eviction(l2_threshold=1.0))
    t.upsert([1, 2, 3], np.array([[0.1, 0.1], [3, 0], [0.6, 0.8]], np.float32))
    assert t.evict() == 1
    assert sorted(t.keys().tolist()) == [2, 3]


def test_max_rows_lfu_and_lru():
    t = EmbeddingTable(2, eviction=Eviction(max_rows=2, policy="lfu"))
    for ks in ([1, 2, 3], [1, 2], [1]):
        t.lookup(ks)
    assert t.evict() == 1
    assert sorted(t.keys().tolist()) == [1, 2]

    t = EmbeddingTable(2, eviction=Eviction(max_rows=2, policy="lru"))
    t.apply_gradients([1], _ones(1, 2), step=5)
    t.apply_gradients([2], _ones(1, 2), step=3)
    t.apply_gradients([3], _ones(1, 2), step=9)
    assert t.evict() == 1
    assert sorted(t.keys().tolist()) == [1, 3]


def test_every_n_steps_and_reuse_after_eviction():
    t = EmbeddingTable(2, eviction=Eviction(steps_to_live=1, every_n_steps=3))
    t.apply_gradients(np.arange(100), _ones(100, 2))  # step 1
    t.apply_gradients([0], _ones(1, 2))  # step 2
    assert len(t) == 100
    t.apply_gradients([0], _ones(1, 2))  # step 3 -> evict rows older than step 2
    assert t.keys().tolist() == [0]
    cap = t.stats()["capacity"]
    t.lookup(np.arange(1000, 1099))  # freed rows reused
    assert t.stats()["capacity"] == cap
    assert len(t) == 100


def test_evict_without_policy_is_a_no_op():
    t = EmbeddingTable(2)
    t.lookup([1, 2])
    assert t.evict() == 0 and len(t) == 2
