"""Conformance tests every :class:`~tensorkv.embedding.tiers.LowerTier` passes.

Subclass :class:`TierTests` and provide a ``make_tier`` fixture: a callable
``make_tier(layout) -> LowerTier`` that opens the tier at this test's location (the first call
finds it empty; for persistent tiers a later call after ``close()`` finds the rows again)::

    class TestSSDHash(TierTests):
        @pytest.fixture
        def make_tier(self, tmp_path):
            return lambda layout: SSDHashTier(tmp_path / "t", layout)

Set ``persistent = False`` for tiers whose rows vanish on close.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tensorkv.embedding.tiers.base import LowerTier, RecordLayout
from tensorkv.errors import ConfigError, KeyTypeError, ShapeError, StoreClosedError

I64 = np.iinfo(np.int64)
LAYOUTS = [
    RecordLayout(8, "float32", 1),
    RecordLayout(5, "float16", 2),
    RecordLayout(3, "bfloat16", 0),
]


def make_records(layout: RecordLayout, keys: np.ndarray, seed: int = 0) -> np.ndarray:
    """Deterministic random records for ``keys`` (every byte of every field varies)."""
    rng = np.random.default_rng(seed)
    n = keys.size
    return layout.pack(
        keys,
        rng.standard_normal((n, layout.dim)).astype(np.float32),
        rng.standard_normal((n, layout.slot_width)).astype(np.float32),
        freq=rng.integers(0, 1 << 40, n),
        version=rng.integers(-(1 << 40), 1 << 40, n),
        seq=rng.integers(0, 1 << 62, n),
    )


class TierTests:
    """The LowerTier contract as pytest tests; subclasses provide ``make_tier``."""

    persistent: bool = True
    layout: RecordLayout = LAYOUTS[0]

    @pytest.fixture
    def make_tier(self) -> Callable[[RecordLayout], LowerTier]:  # pragma: no cover
        raise NotImplementedError("subclasses provide a make_tier fixture")

    @pytest.fixture
    def tier(self, make_tier):
        t = make_tier(self.layout)
        yield t
        t.close()

    def reopen(self, tier: LowerTier, make_tier) -> LowerTier:
        """Close ``tier`` and open its location again."""
        tier.close()
        return make_tier(tier.layout)

    # ----------------------------------------------------------------- basics
    @pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.value_dtype}-{lay.dim}")
    def test_round_trip_bit_identical(self, make_tier, layout: RecordLayout) -> None:
        tier = make_tier(layout)
        try:
            keys = np.array([3, -7, 0, 1 << 40, 12345], np.int64)
            recs = make_records(layout, keys)
            tier.put(keys, recs)
            found, got = tier.get(keys[::-1])
            assert found.all()
            np.testing.assert_array_equal(got, recs[::-1])
            f = layout.unpack(got)
            np.testing.assert_array_equal(f.keys, keys[::-1])
            assert got.dtype == np.uint8 and got.shape == (5, layout.record_bytes)
        finally:
            tier.close()

    def test_missing_rows_are_zero(self, tier: LowerTier) -> None:
        keys = np.array([1, 2], np.int64)
        tier.put(keys[:1], make_records(self.layout, keys[:1]))
        found, got = tier.get(np.array([2, 1, 99], np.int64))
        assert found.tolist() == [False, True, False]
        assert not got[0].any() and not got[2].any()

    def test_empty_batches(self, tier: LowerTier) -> None:
        e = np.empty(0, np.int64)
        tier.put(e, self.layout.empty(0))
        found, got = tier.get(e)
        assert found.shape == (0,) and got.shape == (0, self.layout.record_bytes)
        assert tier.delete(e) == 0
        assert tier.contains(e).shape == (0,)
        assert len(tier) == 0 and tier.keys().size == 0
        assert list(tier.scan(10)) == []

    def test_overwrite(self, tier: LowerTier) -> None:
        keys = np.arange(50, dtype=np.int64)
        tier.put(keys, make_records(self.layout, keys, 1))
        new = make_records(self.layout, keys[10:20], 2)
        tier.put(keys[10:20], new)
        _, got = tier.get(keys[10:20])
        np.testing.assert_array_equal(got, new)
        assert len(tier) == 50

    def test_duplicate_keys_in_one_put_last_wins(self, tier: LowerTier) -> None:
        keys = np.array([5, 6, 5], np.int64)
        recs = make_records(self.layout, keys, 3)
        tier.put(keys, recs)
        _, got = tier.get(np.array([5, 6], np.int64))
        np.testing.assert_array_equal(got[0], recs[2])
        np.testing.assert_array_equal(got[1], recs[1])
        assert len(tier) == 2

    def test_delete_contains_keys_len(self, tier: LowerTier) -> None:
        keys = np.arange(-20, 20, dtype=np.int64)
        tier.put(keys, make_records(self.layout, keys))
        assert tier.delete(np.array([-20, 0, 0, 19, 1000], np.int64)) == 3
        assert tier.delete(np.array([0], np.int64)) == 0
        assert tier.contains(np.array([-20, -19, 0, 19, 5], np.int64)).tolist() == [
            False, True, False, False, True,
        ]  # fmt: skip
        assert len(tier) == 37
        assert sorted(tier.keys().tolist()) == sorted(set(range(-20, 20)) - {-20, 0, 19})
        found, _ = tier.get(np.array([0], np.int64))
        assert not found[0]

    def test_int64_extremes(self, tier: LowerTier) -> None:
        keys = np.array([I64.min, I64.max, -1, 0, 1, I64.min + 1, I64.max - 1], np.int64)
        recs = make_records(self.layout, keys)
        tier.put(keys, recs)
        found, got = tier.get(keys)
        assert found.all()
        np.testing.assert_array_equal(got, recs)
        assert sorted(tier.keys().tolist()) == sorted(keys.tolist())
        assert tier.delete(keys[:2]) == 2
        assert tier.contains(keys).tolist() == [False, False] + [True] * 5

    def test_scan_covers_every_row_once(self, tier: LowerTier) -> None:
        keys = np.random.default_rng(0).permutation(1000).astype(np.int64) * 7 - 3000
        recs = make_records(self.layout, keys)
        tier.put(keys, recs)
        tier.delete(keys[:100])
        seen_k, seen_r = [], []
        for k, r in tier.scan(chunk_rows=64):
            assert k.dtype == np.int64 and r.shape == (k.size, self.layout.record_bytes)
            assert 0 < k.size <= 64
            seen_k.append(k)
            seen_r.append(r)
        k = np.concatenate(seen_k)
        r = np.concatenate(seen_r)
        assert k.size == 900 and np.unique(k).size == 900
        order = {int(x): i for i, x in enumerate(keys)}
        idx = np.array([order[int(x)] for x in k])
        np.testing.assert_array_equal(r, recs[idx])
        with pytest.raises(ValueError):
            list(tier.scan(0))

    def test_scan_yields_rows_left_alone_while_others_change(self, tier: LowerTier) -> None:
        """``scan``'s promise to snapshots: a row untouched while it runs is yielded, unchanged.

        Between chunks, other rows are overwritten, deleted and added (as a training table's
        write-backs, promotions and compactions do while a save reads the tier); every row
        left alone must come out of the scan with its record (once or more; rows changed
        meanwhile may or may not).
        """
        keys = np.arange(3000, dtype=np.int64) * 5 + 1
        recs = make_records(self.layout, keys, seed=3)
        tier.put(keys, recs)
        rng = np.random.default_rng(4)
        touched = np.zeros(keys.size, np.bool_)
        seen: dict[int, np.ndarray] = {}
        fresh = 10**9
        for k, r in tier.scan(chunk_rows=100):
            for key, rec in zip(k.tolist(), r, strict=True):
                seen.setdefault(key, rec.copy())
            idx = rng.choice(keys.size, 30, replace=False)
            touched[idx] = True
            tier.delete(keys[idx[:10]])
            tier.put(keys[idx[10:20]], make_records(self.layout, keys[idx[10:20]],
                                                    seed=int(idx[0])))
            new = np.arange(fresh, fresh + 10, dtype=np.int64)
            fresh += 10
            tier.put(new, make_records(self.layout, new))
        left = np.flatnonzero(~touched)
        assert left.size > 1000
        missing = [int(keys[i]) for i in left if int(keys[i]) not in seen]
        assert not missing, f"the scan missed {len(missing)} untouched rows: {missing[:5]}"
        got = np.stack([seen[int(keys[i])] for i in left])
        np.testing.assert_array_equal(got, recs[left])

    def test_scores_match_the_records(self, tier: LowerTier) -> None:
        """``scores`` (what a cascade ranks by) reads the same fields as whole records."""
        keys = np.arange(500, dtype=np.int64) * 3 - 700
        recs = make_records(self.layout, keys)
        f = self.layout.unpack(recs)
        f.freq[:] = np.arange(keys.size) * 11 + 2**40
        f.change_seq[:] = -np.arange(keys.size) - 5
        tier.put(keys, recs)
        tier.delete(keys[:50])
        for field, want in (("freq", f.freq), ("change_seq", f.change_seq)):
            k, v = tier.scores(field)
            assert k.dtype == np.int64 and v.dtype == np.int64 and k.size == v.size == 450
            order = np.argsort(k)
            np.testing.assert_array_equal(k[order], keys[50:])
            np.testing.assert_array_equal(v[order], want[50:])
        with pytest.raises(ConfigError, match="score field"):
            tier.scores("values")

    def test_check_clean(self, tier: LowerTier) -> None:
        keys = np.arange(300, dtype=np.int64)
        tier.put(keys, make_records(self.layout, keys))
        tier.put(keys[::2], make_records(self.layout, keys[::2], 5))
        tier.delete(keys[::3])
        tier.flush()
        assert tier.check() == []

    def test_stats(self, tier: LowerTier) -> None:
        keys = np.arange(10, dtype=np.int64)
        tier.put(keys, make_records(self.layout, keys))
        tier.get(keys)
        s = tier.stats()
        for name in ("rows", "bytes", "reads", "writes", "compactions"):
            assert name in s, name
        assert s["rows"] == 10 and s["writes"] >= 10 and s["reads"] >= 10

    def test_closed_tier_refuses(self, make_tier) -> None:
        tier = make_tier(self.layout)
        tier.close()
        tier.close()  # twice is harmless
        with pytest.raises(StoreClosedError):
            tier.get(np.array([1], np.int64))
        with pytest.raises(StoreClosedError):
            tier.put(np.array([1], np.int64), make_records(self.layout, np.array([1], np.int64)))

    # ----------------------------------------------------------------- persistence
    def test_reopen_persists(self, make_tier) -> None:
        if not self.persistent:
            pytest.skip("tier is not persistent")
        tier = make_tier(self.layout)
        keys = np.arange(-500, 500, dtype=np.int64) * 3
        recs = make_records(self.layout, keys)
        tier.put(keys, recs)
        tier.put(keys[:100], make_records(self.layout, keys[:100], 9))
        tier.delete(keys[100:200])
        tier.flush()
        tier = self.reopen(tier, make_tier)
        try:
            assert len(tier) == 900
            found, got = tier.get(keys)
            assert found.tolist() == [True] * 100 + [False] * 100 + [True] * 800
            np.testing.assert_array_equal(got[:100], make_records(self.layout, keys[:100], 9))
            np.testing.assert_array_equal(got[200:], recs[200:])
            assert tier.check() == []
        finally:
            tier.close()

    def test_reopen_with_other_layout_refused(self, make_tier) -> None:
        if not self.persistent:
            pytest.skip("tier is not persistent")
        tier = make_tier(self.layout)
        tier.put(np.array([1], np.int64), make_records(self.layout, np.array([1], np.int64)))
        tier.close()
        other = RecordLayout(self.layout.dim + 1, self.layout.value_dtype, self.layout.num_slots)
        with pytest.raises(ShapeError):
            make_tier(other)
        make_tier(self.layout).close()  # the refused open left it usable

    # ----------------------------------------------------------------- bad input
    def _state(self, tier: LowerTier) -> tuple[int, np.ndarray]:
        keys = np.sort(tier.keys())
        return len(tier), tier.get(keys)[1]

    def test_bad_input_changes_nothing(self, tier: LowerTier) -> None:
        lay = self.layout
        keys = np.arange(5, dtype=np.int64)
        recs = make_records(lay, keys)
        tier.put(keys, recs)
        before = self._state(tier)
        bad_calls = [
            (ShapeError, lambda: tier.put(keys, recs[:, :-8])),  # wrong record width
            (ShapeError, lambda: tier.put(keys, recs[:4])),  # mismatched lengths
            (ShapeError, lambda: tier.put(keys, recs.view(np.int8))),  # wrong dtype
            (ShapeError, lambda: tier.put(keys, recs.tolist())),  # not an array
            (ShapeError, lambda: tier.put(keys[::-1], recs)),  # record keys differ
            (KeyTypeError, lambda: tier.put(keys.astype(np.float64), recs)),
            (KeyTypeError, lambda: tier.put(keys.astype(np.uint64), recs)),
            (KeyTypeError, lambda: tier.get(keys.astype(np.float32))),
            (KeyTypeError, lambda: tier.get("abc")),  # type: ignore[arg-type]
            (KeyTypeError, lambda: tier.delete(np.array(["a"]))),
            (ShapeError, lambda: tier.get(keys.reshape(5, 1))),
            (ShapeError, lambda: tier.put(keys.reshape(5, 1), recs)),
        ]
        for exc, call in bad_calls:
            with pytest.raises(exc) as info:
                call()
            assert len(str(info.value)) > 20  # says what was wrong and what to do
        after = self._state(tier)
        assert after[0] == before[0]
        np.testing.assert_array_equal(after[1], before[1])

    def test_small_int_key_dtypes_accepted(self, tier: LowerTier) -> None:
        keys = np.array([1, 2], np.int32)
        recs = make_records(self.layout, keys.astype(np.int64))
        tier.put(keys, recs)
        # a list of keys is accepted too, though the signature asks for an array
        assert tier.contains([1, 2, 3]).tolist() == [True, True, False]  # type: ignore[arg-type]

    # ----------------------------------------------------------------- model check
    def test_matches_dict_model(self, tier: LowerTier) -> None:
        lay = self.layout
        key_st = st.sampled_from([I64.min, -5, -1, 0, 1, 2, 3, 17, 1 << 33, I64.max])

        class TierModel(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                tier.clear()
                self.model: dict[int, bytes] = {}
                self.seed = 0

            @rule(ks=st.lists(key_st, max_size=8))
            def put(self, ks: list[int]) -> None:
                self.seed += 1
                keys = np.array(ks, np.int64)
                recs = make_records(lay, keys, self.seed)
                tier.put(keys, recs)
                for k, r in zip(ks, recs, strict=True):
                    self.model[k] = r.tobytes()

            @rule(ks=st.lists(key_st, max_size=5))
            def delete(self, ks: list[int]) -> None:
                n = tier.delete(np.array(ks, np.int64))
                assert n == len({k for k in ks if k in self.model})
                for k in ks:
                    self.model.pop(k, None)

            @rule(ks=st.lists(key_st, max_size=8))
            def get(self, ks: list[int]) -> None:
                found, got = tier.get(np.array(ks, np.int64))
                for k, f, r in zip(ks, found, got, strict=True):
                    assert bool(f) == (k in self.model)
                    if f:
                        assert r.tobytes() == self.model[k]

            @rule()
            def flush(self) -> None:
                tier.flush()

            @invariant()
            def same_keys(self) -> None:
                assert len(tier) == len(self.model)
                assert sorted(tier.keys().tolist()) == sorted(self.model)

        run_state_machine_as_test(
            TierModel,
            settings=settings(
                max_examples=25,
                stateful_step_count=15,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
        assert tier.check() == []
