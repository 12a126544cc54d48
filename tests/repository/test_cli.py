"""``tensorkv repo`` commands on a real LMDB repository."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from tensorkv import Repository
from tensorkv.cli.main import main

from .models import mlp

GRAPH = {"nodes": [{"name": "x", "op": "input", "type": "input"},
                   {"name": "fc", "type": "Dense", "inputs": ["x"],
                    "params": {"w": {"shape": [3, 2], "dtype": "float32"}}}]}


def test_repo_commands(tmp_path):
    url = str(tmp_path / "r")
    with Repository(url) as repo:
        mid = repo.put(mlp((4, 4)), name="first", metrics={"val_acc": 0.5})
    run = CliRunner().invoke
    out = run(main, ["repo", "ls", url])
    assert out.exit_code == 0 and mid in out.output and "val_acc=0.5" in out.output
    rows = json.loads(run(main, ["repo", "ls", url, "--where", "val_acc>0.6", "--json"]).output)
    assert rows == []
    assert "0.weight" in run(main, ["repo", "show", url, mid]).output
    s = json.loads(run(main, ["repo", "stats", url, "--json"]).output)
    assert s["models"] == 1 and s["tensors"] == 2
    assert run(main, ["repo", "check", url]).exit_code == 0
    (tmp_path / "g.json").write_text(json.dumps(GRAPH))
    np.savez(tmp_path / "s.npz", **{"fc.w": np.ones((3, 2), np.float32)})
    out = run(main, ["repo", "put", url, str(tmp_path / "g.json"), str(tmp_path / "s.npz"),
                     "--name", "np", "--metric", "val_acc=0.9"])
    assert out.exit_code == 0, out.output
    new = out.output.strip()
    got = json.loads(run(main, ["repo", "prefix", url, str(tmp_path / "g.json"), "--json"]).output)
    assert got == {"id": new, "matched_layers": ["x", "fc"]}
    assert run(main, ["repo", "get", url, new, str(tmp_path / "o.npz")]).exit_code == 0
    np.testing.assert_array_equal(np.load(tmp_path / "o.npz")["fc.w"], np.ones((3, 2)))
    assert "2 tensors retired" in run(main, ["repo", "rm", url, mid]).output
    assert "counts_fixed: 0" in run(main, ["repo", "gc", url, "--grace", "0"]).output
    out = run(main, ["repo", "show", url, mid])
    assert out.exit_code == 3 and f"no model '{mid}'" in out.output
    out = run(main, ["repo", "put", url, str(tmp_path / "g.json"), str(tmp_path / "s.npz"),
                     "--metric", "acc"])
    assert out.exit_code == 2 and "NAME=NUMBER" in out.output
    assert "moved 0 tensors" in run(main, ["repo", "rebalance", url]).output
