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


def test_dense_server_steps_adam_on_pushed_gradients():
    """The dense half of bench ps-train, in process: Adam on the gradients a worker pushes."""
    import numpy as np
    import torch

    from tensorkv.bench.ps_train import DenseServer

    server = DenseServer(seed=0)
    w0 = server.pull()
    grads = [np.ones_like(w) for w in w0]
    assert server.push(grads) == 1 and server.push(grads) == 2
    ref = [torch.tensor(w, requires_grad=True) for w in w0]
    opt = torch.optim.Adam(ref, lr=server.opt.defaults["lr"])
    for _ in range(2):
        for p, g in zip(ref, grads, strict=True):
            p.grad = torch.from_numpy(g)
        opt.step()
    for got, want in zip(server.pull(), ref, strict=True):
        np.testing.assert_array_equal(got, want.detach().numpy())
