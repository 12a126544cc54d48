"""``tensorkv bench train``: a tiny run reports every form and phase (no timing asserts)."""

from __future__ import annotations

import pytest

from tensorkv.bench.common import Report


def test_train_smoke_reports_every_form_and_phase():
    pytest.importorskip("tensorkv.torch")
    from tensorkv.bench import train

    report = Report("train", quick=True, echo=False)
    train.run(True, report, batch=64, steps=2, warmup=1)
    cases = [r.case for r in report.results]
    for case in ("DRAM samples/s", "DRAM embedding cost", "DRAM+SSDHASH samples/s",
                 "dense only samples/s", "DRAM step: lookup", "DRAM step: inserts",
                 "DRAM step: backward", "DRAM step: optimizer", "26 static samples/s",
                 "26 DynamicEmbeddingBag embedding cost", "collection samples/s",
                 "collection embedding cost", "convert(group=True) samples/s",
                 "collection step: lookup", "collection step: dedup",
                 "26 DynamicEmbeddingBag step: backward"):
        assert case in cases
    for r in report.results:  # a cost (a difference of two times) may be noise in a tiny run
        assert r.value > 0 or "cost" in r.case
        assert r.ratio == pytest.approx(r.value / r.baseline_value)
    # every timed run inserts new ids, and the static table is sized to the distinct ids
    assert report.params["new_ids_per_step"] > 0
    import numpy as np

    from tensorkv.bench.dlrm import SyntheticCTR

    keys = np.concatenate([SyntheticCTR(0).batch(s, 64).keys.ravel() for s in range(3)])
    assert report.params["distinct_ids"] == np.unique(keys).size
    assert 1 <= report.params["tier0_rows"] <= report.params["distinct_ids"] // 10 + 1


def test_train_refuses_bad_sizes():
    from tensorkv.bench import train

    with pytest.raises(ValueError, match="steps"):
        train.run(True, Report("train", echo=False), steps=-1)


def test_train_is_a_listed_workload_and_dlrm_is_not():
    from tensorkv.cli.bench_cmd import workloads

    assert "train" in workloads() and "dlrm" not in workloads()
