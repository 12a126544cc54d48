"""Take the screenshots of the web viewer shown in docs/viewer.md and README.md.

Builds a small demo checkpoint (two tags of an embedding table with clustered rows and a
few dense tensors) in a temporary LMDB store, starts ``tensorkv view`` on a free port, and
photographs its main pages with headless chromium (Debian's ``chromium`` through Playwright's
Python package) into ``docs/img/viewer-*.png``::

    python scripts/viewer_screenshots.py [--out docs/img]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run"]


def build_demo(url: str) -> int:
    """Save tags ``step-1000`` and ``step-2000`` of a demo model into ``url``; a key to show."""
    import tensorkv

    dim, n = 16, 20_000
    rng = np.random.default_rng(7)
    table = tensorkv.EmbeddingTable(dim, optimizer=tensorkv.Adagrad(lr=0.3), seed=3)
    keys = np.arange(1, n + 1, dtype=np.int64) * 1_000_003
    table.lookup(keys)
    centres = 0.5 * rng.standard_normal((5, dim)).astype(np.float32)
    cluster = rng.integers(0, 5, n)
    seen = rng.zipf(1.6, 200_000) % n  # a few hot keys, a long tail
    table.lookup(keys[seen])
    for step in range(1, 6):  # pull each row towards its cluster's centre
        vals = np.asarray(table.lookup(keys, insert=False))
        grads = vals - centres[cluster] + 0.05 * rng.standard_normal((n, dim))
        table.apply_gradients(keys, grads.astype(np.float32), step=step)
    x = np.linspace(0, 4 * np.pi, 48)
    weight = (np.sin(x)[:, None] * np.cos(x[:32] / 2)[None, :]
              + 0.15 * rng.standard_normal((48, 32))).astype(np.float32)
    model = {"user_embedding": table, "mlp.0.weight": weight,
             "mlp.0.bias": np.zeros(32, np.float32),
             "mlp.1.weight": rng.standard_normal((32, 8)).astype(np.float32)}
    tensorkv.save(model, url, tag="step-1000", step=1000)
    table.apply_gradients(keys[:500], rng.standard_normal((500, dim)).astype(np.float32), step=4)
    table.lookup(np.arange(n + 1, n + 301, dtype=np.int64) * 1_000_003)
    model["mlp.0.weight"] = weight * 1.1
    tensorkv.save(model, url, tag="step-2000", step=2000)
    return int(keys[int(np.bincount(seen).argmax())])


def main() -> None:
    """Build the demo store, start the viewer and write the screenshots."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"))
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("chromium is not installed: apt-get install chromium (or make chromium)")
    from playwright.sync_api import sync_playwright

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"lmdb://{tmp}/demo"
        key = build_demo(url)
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen([sys.executable, "-m", "tensorkv.cli.main", "view", url,
                                 "--port", "0"], stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            m = re.search(r"at (http://\S+/)", line)
            if not m:
                sys.exit(f"the viewer did not start: {line}")
            base = m.group(1)
            shots = {
                "viewer-tags": ("#/", False),
                "viewer-variables": ("#/tag/step-2000", False),
                "viewer-table": ("#/table/step-2000/user_embedding", False),
                "viewer-search": ("#/table/step-2000/user_embedding?where=freq%20%3E%3D%2020",
                                  False),
                "viewer-nearest": (f"#/table/step-2000/user_embedding?nearest={key}&k=10"
                                   "&metric=cosine", False),
                "viewer-row": (f"#/row/step-2000/user_embedding/{key}", False),
                "viewer-heatmap": ("#/dense/step-2000/mlp.0.weight?slice=0%3A48%2C%3A", False),
                "viewer-diff": ("#/diff/step-1000/step-2000", False),
            }
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, args=LAUNCH_ARGS)
                page = browser.new_page(viewport={"width": 1280, "height": 860})
                for name, (hash_, full) in shots.items():
                    page.goto("about:blank")
                    page.goto(base + hash_)
                    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
                    page.screenshot(path=str(out / f"{name}.png"), full_page=full)
                    print(f"wrote {out / name}.png")
                browser.close()
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
