"""The checkpoint benchmark runs end to end at tiny sizes (structure only, never timings)."""

from __future__ import annotations

from tensorkv.bench import checkpoint
from tensorkv.bench.common import Report


def test_checkpoint_bench_smoke(tmp_path):
    report = Report("checkpoint", quick=True, echo=False)
    checkpoint.run(True, report, rows=3000, dim=8, dense_mb=0.5, backends=["lmdb"],
                   block_sizes=(256, 1024), repeat=1, root=str(tmp_path), training=False)
    cases = {r.case for r in report.results}
    assert {"save lmdb", "restore lmdb", "incremental save, 1% rows changed (lmdb)",
            "save lmdb, block_rows=256", "restore lmdb, block_rows=1024",
            "save dram_ssdhash table -> lmdb", "restore dram_ssdhash table -> lmdb"} <= cases
    baselines = {r.baseline for r in report.results if r.case == "save lmdb"}
    assert {"torch.save", "safetensors", "np.save", "raw write+fsync"} <= baselines
    assert all(r.value > 0 and r.baseline_value > 0 for r in report.results)
    assert report.params["rows"] == 3000 and report.params["model_bytes"] > 0


def test_checkpoint_bench_takes_cli_text(tmp_path):
    """``-p backends=lmdb -p block_sizes=`` arrive as text: parsed, not iterated by letter."""
    report = Report("checkpoint", quick=True, echo=False)
    checkpoint.run(True, report, rows=2000, dim=4, dense_mb=0.2, backends="lmdb",
                   block_sizes="", repeat=1, root=str(tmp_path), tiered=False, training=False)
    cases = {r.case for r in report.results}
    assert "save lmdb" in cases and not any("block_rows" in c or "dram" in c for c in cases)
    assert checkpoint._names("256, 1024") == ["256", "1024"]
    assert checkpoint._names(512) == [512] and checkpoint._names(None) == []


def test_save_while_training_smoke(tmp_path):
    """The DLRM passes with saves every other step, both table kinds (tiny sizes)."""
    from tensorkv.bench import save_training

    report = Report("checkpoint", quick=True, echo=False)
    save_training.run(True, report, str(tmp_path), batch=64, steps=4, warm=2, every=2)
    cases = {r.case for r in report.results}
    for kind in ("DRAM", "DRAM+SSDHASH"):
        assert {f"save while training, {kind}: blocking stall",
                f"save while training, {kind}: non-blocking stall",
                f"save while training, {kind}: samples/s while saving"} <= cases
    info = report.params["save_while_training_dram_ssdhash"]
    assert info["saves"] >= 3 and info["rows"] > 0 and info["peak_snapshot_bytes"] > 0
    assert not list(tmp_path.iterdir())  # the store and spill directories are removed
