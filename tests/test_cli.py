import json
import os

import pytest
from click.testing import CliRunner

import tensorkv
from tensorkv.cli.bench_cmd import workloads
from tensorkv.cli.demo import PREFIX, default_scheme
from tensorkv.cli.main import backend_rows, main


@pytest.fixture
def runner():
    return CliRunner()


def test_help_lists_subcommands(runner):
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    for name in ("demo", "bench", "stores"):
        assert name in result.output


def test_version(runner):
    result = runner.invoke(main, ["--version"])
    assert result.exit_code == 0
    assert tensorkv.__version__ in result.output


def test_demo_default_store(runner, tmp_path):
    path = tmp_path / "data"
    result = runner.invoke(main, ["demo", "tour", "--path", str(path)])
    assert result.exit_code == 0, result.output
    assert "bit-identical" in result.output
    assert "embedding.weight" in result.output and "bfloat16" in result.output
    assert (path / default_scheme()).is_dir()
    # the tensors are really in the store, readable by a fresh open
    url = f"{default_scheme()}://{path / default_scheme()}"
    with tensorkv.open_store(url) as store:
        assert store.count(PREFIX) == 6
    # running again over existing data works
    again = runner.invoke(main, ["demo", "tour", "--path", str(path)])
    assert again.exit_code == 0, again.output


def test_demo_memory_url(runner, tmp_path):
    result = runner.invoke(main, ["demo", "tour", "--url", "memory://"])
    assert result.exit_code == 0, result.output
    assert "6/6 bit-identical" in result.output
    try:
        from tensorkv.embedding import EmbeddingTable  # noqa: F401
    except ImportError:
        assert "skipped" in result.output
    else:
        assert "apply_gradients" in result.output and "rows=6" in result.output


def test_demo_bad_url(runner):
    result = runner.invoke(main, ["demo", "tour", "--url", "nosuch://x"])
    assert result.exit_code == 2  # a usage error
    assert "nosuch" in result.output and "lmdb" in result.output  # names the known schemes
    result = runner.invoke(main, ["demo", "tour", "--url", "lmdb://relative/path"])
    assert result.exit_code == 2
    assert "lmdb:///" in result.output  # says how to write it


def test_bench_unknown_name_lists_workloads(runner):
    result = runner.invoke(main, ["bench", "no_such_workload"])
    assert result.exit_code == 2
    assert "no_such_workload" in result.output
    assert "kv" in result.output
    assert "common" not in workloads() and "redis_server" not in workloads()
    result = runner.invoke(main, ["bench"])
    assert result.exit_code == 2
    assert "kv" in result.output


def test_bench_bad_param(runner):
    result = runner.invoke(main, ["bench", "kv", "-p", "bogus=1"])
    assert result.exit_code == 2
    assert "bogus" in result.output and "scale" in result.output
    result = runner.invoke(main, ["bench", "kv", "-p", "noequals"])
    assert result.exit_code == 2
    assert "NAME=VALUE" in result.output


