import json

import numpy as np
import pytest

import tensorkv
from tensorkv.embedding.optimizers import SGD, Adagrad
from tensorkv.embedding.table import EmbeddingTable, ExportChunk
from tensorkv.errors import CapacityError, ConfigError

I64 = np.iinfo(np.int64)


def test_lookup_inserts_and_is_stable():
    t = EmbeddingTable(8, seed=1)
    k = np.array([3, -4, I64.min, I64.max], np.int64)
    a = t.lookup(k)
    assert a.shape == (4, 8) and a.dtype == np.float32
    assert len(t) == 4
    np.testing.assert_array_equal(t.lookup(k[::-1]), a[::-1])
    assert t.contains(np.array([3, 5])).tolist() == [True, False]
    assert 3 in t and 5 not in t
    s = t.stats()
    assert s["rows"] == 4 and s["inserts"] == 4 and s["hits"] == 4 and s["misses"] == 4


def test_lookup_without_insert():
    t = EmbeddingTable(4, initializer="uniform", seed=2)
    out = t.lookup([10, 11], insert=False)
    assert len(t) == 0
    np.testing.assert_array_equal(out, t.initializer.values(np.array([10, 11]), 4, 2))
    t2 = EmbeddingTable(4, default_value=[1, 2, 3, 4])
    np.testing.assert_array_equal(t2[[7]], [[1, 2, 3, 4]])
    assert len(t2) == 0
    # insert=False counts no sighting
    t.lookup([10])
    t.lookup([10], insert=False)
    assert t.frequency([10, 11]).tolist() == [1, 0]


def test_duplicate_gradients_are_summed_like_numpy():
    dim = 5
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 50, 400)
    grads = rng.standard_normal((400, dim)).astype(np.float32)
    t = EmbeddingTable(dim, optimizer=SGD(lr=1.0), initializer="zeros")
    uniq = np.unique(keys)
    t.lookup(uniq)
    n = t.apply_gradients(keys, grads)
    assert n == uniq.size
    ref = np.zeros((50, dim), np.float32)
    np.add.at(ref, keys, grads)  # sequential accumulation in input order
    np.testing.assert_array_equal(t.lookup(uniq, insert=False), -ref[uniq])
    # untouched rows unchanged
    t.lookup([1000])
    before = t.lookup([1000], insert=False)
    t.apply_gradients(keys, grads)
    np.testing.assert_array_equal(t.lookup([1000], insert=False), before)


def test_apply_gradients_inserts_unseen_keys_and_counts_steps():
    t = EmbeddingTable(2, optimizer=SGD(lr=0.5), initializer="zeros")
    t.apply_gradients([1, 2], np.ones((2, 2)))
    assert t.step == 1 and len(t) == 2
    t.apply_gradients([1], np.ones((1, 2)), step=10)
    assert t.step == 10
    assert t.version([1, 2, 3]).tolist() == [10, 1, -1]
    np.testing.assert_array_equal(t.lookup([1, 2], insert=False), [[-1, -1], [-0.5, -0.5]])


def test_upsert_remove_clear_keys():
    t = EmbeddingTable(3, optimizer="adagrad")
    vals = np.arange(12, dtype=np.float32).reshape(4, 3)
    t.upsert([1, 2, 3, 1], vals)  # later duplicate wins
    np.testing.assert_array_equal(t.lookup([1, 2, 3], insert=False), vals[[3, 1, 2]])
    assert sorted(t.keys().tolist()) == [1, 2, 3]
    assert t.remove([2, 99]) == 1
    assert sorted(t.keys().tolist()) == [1, 3]
    assert t.contains([2]).tolist() == [False]
    t.clear()
    assert len(t) == 0 and t.keys().size == 0
    t.lookup([5])
    assert len(t) == 1


