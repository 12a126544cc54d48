"""The repository benchmark runs end to end at tiny sizes (structure only, never timings)."""

from __future__ import annotations

import pytest

from tensorkv.bench import repo
from tensorkv.bench.common import Report
from tensorkv.bench.redis_server import redis_server_path


def test_repo_bench_smoke(tmp_path):
    pytest.importorskip("h5py")
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    report = Report("repo", quick=True, echo=False)
    repo.run(True, report, layers=8, model_mb=0.2, populations="60,120", readers="1",
             providers="1,2", repeat=1, root=str(tmp_path), read_seconds=0.2)
    cases = {r.case for r in report.results}
    assert {"store model (LMDB, durable)", "load model (LMDB, copying)",
            "load model (LMDB, zero-copy)", "load 25% prefix (LMDB, copying)",
            "load 25% prefix (LMDB, zero-copy)", "one tensor of a 100-tensor model (copying)",
            "one tensor of a 100-tensor model (zero-copy)", "bytes stored, children share 50%",
            "1 reader processes (copying)", "1 reader processes (zero-copy)",
            "store over 2 Redis providers", "placement over 2 providers",
            "longest_prefix p50 at 120 models", "metadata puts, 2 client processes"} <= cases
    bad = [r for r in report.results if not (r.value > 0 and r.baseline_value > 0)]
    assert not bad, bad
    dedup = next(r for r in report.results if r.case.startswith("bytes stored"))
    assert dedup.ratio < 1.01


def test_repo_put_profile_smoke(tmp_path):
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    from tensorkv.bench import repo_put

    report = Report("repo-put", quick=True, echo=False)
    repo_put.run(True, report, model_mb=0.4, layers=8, child_layers=4, repeat=1,
                 root=str(tmp_path))
    cases = {r.case for r in report.results}
    for label in ("0 MB put (LMDB, sync=False)", "0 MB put (LMDB, durable)", "0 MB put (Redis)",
                  "4-layer child, 75% shared (LMDB, sync=False)"):
        assert f"{label}: hashing (one pass over the bytes)" in cases
        assert f"{label}: counting references (intent ahead)" in cases
    assert all(r.baseline == "whole put" and r.value > 0 for r in report.results
               if "hashing" in r.case or "counting" in r.case)
