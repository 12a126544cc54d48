import statistics

import numpy as np
import pytest

from tensorkv.embedding.initializers import (
    Constant,
    Normal,
    TruncatedNormal,
    Uniform,
    Zeros,
    get_initializer,
)
from tensorkv.embedding.table import EmbeddingTable
from tensorkv.errors import ConfigError
from tensorkv.kernels.initializers import norm_ppf

KEYS = np.array([0, 1, -1, 2**62, -(2**63), 2**63 - 1, 12345], np.int64)


@pytest.mark.parametrize("init", [Normal(std=0.1), TruncatedNormal(std=0.1), Uniform(-1, 1)])
def test_value_is_a_pure_function_of_seed_key_column(init):
    a = init.values(KEYS, 16, seed=7)
    # different order, batch composition and width give the same columns
    perm = np.random.default_rng(0).permutation(KEYS.size)
    b = init.values(KEYS[perm], 16, seed=7)
    np.testing.assert_array_equal(a[perm], b)
    c = init.values(np.concatenate([KEYS, np.arange(1000)]), 16, seed=7)[: KEYS.size]
    np.testing.assert_array_equal(a, c)
    wide = init.values(KEYS, 32, seed=7)
    np.testing.assert_array_equal(wide[:, :16], a)
    # seed matters, keys differ from each other
    assert not np.array_equal(init.values(KEYS, 16, seed=8), a)
    assert np.unique(a[:, 0]).size == KEYS.size


def test_table_rows_identical_across_tables_batches_and_orders():
    t1 = EmbeddingTable(8, initializer="normal", seed=3)
    t2 = EmbeddingTable(8, initializer="normal", seed=3)
    ks = np.arange(-500, 500, dtype=np.int64)
    for chunk in np.array_split(ks, 7):
        t1.lookup(chunk)
    t2.lookup(ks[::-1])
    t2.lookup(ks[:10])
    np.testing.assert_array_equal(t1.lookup(ks, insert=False), t2.lookup(ks, insert=False))
    # and equal to the initializer's pure function
    np.testing.assert_array_equal(t1.lookup(ks), Normal().values(ks, 8, 3))


def test_distributions():
    keys = np.arange(20_000, dtype=np.int64)
    n = Normal(mean=1.0, std=2.0).values(keys, 16, 0).astype(np.float64)
    assert abs(n.mean() - 1.0) < 0.05 and abs(n.std() - 2.0) < 0.05
    t = TruncatedNormal(std=1.0).values(keys, 16, 0).astype(np.float64)
    assert np.abs(t).max() <= 2.0
    # std of a standard normal truncated at +-2 sigma
    assert abs(t.std() - 0.8796) < 0.01
    u = Uniform(-3, 5).values(keys, 16, 0)
    assert u.min() >= -3 and u.max() < 5 and abs(u.mean() - 1.0) < 0.05
    # columns are uncorrelated
    assert abs(np.corrcoef(n[:, 0], n[:, 1])[0, 1]) < 0.05


def test_norm_ppf_matches_statistics_normaldist():
    nd = statistics.NormalDist()
    for p in np.concatenate([np.linspace(1e-9, 1 - 1e-9, 2001), [1e-300, 1e-20, 0.5]]):
        assert norm_ppf(p) == pytest.approx(nd.inv_cdf(float(p)), rel=1e-12, abs=1e-15)


def test_constant_and_zeros():
    np.testing.assert_array_equal(Constant(0.5).values(KEYS, 4, 0), np.full((7, 4), 0.5))
    np.testing.assert_array_equal(Zeros().values(KEYS, 4, 0), np.zeros((7, 4)))


def test_get_initializer_and_config_round_trip():
    for init in (Zeros(), Constant(2.0), Uniform(-1, 2), Normal(0.5, 0.1), TruncatedNormal()):
        again = get_initializer(init.config())
        assert again == init and type(again) is type(init)
    assert isinstance(get_initializer("normal", std=0.3), Normal)
    assert get_initializer("normal", std=0.3).std == 0.3
    assert isinstance(get_initializer(None), TruncatedNormal)


def test_bad_initializer_specs():
    with pytest.raises(ConfigError, match="unknown initializer 'gauss'"):
        get_initializer("gauss")
    with pytest.raises(ConfigError, match="high must exceed low"):
        Uniform(1, 1)
    with pytest.raises(ConfigError, match="std"):
        Normal(std=-1)
    with pytest.raises(ConfigError, match="initializer 'normal'"):
        get_initializer("normal", sigma=1)


@pytest.mark.parametrize("name", ["normal", "truncated_normal", "uniform"])
def test_large_batches_on_threads_equal_the_serial_kernel(name):
    """Batches big enough for numba's threads give the serial kernel's values bit for bit."""
    from tensorkv.kernels import initializers as ik

    init = get_initializer(name)
    keys = np.random.default_rng(4).integers(-(2**62), 2**62, 30_000)
    rows = np.arange(keys.size, dtype=np.int64)[::-1].copy()
    out = np.zeros((keys.size, 16), np.float32)
    init.fill(out, rows, keys, 11)
    ref = np.zeros_like(out)
    seed = np.uint64(11)
    if name == "uniform":
        ik.init_uniform(ref, rows, keys, seed, init.low, init.high)
    else:
        ik.init_normal(ref, rows, keys, seed, init.mean, init.std, name == "truncated_normal")
    np.testing.assert_array_equal(out, ref)