def test_mutation_seq_and_incremental_export():
    t = EmbeddingTable(2, optimizer="adagrad")
    s0 = t.mutation_seq
    t.lookup(np.arange(10))
    s1 = t.mutation_seq
    assert s1 > s0
    t.lookup(np.arange(10), insert=False)  # a read without a sighting changes nothing
    assert t.mutation_seq == s1
    t.lookup(np.arange(5))  # a sighting raises the frequency: those rows changed
    s2 = t.mutation_seq
    assert s2 > s1
    changed = list(t.export(since=s1))
    assert sorted(np.concatenate([c.keys for c in changed]).tolist()) == [0, 1, 2, 3, 4]
    t.apply_gradients([3, 4], np.ones((2, 2)))
    changed = list(t.export(since=s2))
    assert sorted(np.concatenate([c.keys for c in changed]).tolist()) == [3, 4]
    t.remove([0])
    assert t.mutation_seq > s1


def test_export_import_round_trip_bit_identical():
    t = EmbeddingTable(6, optimizer=Adagrad(lr=0.1), initializer="normal", seed=4)
    rng = np.random.default_rng(3)
    keys = np.concatenate([rng.integers(I64.min, I64.max, 3000, dtype=np.int64),
                           [I64.min, I64.max, 0, -1]])
    t.lookup(keys)
    for _ in range(3):
        k = rng.choice(keys, 500)
        t.apply_gradients(k, rng.standard_normal((500, 6)))
    chunks = list(t.export(chunk_rows=700))
    assert all(isinstance(c, ExportChunk) and len(c.keys) <= 700 for c in chunks)
    assert sum(len(c.keys) for c in chunks) == len(t)
    t2 = EmbeddingTable.from_meta(json.loads(json.dumps(t.state_dict_meta())))
    assert t2.import_(chunks) == len(t)
    assert len(t2) == len(t) and t2.step == t.step

    def dump(tab):
        ch = list(tab.export(chunk_rows=10**6))[0]
        order = np.argsort(ch.keys)
        return [np.asarray(x)[order] for x in ch[:5]]

    for a, b in zip(dump(t), dump(t2), strict=True):
        np.testing.assert_array_equal(a, b)
    # both continue identically
    g = rng.standard_normal((100, 6)).astype(np.float32)
    k = keys[:100]
    t.apply_gradients(k, g)
    t2.apply_gradients(k, g)
    np.testing.assert_array_equal(t.lookup(k, insert=False), t2.lookup(k, insert=False))
    # plain tuples import too
    t3 = EmbeddingTable(6, optimizer=Adagrad(lr=0.1))
    t3.import_([tuple(c) for c in t.export()])
    assert len(t3) == len(t)


def test_string_keys():
    t = EmbeddingTable(4, seed=0)
    a = t.lookup(["user:1", "user:2", b"user:1"])
    np.testing.assert_array_equal(a[0], a[2])
    assert len(t) == 2
    np.testing.assert_array_equal(t.lookup(np.array(["user:2"])), a[1:2])
    np.testing.assert_array_equal(t.lookup(np.array(["user:1"], dtype=object)), a[:1])
    t.apply_gradients(["user:1", "user:1"], np.ones((2, 4)))
    assert t.stats()["collisions"] == 0
    assert t.contains(["user:1", "nobody"]).tolist() == [True, False]
    assert t.frequency(["user:1"]).tolist() == [3]


def test_frequency_counts_lookups():
    t = EmbeddingTable(2)
    t.lookup([1, 1, 2])
    t.lookup([1])
    assert t.frequency([1, 2, 3]).tolist() == [3, 1, 0]


def test_stats_and_bytes_per_key():
    t = EmbeddingTable(64, optimizer="adagrad")
    t.lookup(np.arange(20_000))
    s = t.stats()
    assert s["rows"] == 20_000
    assert s["row_bytes"] == 512
    assert s["bytes_per_key"] == s["bytes"] / 20_000
    assert 0 < s["load_factor"] <= 0.5
    # metadata + index overhead stay modest
    assert s["bytes_per_key"] < 2 * s["row_bytes"]


