"""Griffe extension: Sphinx cross-reference roles in docstrings rendered as code.

The docstrings use Sphinx roles (``:class:`~tensorkv.EmbeddingTable```, ``:meth:`lookup```)
that mkdocstrings would print as they are. This extension turns each into a code span of the
name as Sphinx shows it (``~`` keeps the last dotted part) before the docstrings are parsed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: ``:role:`target``` or ``:role:`~target```, Sphinx's Python roles.
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _shown(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def plain_roles(text: str) -> str:
    """``text`` with every Sphinx role replaced by a code span of its target."""
    return ROLE.sub(_shown, text)


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring."""
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(obj.docstring.value)
