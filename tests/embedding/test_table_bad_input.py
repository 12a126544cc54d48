import numpy as np
import pytest

from tensorkv.embedding.optimizers import Adagrad
from tensorkv.embedding.table import EmbeddingTable
from tensorkv.errors import (
    CapacityError,
    ConfigError,
    KeyRangeError,
    KeyTypeError,
    NonFiniteGradientError,
    ShapeError,
)


@pytest.fixture
def table():
    t = EmbeddingTable(4, optimizer=Adagrad(lr=0.1), seed=3)
    t.lookup(np.arange(10))
    t.apply_gradients(np.arange(10), np.ones((10, 4)))
    return t


def snapshot(t):
    ch = list(t.export(chunk_rows=10**6))
    return t.mutation_seq, t.step, [np.asarray(x).copy() for x in ch[0]] if ch else []


def assert_unchanged(t, snap):
    now = snapshot(t)
    assert now[0] == snap[0] and now[1] == snap[1]
    for a, b in zip(now[2], snap[2], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "keys, error, match",
    [
        (np.array([1.0, 2.0]), ShapeError, "dtype float64"),
        (np.array([[1, 2], [3, 4]]), ShapeError, r"shape \(2, 2\)"),
        (np.array([True, False]), ShapeError, "dtype bool"),
        (7, ShapeError, "single key"),
        ("abc", ShapeError, "single key"),
        # a mix of int and str keys: refused, not hashed as the strings "1", "a"
        ([1, "a"], KeyTypeError, r"mix types int and str .*key 'a' at position 1"),
        (["a", 1], KeyTypeError, r"mix types int and str .*key 1 at position 1"),
        ((b"x", 2), KeyTypeError, "mix types bytes and int"),
        (np.array([1, "a"], dtype=object), KeyTypeError, "mix types int and str"),
        (np.array([True, 1], dtype=object), KeyTypeError, "mix types bool and int"),
        # keys outside int64: refused, not wrapped onto negative keys
        (np.array([3, 2**63, 2**64 - 1], np.uint64), KeyRangeError,
         r"key 9223372036854775808 \(position 1; 2 of 3 keys\).*view\(np.int64\)"),
        ([2**63], KeyRangeError, r"key 9223372036854775808 \(position 0.*view\(np.int64\)"),
        ([-1, 2**63], KeyRangeError, r"key 9223372036854775808 \(position 1; 1 of 2"),
        ([5, 2**64], KeyRangeError, r"key 18446744073709551616 \(position 1.*remap"),
        ([-(2**63) - 1], KeyRangeError, r"key -9223372036854775809 \(position 0"),
    ],
)
def test_bad_keys(table, keys, error, match):
    snap = snapshot(table)
    n = 2 if isinstance(keys, (int, str)) else len(keys)
    for call in (lambda: table.lookup(keys), lambda: table.contains(keys),
                 lambda: table.remove(keys), lambda: table.apply_gradients(keys, np.ones((n, 4))),
                 lambda: table.upsert(keys, np.ones((n, 4))), lambda: table.frequency(keys)):
        with pytest.raises(error, match=match):
            call()
    assert_unchanged(table, snap)


def test_good_keys_of_every_accepted_kind(table):
    big = np.array([2**63 - 1, 5], np.uint64)  # uint64 below 2**63: the same int64 keys
    np.testing.assert_array_equal(table.as_keys(big), [2**63 - 1, 5])
    ids = np.array([2**63, 2**64 - 1], np.uint64)  # the documented bit-pattern rule
    np.testing.assert_array_equal(table.as_keys(ids.view(np.int64)), [-(2**63), -1])
    assert table.as_keys([-(2**63), 2**63 - 1]).tolist() == [-(2**63), 2**63 - 1]
    s = table.as_keys(["a", b"a", np.str_("b")])
    assert s[0] == s[1] != s[2]  # str/bytes keys still hash (UTF-8 bytes)
    np.testing.assert_array_equal(table.as_keys(np.array(["a", "b"])), table.as_keys(["a", "b"]))
    assert table.as_keys(["1"])[0] != 1  # a string key is never its integer


