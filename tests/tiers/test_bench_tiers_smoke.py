"""``tensorkv bench tiers`` runs at tiny size and reports every case (timing is not checked)."""

from __future__ import annotations

import math

from tensorkv.bench import tiers as bench_tiers
from tensorkv.bench.common import Report


def test_bench_tiers_tiny(tmp_path):
    report = Report("tiers", quick=True, echo=False)
    bench_tiers.run(True, report, n_keys=3000, batch=256, dim=8, steps=2,
                    fractions=(0.1, 0.5), zipfs=(1.05,),
                    backends=("DRAM_SSDHASH", "DRAM_LEVELDB"), data_dir=str(tmp_path))
    cases = [(r.case, r.metric) for r in report.results]
    assert ("DRAM_SSDHASH tier0=10% zipf=1.05", "Mkeys/s") in cases
    assert ("DRAM_LEVELDB tier0=50% zipf=1.05", "tier0 hit %") in cases
    assert ("SSDHASH vs LEVELDB tier0=10% zipf=1.05", "Mkeys/s") in cases
    assert len(report.results) == 2 * 2 * 2 + 2
    for r in report.results:
        assert r.value > 0 and r.baseline_value > 0 and math.isfinite(r.ratio)
        if r.metric == "tier0 hit %":
            assert 0 < r.value <= 100 and 0 < r.baseline_value <= 100
    assert report.params["n_keys"] == 3000
    assert list(tmp_path.iterdir()) == []  # data removed


def test_bench_tiers_prefetch_and_model_step(tmp_path):
    report = Report("tiers", quick=True, echo=False)
    bench_tiers.run(True, report, n_keys=3000, batch=256, dim=8, steps=3,
                    fractions=(0.1,), zipfs=(1.05,), backends=("DRAM_SSDHASH",),
                    data_dir=str(tmp_path), prefetch=True, model_ms=1)
    (speed, hit) = report.results
    assert speed.case == "DRAM_SSDHASH tier0=10% zipf=1.05 prefetch model=1ms"
    assert "of misses prefetched" in speed.note and hit.metric == "tier0 hit %"
    assert report.params["prefetch"] is True and report.params["model_ms"] == 1.0


def test_bench_tiers_rejects_negative_model_time(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="model_ms=-1"):
        bench_tiers.run(True, Report("tiers", quick=True, echo=False), n_keys=100,
                        model_ms=-1, data_dir=str(tmp_path))


def test_bench_tiers_hbm_chains_on_cpu(tmp_path):
    report = Report("tiers", quick=True, echo=False)
    bench_tiers.run(True, report, n_keys=3000, batch=256, dim=8, steps=2,
                    fractions=(0.1, 0.5), zipfs=(1.05,),
                    backends=("HBM", "HBM_SSDHASH", "HBM_DRAM_SSDHASH"), data_dir=str(tmp_path),
                    device="cpu")
    by = {(r.case, r.metric): r for r in report.results}
    # HBM alone holds every row: one case, whatever the fractions
    assert [c for c, _ in by if c.startswith("HBM tier0")] == ["HBM tier0=100% zipf=1.05"] * 2
    assert by[("HBM tier0=100% zipf=1.05", "tier0 hit %")].value == 100.0
    speed = by[("HBM_DRAM_SSDHASH tier0=10% zipf=1.05", "Mkeys/s")]
    assert speed.baseline == "DRAM-only table + copy to cpu" and "lookup_torch" in speed.note
    assert len(report.results) == 2 + 2 * 2 * 2 and report.params["device"] == "cpu"
    assert list(tmp_path.iterdir()) == []


def test_bench_tiers_hbm_needs_a_device(tmp_path):
    import pytest
    import torch

    with pytest.raises(ValueError, match="not a torch device"):
        bench_tiers.run(True, Report("tiers", quick=True, echo=False), n_keys=100,
                        backends=("HBM",), device="floppy", data_dir=str(tmp_path))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device=cpu"):
            bench_tiers.run(True, Report("tiers", quick=True, echo=False), n_keys=100,
                            backends=("HBM_SSDHASH",), data_dir=str(tmp_path))
