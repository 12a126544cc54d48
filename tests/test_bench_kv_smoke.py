import os

import pytest

from tensorkv import open_store
from tensorkv.bench import kv
from tensorkv.bench.common import Report
from tensorkv.bench.redis_server import RedisServer, redis_server_path


def test_kv_smoke_every_backend(tmp_path):
    report = Report("kv", quick=True, echo=False)
    kv.run(True, report, scale=0.0002, directory=str(tmp_path), drop_caches=False)
    names = report.params["backends"]
    assert "memory" in names
    for skipped in report.params["skipped"].values():
        assert skipped  # every skip says why
    metrics = {(r.case, r.metric) for r in report.results}
    for size in ("100B", "4KiB", "1MiB"):
        assert (f"files {size} write", "MB/s") in metrics
        assert (f"files {size} read", "MB/s") in metrics
        for name in names:
            for op in ("put_many", "get_many"):
                assert (f"{name} {size} {op}", "MB/s") in metrics
                assert (f"{name} {size} {op}", "ops/s") in metrics
    for r in report.results:
        assert r.value > 0 and r.baseline_value > 0
        assert r.ratio == pytest.approx(r.value / r.baseline_value)
    assert "warm" in report.params["reads"]
    table = kv.summary_table(report.to_dict()["results"]).splitlines()
    assert len(table) == 2 + 3 * (len(names) + 2)
    assert all(line.count("|") == 11 for line in table)
    assert os.listdir(tmp_path) == []


def test_kv_bad_arguments_name_the_choices(tmp_path):
    report = Report("kv", echo=False)
    with pytest.raises(ValueError, match="4KiB"):
        kv.run(True, report, sizes=["7B"], directory=str(tmp_path))
    with pytest.raises(ValueError, match="lmdb"):
        kv.run(True, report, backends=["nosuchdb"], directory=str(tmp_path))
    with pytest.raises(ValueError, match="scale"):
        kv.run(True, report, scale=0, directory=str(tmp_path))
    assert report.results == []


def test_make_data_is_deterministic():
    case = kv.SIZE_CASES[0]
    a = kv.make_data(case, 10_000)
    b = kv.make_data(case, 10_000)
    assert a.keys == b.keys and a.values == b.values
    assert len(set(a.keys)) == a.n == 100
    assert all(len(k) == kv.KEY_BYTES for k in a.keys)
    assert b"".join(a.values) == a.blob
    assert sum(len(batch) for batch in a.put_batches) == a.n


def test_bench_root_avoids_memory_filesystems(tmp_path):
    assert kv.bench_root(str(tmp_path)) == str(tmp_path)
    assert kv._fs_type(kv.bench_root()) not in {"tmpfs", "ramfs"}


@pytest.mark.skipif(redis_server_path() is None, reason="redis-server is not installed")
def test_redis_server_starts_and_stops():
    with RedisServer() as server:
        with open_store(server.url) as store:
            store.put(b"k", b"v")
            assert store.get(b"k") == b"v"
        server.flushall()
        with open_store(server.url) as store:
            assert store.get(b"k") is None
        assert server.used_memory() > 0
        directory = server._dir
    assert not os.path.exists(directory)
    server.stop()  # idempotent


def test_redis_server_missing_binary(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without redis-server
    with pytest.raises(FileNotFoundError, match="redis-server"):
        RedisServer()
