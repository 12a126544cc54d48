"""Random operation sequences: a tiered table always matches the DRAM-only table."""

from __future__ import annotations

import itertools
import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tensorkv.embedding import EmbeddingTable
from tensorkv.embedding.tiers.base import RecordLayout

from .test_exactness import assert_same

DIM = 3
RB = RecordLayout(DIM, num_slots=2).record_bytes
_storages = itertools.cycle([
    ("DRAM_SSDHASH", [6 * RB], "lru"),
    ("DRAM_PMEM_SSDHASH", [5 * RB, 9 * RB], "lfu"),
    ("DRAM_LMDB", [4 * RB], "lfu"),
])
keys_st = st.lists(st.integers(0, 40), min_size=1, max_size=12)


class TieredModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="tkv-model-")
        name, sizes, policy = next(_storages)
        ev = {"steps_to_live": 6, "max_rows": 30, "policy": policy, "every_n_steps": 4}
        self.ref = EmbeddingTable(DIM, optimizer="adam", seed=5, eviction=ev)
        self.t = EmbeddingTable(DIM, optimizer="adam", seed=5, eviction=ev, storage=name,
                                      storage_path=self.dir + "/t", storage_size=sizes,
                                      cache_strategy=policy)
        self.rng = np.random.default_rng(0)

    @rule(keys=keys_st)
    def lookup(self, keys):
        np.testing.assert_array_equal(self.t.lookup(keys), self.ref.lookup(keys))

    @rule(keys=keys_st)
    def peek(self, keys):
        np.testing.assert_array_equal(self.t[keys], self.ref[keys])
        np.testing.assert_array_equal(self.t.frequency(keys), self.ref.frequency(keys))
        np.testing.assert_array_equal(self.t.version(keys), self.ref.version(keys))
        np.testing.assert_array_equal(self.t.contains(keys), self.ref.contains(keys))

    @rule(keys=keys_st)
    def apply(self, keys):
        g = self.rng.standard_normal((len(keys), DIM)).astype(np.float32)
        assert self.t.apply_gradients(keys, g) == self.ref.apply_gradients(keys, g)

    @rule(keys=keys_st, v=st.floats(-1, 1, width=32))
    def upsert(self, keys, v):
        vals = np.full((len(keys), DIM), v, np.float32)
        self.t.upsert(keys, vals)
        self.ref.upsert(keys, vals)

    @rule(keys=keys_st)
    def remove(self, keys):
        assert self.t.remove(keys) == self.ref.remove(keys)

    @rule()
    def evict(self):
        assert self.t.evict() == self.ref.evict()

    @rule(since=st.integers(0, 30))
    def export_since(self, since):
        def rows(tab):
            ch = list(tab.export(chunk_rows=7, since=since))
            if not ch:
                return np.empty(0, np.int64)
            k = np.concatenate([c.keys for c in ch])
            return np.sort(k)

        np.testing.assert_array_equal(rows(self.t), rows(self.ref))

    @invariant()
    def same_size(self):
        assert len(self.t) == len(self.ref)
        assert self.t.mutation_seq == self.ref.mutation_seq

    def teardown(self):
        try:
            assert_same(self.ref, self.t)
        finally:
            self.t.close()
            shutil.rmtree(self.dir, ignore_errors=True)


TieredModel.TestCase.settings = settings(
    max_examples=15, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tiered_matches_dram = TieredModel.TestCase
