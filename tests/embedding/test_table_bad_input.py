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
    NonFiniteValueError,
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


def test_nonfinite_upsert_raises_and_writes_nothing(table):
    snap = snapshot(table)
    v = np.ones((4, 4), np.float32)
    v[1, 3] = np.nan
    v[3, 0] = -np.inf
    with pytest.raises(NonFiniteValueError,
                       match=r"upsert: 2 of 4 rows hold NaN or Inf \(first: key 2, row 1\); "
                             "nothing was written.*nan_policy='skip'"):
        table.upsert([1, 2, 100, 3], v)
    with pytest.raises(NonFiniteValueError, match="first: key 7, row 0"):
        table.upsert([7], np.full((1, 4), 1e300))  # finite float64, Inf as float32
    assert_unchanged(table, snap)
    assert 100 not in table  # the unseen key of the batch was not inserted either


def test_nonfinite_upsert_beyond_float16_range_raises():
    t = EmbeddingTable(4, dtype="float16")
    with pytest.raises(NonFiniteValueError, match="1 of 2 rows"):
        t.upsert([1, 2], np.array([[1.0] * 4, [7e4] * 4]))  # 7e4 rounds to Inf in float16
    assert len(t) == 0
    assert t.upsert([1], np.full((1, 4), 6e4)) == 1  # still in range


def test_nonfinite_upsert_skip_writes_the_other_rows():
    t = EmbeddingTable(4, nan_policy="skip")
    t.upsert([1, 2], np.zeros((2, 4)))
    v = np.full((3, 4), 5.0)
    v[1, 2] = np.inf
    assert t.upsert([1, 2, 3], v) == 2
    np.testing.assert_array_equal(t.lookup([1, 2, 3], insert=False), [[5] * 4, [0] * 4, [5] * 4])
    assert t.stats()["nonfinite_skipped"] == 1
    assert t.upsert([9], np.full((1, 4), np.nan)) == 0 and 9 not in t
    assert t.stats()["nonfinite_skipped"] == 2


def chunk_of(table, keys, value=1.0):
    keys = np.asarray(keys, np.int64)
    n, w = keys.size, table.num_slots * table.dim
    return (keys, np.full((n, table.dim), value, np.float32), np.full((n, w), 0.5, np.float32),
            np.arange(n, dtype=np.int64), np.full(n, 3, np.int64))


@pytest.mark.parametrize("field", [1, 2])  # values, optimizer slots
def test_nonfinite_import_raises_per_chunk(table, field):
    good, bad = chunk_of(table, [20, 21]), chunk_of(table, [30, 31, 32])
    bad[field][2, 1] = np.nan
    with pytest.raises(NonFiniteValueError,
                       match=r"import_: 1 of 3 rows.*first: key 32, row 2\); this chunk was "
                             r"not written \(chunks before it were\)"):
        table.import_([good, bad])
    assert table.contains([20, 21, 30, 31, 32]).tolist() == [True, True, False, False, False]


def test_nonfinite_import_skip():
    t = EmbeddingTable(4, optimizer=Adagrad(), nan_policy="skip")
    ch = chunk_of(t, [1, 2, 3])
    ch[2][0, 0] = np.inf
    assert t.import_([ch]) == 2
    assert t.contains([1, 2, 3]).tolist() == [False, True, True]
    assert t.stats()["nonfinite_skipped"] == 1


def test_nonfinite_bulk_import():
    t = EmbeddingTable(4, optimizer=Adagrad())
    t.lookup([99])
    imp = t.bulk_import(5)
    ch = chunk_of(t, [1, 2, 3])
    ch[1][1] = np.nan
    with pytest.raises(NonFiniteValueError, match="bulk import: 1 of 3 rows.*first: key 2"):
        imp.put(0, ch)
    assert t.keys().tolist() == [99]  # the table is untouched

    s = EmbeddingTable(4, optimizer=Adagrad(), nan_policy="skip")
    imp = s.bulk_import(7)
    first = chunk_of(s, [1, 2, 3], value=1.0)
    later = chunk_of(s, [2, 4, 5, 6], value=2.0)
    later[1][0, 0] = np.nan  # key 2's later row: skipped, its earlier row stays
    later[2][2, 3] = -np.inf  # key 5: skipped
    assert imp.put(0, first) == 3 and imp.put(3, later) == 4  # positions used
    imp.index(0, 3)
    imp.index(3, 7)
    imp.commit()
    assert sorted(s.keys().tolist()) == [1, 2, 3, 4, 6]  # no key 0 from the empty positions
    np.testing.assert_array_equal(s.lookup([2, 4], insert=False), [[1.0] * 4, [2.0] * 4])
    assert s.stats()["nonfinite_skipped"] == 2
    s.lookup(np.arange(100, 110))  # the empty positions are free rows
    assert len(s) == 15


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


@pytest.mark.parametrize("kwargs, what", [
    ({"dim": 2**40}, r"dim=1099511627776 with room for \d+ rows"),
    ({"dim": 8, "capacity": 2**50}, r"dim=8 with room for 1125899906842624 rows"),
], ids=["dim", "capacity"])
def test_a_table_larger_than_memory_is_refused_with_the_fix(kwargs, what):
    """Sizes past any address space: never a raw numpy MemoryError."""
    with pytest.raises(CapacityError, match=f"{what} needs .* GiB .*storage_size"):
        EmbeddingTable(**kwargs)
