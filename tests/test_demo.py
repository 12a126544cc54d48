"""``tensorkv demo``: the training demo's data, AUC, checkpoint and fresh-process resume."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from tensorkv.bench.dlrm import N_CAT, N_DENSE, SyntheticCTR, auc
from tensorkv.cli.main import main


def test_batches_are_a_function_of_seed_and_step():
    data = SyntheticCTR(0)
    a, b = data.batch(7, 512), SyntheticCTR(0).batch(7, 512)
    assert np.array_equal(a.keys, b.keys) and np.array_equal(a.dense, b.dense)
    assert np.array_equal(a.labels, b.labels)
    assert a.dense.shape == (512, N_DENSE) and a.keys.shape == (512, N_CAT)
    assert not np.array_equal(a.keys, data.batch(8, 512).keys)
    feature = a.keys >> 32
    assert np.array_equal(feature, np.broadcast_to(np.arange(N_CAT), (512, N_CAT)))
    ids = a.keys & ((1 << 32) - 1)
    assert ids.max() < data.vocab
    # Zipf: the widest feature repeats few ids, the narrowest mostly one
    assert len(np.unique(ids[:, 0])) > 5 * len(np.unique(ids[:, -1]))


def test_labels_follow_the_hidden_model():
    data = SyntheticCTR(0)
    b = data.batch(0, 20_000)
    logit = data.bias + b.dense @ data.dense_weight + data.id_effects(b.keys).sum(1)
    assert auc(b.labels, logit) > 0.8  # learnable: the true logit ranks the labels well
    assert 0.1 < b.labels.mean() < 0.5


def test_auc_matches_the_pairwise_definition():
    rng = np.random.default_rng(0)
    y = rng.random(300) < 0.3
    s = np.round(rng.random(300), 1)  # many ties
    pos, neg = s[y], s[~y]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert auc(y, s) == pytest.approx(pairs)
    assert np.isnan(auc(np.ones(3), np.arange(3.0)))


def test_demo_trains_checkpoints_and_resumes_identically(tmp_path):
    pytest.importorskip("tensorkv.torch")
    path = tmp_path / "data"
    runner = CliRunner()
    for _ in range(2):  # a second run in the same directory replaces the first
        result = runner.invoke(main, ["demo", "--path", str(path), "--quick"])
        assert result.exit_code == 0, result.output
        out = result.output
        assert "samples/s" in out and "AUC" in out
        assert "identical" in out and "DIFFERENT" not in out
        for word in ("rows", "hit ratio", "admission", "eviction", "checkpoints",
                     "tensorkv ls lmdb://", "tensorkv view lmdb://", "tensorkv check lmdb://"):
            assert word in out
    from tensorkv.checkpoint import list_tags

    tags = list_tags(f"lmdb://{path / 'lmdb'}")
    assert len(tags) == 2  # mid-run and final; none of the first run's
    assert (path / "spill").is_dir()
