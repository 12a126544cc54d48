"""``tensorkv bench redis-table`` at a tiny size: every case runs and reports a figure."""

from __future__ import annotations

import pytest

from tensorkv.bench import redis_table
from tensorkv.bench.common import Report
from tensorkv.bench.redis_server import redis_server_path


@pytest.mark.skipif(redis_server_path() is None, reason="redis-server is not installed")
def test_bench_redis_table_smoke():
    report = Report("redis-table", quick=True, echo=False)
    redis_table.run(True, report, n_keys=3000, batch=1000, repeat=1)
    cases = {r.case for r in report.results}
    assert {"upsert", "lookup (read-only table)", "lookup+apply, exact",
            "Cluster 2 masters: lookup", "Cluster 3 masters: lookup", "SGD upsert, exact",
            "SGD lookup, last_writer_wins",
            "Zipf 1.05 lookup, near-cache, 2nd process training"} <= cases
    assert report.params["zipf_stale_reads"] == 0 and report.params["zipf_checked_reads"] > 0
    assert all(r.value > 0 and r.baseline_value > 0 for r in report.results)
