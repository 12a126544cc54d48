"""The scripts behind docs/benchmarks.md ("Web viewer") and docs/img/viewer-*.png still run.

Each runs at a tiny size in a subprocess (its figures are not checked): the web benchmark
over a 3,000-row store, the screenshots into a temporary folder (needs chromium).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tensorkv

ROOT = Path(__file__).resolve().parents[2]
SRC = str(Path(tensorkv.__file__).resolve().parents[1])  # the tensorkv under test
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
#: The screenshots docs/viewer.md and README.md show.
SHOTS = ["viewer-tags.png", "viewer-variables.png", "viewer-table.png", "viewer-search.png",
         "viewer-nearest.png", "viewer-row.png", "viewer-heatmap.png", "viewer-diff.png"]


def _run(*args: str) -> str:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, f"{args[0]} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_web_benchmark_script_runs(tmp_path):
    out = _run("scripts/bench_viewer_web.py", "--store", str(tmp_path / "store"), "--rows",
               "3000", "--dim", "8", "--requests", "2")
    for label in ("page of 50 rows", "key search (5 keys)", "row detail", "PCA sample",
                  "histograms (cached)", "nearest k=10 cosine", "server memory (MB) at the end"):
        assert label in out, out


def test_screenshot_script_photographs_every_page(tmp_path):
    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; `make test` "
                    "installs it)")
    pytest.importorskip("playwright.sync_api",
                        reason='Playwright is not installed: pip install "tensorkv[dev]"')
    _run("scripts/viewer_screenshots.py", "--out", str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(SHOTS)
    for name in SHOTS:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, name
        assert (ROOT / "docs" / "img" / name).is_file(), name  # the committed one
