"""Architecture contract of ``src/tensorkv``: import layers, no cycles, no private imports, size.

Why pure Python with :mod:`ast` and not import-linter + grimp: the contract needs a few
rules that import-linter does not express directly (the root package's special place, "a
top-level package not in the contract fails", a size rule with a docstring escape hatch), the
graph is small (under a hundred modules, parsed in a fraction of a second), and reading the
source with ``ast`` adds no dependency and no configuration language: the whole contract is
the data below plus a few hundred lines of plain code that anyone can debug with a print.

How the module graph is built (:func:`import_graph`):

- every ``import`` / ``from ... import`` statement of every module under ``src/tensorkv``,
  wherever it stands (module level, inside functions, methods, ``try`` blocks);
- ``from tensorkv.x import y`` is an edge to ``tensorkv.x.y`` when that is a submodule, else
  to ``tensorkv.x``; ``import tensorkv.x.y`` is an edge to ``tensorkv.x.y``; relative imports
  are resolved against the importing module's package;
- the implicit import of parent packages' ``__init__`` is NOT an edge (importing
  ``tensorkv.a.b`` runs ``tensorkv/a/__init__.py`` too, but that is Python's mechanics, not a
  dependency written by the importer);
- imports in the body of ``if TYPE_CHECKING:`` are marked type-only, and every check counts
  them: a type-only import that closes a circle is still two files that need each other to
  be read (the fix is an interface in a leaf module both import), and a type-level
  dependency on a higher layer is still a dependency on its API;
- dynamic imports (``importlib.import_module("...")``, lazy ``__getattr__`` tables) are not
  seen.

Run ``python tests/test_architecture.py`` to print the graph's findings without pytest.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "tensorkv"

# ---------------------------------------------------------------------------------------------
# The contract (data).
# ---------------------------------------------------------------------------------------------

#: Top-level packages/modules of tensorkv, lowest layer first. A module may import its own
#: top-level package and anything in a LOWER layer; names sharing a layer are independent of
#: each other unless SIBLING_ALLOWED says otherwise. "tensorkv" is the root package
#: (tensorkv/__init__.py): it may import everything below testing/bench/cli.
#: The bottom (errors < config < pages, codec < kernels) is what the code does today:
#: config reads errors, codec reads errors, kernels/optimizers reads config; pages imports no
#: tensorkv module.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("config",),
    ("pages", "codec"),
    ("kernels",),
    ("stores",),
    ("embedding",),
    ("checkpoint",),
    ("torch", "repository", "distributed", "viewer", "compat"),
    (ROOT,),
    ("testing",),
    ("bench",),
    ("cli",),
]

#: (importer, imported) pairs of the same layer that may import each other in this direction.
SIBLING_ALLOWED: set[tuple[str, str]] = {
    ("distributed", "torch"),
    ("repository", "torch"),
    ("viewer", "torch"),
}

#: (importer prefix, forbidden prefix): no module under the first may import one under the
#: second. Prefixes are dotted module names and match whole components.
FORBIDDEN: list[tuple[str, str]] = [
    # tier engines are storage below the chain runtime and the table
    ("tensorkv.embedding.tiers", "tensorkv.embedding.chain"),
    ("tensorkv.embedding.tiers", "tensorkv.embedding.table"),
    # the chain runtime works on tiers, not on the table object
    ("tensorkv.embedding.chain", "tensorkv.embedding.table"),
    # the Redis-resident table (embedding/redis) is a row backend the chain opens: it works
    # on tier 0 and record layouts, never on the chain or the table object, and the tier
    # engines below know nothing of it
    ("tensorkv.embedding.redis", "tensorkv.embedding.chain"),
    ("tensorkv.embedding.redis", "tensorkv.embedding.table"),
    ("tensorkv.embedding.tiers", "tensorkv.embedding.redis"),
]

#: Lines a module may have without a "Size:" line in its docstring.
MAX_LINES = 800

# ---------------------------------------------------------------------------------------------
# The module graph.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """One import edge: ``importer`` imports ``target`` (both dotted module names)."""

    importer: str
    target: str
    lineno: int
    type_only: bool  # under ``if TYPE_CHECKING:``
    names: tuple[str, ...]  # names of a from-import taken from ``target`` (not submodules)


def module_name(path: Path) -> str:
    """Return the dotted module name of a file under :data:`SRC`."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Return every module of the package, name -> path."""
    return {module_name(p): p for p in sorted((SRC / ROOT).rglob("*.py"))}