def test_bench_kv_tiny_json(runner, tmp_path):
    out = tmp_path / "kv.json"
    result = runner.invoke(
        main,
        [
            "bench", "kv", "--quick", "--json", str(out),
            "-p", "scale=0.0005", "-p", "backends=memory,lmdb", "-p", "sizes=4KiB",
            "-p", "drop_caches=false", "-p", f"directory={tmp_path}",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "| ratio |" in result.output
    doc = json.loads(out.read_text())
    assert doc["bench"] == "kv"
    assert set(doc["machine"]) >= {"python", "cpus"}
    cases = {r["case"] for r in doc["results"]}
    assert {"memory 4KiB put_many", "lmdb 4KiB get_many", "files 4KiB write"} <= cases
    for r in doc["results"]:
        assert set(r) >= {"case", "metric", "value", "baseline", "baseline_value", "ratio"}
        assert r["value"] > 0 and r["baseline_value"] > 0
    # the benchmark cleaned up after itself
    assert not [p for p in os.listdir(tmp_path) if p.startswith("tensorkv-bench-kv-")]


def test_bench_kv_bad_size(runner, tmp_path):
    result = runner.invoke(main, ["bench", "kv", "-p", "sizes=3B", "-p", f"directory={tmp_path}"])
    assert result.exit_code == 2
    assert "3B" in result.output and "4KiB" in result.output


def test_stores_lists_every_scheme(runner):
    result = runner.invoke(main, ["stores"])
    assert result.exit_code == 0, result.output
    for scheme in tensorkv.stores.schemes():
        assert f"{scheme}://" in result.output
    rows = {r["scheme"]: r for r in backend_rows()}
    assert rows["memory"]["status"] == "ok"
    assert rows["memory"]["ordered_scans"] is True


# ------------------------------------------------------------------ errors and read-only commands

def _cli(*args, **env):
    """Run the real ``tensorkv`` entry point in a subprocess (stderr kept apart)."""
    import subprocess
    import sys

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    full = {**os.environ, "PYTHONPATH": src, **env}
    if "TENSORKV_DEBUG" not in env:
        full.pop("TENSORKV_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "tensorkv.cli.main", *args],
                          capture_output=True, text=True, env=full, timeout=120)


@pytest.mark.parametrize("scheme", ["lmdb", "rocksdb", "leveldb"])
@pytest.mark.parametrize("command", [["tags"], ["check"], ["check", "--verify"],
                                     ["gc", "--dry-run"], ["gc"], ["vacuum"],
                                     ["compact", "{url}", "v1"], ["ls"]])
def test_read_only_commands_on_a_mistyped_path(runner, tmp_path, scheme, command):
    """Maintenance and viewer commands open existing stores only: nothing is created."""
    path = tmp_path / "typo" / "deeper"
    url = f"{scheme}://{path}"
    args = [a.format(url=url) for a in command] + ([] if "{url}" in command else [url])
    result = runner.invoke(main, args)
    assert result.exit_code == 3  # not found
    assert result.stderr.startswith("tensorkv: error: no "), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert str(path) in result.stderr and "[Errno" not in result.stderr
    assert os.listdir(tmp_path) == []


def test_truncated_lmdb_is_one_line_not_a_signal(tmp_path):
    import numpy as np

    url = f"lmdb://{tmp_path / 'db'}"
    tensorkv.save({"w": np.zeros((512, 1024), np.float32)}, url, tag="v1")
    data = tmp_path / "db" / "data.mdb"
    os.truncate(data, os.path.getsize(data) // 2)
    for args in (["tags", url], ["check", url], ["check", "--verify", url]):
        r = _cli(*args)
        assert r.returncode == 4, (args, r.returncode, r.stderr)  # not -7 (SIGBUS)
        assert r.stderr.startswith("tensorkv: error: the lmdb store") and "truncated" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_debug_env_shows_the_traceback(tmp_path):
    r = _cli("tags", f"lmdb://{tmp_path / 'typo'}", TENSORKV_DEBUG="1")
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "StoreNotFoundError" in r.stderr
    r = _cli("tags", f"lmdb://{tmp_path / 'typo'}")
    assert "Traceback" not in r.stderr and r.stderr.startswith("tensorkv: error:")
    assert "TENSORKV_DEBUG=1" in _cli("--help").stdout


def test_error_message_of_every_kind_of_exception():
    import lmdb

    from tensorkv.cli.main import error_message
    from tensorkv.errors import CorruptStoreError, StoreNotFoundError

    msg = error_message(StoreNotFoundError(2, "no lmdb store at '/x'", "/x"))
    assert msg == "tensorkv: error: no lmdb store at '/x'"
    assert error_message(CorruptStoreError("data.mdb is\ncut")) == (
        "tensorkv: error: data.mdb is cut")
    assert error_message(lmdb.CorruptedError("mdb_get: MDB_CORRUPTED")) == (
        "tensorkv: error: CorruptedError: mdb_get: MDB_CORRUPTED")
    msg = error_message(ZeroDivisionError("division by zero"))
    assert msg.startswith("tensorkv: error: unexpected ZeroDivisionError: division by zero")
    assert "TENSORKV_DEBUG=1" in msg


def test_vacuum_gives_lmdb_space_back(runner, tmp_path):
    import numpy as np

    url = f"lmdb://{tmp_path / 'db'}"
    rng = np.random.default_rng(0)
    with tensorkv.open_store(url) as s:
        s.put_many({b"k%05d" % i: rng.bytes(4000) for i in range(3000)})
        s.delete_many([b"k%05d" % i for i in range(100, 3000)])
    size = os.path.getsize(tmp_path / "db" / "data.mdb")
    result = runner.invoke(main, ["vacuum", url])
    assert result.exit_code == 0, result.output
    assert f"{size / 1e6:.1f} MB before" in result.output and "MB given back" in result.output
    assert os.path.getsize(tmp_path / "db" / "data.mdb") < size / 4
    with tensorkv.open_store(url, readonly=True) as s:
        assert s.count() == 100