def test_meta_is_json_and_rebuilds_an_empty_twin():
    t = EmbeddingTable(4, optimizer=Adagrad(lr=0.3), initializer="uniform", seed=9,
                       nan_policy="skip")
    t.apply_gradients([1], np.ones((1, 4)))
    meta = json.loads(json.dumps(t.state_dict_meta()))
    t2 = EmbeddingTable.from_meta(meta)
    assert len(t2) == 0
    assert t2.optimizer.config() == t.optimizer.config()
    assert t2.initializer == t.initializer and t2.seed == 9 and t2.nan_policy == "skip"
    np.testing.assert_array_equal(t2.lookup([77]), t.lookup([77]))


def test_nan_policy_skip():
    t = EmbeddingTable(2, optimizer=SGD(lr=1.0), initializer="zeros", nan_policy="skip")
    g = np.array([[1, 1], [np.nan, 1], [2, 2], [1, np.inf]], np.float32)
    t.lookup([1, 2, 3])
    t.apply_gradients([1, 2, 3, 2], g)
    np.testing.assert_array_equal(t.lookup([1, 2, 3], insert=False),
                                  [[-1, -1], [0, 0], [-2, -2]])
    assert t.stats()["nonfinite_skipped"] == 1


def test_growth_false_capacity():
    t = EmbeddingTable(2, capacity=10, growth=False)
    t.lookup(np.arange(10))
    t.lookup(np.arange(10))  # existing keys fit
    assert len(t) == 10
    t.remove([0])
    t.lookup([100])
    assert len(t) == 10