@cache
def parsed(name: str) -> ast.Module:
    """Return the parsed source of module ``name``."""
    path = modules()[name]
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(nodes, type_only: bool = False):
    """Yield (node, type_only) for every import statement, recursing into every block."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, type_only
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.body, True)
            yield from _import_nodes(node.orelse, type_only)
        else:
            yield from _import_nodes(ast.iter_child_nodes(node), type_only)


def _resolve_from(importer: str, node: ast.ImportFrom) -> str | None:
    """Return the absolute module a from-import names, or None if it is not a tensorkv one."""
    if node.level:
        base = importer.split(".")
        if modules()[importer].name != "__init__.py":
            base = base[:-1]  # the package the module is in
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, node.module] if node.module else base)
    return node.module


def _in_package(name: str | None) -> bool:
    return name is not None and (name == ROOT or name.startswith(ROOT + "."))


@cache
def import_graph() -> tuple[Import, ...]:
    """Return every import edge between tensorkv modules."""
    known = modules()
    edges: list[Import] = []
    for importer in known:
        for node, type_only in _import_nodes(parsed(importer).body):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _in_package(alias.name):
                        edges.append(Import(importer, _known_prefix(alias.name), node.lineno,
                                            type_only, ()))
                continue
            base = _resolve_from(importer, node)
            if not _in_package(base):
                continue
            assert base is not None
            plain: list[str] = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    edges.append(Import(importer, sub, node.lineno, type_only, ()))
                else:
                    plain.append(alias.name)
            if plain:
                edges.append(Import(importer, _known_prefix(base), node.lineno, type_only,
                                    tuple(plain)))
    return tuple(edges)


def _known_prefix(name: str) -> str:
    """Return the longest prefix of ``name`` that is a module of the package."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules():
        parts.pop()
    return ".".join(parts) or name


def top_level(module: str) -> str:
    """Return the top-level package/module of tensorkv that ``module`` belongs to."""
    parts = module.split(".")
    return ROOT if len(parts) == 1 else parts[1]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _where(edge: Import) -> str:
    path = modules()[edge.importer].relative_to(SRC.parent)
    return f"{path}:{edge.lineno}"


# ---------------------------------------------------------------------------------------------
# Cycles.
# ---------------------------------------------------------------------------------------------


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components of ``graph`` (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def module_graph() -> dict[str, set[str]]:
    """Return importer -> imported modules over every import, type-only ones included."""
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for edge in import_graph():
        graph[edge.importer].add(edge.target)
    return graph


def import_cycles() -> list[list[str]]:
    """Return each import cycle as the sorted modules of one strongly connected component."""
    graph = module_graph()
    return [c for c in strongly_connected(graph)
            if len(c) > 1 or c[0] in graph.get(c[0], ())]


def _shortest_cycle(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """Return one shortest cycle through the component's first module (for the message)."""
    start, members = component[0], set(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if succ not in previous:
                    previous[succ] = node
                    nxt.append(succ)
        frontier = nxt
    return component


def packages() -> list[str]:
    """Return the top-level packages/modules that exist (the tests' parameters)."""
    return sorted({top_level(m) for m in modules()})


def _touches(component: list[str], package: str) -> bool:
    return any(top_level(m) == package for m in component)


@pytest.mark.parametrize("package", packages())
def test_no_import_cycles(package):
    """No import cycle through any module of ``package`` (one case per top-level package)."""
    graph = module_graph()
    cycles = [c for c in import_cycles() if _touches(c, package)]
    lines = []
    for component in cycles:
        lines.append(f"cycle of {len(component)} modules: {', '.join(component)}")
        lines.append(f"  e.g. {' -> '.join(_shortest_cycle(component, graph))}")
        members = set(component)
        for edge in import_graph():
            if edge.importer in members and edge.target in members:
                kind = " (type-only)" if edge.type_only else ""
                lines.append(f"  {_where(edge)}: {edge.importer} -> {edge.target}{kind}")
    assert not cycles, f"import cycles through tensorkv.{package}:\n" + "\n".join(lines)


def test_cycle_finder_on_a_known_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}, "f": set()}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["d"], ["e"], ["f"]]
    assert _shortest_cycle(["a", "b", "c"], graph) == ["a", "b", "c", "a"]


# ---------------------------------------------------------------------------------------------
# Layers.
# ---------------------------------------------------------------------------------------------


def _layer_of() -> dict[str, int]:
    return {name: i for i, layer in enumerate(LAYERS) for name in layer}


def test_every_top_level_package_is_in_the_contract():
    layer_of = _layer_of()
    missing = sorted({top_level(m) for m in modules()} - set(layer_of))
    assert not missing, (
        f"top-level tensorkv package(s)/module(s) {missing} are not in the layer contract: add "
        f"each to LAYERS in {Path(__file__).name} at the layer it belongs to (what it may "
        f"import and what may import it), next to the others of that layer"
    )