@pytest.mark.parametrize(
    "grads, match",
    [
        (np.ones((3, 5)), r"shape \(3, 5\).*\(3, 4\)"),
        (np.ones((2, 4)), r"shape \(2, 4\).*\(3, 4\)"),
        (np.ones(12), r"shape \(12,\)"),
        (np.ones((3, 4), dtype=np.int64), "dtype int64"),
        (np.array([["a"] * 4] * 3), "dtype <U1"),
    ],
)
def test_bad_gradients(table, grads, match):
    snap = snapshot(table)
    with pytest.raises(ShapeError, match=match):
        table.apply_gradients([1, 2, 3], grads)
    assert_unchanged(table, snap)


def test_nonfinite_gradients_raise_and_change_nothing(table):
    snap = snapshot(table)
    g = np.ones((3, 4), np.float32)
    g[1, 2] = np.nan
    g[2, 0] = np.inf
    with pytest.raises(NonFiniteGradientError, match=r"gradients for 2 keys.*\[2, 100\]"):
        table.apply_gradients([1, 2, 100], g)
    assert_unchanged(table, snap)
    assert 100 not in table  # the unseen key was not inserted either


def test_import_dim_mismatch(table):
    other = EmbeddingTable(8, optimizer=Adagrad())
    other.lookup([1, 2])
    snap = snapshot(table)
    with pytest.raises(ShapeError, match=r"dim 8.*dim=4"):
        table.import_(other.export())
    assert_unchanged(table, snap)
    sgd = EmbeddingTable(4)
    sgd.lookup([1])
    with pytest.raises(ShapeError, match="optimizer 'adagrad' needs"):
        table.import_(sgd.export())
    with pytest.raises(ShapeError, match="ExportChunk"):
        table.import_([5])
    assert_unchanged(table, snap)


@pytest.mark.parametrize("dim", [0, -3, 2.5, True])
def test_bad_dim(dim):
    with pytest.raises(ShapeError, match=f"dim={dim!r}"):
        EmbeddingTable(dim)


def test_bad_options():
    with pytest.raises(ConfigError, match="nan_policy='ignore'"):
        EmbeddingTable(4, nan_policy="ignore")
    with pytest.raises(ConfigError, match="growth=False needs capacity"):
        EmbeddingTable(4, growth=False)
    with pytest.raises(ConfigError, match="dtype='int8'"):
        EmbeddingTable(4, dtype="int8")
    with pytest.raises(ShapeError, match="default_value"):
        EmbeddingTable(4, default_value=[1, 2])
    with pytest.raises(ConfigError, match="chunk_rows=0"):
        list(EmbeddingTable(4).export(chunk_rows=0))


def test_capacity_overflow_without_growth():
    t = EmbeddingTable(4, capacity=8, growth=False)
    t.lookup(np.arange(6))
    snap = snapshot(t)
    with pytest.raises(CapacityError, match=r"capacity=8.*3 new keys would need 9 rows"):
        t.lookup(np.arange(3, 9))
    assert_unchanged(t, snap)
    with pytest.raises(CapacityError, match="capacity=8"):
        t.upsert(np.arange(20, 23), np.zeros((3, 4)))
    with pytest.raises(CapacityError, match="capacity=8"):
        t.apply_gradients(np.arange(20, 23), np.zeros((3, 4)))
    assert_unchanged(t, snap)
    t.lookup([6, 7, 6])  # exactly fills it
    assert len(t) == 8


def test_upsert_bad_values(table):
    snap = snapshot(table)
    with pytest.raises(ShapeError, match=r"shape \(2, 3\)"):
        table.upsert([1, 2], np.zeros((2, 3)))
    assert_unchanged(table, snap)


def test_bad_step(table):
    with pytest.raises(ConfigError, match="step='3'"):
        table.apply_gradients([1], np.ones((1, 4)), step="3")