def test_end_to_end_adagrad_matches_torch():
    torch = pytest.importorskip("torch")
    dim, n_keys, steps = 16, 200, 20
    rng = np.random.default_rng(7)
    t = EmbeddingTable(dim, optimizer=Adagrad(lr=0.05), initializer="normal", seed=1)
    ids = np.arange(n_keys, dtype=np.int64) * 1_000_003 - 50_000  # sparse, negative ids
    init = t.lookup(ids)
    emb = torch.nn.Embedding(n_keys, dim, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(init))
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.05)
    for _ in range(steps):
        idx = rng.integers(0, n_keys, 300)  # with duplicates
        g = rng.standard_normal((300, dim)).astype(np.float32)
        t.apply_gradients(ids[idx], g)
        opt.zero_grad()
        out = emb(torch.from_numpy(idx))
        out.backward(torch.from_numpy(g))
        opt.step()
    got = t.lookup(ids, insert=False)
    want = emb.weight.detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_package_exports():
    assert tensorkv.EmbeddingTable is EmbeddingTable


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_storage(dtype):
    import ml_dtypes

    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    t = EmbeddingTable(8, dtype=dtype, optimizer=Adagrad(lr=0.1), initializer="normal", seed=2)
    ref = EmbeddingTable(8, optimizer=Adagrad(lr=0.1), initializer="normal", seed=2)
    keys = np.arange(-50, 50, dtype=np.int64)
    a = t.lookup(keys)
    assert a.dtype == np.float32
    exact = ref.lookup(keys)
    # the initial value rounded to the storage dtype, and reads agree before/after insert
    np.testing.assert_array_equal(a, exact.astype(np_dtype).astype(np.float32))
    np.testing.assert_array_equal(t.lookup([1000], insert=False),
                                  t.lookup([1000]))
    # an update is computed in float32 from the stored value, then rounded
    g = np.random.default_rng(0).standard_normal((100, 8)).astype(np.float32)
    t.apply_gradients(keys, g)
    shadow = EmbeddingTable(8, optimizer=Adagrad(lr=0.1))
    shadow.upsert(keys, a)
    shadow.apply_gradients(keys, g)
    np.testing.assert_array_equal(
        t.lookup(keys, insert=False),
        shadow.lookup(keys, insert=False).astype(np_dtype).astype(np.float32))
    # export in the storage dtype, bit-identical round trip
    ch = list(t.export())
    assert ch[0].values.dtype == np_dtype
    t2 = EmbeddingTable.from_meta(t.state_dict_meta())
    assert t2.dtype == dtype
    t2.import_(ch)
    np.testing.assert_array_equal(t2.lookup(keys, insert=False), t.lookup(keys, insert=False))
    s = t.stats()
    assert s["row_bytes"] == 8 * 2 + 8 * 4
    # eviction by norm works on 16-bit rows
    from tensorkv.embedding.filters import Eviction

    t3 = EmbeddingTable(2, dtype=dtype, eviction=Eviction(l2_threshold=1.0))
    t3.upsert([1, 2], np.array([[0.1, 0.1], [3, 0]], np.float32))
    assert t3.evict() == 1 and t3.keys().tolist() == [2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lookup_into_out_buffer(dtype):
    t = EmbeddingTable(4, dtype=dtype, seed=1)
    keys = np.arange(10)
    want = t.lookup(keys)
    buf = np.full((10, 4), 7.0, np.float32)
    got = t.lookup(keys, out=buf)
    assert got is buf
    np.testing.assert_array_equal(buf, want)
    t.lookup(np.arange(10, 20), out=buf)  # new keys via the insert path
    np.testing.assert_array_equal(buf, t.lookup(np.arange(10, 20), insert=False))
    t.lookup(np.arange(30, 40), insert=False, out=buf)
    np.testing.assert_array_equal(buf, t.lookup(np.arange(30, 40), insert=False))
    from tensorkv.errors import ShapeError

    for bad in (np.zeros((10, 4)), np.zeros((9, 4), np.float32),
                np.zeros((4, 10), np.float32).T):
        with pytest.raises(ShapeError, match="out must be"):
            t.lookup(keys, out=bad)


def test_random_operations_match_a_reference_model():
    """lookup / apply_gradients / upsert / remove against a dict-of-rows model (SGD)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    dim = 3
    op = st.tuples(st.sampled_from(["lookup", "apply", "upsert", "remove"]),
                   st.lists(st.integers(-20, 20), min_size=0, max_size=12))

    @settings(max_examples=40, deadline=None)
    @given(st.lists(op, min_size=1, max_size=25), st.integers(0, 2**31))
    def run(ops, seed):
        t = EmbeddingTable(dim, optimizer=SGD(lr=0.5), initializer="uniform", seed=seed,
                           capacity=4)
        init = t.initializer
        ref: dict[int, np.ndarray] = {}
        rng = np.random.default_rng(seed)
        for name, ks in ops:
            k = np.array(ks, np.int64)
            if name == "lookup":
                got = t.lookup(k)
                for key in ks:
                    ref.setdefault(key, init.values(np.array([key]), dim, seed)[0])
                want = np.array([ref[key] for key in ks], np.float32).reshape(-1, dim)
                np.testing.assert_array_equal(got, want)
            elif name == "apply":
                g = rng.standard_normal((len(ks), dim)).astype(np.float32)
                t.apply_gradients(k, g)
                sums: dict[int, np.ndarray] = {}
                for key, gi in zip(ks, g, strict=True):
                    sums[key] = sums[key] + gi if key in sums else gi.copy()
                for key, s in sums.items():
                    row = ref.setdefault(key, init.values(np.array([key]), dim, seed)[0])
                    ref[key] = (row - np.float32(0.5) * s).astype(np.float32)
            elif name == "upsert":
                v = rng.standard_normal((len(ks), dim)).astype(np.float32)
                t.upsert(k, v)
                for key, vi in zip(ks, v, strict=True):
                    ref[key] = vi
            else:
                assert t.remove(k) == len(set(ks) & set(ref))
                for key in ks:
                    ref.pop(key, None)
            assert len(t) == len(ref)
            assert sorted(t.keys().tolist()) == sorted(ref)
        keys = np.array(sorted(ref), np.int64)
        if keys.size:
            want = np.array([ref[key] for key in keys.tolist()], np.float32)
            np.testing.assert_array_equal(t.lookup(keys, insert=False), want)

    run()


def test_step_setter_and_reserve():
    t = EmbeddingTable(4, optimizer="adagrad")
    t.step = 41
    t.apply_gradients([1, 2], np.ones((2, 4)))
    assert t.step == 42 and t.version([1])[0] == 42
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises(ConfigError, match="step="):
            t.step = bad
    assert t.step == 42
    t.reserve(5000)
    cap = t.stats()["capacity"]
    assert cap >= 5000
    t.lookup(np.arange(5000))
    assert t.stats()["capacity"] == cap  # no regrowth while filling the reserved rows
    with pytest.raises(ConfigError, match="n_keys="):
        t.reserve(-3)


def test_reserve_beyond_fixed_capacity_is_refused():
    t = EmbeddingTable(4, capacity=100, growth=False)
    t.lookup(np.arange(10))
    with pytest.raises(CapacityError, match="100"):
        t.reserve(1000)
    assert len(t) == 10


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lookup_torch_of_a_dram_table_equals_lookup(dtype):
    torch = pytest.importorskip("torch")
    a = EmbeddingTable(4, dtype=dtype, seed=3)
    b = EmbeddingTable(4, dtype=dtype, seed=3)
    keys = np.array([5, 9, 5, 11], np.int64)
    got = a.lookup_torch(keys)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), b.lookup(keys))
    np.testing.assert_array_equal(a.frequency(keys), b.frequency(keys))
    np.testing.assert_array_equal(a.lookup_torch(np.array([77]), insert=False).numpy(),
                                  b.lookup(np.array([77]), insert=False))
    assert len(a) == len(b) == 3


def _dump(t):
    """Every row of ``t`` sorted by key: keys, values, slots, freq, version."""
    chunks = list(t.export())
    order = np.argsort(np.concatenate([c.keys for c in chunks]))
    return {name: np.concatenate([getattr(c, name) for c in chunks])[order]
            for name in ("keys", "values", "slots", "freq", "version")}


@pytest.mark.parametrize("storage", [None, "DRAM_SSDHASH"])
def test_unique_gradients_skip_the_sum_with_equal_results(storage, tmp_path):
    """``unique=True`` (distinct keys) updates exactly as the summing path does."""
    rng = np.random.default_rng(3)
    def make(name):
        opts = {"storage_size": ["4KiB"], "storage_path": str(tmp_path / name)} \
            if storage else {}
        return EmbeddingTable(8, optimizer=Adagrad(lr=0.1), seed=5, storage=storage, **opts)

    a, b = make("a"), make("b")
    for step in range(6):
        keys = rng.choice(500, 120, replace=False).astype(np.int64)
        grads = rng.standard_normal((120, 8)).astype(np.float32)
        for t in (a, b):
            t.lookup(keys[: 60 + step])
        a.apply_gradients(keys, grads)
        b.apply_gradients(keys, grads, unique=True)
    da, db = _dump(a), _dump(b)
    for name in ("keys", "values", "slots", "freq", "version"):
        np.testing.assert_array_equal(da[name], db[name])
    bad = np.ones((2, 8), np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(tensorkv.errors.NonFiniteGradientError, match="keys"):
        b.apply_gradients(np.array([1, 2]), bad, unique=True)
    a.close()
    b.close()


def _twin_tables():
    return [EmbeddingTable(4, optimizer=Adagrad(lr=0.1), seed=9) for _ in range(2)]


def test_update_after_lookup_reuses_its_rows_only_while_they_hold():
    """``apply_gradients(unique=True)`` of the keys just looked up skips the index probe,
    and probes again once a row moved, the keys differ, or the caller's buffer changed."""
    hinted, plain = _twin_tables()
    rows = hinted._rows
    buf = np.arange(100, 140, dtype=np.int64)
    g = np.linspace(-1, 1, 160, dtype=np.float32).reshape(40, 4)
    hinted.lookup(buf)
    plain.lookup(buf.copy())
    assert rows.known_rows(buf) is not None
    assert rows.known_rows(buf[::-1].copy()) is None  # other keys
    # a removal frees rows that a later insert may reuse: the remembered rows are stale
    for t in (hinted, plain):
        t.remove(np.array([100, 101]))
        t.upsert(np.array([7, 8]), np.ones((2, 4), np.float32))
    assert rows.known_rows(buf) is None
    for t in (hinted, plain):
        t.apply_gradients(buf, g, unique=True)
    # the caller reuses its key buffer for other keys after the lookup
    hinted.lookup(buf)
    plain.lookup(buf.copy())
    buf[:] = np.arange(500, 540)
    assert rows.known_rows(buf) is None
    for t in (hinted, plain):
        t.apply_gradients(buf.copy(), g, unique=True)
    hinted.lookup(buf)
    plain.lookup(buf.copy())
    for t in (hinted, plain):
        t.apply_gradients(buf, g * 2, unique=True)
    da, db = _dump(hinted), _dump(plain)
    for name in ("keys", "values", "slots", "freq", "version"):
        np.testing.assert_array_equal(da[name], db[name])
    hinted.close()
    plain.close()


def test_rows_of_rejected_or_huge_lookups_are_not_remembered():
    from tensorkv.embedding import rows as rows_mod
    from tensorkv.embedding.filters import CounterFilter

    t = EmbeddingTable(4, admission=CounterFilter(2))
    keys = np.arange(10, dtype=np.int64)
    t.lookup(keys)  # first sighting: not admitted, rows stay -1
    assert t._rows.known_rows(keys) is None
    t.close()
    t = EmbeddingTable(4)
    big = np.arange(rows_mod.HINT_MAX_KEYS + 1, dtype=np.int64)
    t.lookup(big)
    assert t._rows.known_rows(big) is None
    t.lookup(big[:5])
    assert t._rows.known_rows(big[:5]) is not None
    t.close()


@pytest.mark.parametrize("between", ["insert", "remove"])
def test_a_lookup_rereads_keys_another_writer_changed(between):
    """The write-locked insert path reads again what changed since the shared-lock pass:
    missing keys another writer inserted (the index grew) or every key (a row moved)."""
    t = EmbeddingTable(4, optimizer=Adagrad(lr=0.1), seed=1)
    t.lookup(np.array([1, 2, 8]))
    k = np.array([1, 3, 4, 8], np.int64)
    raw = np.empty((4, 4), np.float32)
    a = t.arena
    found, _ = a.find_gather(k, raw)
    moves, size = a.moves, len(a)
    if between == "insert":
        t.lookup(np.array([3]))  # inserted meanwhile: not inserted twice
    else:
        t.remove(np.array([8]))  # removed meanwhile: inserted again
    with t._lock.write():
        t._insert_missing(k, raw, found, moves, size)
    st = t.stats()  # 1, 3 and 8 found (insert) or 1 found (remove: every key read again)
    assert (st["hits"], st["misses"]) == ((3, 5) if between == "insert" else (1, 6))
    np.testing.assert_array_equal(raw, t.lookup(k, insert=False))
    assert sorted(t.keys().tolist()) == [1, 2, 3, 4, 8]
    assert t.stats()["inserts"] == (5 if between == "insert" else 6)
    want = {1: 2, 3: 2, 4: 1, 8: 2} if between == "insert" else {1: 2, 3: 1, 4: 1, 8: 1}
    assert t.frequency(list(want)).tolist() == list(want.values())
    t.close()
