"""Tier 0's cache policies (``cache_strategy="lru"`` / ``"lfu"``) against a reference model.

How tier 0 evicts (docs/tiers.md, "Per batch"): after each batch every row of the batch gets
the batch's tick, and if tier 0 holds more rows than its budget, the excess moves down; the
batch's own rows are never chosen. LRU takes the rows of the oldest tick, LFU the rows with
the lowest access count (``frequency``, which travels with a row through the tiers), older
tick first among equal counts. The choice is exact, but batched, and it is unspecified among
rows of equal score: LFU picks among equals with ``argpartition``, and LRU's order within one
tick depends on the order the rows were touched (and is reset to row order when tier 0 is
packed). So :class:`PolicyModel` does not predict one resident set: after every batch it
checks that the rows the table moved down are a valid choice (the right number, none of the
batch, and no remaining candidate scoring below a victim), then goes on from the table's
choice. Its tier-0 hit and miss counts are then exact and must equal the table's.

Below tier 0, a lower tier over its budget cascades its coldest rows (LFU: lowest frequency;
LRU: oldest change sequence) to the next tier: :func:`check_cascade`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

from tensorkv.embedding import EmbeddingTable
from tensorkv.embedding.tiers.base import RecordLayout

DIM = 4
BUDGET = 32  # tier-0 rows
LAY = RecordLayout(DIM, num_slots=0)  # sgd: no slots


class PolicyModel:
    """Tier 0 of a tiered table under ``policy``, ``budget`` rows, checked batch by batch."""

    def __init__(self, policy: str, budget: int) -> None:
        self.policy = policy
        self.budget = budget
        self.freq: Counter[int] = Counter()
        self.tick: dict[int, int] = {}
        self.resident: set[int] = set()
        self.hits = self.misses = 0
        self.ties = 0  # batches whose victims tied with a row that stayed

    def score(self, key: int) -> Any:
        return self.tick[key] if self.policy == "lru" else (self.freq[key], self.tick[key])

    def batch(self, b: int, keys: np.ndarray, observed: set[int]) -> None:
        """Account lookup ``b`` of ``keys``; check the table's tier 0 after it, ``observed``."""
        ks = keys.tolist()
        distinct = set(ks)
        missed = len(distinct - self.resident)
        self.misses += missed
        self.hits += len(ks) - missed
        self.freq.update(ks)
        for k in distinct:
            self.tick[k] = b
        union = self.resident | distinct
        candidates = union - distinct
        n_victims = min(max(len(union) - self.budget, 0), len(candidates))
        where = f"batch {b} ({self.policy})"
        assert distinct <= observed, f"{where}: rows of the batch left tier 0"
        assert observed <= union, f"{where}: tier 0 holds keys from nowhere"
        victims = union - observed
        assert len(victims) == n_victims, (
            f"{where}: {len(victims)} rows moved down, expected {n_victims}")
        stayed = candidates - victims
        if victims and stayed:
            worst = max(self.score(k) for k in victims)
            best = min(self.score(k) for k in stayed)
            assert worst <= best, (
                f"{where}: moved down a row scoring {worst} while one scoring {best} stayed "
                f"(scores: {'tick' if self.policy == 'lru' else '(frequency, tick)'})")
            self.ties += worst == best
        self.resident = observed


def tier0_keys(table: EmbeddingTable) -> set[int]:
    """Keys in tier 0 now (after the deferred demotion of the last lookup has finished)."""
    with table._rows.lock.read():  # settles the demotion
        return set(table.arena.keys().tolist())


def make_table(tmp_path, policy: str, storage: str = "DRAM_SSDHASH", sizes=None,
               **kw: Any) -> EmbeddingTable:
    if storage.startswith("HBM"):
        kw["device"] = "cpu"
    return EmbeddingTable(DIM, optimizer="sgd", seed=2, storage=storage,
                          storage_path=str(tmp_path / "tier"), cache_strategy=policy,
                          storage_size=sizes or [BUDGET * LAY.record_bytes], **kw)


def run(table: EmbeddingTable, model: PolicyModel, batches: list[np.ndarray],
        start: int = 0) -> None:
    """Lookup + apply of each batch, checking tier 0 against ``model`` after each one."""
    for i, keys in enumerate(batches):
        table.lookup(keys)
        table.apply_gradients(keys, np.full((keys.size, DIM), 0.01, np.float32))
        model.batch(start + i + 1, keys, tier0_keys(table))


