"""Exactness: DynamicEmbeddingBag trains like nn.EmbeddingBag(sparse=True) on pre-mapped ids.

The same model (EmbeddingBag + Linear) is built with a DynamicEmbeddingBag and with a static
nn.EmbeddingBag holding the same initial rows; 200 steps of SGD, Adagrad and (Sparse)Adam give
the same losses and parameters within 1e-5, on DRAM and on a DRAM+SSDHASH chain whose tier 0
is smaller than the ids (rows move down and up every step), and across a save and a restore
into a fresh process.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import parity_model as pm  # noqa: E402

import tensorkv.torch as tt  # noqa: E402

STEPS = 200
TOL = 1e-5


def assert_same_params(dyn, sta):
    rows = dyn.bag.table.lookup(pm.KEYS, insert=False)
    assert np.abs(rows - sta.bag.weight.detach().numpy()).max() <= TOL
    for a, b in zip(dyn.lin.parameters(), sta.lin.parameters(), strict=True):
        assert (a - b).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", ["dram", "ssdhash"])
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam"])
def test_dynamic_bag_trains_like_static_sparse_bag(opt, kind, tmp_path):
    dyn, dopt = pm.dynamic(opt, kind, str(tmp_path / "spill"))
    sta, sopts = pm.static(opt)
    try:
        for step in range(STEPS):
            ld = pm.train_step(dyn, [dopt], step, False)
            ls = pm.train_step(sta, sopts, step, True)
            assert abs(ld - ls) <= TOL, f"step {step}: loss {ld} vs {ls}"
        if kind == "ssdhash":
            stats = dyn.bag.table.stats()
            assert stats["tier0_rows"] <= pm.TIER0_ROWS < stats["rows"]
            assert stats["tiers"][0]["evictions"] >= STEPS  # rows went down every step
        assert_same_params(dyn, sta)
    finally:
        dyn.bag.table.close()


@pytest.mark.parametrize("kind", ["dram", "ssdhash"])
def test_fused_updates_in_backward_give_identical_results(kind, tmp_path):
    """Optimizer(fused=True) applies the table step inside backward: bit-identical training."""
    runs = [pm.dynamic("adagrad", kind, str(tmp_path / f"spill{fused}"), fused=fused)
            for fused in (False, True)]
    try:
        for step in range(40):
            losses = [pm.train_step(m, [o], step, False) for m, o in runs]
            assert losses[0] == losses[1], f"step {step}"
            assert runs[1][0].bag.pending_gradients() == 0  # nothing waits for step()
        rows = [m.bag.table.lookup(pm.KEYS, insert=False) for m, _ in runs]
        np.testing.assert_array_equal(rows[0], rows[1])
        assert "fused=True" in repr(runs[1][1])
    finally:
        for m, _ in runs:
            m.bag.table.close()


def test_training_continues_identically_after_restore_in_a_fresh_process(tmp_path):
    opt, kind = "adam", "ssdhash"  # table slots and global step, dense Adam state, tiers
    half, rest = 60, 40
    url = f"lmdb://{tmp_path / 'ckpt'}"
    dyn, dopt = pm.dynamic(opt, kind, str(tmp_path / "spill"))
    sta, sopts = pm.static(opt)
    try:
        for step in range(half):
            pm.train_step(dyn, [dopt], step, False)
            pm.train_step(sta, sopts, step, True)
        tt.save(dyn, url, "mid", optimizer=dopt)
        want = [pm.train_step(dyn, [dopt], s, False) for s in range(half, half + rest)]
        ref = [pm.train_step(sta, sopts, s, True) for s in range(half, half + rest)]
        rows = dyn.bag.table.lookup(pm.KEYS, insert=False)
    finally:
        dyn.bag.table.close()
    script = os.path.join(os.path.dirname(__file__), "parity_model.py")
    out = subprocess.run(
        [sys.executable, script, opt, kind, url, "mid", str(tmp_path / "spill2"), str(half),
         str(rest)], capture_output=True, text=True, env={**os.environ}, timeout=240)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["losses"] == want  # the same process state: bit-identical
    assert np.array_equal(np.asarray(got["rows"], np.float32), rows)
    assert np.abs(np.asarray(got["losses"]) - np.asarray(ref)).max() <= TOL
