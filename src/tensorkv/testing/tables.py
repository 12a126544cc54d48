"""Conformance tests every embedding table implementation passes.

The single-process DRAM :class:`tensorkv.EmbeddingTable` defines the semantics; every other
table (a tier chain, a table with rows on a device, a table written elsewhere) must give the
same results, bit for bit, on the same operations. Subclass :class:`TableTests` and provide a
``make_table`` fixture: a callable ``make_table(dim, **table_kwargs)`` that returns a fresh,
empty table under test (every call a new one; tiered tables need a new storage path each
time). The suite builds the reference itself as ``tensorkv.EmbeddingTable(dim,
**table_kwargs)`` with the same arguments (deep copies of them: optimizer and filter objects
hold state), runs identical operation sequences on both and compares every result, the
float bit patterns included::

    class TestSSDHashTable(TableTests):
        @pytest.fixture
        def make_table(self, tmp_path):
            paths = (str(tmp_path / f"t{i}") for i in itertools.count())
            return lambda dim, **kw: tensorkv.EmbeddingTable(
                dim, storage="DRAM_SSDHASH", storage_path=next(paths),
                storage_size=["1KiB"], **kw)

Tables that own resources (threads, files) are closed at teardown: ``table.close()`` is called
on every table ``make_table`` returned, if it has such a method.

The class attributes that tune the suite are documented on :class:`TableTests`; the
comparison helpers (:func:`~tensorkv.testing.tablecheck.assert_same_table`, ...) live in
:mod:`tensorkv.testing.tablecheck`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import tensorkv
from tensorkv.errors import ConfigError, NonFiniteGradientError, NonFiniteValueError
from tensorkv.testing.snapshots import SnapshotTests
from tensorkv.testing.tablecheck import (
    ROW_FIELDS,
    assert_bits_equal,
    assert_reads_equal,
    assert_same_rows,
    assert_same_table,
    close_table,
    grads_like,
    rng_keys,
    snapshot,
    table_rows,
)

FEATURES = frozenset({
    "string_keys", "admission", "eviction", "nan_skip", "upsert", "remove", "clear", "export",
    "checkpoint", "prefetch", "stats",
})  # fmt: skip
"""Every feature :attr:`TableTests.supports` can name."""

CHECKS = frozenset({
    "reads", "string_keys", "training", "optimizer_objects", "initializers", "nan",
    "mutations", "eviction", "admission", "export", "dtypes", "checkpoint", "randomized",
    "snapshot",
})  # fmt: skip
"""Every group of tests :attr:`TableTests.checks` can name."""

TableFactory = Callable[..., Any]


# --------------------------------------------------------------------------- the suite
class TableTests(SnapshotTests):
    """The EmbeddingTable contract as pytest tests; subclasses provide ``make_table``.

    Class attributes tune the suite.

    Attributes
    ----------
    dim
        Row width of the tables (default 5: odd, so 16-bit rows and records need padding).
    optimizers
        Optimizer names :meth:`TableTests.test_apply_gradients` runs, one test each (default
        ``("sgd", "adagrad", "adam", "ftrl")``).
    dtypes
        Storage dtypes :meth:`TableTests.test_storage_dtype` runs (default ``("float32",
        "float16", "bfloat16")``); narrow it for tables that hold float32 rows only.
    supports
        What the implementation can do (default :data:`FEATURES`, all of them); a test needing a
        feature not in it is skipped with the reason ``"<feature> not supported"``. Features:

        - ``"string_keys"``: str/bytes keys, hashed as the reference hashes them;
        - ``"admission"``: ``admission=CounterFilter(...)`` / ``BloomFilter(...)``;
        - ``"eviction"``: ``eviction=Eviction(...)``, :meth:`evict` and ``every_n_steps``;
        - ``"nan_skip"``: ``nan_policy="skip"``;
        - ``"upsert"``, ``"remove"``, ``"clear"``: those methods;
        - ``"export"``: ``export(chunk_rows=..., since=...)`` and ``import_``, with the fields of
          :class:`tensorkv.ExportChunk`; without it, states are compared through lookups;
        - ``"checkpoint"``: ``tensorkv.save`` / ``tensorkv.load`` of the table;
        - ``"prefetch"``: ``prefetch(keys)`` (a no-op for the reference);
        - ``"stats"``: ``stats()`` has the reference's counters (:data:`STAT_COUNTERS`).
    checks
        Which groups of tests run (default :data:`CHECKS`, all of them): narrowing it keeps a
        slow implementation's run short (tests left out are skipped with the reason ``"not in
        checks"``), without claiming that the implementation cannot do them. Groups:
        ``"reads"``, ``"string_keys"``, ``"training"``, ``"optimizer_objects"``,
        ``"initializers"``, ``"nan"``, ``"mutations"``, ``"eviction"``, ``"admission"``,
        ``"export"``, ``"dtypes"``, ``"checkpoint"``, ``"randomized"``, ``"snapshot"``
        (:class:`~tensorkv.testing.snapshots.SnapshotTests`).
    random_seeds
        Seeds of :meth:`TableTests.test_random_operations`, one test each (default
        ``(0, 1, 2)``).
    random_ops
        Operations per sequence of :meth:`TableTests.test_random_operations` (default 150).

    Notes
    -----
    :meth:`TableTests.check_exercised` is a hook called with the table under test at the end of
    the training and randomized tests (default: does nothing); a tiered table's tests override
    it to assert that rows really moved through the lower tiers, so the comparison tested them.
    """

    dim: int = 5
    optimizers: tuple[str, ...] = ("sgd", "adagrad", "adam", "ftrl")
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    supports: frozenset[str] = FEATURES
    checks: frozenset[str] = CHECKS
    random_seeds: tuple[int, ...] = (0, 1, 2)
    random_ops: int = 150

    # ----------------------------------------------------------------- fixtures and hooks
    @pytest.fixture
    def make_table(self) -> TableFactory:  # pragma: no cover - subclasses override
        raise NotImplementedError("subclasses provide a make_table(dim, **kwargs) fixture")

    @pytest.fixture
    def new_table(self, make_table: TableFactory) -> Iterator[TableFactory]:
        """``make_table``, with every table it made closed at teardown."""
        made: list[Any] = []

        def new(dim: int, **kwargs: Any) -> Any:
            t = make_table(dim, **kwargs)
            made.append(t)
            return t

        yield new
        errors = []
        for t in reversed(made):
            try:
                close_table(t)
            except Exception as exc:  # close them all, then report the first failure
                errors.append(exc)
        if errors:
            raise errors[0]

    @pytest.fixture
    def pair(self, new_table: TableFactory) -> Callable[..., tuple[Any, Any]]:
        """``pair(**kwargs) -> (table, reference)``: built with equal, unshared arguments."""

        def build(**kwargs: Any) -> tuple[Any, Any]:
            dim = kwargs.pop("dim", self.dim)
            kwargs.setdefault("seed", 11)
            ref = tensorkv.EmbeddingTable(dim, **copy.deepcopy(kwargs))
            return new_table(dim, **copy.deepcopy(kwargs)), ref

        return build

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Parametrize ``optimizer``, ``dtype`` and ``random_seed`` from class attributes."""
        for name, values in (("optimizer", self.optimizers), ("dtype", self.dtypes),
                             ("random_seed", self.random_seeds)):
            if name in metafunc.fixturenames:
                metafunc.parametrize(name, list(values), ids=[str(v) for v in values])

    def need(self, *features: str, check: str | None = None) -> None:
        """Skip the calling test unless the implementation supports ``features``.

        ``check`` names the test's group in :attr:`checks`.
        """
        unknown = set(features) - FEATURES
        if unknown:
            raise ConfigError(f"unknown features {sorted(unknown)}; known: {sorted(FEATURES)}")
        if check is not None:
            assert check in CHECKS, check
            if check not in self.checks:
                pytest.skip(f"{check!r} not in checks of {type(self).__name__}")
        missing = [f for f in features if f not in self.supports]
        if missing:
            pytest.skip(f"{', '.join(missing)} not supported by {type(self).__name__}")

    def check_exercised(self, table: Any) -> None:
        """Hook: called with the table under test after its training and randomized tests.

        Tiered tables' tests override it to assert that rows went down and came back up
        (``table.stats()["tiers"]``), so the comparisons covered the lower tiers.
        """

    @property
    def _export(self) -> bool:
        return "export" in self.supports

    def same(self, table: Any, ref: Any, **kwargs: Any) -> None:
        """:func:`assert_same_table`, comparing exports when the table supports them."""
        kwargs.setdefault("stats", "stats" in self.supports and kwargs.get("seq", True))
        assert_same_table(table, ref, export=self._export and kwargs.pop("export", True),
                          **kwargs)

    def train(self, tables: list[Any], rng: np.random.Generator, steps: int, *,
              high: int = 40, batch: int = 12, scale: float = 1.0,
              steps_at: dict[int, int] | None = None) -> None:
        """Lookup + apply_gradients of random batches (with duplicates) on every table.

        Results must agree with the first table's at every step; ``steps_at`` gives explicit
        ``step=`` values for some steps (by index).
        """
        for i in range(steps):
            keys = rng_keys(rng, batch, high)
            g = grads_like(rng, keys.size, self.dim, scale)
            outs = [t.lookup(keys) for t in tables]
            for o in outs[1:]:
                assert_bits_equal(o, outs[0], f"lookup at training step {i}", keys)
            step = None if steps_at is None else steps_at.get(i)
            ns = [t.apply_gradients(keys, g, step=step) for t in tables]
            assert ns == [ns[0]] * len(ns), f"apply_gradients returned {ns} at step {i}"

    # ----------------------------------------------------------------- reads
    def test_lookup_inserts_and_counts(self, pair) -> None:
        self.need(check="reads")
        t, ref = pair(optimizer="adagrad")
        rng = np.random.default_rng(1)
        i64 = np.iinfo(np.int64)
        batches = [
            np.array([3, 7, 3, 3, -5, 0], np.int64),  # duplicates, a negative key, zero
            np.array([i64.max, i64.min, i64.min + 1, 7], np.int64),  # extremes
            np.array([1, 2, 3], np.int32),  # a narrower int dtype
            [9, 9, 10],  # a list of Python ints
            np.empty(0, np.int64),  # an empty batch
        ] + [rng_keys(rng, 10, 60, 3) for _ in range(6)]
        for i, keys in enumerate(batches):
            assert_bits_equal(t.lookup(keys), ref.lookup(keys), f"lookup of batch {i}", keys)
            assert len(t) == len(ref)
            assert_reads_equal(t, ref, np.asarray(keys, np.int64))
        out_t = np.full((6, self.dim), np.nan, np.float32)
        out_r = out_t.copy()
        keys = np.array([3, 70, 71, 3, 7, 70], np.int64)
        got = t.lookup(keys, out=out_t)
        want = ref.lookup(keys, out=out_r)
        assert got is out_t and want is out_r
        assert_bits_equal(out_t, out_r, "lookup(out=...)", keys)
        assert 3 in t and 12345 not in t
        self.same(t, ref)

    def test_lookup_without_insert(self, pair) -> None:
        self.need(check="reads")
        rng = np.random.default_rng(2)
        for default in (None, 0.25, np.linspace(-1, 1, self.dim)):
            t, ref = pair(optimizer="sgd", default_value=default)
            for tab in (t, ref):
                tab.lookup(np.arange(0, 20, 2))
            seq = ref.mutation_seq
            for _ in range(3):
                keys = rng_keys(rng, 12, 30, 2)  # half of them have no row
                assert_bits_equal(t.lookup(keys, insert=False), ref.lookup(keys, insert=False),
                                  f"lookup(insert=False), default_value={default}", keys)
                assert_bits_equal(t[keys], ref[keys], "table[keys]", keys)
            assert len(t) == len(ref) == 10, "lookup(insert=False) inserted rows"
            assert t.mutation_seq == ref.mutation_seq == seq
            assert not t.contains(np.arange(1, 20, 2)).any()
            assert (t.frequency(np.arange(1, 20, 2)) == 0).all()
            assert (t.version(np.arange(1, 20, 2)) == -1).all()
            self.same(t, ref)

    def test_string_keys(self, pair) -> None:
        self.need("string_keys", check="string_keys")
        t, ref = pair(optimizer="adagrad")
        rng = np.random.default_rng(3)
        words = [f"user-{i}" for i in range(25)] + ["", "ü-ñícode", "x" * 300]
        for i in range(6):
            keys = [words[j] for j in rng.integers(0, len(words), 9)] + [words[0]]
            if i % 2:
                keys = [k.encode() for k in keys]  # bytes keys
            assert_bits_equal(t.lookup(keys), ref.lookup(keys), "lookup of str keys")
            g = grads_like(rng, len(keys), self.dim)
            assert t.apply_gradients(keys, g) == ref.apply_gradients(keys, g)
            for name in ("contains", "frequency", "version", "__getitem__"):
                assert_bits_equal(getattr(t, name)(words), getattr(ref, name)(words), name)
        if "remove" in self.supports:
            assert t.remove(words[:5]) == ref.remove(words[:5])
        assert ("user-7" in t) == ("user-7" in ref)
        self.same(t, ref)

    # ----------------------------------------------------------------- training
    def test_apply_gradients(self, pair, optimizer: str) -> None:
        self.need(check="training")
        t, ref = pair(optimizer=optimizer)
        rng = np.random.default_rng(4)
        # explicit steps: jump ahead, repeat a step, go back (versions record them)
        self.train([t, ref], rng, 10, steps_at={2: 10, 3: 10, 6: 4})
        assert t.step == ref.step == 7  # the last step went back to 4, then counted on
        # keys never looked up are inserted by the update; duplicates sum
        keys = np.array([100, 101, 100, 100, 5], np.int64)
        g = grads_like(rng, keys.size, self.dim)
        assert t.apply_gradients(keys, g) == ref.apply_gradients(keys, g) == 3
        assert t.apply_gradients(keys[:0], g[:0]) == ref.apply_gradients(keys[:0], g[:0]) == 0
        g64 = rng.standard_normal((3, self.dim))  # float64 gradients are rounded to float32
        assert t.apply_gradients([7, 8, 7], g64, step=20) == \
            ref.apply_gradients([7, 8, 7], g64, step=20)
        self.same(t, ref)
        self.check_exercised(t)

    def test_optimizer_objects(self, pair) -> None:
        self.need(check="optimizer_objects")
        opts = [
            tensorkv.SGD(lr=0.3),
            tensorkv.Adagrad(lr=0.2, initial_accumulator_value=0.1),
            tensorkv.Adam(lr=0.05, betas=(0.8, 0.95)),
            tensorkv.AdamW(lr=0.05, weight_decay=0.1),
            tensorkv.FTRL(lr=0.1),
            tensorkv.RMSProp(lr=0.02),
            {"name": "adagrad", "lr": 0.5},  # a config dict
            tensorkv.SGD(lr=lambda step: 0.5 / (1 + step)),  # a learning-rate schedule
        ]
        for i, opt in enumerate(opts):
            t, ref = pair(optimizer=opt)
            self.train([t, ref], np.random.default_rng(100 + i), 5, high=30)
            self.same(t, ref)

    def test_initializers(self, pair) -> None:
        self.need(check="initializers")
        inits: list[Any] = [
            tensorkv.Zeros(), tensorkv.Constant(0.3), tensorkv.Uniform(-0.2, 0.1),
            tensorkv.Normal(mean=0.1, std=0.2), tensorkv.TruncatedNormal(std=0.1), "uniform",
            {"name": "normal", "mean": -0.5, "std": 1.0},  # a config dict
        ]
        i64 = np.iinfo(np.int64)
        keys = np.array([0, 1, -1, i64.max, i64.min, 2**40, 1], np.int64)
        for i, init in enumerate(inits):
            t, ref = pair(optimizer="adagrad", initializer=init, seed=20 + i)
            assert_bits_equal(t.lookup(keys, insert=False), ref.lookup(keys, insert=False),
                              f"initial values of {init!r} (insert=False)", keys)
            assert_bits_equal(t.lookup(keys), ref.lookup(keys), f"inserted {init!r}", keys)
            self.train([t, ref], np.random.default_rng(30 + i), 3, high=25)
            self.same(t, ref)

    def test_nan_skip(self, pair) -> None:
        self.need("nan_skip", check="nan")
        t, ref = pair(optimizer="adam", nan_policy="skip")
        rng = np.random.default_rng(5)
        self.train([t, ref], rng, 3)
        for i in range(4):
            keys = rng_keys(rng, 10, 40, 3)
            g = grads_like(rng, keys.size, self.dim)
            g[i, 1 % self.dim] = np.nan
            g[-1, 0] = np.inf  # a duplicate of keys[2]: its summed gradient is infinite
            g[5, :] = -np.inf
            assert t.apply_gradients(keys, g) == ref.apply_gradients(keys, g)
        assert t.stats()["nonfinite_skipped"] == ref.stats()["nonfinite_skipped"] > 0
        self.same(t, ref)

    def test_nonfinite_gradients_raise_and_change_nothing(self, pair) -> None:
        self.need(check="nan")
        t, ref = pair(optimizer="adagrad")
        rng = np.random.default_rng(6)
        self.train([t, ref], rng, 4)
        before = [snapshot(x, self._export) for x in (t, ref)]
        keys = np.array([1, 2, 999, 1000, 2], np.int64)  # 999, 1000 have no row
        g = grads_like(rng, keys.size, self.dim)
        g[3, 2 % self.dim] = np.nan
        for tab in (t, ref):
            with pytest.raises(NonFiniteGradientError):
                tab.apply_gradients(keys, g)
            with pytest.raises(NonFiniteGradientError):
                tab.apply_gradients(keys, np.where(g == g, g, np.inf), step=50)
        for tab, (n, step, mseq, rows) in zip((t, ref), before, strict=True):
            assert (len(tab), tab.step, tab.mutation_seq) == (n, step, mseq), \
                f"{type(tab).__name__} changed by a refused update"
            if rows is not None:
                assert_same_rows(table_rows(tab), rows, "rows after a refused update")
        self.same(t, ref)
        # refused right after the lookup of its batch, then the batch's valid update
        looked = np.array([1, 2, 3, 2], np.int64)
        g = grads_like(rng, looked.size, self.dim)
        bad = g.copy()
        bad[1, 0] = np.inf
        for tab in (t, ref):
            tab.lookup(looked)
            with pytest.raises(NonFiniteGradientError):
                tab.apply_gradients(looked, bad)
        assert t.apply_gradients(looked, g) == ref.apply_gradients(looked, g)
        self.same(t, ref)

    # ----------------------------------------------------------------- mutations
    def test_upsert_remove_clear(self, pair) -> None:
        self.need(check="mutations")
        t, ref = pair(optimizer="adagrad")
        rng = np.random.default_rng(7)
        self.train([t, ref], rng, 4)
        if "upsert" in self.supports:
            keys = np.array([1, 50, 1, 51, 3], np.int64)  # new and existing; a later 1 wins
            vals = grads_like(rng, keys.size, self.dim)
            vals[2, 0] = -0.0  # kept as -0.0
            for tab in (t, ref):
                tab.upsert(keys, vals)
            self.same(t, ref)
            for tab in (t, ref):
                tab.upsert(keys[:0], vals[:0])
                tab.upsert([52], np.full((1, self.dim), 1e30))  # float64 in, float32 kept
        if "remove" in self.supports:
            gone = np.array([1, 1, 50, 777, 3, -9], np.int64)
            assert t.remove(gone) == ref.remove(gone)
            assert t.remove(gone) == ref.remove(gone) == 0
            self.same(t, ref)
        self.train([t, ref], rng, 3)  # removed keys come back with their initial values
        self.same(t, ref)
        if "clear" in self.supports:
            for tab in (t, ref):
                tab.clear()
            assert len(t) == len(ref) == 0
            self.same(t, ref)
            self.train([t, ref], rng, 3)
            self.same(t, ref)

    # ----------------------------------------------------------------- eviction
    EVICTIONS: dict[str, dict[str, Any]] = {
        "steps_to_live": {"steps_to_live": 3},
        "l2_threshold": {"l2_threshold": 0.1},
        "max_rows_lfu": {"max_rows": 15, "policy": "lfu"},
        "max_rows_lru": {"max_rows": 15, "policy": "lru"},
        "every_n_steps": {"steps_to_live": 4, "max_rows": 20, "every_n_steps": 3},
    }

    @pytest.mark.parametrize("case", list(EVICTIONS))
    def test_eviction(self, pair, case: str) -> None:
        self.need("eviction", check="eviction")
        t, ref = pair(optimizer="sgd", eviction=tensorkv.Eviction(**self.EVICTIONS[case]))
        rng = np.random.default_rng(8)
        for i in range(4):
            self.train([t, ref], rng, 3, high=50, scale=0.02)
            n = t.evict()
            assert n == ref.evict(), f"evict() round {i}"
            self.same(t, ref)
        assert t.stats()["evictions"] == ref.stats()["evictions"] > 0
        self.check_exercised(t)

    # ----------------------------------------------------------------- admission
    def test_admission(self, pair) -> None:
        self.need("admission", check="admission")
        filters = [(tensorkv.CounterFilter(min_count=3), None),
                   (tensorkv.BloomFilter(min_count=2, capacity=1000, counter_bits=2), -0.5)]
        for adm, default in filters:  # keys not admitted read the default value, if set
            t, ref = pair(optimizer="adagrad", admission=adm, default_value=default)
            rng = np.random.default_rng(9)
            for i in range(8):
                keys = rng_keys(rng, 10, 40, 3)
                assert_bits_equal(t.lookup(keys), ref.lookup(keys), f"lookup {i}", keys)
                g = grads_like(rng, keys.size, self.dim)
                # keys not admitted yet (and keys never looked up) drop their gradients
                k2 = np.concatenate([keys, [900 + i]])
                g2 = np.concatenate([g, g[:1]])
                assert t.apply_gradients(k2, g2) == ref.apply_gradients(k2, g2)
                assert_reads_equal(t, ref, k2)
            for name in ("admissions_rejected", "gradients_dropped"):
                assert t.stats()[name] == ref.stats()[name] > 0, name
            self.same(t, ref)
            if "clear" in self.supports:  # clear forgets the counts too
                for tab in (t, ref):
                    tab.clear()
                keys = np.arange(5, dtype=np.int64)
                assert_bits_equal(t.lookup(keys), ref.lookup(keys), "lookup after clear")
                self.same(t, ref)

    # ----------------------------------------------------------------- export / import
    def test_export_import_round_trip(self, pair, new_table) -> None:
        self.need("export", check="export")
        kw: dict[str, Any] = {"optimizer": "adam", "seed": 12}
        t, ref = pair(**kw)
        rng = np.random.default_rng(10)
        self.train([t, ref], rng, 6, high=60)
        assert_same_rows(table_rows(t, 3), table_rows(ref, 3), "export(chunk_rows=3)")
        chunks = list(t.export(chunk_rows=4))
        copy_t = new_table(self.dim, **copy.deepcopy(kw))
        copy_ref = tensorkv.EmbeddingTable(self.dim, **copy.deepcopy(kw))
        n = len(t)
        assert copy_t.import_(iter(chunks)) == copy_ref.import_(iter(chunks)) == n
        # the same chunks in the same order: the copies agree with each other to the seq
        self.same(copy_t, copy_ref)
        assert_same_rows(table_rows(copy_t), table_rows(ref), "imported copy", seq=False)
        # import_ over existing rows (upserts every field), from a plain tuple too
        src = table_rows(ref)
        part = tuple(np.ascontiguousarray(src[f][::2]) for f in ROW_FIELDS[:5])
        part[3][:] += 5
        for tab in (t, ref, copy_t, copy_ref):
            assert tab.import_(part) == part[0].size
        self.same(t, ref)
        self.same(copy_t, copy_ref)
        # each copy trains on like its reference (the optimizers' global steps are fresh)
        for pair_ in ((t, ref), (copy_t, copy_ref)):
            self.train(list(pair_), np.random.default_rng(11), 4, high=60)
            self.same(*pair_)

    def test_export_since(self, pair) -> None:
        self.need("export", check="export")
        t, ref = pair(optimizer="adagrad")
        rng = np.random.default_rng(12)
        self.train([t, ref], rng, 5, high=60)
        marks = [ref.mutation_seq]
        assert t.mutation_seq == marks[0]
        for tab in (t, ref):
            tab.apply_gradients([1, 2, 3, 500], np.ones((4, self.dim), np.float32))
        marks.append(ref.mutation_seq)
        for tab in (t, ref):
            tab.lookup([600, 601, 2])
            if "upsert" in self.supports:
                tab.upsert([4, 602], np.zeros((2, self.dim), np.float32))
        marks.append(ref.mutation_seq)
        for since in [*marks, 0, -1]:
            got, want = table_rows(t, 2, since=since), table_rows(ref, 2, since=since)
            assert_same_rows(got, want, f"export(since={since})")
        assert table_rows(t, since=t.mutation_seq)["keys"].size == 0

    # ----------------------------------------------------------------- storage dtypes
    def test_storage_dtype(self, pair, new_table, tmp_path, dtype: str) -> None:
        """Rows stored as ``dtype``: training, export/import and checkpoints keep their bits."""
        self.need(check="dtypes")
        ev = tensorkv.Eviction(l2_threshold=0.05, every_n_steps=4) \
            if "eviction" in self.supports else None
        kw = {"optimizer": "adagrad", "dtype": dtype, "eviction": ev, "seed": 13}
        t, ref = pair(**copy.deepcopy(kw))
        rng = np.random.default_rng(13)
        self.train([t, ref], rng, 8, high=50, scale=0.3)
        if "upsert" in self.supports:  # values that round in 16 bits; beyond range: refused
            vals = np.array([[1 / 3, -1e-8, 6e4, -0.0, 1e-30][i % 5] for i in range(
                self.dim * 2)], np.float64).reshape(2, self.dim)
            for tab in (t, ref):
                tab.upsert([5, 6], vals)
                with pytest.raises(NonFiniteValueError):  # 1e39 is inf in float32
                    tab.upsert([7], np.full((1, self.dim), 1e39))
        self.same(t, ref)
        self.check_exercised(t)
        if self._export:
            rows = table_rows(t)
            assert np.dtype(rows["values"].dtype).name == dtype, rows["values"].dtype
            copy_t = new_table(self.dim, **copy.deepcopy(kw))
            copy_t.import_(t.export(chunk_rows=4))
            assert_same_rows(table_rows(copy_t), rows, f"{dtype} rows imported", seq=False)
        if "checkpoint" in self.supports:
            url = self.checkpoint_url(tmp_path)
            tensorkv.save({"t": t}, url, tag="a")
            fresh = new_table(self.dim, **copy.deepcopy(kw))
            tensorkv.load({"t": fresh}, url, "a")
            self.same(fresh, ref, seq=False)

    # ----------------------------------------------------------------- checkpoints
    def checkpoint_url(self, tmp_path: Any) -> str:
        """Store URL the checkpoint test saves into (default: LMDB under ``tmp_path``)."""
        return f"lmdb://{tmp_path}/checkpoint"

    def test_checkpoint_round_trip(self, pair, new_table, tmp_path) -> None:
        self.need("checkpoint", check="checkpoint")
        kw = {"optimizer": "adam", "seed": 14}
        t, ref = pair(**kw)
        rng = np.random.default_rng(14)
        self.train([t, ref], rng, 6, high=60)
        url = self.checkpoint_url(tmp_path)
        if "prefetch" in self.supports:
            t.prefetch(np.arange(0, 60, 2))  # a save waits for the rows in flight
        tensorkv.save({"t": t}, url, tag="a")
        loaded = tensorkv.load(None, url, "a")["t"]  # a DRAM table built from the checkpoint
        assert type(loaded) is tensorkv.EmbeddingTable
        self.same(loaded, ref, seq=False)
        fresh = new_table(self.dim, **copy.deepcopy(kw))
        fresh.lookup(np.arange(1000, 1030))  # rows the load drops (some in lower tiers)
        assert tensorkv.load({"t": fresh}, url, "a")["t"] is fresh
        self.same(fresh, ref, seq=False)
        # all four train on alike (the optimizer's global state came back too)
        state = np.random.default_rng(15).bit_generator.state
        for group in ([t, ref], [loaded, fresh]):
            r = np.random.default_rng()
            r.bit_generator.state = state
            self.train(group, r, 5, high=70)
        self.same(t, ref, stats=False)  # the comparisons above read ref: more hits
        self.same(fresh, ref, seq=False)
        self.same(loaded, ref, seq=False)
        # an incremental tag (rows changed and removed since "a") of the trained table, loaded
        # into the trained fresh table and into a new one
        if "remove" in self.supports:
            for tab in (t, ref):
                tab.remove(np.arange(0, 70, 3))
        tensorkv.save({"t": t}, url, tag="b", incremental=True)
        assert tensorkv.load({"t": fresh}, url, "b")["t"] is fresh
        self.same(fresh, ref, seq=False)
        again = new_table(self.dim, **copy.deepcopy(kw))
        tensorkv.load({"t": again}, url, "b")
        self.same(again, ref, seq=False)
        self.same(tensorkv.load(None, url, "b")["t"], ref, seq=False)

    # ----------------------------------------------------------------- random sequences
    def random_table_kwargs(self, seed: int) -> dict[str, Any]:
        """Table arguments of :meth:`test_random_operations` for ``seed``."""
        kw: dict[str, Any] = {"optimizer": ("adam", "adagrad", "ftrl")[seed % 3],
                              "dtype": self.dtypes[seed % len(self.dtypes)], "seed": seed}
        if "nan_skip" in self.supports:
            kw["nan_policy"] = "skip"
        if "eviction" in self.supports:
            kw["eviction"] = tensorkv.Eviction(
                steps_to_live=9, max_rows=35, policy=("lfu", "lru")[seed % 2], every_n_steps=5)
        if "admission" in self.supports and seed % 2:
            kw["admission"] = tensorkv.CounterFilter(min_count=2)
        return kw

    def test_random_operations(self, pair, random_seed: int) -> None:
        """A seeded random sequence of every operation, compared after each one.

        Each operation's results are compared at once; the whole state (:meth:`same`, which
        waits for a tiered table's background writes) every third operation and at the end.
        """
        self.need(check="randomized")
        seed = random_seed
        kw = self.random_table_kwargs(seed)
        t, ref = pair(**kw)
        rng = np.random.default_rng(1000 + seed)
        ops = self.random_operations(t, ref, rng, kw)
        weights = np.array([w for _, w in ops])
        done = []
        for i in range(self.random_ops):
            fn = ops[int(rng.choice(len(ops), p=weights / weights.sum()))][0]
            done.append(fn.__name__[3:])
            try:
                fn()
                assert t.mutation_seq == ref.mutation_seq and t.step == ref.step
                if i % 3 == 2 or i == self.random_ops - 1:
                    self.same(t, ref)
            except AssertionError as exc:
                raise AssertionError(
                    f"after operation {i} of seed {seed} ({' '.join(done[-8:])}): {exc}"
                ) from exc
        self.check_exercised(t)

    def random_operations(self, t: Any, ref: Any, rng: np.random.Generator,
                          kw: dict[str, Any]) -> list[tuple[Callable[[], None], float]]:
        """``(operation, weight)`` pairs of :meth:`test_random_operations` on ``t`` and ``ref``.

        Each operation runs on both tables and compares what they return; those the
        implementation does not support (:attr:`supports`) are left out.
        """
        dim = self.dim
        words = [f"w{i}" for i in range(12)]
        sup = self.supports
        nan_skip = kw.get("nan_policy") == "skip"

        def keys_(n: int | None = None) -> Any:
            n = int(rng.integers(1, 14)) if n is None else n
            if "string_keys" in sup and rng.random() < 0.15:
                return [words[j] for j in rng.integers(0, len(words), n)]
            k = rng.integers(0, 70, n).astype(np.int64)
            return np.concatenate([k, k[: int(rng.integers(0, 3))]])

        def op_lookup() -> None:
            k = keys_()
            assert_bits_equal(t.lookup(k), ref.lookup(k), "lookup")

        def op_peek() -> None:
            k = keys_()
            if isinstance(k, list):
                assert_bits_equal(t[k], ref[k], "table[keys]")
                return
            assert_reads_equal(t, ref, k)
            assert_bits_equal(t.lookup(k, insert=False), ref.lookup(k, insert=False),
                              "lookup(insert=False)")

        def op_apply() -> None:
            k = keys_()
            n = len(k)
            g = grads_like(rng, n, dim)
            if nan_skip and rng.random() < 0.2:
                g[int(rng.integers(0, n)), int(rng.integers(0, dim))] = np.nan
            step = int(rng.integers(0, 40)) if rng.random() < 0.2 else None
            if rng.random() < 0.5:  # the usual lookup, then apply of the same batch
                assert_bits_equal(t.lookup(k), ref.lookup(k), "lookup before apply")
            assert t.apply_gradients(k, g, step=step) == ref.apply_gradients(k, g, step=step)

        def op_upsert() -> None:
            k = keys_()
            v = grads_like(rng, len(k), dim, 0.1)
            t.upsert(k, v)
            ref.upsert(k, v)

        def op_remove() -> None:
            k = keys_()
            assert t.remove(k) == ref.remove(k)

        def op_evict() -> None:
            assert t.evict() == ref.evict()

        def op_export_since() -> None:
            since = int(rng.integers(-1, ref.mutation_seq + 1))
            assert_same_rows(table_rows(t, 5, since), table_rows(ref, 5, since),
                             f"export(since={since})")

        def op_import() -> None:
            rows = table_rows(ref)
            if rows["keys"].size == 0:
                return
            idx = rng.choice(rows["keys"].size, min(12, rows["keys"].size), replace=False)
            ch = [np.ascontiguousarray(rows[f][idx]) for f in ROW_FIELDS[:5]]
            ch[0] = ch[0] + 1  # moved to neighbouring keys (new or existing)
            ch[4] = ch[4] + 1
            if ch[0].size > 2 and rng.random() < 0.3:
                ch[0][1] = ch[0][0]  # a key twice in one chunk: the later row wins
            chunks = [tuple(x[:5] for x in ch), tuple(x[5:] for x in ch)]
            assert t.import_(iter(chunks)) == ref.import_(iter(chunks))

        def op_lookup_out() -> None:
            k = keys_()
            outs = [np.empty((len(k), dim), np.float32) for _ in range(2)]
            ins = bool(rng.random() < 0.5)
            t.lookup(k, insert=ins, out=outs[0])
            ref.lookup(k, insert=ins, out=outs[1])
            assert_bits_equal(outs[0], outs[1], f"lookup(insert={ins}, out=...)")

        def op_wide_batch() -> None:  # more distinct keys than a small tier 0 holds
            k = rng.integers(0, 120, 40).astype(np.int64)
            assert_bits_equal(t.lookup(k), ref.lookup(k), "lookup of a wide batch")
            g = grads_like(rng, k.size, dim)
            assert t.apply_gradients(k, g) == ref.apply_gradients(k, g)

        def op_set_step() -> None:
            step = int(rng.integers(0, 40))
            t.step = step
            ref.step = step

        def op_prefetch() -> None:
            k = keys_()
            t.prefetch(k)
            ref.prefetch(k)

        def op_flush() -> None:
            for name in ("wait_writes", "flush"):
                fn = getattr(t, name, None)
                if callable(fn) and rng.random() < 0.5:
                    fn()

        def op_clear() -> None:
            t.clear()
            ref.clear()

        ops: list[tuple[Callable[[], None], float, str | None]] = [
            (op_lookup, 4, None), (op_peek, 2, None), (op_apply, 5, None),
            (op_upsert, 1, "upsert"), (op_remove, 1, "remove"), (op_evict, 1, "eviction"),
            (op_export_since, 1, "export"), (op_import, 1, "export"),
            (op_prefetch, 1.5, "prefetch"), (op_flush, 1, None), (op_clear, 0.15, "clear"),
            (op_lookup_out, 0.5, None), (op_wide_batch, 0.5, None), (op_set_step, 0.3, None),
        ]
        return [(fn, w) for fn, w, need in ops if need is None or need in sup]

