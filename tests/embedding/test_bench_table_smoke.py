import math

from tensorkv.bench import table as bench_table
from tensorkv.bench.common import Report


def test_bench_table_runs_tiny_and_reports_every_case():
    report = Report("table", quick=True, echo=False)
    bench_table.run(True, report, sizes=(3000,), batch=512, dim=8, repeat=2)
    cases = [r.case for r in report.results]
    assert any(c.startswith("insert") for c in cases)
    assert sum(c.startswith("lookup") and "threads" not in c for c in cases) == 4
    assert sum(c.startswith("apply_gradients") for c in cases) == 4  # 2 draws x torch 1/all
    assert any(c.startswith("memory") for c in cases)
    for r in report.results:
        assert r.value > 0 and r.baseline_value > 0 and math.isfinite(r.ratio)
        assert r.metric in {"Mkeys/s", "bytes/key"}
    assert report.params["sizes"] == [3000]
    doc = report.to_dict()
    assert doc["bench"] == "table" and len(doc["results"]) == len(report.results)