def skewed_batches(seed: int, n: int, batch: int = 12, n_ids: int = 300) -> list[np.ndarray]:
    """Batches drawn from a Zipf-like law (p ~ 1/rank) over shuffled ids, duplicates kept."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_ids + 1)
    ids = rng.permutation(n_ids).astype(np.int64) * 7 + 1000
    return [ids[rng.choice(n_ids, batch, p=p / p.sum())] for _ in range(n)]


@pytest.mark.parametrize("storage", ["DRAM_SSDHASH", "HBM_SSDHASH"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_tier0_follows_the_policy_on_a_skewed_trace(tmp_path, policy, storage):
    """150 batches of 12 lookups over 300 ids: every eviction is a valid choice of the
    policy, and the tier-0 hit ratio equals the reference model's."""
    batches = skewed_batches(5, 150)
    model = PolicyModel(policy, BUDGET)
    with make_table(tmp_path, policy, storage) as t:
        run(t, model, batches)
        st = t.stats()["tiers"]
        assert st[0]["evictions"] > 500 and st[1]["promotions"] > 300, st
        assert (st[0]["hits"], st[0]["misses"]) == (model.hits, model.misses)
        keys = np.array(sorted(model.freq), np.int64)
        np.testing.assert_array_equal(t.frequency(keys), [model.freq[k] for k in keys])
    ratio = model.hits / (model.hits + model.misses)
    assert 0.3 < ratio < 0.9, ratio  # a skewed trace with a real cache: neither extreme


def scan_trace() -> tuple[np.ndarray, list[np.ndarray]]:
    """Hot keys (8, in each of 30 batches beside 4 warm ones), then a scan of 300 new keys."""
    rng = np.random.default_rng(9)
    hot = np.arange(8, dtype=np.int64)
    warm = [np.concatenate([hot, rng.choice(np.arange(100, 200), 4, replace=False)])
            for _ in range(30)]
    scan = [np.arange(1000 + 12 * i, 1012 + 12 * i, dtype=np.int64) for i in range(25)]
    return hot, warm + scan


def test_lfu_keeps_the_hottest_keys_through_a_scan(tmp_path):
    """Under LFU the hot keys (30 lookups each) outlast 300 keys seen once."""
    hot, batches = scan_trace()
    model = PolicyModel("lfu", BUDGET)
    with make_table(tmp_path, "lfu") as t:
        run(t, model, batches)
        resident = tier0_keys(t)
        assert set(hot.tolist()) <= resident, (
            f"hot keys moved down under LFU: {sorted(set(hot.tolist()) - resident)}")
        before = t.stats()["tiers"][0]["hits"]
        t.lookup(hot)
        assert t.stats()["tiers"][0]["hits"] - before == hot.size


def test_lru_keeps_the_most_recent_keys_through_a_scan(tmp_path):
    """Under LRU the scan pushes the hot keys out; tier 0 holds the latest batches."""
    hot, batches = scan_trace()
    model = PolicyModel("lru", BUDGET)
    with make_table(tmp_path, "lru") as t:
        run(t, model, batches)
        resident = tier0_keys(t)
        assert not set(hot.tolist()) & resident, "hot keys stayed under LRU"
        recent = set(np.concatenate(batches[-(BUDGET // 12):]).tolist())  # 2 batches
        assert recent <= resident and len(resident) == BUDGET
        older = set(batches[-(BUDGET // 12) - 1].tolist())  # the rest from the batch before
        assert resident - recent <= older
        before = t.stats()["tiers"][0]["misses"]
        t.lookup(hot)
        assert t.stats()["tiers"][0]["misses"] - before == hot.size


# --------------------------------------------------------------------------- cascades
def lower_scores(table: EmbeddingTable, ti: int, field: str) -> dict[int, int]:
    """``{key: score}`` of the rows in lower tier ``ti`` (1-based), after every write."""
    tier = table._rows.chain.lowers[ti - 1][0]
    keys, scores = tier.scores(field)
    return dict(zip(keys.tolist(), scores.tolist(), strict=True))


def check_cascade(moved: set[int], stayed: dict[int, int], scores: dict[int, int],
                  where: str) -> None:
    """Rows ``moved`` from tier 1 to tier 2 score no higher than any row that stayed."""
    if not moved or not stayed:
        return
    worst = max(scores[k] for k in moved)
    best = min(stayed.values())
    assert worst <= best, f"{where}: cascaded a row scoring {worst} while one scoring {best} " \
        "stayed in tier 1"


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cascade_moves_the_coldest_rows_down(tmp_path, policy):
    """DRAM (32 rows) over PMEM (64 rows) over SSDHASH: each cascade moves the tier-1 rows
    of lowest frequency (LFU) or oldest change sequence (LRU) to tier 2."""
    field = "freq" if policy == "lfu" else "change_seq"
    sizes = [BUDGET * LAY.record_bytes, 64 * LAY.record_bytes]
    model = PolicyModel(policy, BUDGET)
    cascades = 0
    with make_table(tmp_path, policy, "DRAM_PMEM_SSDHASH", sizes) as t:
        tier2: set[int] = set()
        for i, keys in enumerate(skewed_batches(6, 120)):
            t.lookup(keys)
            t.apply_gradients(keys, np.full((keys.size, DIM), 0.01, np.float32))
            model.batch(i + 1, keys, tier0_keys(t))
            t.wait_writes()  # the landing and its cascade have run
            s1 = lower_scores(t, 1, field)
            s2 = lower_scores(t, 2, field)
            moved = set(s2) - tier2
            cascades += bool(moved)
            check_cascade(moved, s1, s2, f"batch {i + 1} ({policy})")
            tier2 = set(s2)
        assert cascades > 5 and t.stats()["tiers"][1]["evictions"] > 0
