"""``tensorkv bench ps`` and ``bench ps_train`` run at a tiny size (figures not checked)."""

import math

import pytest

from tensorkv.bench.common import Report


def test_bench_ps_tiny(ray_cluster):
    from tensorkv.bench import ps

    report = Report("ps", echo=False)
    # (several workers: test_ps.py and the ps_train test below run worker actors)
    ps.run(True, report, batch=256, steps=2, vocab=2000, shards="1,2", calls=10, workers=0,
           small=16)
    cases = [r.case for r in report.results]
    assert cases == ["pull+push, 1 shard, 1 worker", "pull of 1 key (per-call overhead)",
                     "pull of an empty batch", "pull+push, 2 shards, 1 worker",
                     "step of 16 keys, 2 shards (latency)"]
    assert all(math.isfinite(r.ratio) and r.value > 0 for r in report.results)


def test_bench_ps_train_tiny(ray_cluster):
    pytest.importorskip("torch")
    from tensorkv.bench import ps_train

    report = Report("ps_train", echo=False)
    ps_train.run(True, report, steps=4, batch=64, eval_batches=1)
    auc = report.results[0]
    assert auc.metric == "AUC" and 0 <= auc.value <= 1 and 0 <= auc.baseline_value <= 1
    assert report.params["rows"] > 0