def layer_violations() -> list[str]:
    """Return one line per import that goes up (or sideways) in :data:`LAYERS`."""
    layer_of = _layer_of()
    found = []
    for edge in import_graph():
        src, dst = top_level(edge.importer), top_level(edge.target)
        if src == dst or src not in layer_of or dst not in layer_of:
            continue
        if layer_of[dst] < layer_of[src] or (src, dst) in SIBLING_ALLOWED:
            continue
        how = "same layer" if layer_of[dst] == layer_of[src] else "higher layer"
        found.append(f"{_where(edge)}: {edge.importer} imports {edge.target} "
                     f"({src} -> {dst}: {how})")
    return found


def test_layers():
    violations = layer_violations()
    order = " < ".join("[" + ", ".join(layer) + "]" for layer in LAYERS)
    assert not violations, (f"imports against the layer order {order}:\n"
                            + "\n".join(violations))


def forbidden_imports() -> list[str]:
    """Return one line per import that :data:`FORBIDDEN` rules out."""
    found = []
    for edge in import_graph():
        for importer, forbidden in FORBIDDEN:
            if _under(edge.importer, importer) and _under(edge.target, forbidden):
                found.append(f"{_where(edge)}: {edge.importer} imports {edge.target} "
                             f"({importer} must not import {forbidden})")
    return found


def test_forbidden_imports():
    found = forbidden_imports()
    assert not found, "forbidden imports:\n" + "\n".join(found)


# ---------------------------------------------------------------------------------------------
# Private names.
# ---------------------------------------------------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(package: str | None = None) -> list[str]:
    """Return one line per ``from tensorkv.a.b import _x`` taken by another module.

    A private submodule (``from tensorkv.a import _impl``) may be imported from inside its own
    package ``tensorkv.a``.
    """
    found = []
    for edge in import_graph():
        if edge.importer == edge.target or (package and top_level(edge.importer) != package):
            continue
        names = [n for n in edge.names if _private(n)]
        if not names and _private(edge.target.rsplit(".", 1)[-1]):
            package = edge.target.rsplit(".", 1)[0]
            if not _under(edge.importer, package):
                names = [edge.target.rsplit(".", 1)[-1]]
        if names:
            found.append(f"{_where(edge)}: {edge.importer} imports {', '.join(names)} "
                         f"from {edge.target}")
    return found


@pytest.mark.parametrize("package", packages())
def test_no_private_imports(package):
    found = private_imports(package)
    assert not found, ("private names imported from another module (make the name public, "
                       "or move the code that needs it):\n" + "\n".join(found))


# ---------------------------------------------------------------------------------------------
# Module size.
# ---------------------------------------------------------------------------------------------


def long_modules(package: str | None = None) -> list[str]:
    """Return one line per module of MAX_LINES lines or more without a "Size:" reason."""
    found = []
    for name, path in modules().items():
        if package and top_level(name) != package:
            continue
        n_lines = len(path.read_text(encoding="utf-8").splitlines())
        if n_lines < MAX_LINES:
            continue
        doc = ast.get_docstring(parsed(name)) or ""
        reasons = [line for line in doc.splitlines()
                   if line.strip().startswith("Size:") and line.strip()[5:].strip()]
        if not reasons:
            found.append(f"{path.relative_to(SRC.parent)}: {n_lines} lines")
    return found


@pytest.mark.parametrize("package", packages())
def test_module_size(package):
    found = long_modules(package)
    assert not found, (
        f"modules of {MAX_LINES} lines or more: split them, or give a one-line reason in the "
        f'module docstring on a line starting with "Size:":\n' + "\n".join(found))


# ---------------------------------------------------------------------------------------------
# The graph builder itself, on a throw-away package.
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_src(tmp_path, monkeypatch):
    """Point the checks at a throw-away ``tensorkv`` tree; return a writer of its files."""

    def write(files: dict[str, str]) -> None:
        for rel, text in files.items():
            path = tmp_path / ROOT / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        for fn in (modules, parsed, import_graph):
            fn.cache_clear()

    monkeypatch.setitem(globals(), "SRC", tmp_path)
    yield write
    for fn in (modules, parsed, import_graph):
        fn.cache_clear()


