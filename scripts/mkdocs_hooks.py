"""MkDocs hooks: the README and the changelog become pages of the documentation site.

README.md (the home page, ``index.md``) and CHANGELOG.md live at the repository root and link
the guides as ``docs/NAME.md``; the guides link the changelog as ``../CHANGELOG.md``. On the
site all of them sit in one folder, so these links are rewritten to it before the pages are
rendered, and MkDocs then checks every link and anchor as for any other page.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
#: Root files published as pages: site path -> file in the repository.
ROOT_PAGES = {"index.md": ROOT / "README.md", "CHANGELOG.md": ROOT / "CHANGELOG.md"}
#: A Markdown link or image target starting with ``docs/`` (root pages) or ``../`` (guides).
ROOT_LINK = re.compile(r"\]\((?:\.\./)(?=[^)\s]+\))")
DOCS_LINK = re.compile(r"\]\((?:docs/)(?=[^)\s]+\))")


def on_files(files: Files, config: Any) -> Files:
    """Add the root files as generated pages (``mkdocs serve`` does not watch them)."""
    for uri, path in ROOT_PAGES.items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Rewrite the links between the root files and the guides to the site's one folder."""
    if page.file.src_uri in ROOT_PAGES:
        return DOCS_LINK.sub("](", markdown)
    if "/" not in page.file.src_uri:  # a guide in docs/
        return ROOT_LINK.sub("](", markdown)
    return markdown
