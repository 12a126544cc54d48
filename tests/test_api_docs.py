"""The documentation site (README, guides, API reference, changelog) builds with no warning.

``mkdocs build --strict`` (mkdocs.yml) fails on any warning: a docstring griffe cannot parse,
a broken link or anchor between the pages, a cross-reference that resolves nowhere. The build
runs offline (no remote inventory). It takes 15-20 s, hence ``slow``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def build(site: Path, config: Path = ROOT / "mkdocs.yml") -> subprocess.CompletedProcess[str]:
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as e:  # pragma: no cover - the dev extra installs them
        pytest.fail(f"{e.name} is missing: pip install -e '.[docs]' (make test installs it)")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    done = build(site)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "WARNING" not in done.stderr, done.stderr[-6000:]
    # the root files became pages, the reference rendered the docstrings
    assert (site / "index.html").is_file() and (site / "CHANGELOG.html").is_file()
    page = (site / "reference" / "embedding.html").read_text()
    assert "EmbeddingTable" in page and "apply_gradients" in page
    # Sphinx roles become links where their target has an entry, code otherwise; never
    # printed as they are
    root = (site / "reference" / "tensorkv.html").read_text()
    assert 'href="errors.html#tensorkv.errors"' in root  # the package docstring's :mod: role
    for html in (site / "reference").glob("*.html"):
        text = html.read_text()
        for role in (":class:", ":func:", ":meth:", ":mod:", ":attr:", ":data:", ":exc:"):
            assert role not in text, f"{html.name}: {role}"
