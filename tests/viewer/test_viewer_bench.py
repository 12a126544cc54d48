"""``tensorkv bench viewer`` at a tiny size: it runs, checks its answers and reuses its data."""

from __future__ import annotations

from tensorkv.bench.common import Report
from tensorkv.bench.viewer import ensure_checkpoint, run


def test_viewer_bench_runs_and_reuses_its_checkpoint(tmp_path):
    path = tmp_path / "store"
    report = Report("viewer", quick=True, echo=False)
    run(True, report, rows=3000, dim=8, path=str(path), repeat=1, k=5)
    cases = {r.case: r for r in report.results}
    assert {r.note for r in report.results if r.baseline == "load + numpy"
            and r.case.startswith("nearest")} == {"same keys"}
    assert "`tensorkv search --nearest` (new process)" in cases
    assert all(r.value > 0 for r in report.results)
    mtime = (path / "data.mdb").stat().st_mtime_ns
    ensure_checkpoint(f"lmdb://{path}", 3000, 8)  # what a second run does first
    assert (path / "data.mdb").stat().st_mtime_ns == mtime  # reused, not saved again
