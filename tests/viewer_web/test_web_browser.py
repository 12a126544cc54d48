"""End to end: `tensorkv view` (real uvicorn) in a subprocess, driven by headless Chromium.

Debian's chromium (``make test`` installs it) is driven through Playwright's Python package
with ``executable_path``; no browser is downloaded. Skipped only where chromium or
Playwright cannot be found.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.checkpoint.helpers import rows_of
from tests.viewer_web.conftest import EVIL

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("chromium is not installed (Debian: apt-get install chromium; `make test` "
                "installs it)", allow_module_level=True)
pytest.importorskip("playwright.sync_api", reason='Playwright is not installed: pip install '
                    '"tensorkv[dev]"')

from playwright.sync_api import sync_playwright  # noqa: E402

LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run"]

# Non-transparent pixels of every canvas of each plot, and the number of plots.
PLOT_PIXELS = """() => window.tkvPlots.map((u) => {
  let n = 0;
  for (const c of u.root.querySelectorAll("canvas")) {
    const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
    for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
  }
  return n;
})"""
CANVAS_COLOURS = """(id) => {
  const c = document.getElementById(id);
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  const seen = new Set();
  for (let i = 0; i < d.length; i += 4) {
    if (d[i + 3]) seen.add(d[i] << 16 | d[i + 1] << 8 | d[i + 2]);
  }
  return [c.width, c.height, seen.size];
}"""


@pytest.fixture(scope="module")
def server(ckpt):
    """``tensorkv view URL --port 0`` in a subprocess; yields its base URL."""
    import tensorkv

    src = str(Path(tensorkv.__file__).resolve().parents[1])  # the tensorkv under test
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorkv.cli.main", "view", ckpt["url"], "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
        assert m, f"the viewer did not start: {line}{proc.stdout.read() if proc.poll() else ''}"
        yield m.group(1)
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop, exit status 0
        try:
            rc = proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a stuck server
            proc.kill()
            proc.wait()
            raise
    assert rc == 0, proc.stdout.read()


@pytest.fixture(scope="module")
def page(server):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        pg = browser.new_page(viewport={"width": 1280, "height": 900})
        pg.problems = []  # type: ignore[attr-defined]
        pg.on("pageerror", lambda e: pg.problems.append(f"page error: {e}"))
        pg.on("console", lambda m: m.type == "error" and pg.problems.append(m.text))
        try:
            yield pg
        finally:
            browser.close()


def _open(page, server, hash_):
    page.goto(server + hash_)
    _settled(page)


def _go(page, action):
    """Do ``action`` (a click that navigates) and wait until the new page has rendered."""
    page.evaluate("document.body.dataset.ready = ''")
    action()
    _settled(page)


def _settled(page):
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    assert page.locator("#error").is_hidden(), page.locator("#error").text_content()


def test_tags_and_variables_show_names_as_text(page, server):
    _open(page, server, "#/")
    assert page.locator("main table td:first-child a").all_text_contents() == ["t1", "t2"]
    assert page.locator("main table td:last-child a").all_text_contents() == ["diff with t1"]
    _go(page, lambda: page.click("text=t1"))
    names = page.locator("main table tbody tr td:first-child").all_text_contents()
    assert EVIL in names and "emb" in names
    # the markup in the name stayed text: no script ran, no element was made from it
    assert page.evaluate("window.tkvPwned") is None
    assert page.locator("main img").count() == 0
    assert page.problems == []


def test_key_search_renders_the_row_and_plots_draw(page, server, ckpt):
    ref = rows_of(ckpt["table"])
    key = str(int(ref[0][42]))
    _open(page, server, "#/table/t2/emb")
    page.fill("#key-search", key)
    _go(page, lambda: page.click("#search-form button"))
    cells = page.locator("#rows tbody tr").first.locator("td").all_text_contents()
    assert cells[0] == key
    assert int(cells[1].replace(",", "")) == int(ref[3][42])  # freq
    assert int(cells[2].replace(",", "")) == int(ref[4][42])  # version
    first = float(cells[4].split()[0])
    np.testing.assert_allclose(first, ref[1][42][0], rtol=1e-2)
    # two histograms and the PCA scatter, each drawn (non-transparent pixels on its canvas)
    pixels = page.evaluate(PLOT_PIXELS)
    assert len(pixels) == 3 and all(n > 100 for n in pixels), pixels
    assert page.locator("#hist-norm .uplot").count() == 1
    assert page.locator("#pca .uplot").count() == 1
    # the row's page: value, slots, and its bar chart
    _go(page, lambda: page.click(f"#rows a:text-is('{key}')"))
    assert "#/row/t2/emb/" in page.url
    shown = [float(x) for x in page.locator("#row-value").text_content().split()]
    np.testing.assert_allclose(shown, ref[1][42], rtol=1e-5)
    assert page.evaluate(PLOT_PIXELS)[0] > 100
    assert page.problems == []


def test_filter_nearest_heat_map_and_diff(page, server, ckpt):
    ref = rows_of(ckpt["table"])
    _open(page, server, "#/table/t2/emb")
    page.fill("#where", "freq >= 2 and version >= 3")
    _go(page, lambda: page.click("#where-form button"))
    want = int(((ref[3] >= 2) & (ref[4] >= 3)).sum())
    assert page.locator("#rows tbody tr").count() == min(want, 50)
    _open(page, server, f"#/table/t2/emb?nearest={int(ref[0][3])}&k=4&metric=cosine")
    assert page.locator("#rows tbody tr").count() == 4
    vec = "%2C".join(repr(float(x)) for x in ref[1][3])  # a vector instead of a key
    _open(page, server, f"#/table/t2/emb?nearest={vec}&k=3&metric=l2")
    assert page.locator("#rows tbody tr").first.locator("td").first.text_content() == str(
        int(ref[0][3]))  # the row equal to the vector comes first
    _open(page, server, "#/dense/t2/mlp.weight?slice=0%3A20%2C%3A")
    width, height, colours = page.evaluate(CANVAS_COLOURS, "heatmap")
    assert width >= 24 and height >= 20 and colours > 10
    _open(page, server, "#/diff/t1/t2")
    rows = page.locator("main table").first.locator("tbody tr").all_text_contents()
    assert any(r.startswith("emb") and "changed" in r for r in rows)
    assert page.problems == []