def test_graph_builder_resolution(fake_src):
    fake_src({
        "__init__.py": "",
        "a/__init__.py": "X = 1\n",
        "a/b.py": (
            "from typing import TYPE_CHECKING\n"
            "from tensorkv.a import X\n"              # -> tensorkv.a (a name)
            "if TYPE_CHECKING:\n"
            "    from tensorkv.c import C\n"          # type-only
            "else:\n"
            "    from tensorkv.errors import E\n"     # runtime
            "def f():\n"
            "    from tensorkv.c import _helper\n"    # function-level, private
            "    from . import sub\n"                 # relative, submodule
        ),
        "a/sub.py": "import tensorkv.c\nfrom tensorkv import a, errors\n",
        "c.py": "from tensorkv.a import b\nfrom tensorkv.a import __doc__\n",
        "errors.py": "",
    })
    edges = {(e.importer, e.target, e.type_only, e.names) for e in import_graph()}
    assert edges == {
        ("tensorkv.a.b", "tensorkv.a", False, ("X",)),
        ("tensorkv.a.b", "tensorkv.c", True, ("C",)),
        ("tensorkv.a.b", "tensorkv.errors", False, ("E",)),
        ("tensorkv.a.b", "tensorkv.c", False, ("_helper",)),
        ("tensorkv.a.b", "tensorkv.a.sub", False, ()),
        ("tensorkv.a.sub", "tensorkv.c", False, ()),
        ("tensorkv.a.sub", "tensorkv.a", False, ()),
        ("tensorkv.a.sub", "tensorkv.errors", False, ()),
        ("tensorkv.c", "tensorkv.a.b", False, ()),
        ("tensorkv.c", "tensorkv.a", False, ("__doc__",)),
    }
    # c -> a.b -> a.sub -> c, and c -> a.b -> c through the type-only import
    assert import_cycles() == [["tensorkv.a.b", "tensorkv.a.sub", "tensorkv.c"]]
    assert [line.split(": ", 1)[1] for line in private_imports()] == [
        "tensorkv.a.b imports _helper from tensorkv.c"]


def test_a_type_only_import_closes_a_cycle(fake_src):
    """Two files that name each other, one only under TYPE_CHECKING, are a circle too."""
    fake_src({
        "__init__.py": "",
        "x/__init__.py": "",
        "x/a.py": "from tensorkv.x.b import B\n",
        "x/b.py": ("from typing import TYPE_CHECKING\n"
                   "if TYPE_CHECKING:\n"
                   "    from tensorkv.x.a import A\n"),
        "x/c.py": "from tensorkv.x.a import A\n",  # imports into the circle: not part of it
    })
    assert import_cycles() == [["tensorkv.x.a", "tensorkv.x.b"]]
    with pytest.raises(AssertionError, match=r"tensorkv.x.b -> tensorkv.x.a \(type-only\)"):
        test_no_import_cycles("x")


def test_contract_checks_catch_violations(fake_src):
    fake_src({
        "__init__.py": "from tensorkv import cli\n",                  # root may not import cli
        "errors.py": "def f():\n    from tensorkv.config import X\n",  # upwards
        "codec.py": "import tensorkv.pages\n",                         # sideways
        "config.py": "from tensorkv.errors import E\n",                # fine
        "pages.py": "",
        "cli/__init__.py": "import tensorkv\n",                        # fine: root is below
        "newthing/__init__.py": "",                                     # not in the contract
        "embedding/tiers/ssd.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from tensorkv.embedding.chain.runtime import Chain\n"  # forbidden, even typed
        ),
        "embedding/chain/runtime.py": "from tensorkv.embedding import table\n",  # forbidden
        "embedding/table.py": "from tensorkv.embedding.tiers import ssd\n",     # fine
        "stores/big.py": '"""Big.\n\nSize: one reason.\n"""\n' + "x = 1\n" * 900,
        "stores/huge.py": '"""Huge.\n\nSize:\n"""\n' + "x = 1\n" * 900,  # no reason given
    })
    assert [v.split(": ", 1)[1] for v in layer_violations()] == [
        "tensorkv imports tensorkv.cli (tensorkv -> cli: higher layer)",
        "tensorkv.codec imports tensorkv.pages (codec -> pages: same layer)",
        "tensorkv.errors imports tensorkv.config (errors -> config: higher layer)",
    ]
    with pytest.raises(AssertionError, match=r"\['newthing'\] are not in the layer contract"):
        test_every_top_level_package_is_in_the_contract()
    assert [v.split(": ", 1)[1] for v in forbidden_imports()] == [
        "tensorkv.embedding.chain.runtime imports tensorkv.embedding.table "
        "(tensorkv.embedding.chain must not import tensorkv.embedding.table)",
        "tensorkv.embedding.tiers.ssd imports tensorkv.embedding.chain.runtime "
        "(tensorkv.embedding.tiers must not import tensorkv.embedding.chain)",
    ]
    [long] = long_modules()
    assert long.endswith("tensorkv/stores/huge.py: 904 lines")


def _report() -> str:
    parts = [("cycles", [", ".join(c) for c in import_cycles()]),
             ("layer violations", layer_violations()),
             ("forbidden imports", forbidden_imports()),
             ("private imports", private_imports()),
             ("long modules", long_modules())]
    out = []
    for title, lines in parts:
        out.append(f"{title}: {len(lines)}")
        out.extend(f"  {line}" for line in lines)
    return "\n".join(out)


if __name__ == "__main__":
    print(_report())
