"""Griffe extension: Sphinx cross-reference roles in docstrings become reference links.

The docstrings use Sphinx roles (``:class:`~tensorkv.EmbeddingTable```, ``:meth:`lookup```)
that mkdocstrings would print as they are. This extension turns each into an optional
mkdocs-autorefs reference before the docstrings are parsed: a code span of the name as Sphinx
shows it (``~`` keeps the last dotted part), linked to the object's entry when the reference
renders one, plain code otherwise (no warning: not every object has a page).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

#: ``:role:`target``` or ``:role:`~target```, Sphinx's Python roles.
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _candidates(target: str, obj: griffe.Object) -> list[str]:
    """Identifiers ``target`` may mean, seen from ``obj``: absolute, or in its module or class."""
    if target.startswith("tensorkv"):
        return [target]
    scopes = [obj.module.path]
    if obj.is_class or (obj.parent is not None and obj.parent.is_class):
        scopes.append(obj.path if obj.is_class else obj.parent.path)  # type: ignore[union-attr]
    return [f"{scope}.{target}" for scope in dict.fromkeys(scopes)]


def linked_roles(text: str, obj: griffe.Object) -> str:
    """``text`` with every Sphinx role replaced by an optional reference to its target."""

    def replace(match: re.Match[str]) -> str:
        tilde, target = match.groups()
        target = target.strip().removesuffix("()")
        shown = target.rsplit(".", 1)[-1] if tilde else target
        first, *rest = _candidates(target, obj)
        slug = f' slug="{html.escape(rest[0])}"' if rest else ""
        return (f'<autoref identifier="{html.escape(first)}"{slug} optional>'
                f"<code>{html.escape(shown)}</code></autoref>")

    return ROLE.sub(replace, text)


def _rewrite(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = linked_roles(obj.docstring.value, obj)
    for member in obj.members.values():
        if not member.is_alias:
            _rewrite(member)  # type: ignore[arg-type]


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring of a package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Rewrite the docstrings of ``pkg``, its modules and everything they define."""
        _rewrite(pkg)
