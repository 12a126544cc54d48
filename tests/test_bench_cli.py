"""``tensorkv bench``: its help lists the workloads and their parameters; ``kv`` leaves the
machine's page cache alone unless asked (``-p drop_caches=true``)."""

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tensorkv.cli.bench_cmd import workloads
from tensorkv.cli.main import main

SRC = Path(__file__).resolve().parents[1] / "src"
#: A run of seconds, should a refusal tested below ever let the benchmark start.
TINY = ("-p", "scale=0.0002", "-p", "sizes=100B", "-p", "backends=memory")


def _flat(text: str) -> str:
    return " ".join(text.split())


def _tensorkv(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "tensorkv.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_bench_help_lists_every_workload_with_its_summary():
    names = workloads()
    assert {"kv", "table", "tiers", "checkpoint"} <= set(names)
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    out = _flat(result.output)
    for name in names:
        module = importlib.import_module(f"tensorkv.bench.{name.replace('-', '_')}")
        first = module.__doc__.strip().splitlines()[0]
        summary = re.sub(r"^``tensorkv bench [\w-]+``:\s*", "", first).replace("``", "`")
        assert f"{name} {summary}" in out, f"{name!r}: {summary!r} not in\n{result.output}"


def test_bench_kv_help_states_drop_caches():
    result = CliRunner().invoke(main, ["bench", "kv", "--help"])
    assert result.exit_code == 0, result.output
    out = _flat(result.output)
    assert "drop_caches=false" in out
    assert "/proc/sys/vm/drop_caches" in out and "root only" in out
    for param in ("scale", "sizes", "backends", "repeat", "directory"):  # every -p parameter
        assert f"{param}=" in out


def test_bench_dry_run_checks_parameters_and_runs_nothing(tmp_path):
    args = ["bench", "kv", *TINY, "-p", f"directory={tmp_path}", "--dry-run"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "kv.run(quick=False, scale=0.0002, sizes='100B', backends='memory'" in result.output
    assert list(tmp_path.iterdir()) == []
    result = CliRunner().invoke(main, ["bench", "kv", "-p", "bogus=1", "--dry-run"])
    assert result.exit_code == 2 and "bogus" in result.output


def test_kv_bench_leaves_the_page_cache_alone_by_default(tmp_path):
    out = tmp_path / "kv.json"
    data = tmp_path / "data"
    data.mkdir()
    r = _tensorkv("bench", "kv", "--quick", "--json", str(out), "-p", "scale=0.0002",
                  "-p", "sizes=100B", "-p", "backends=memory,lmdb", "-p", f"directory={data}",
                  cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    params = json.loads(out.read_text())["params"]
    assert params["drop_caches"] is False
    assert params["page_cache_drops"] == 0  # drop_page_cache() was never called
    assert params["reads"].startswith("warm")
    assert list(data.iterdir()) == []  # and it removed its own files


def test_kv_bench_drop_caches_must_be_a_bool(tmp_path):
    result = CliRunner().invoke(main, ["bench", "kv", "-p", "drop_caches=maybe", *TINY,
                                       "-p", f"directory={tmp_path}"])
    assert result.exit_code == 2
    assert "drop_caches='maybe'" in result.output and "true or false" in result.output


@pytest.mark.skipif(os.geteuid() == 0, reason="root may drop the page cache: the refusal "
                    "is what an unprivileged user gets")
def test_kv_bench_drop_caches_refused_without_root(tmp_path):
    result = CliRunner().invoke(main, ["bench", "kv", "-p", "drop_caches=true", *TINY,
                                       "-p", f"directory={tmp_path}"])
    assert result.exit_code == 1
    assert "/proc/sys/vm/drop_caches" in result.output and "root" in result.output
    assert list(tmp_path.iterdir()) == []  # refused before writing anything
