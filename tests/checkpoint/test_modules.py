"""The modules of tensorkv.checkpoint import one another in one order.

Private imports, cycles and layers of every package: tests/test_architecture.py.
"""

import ast
import pathlib

import pytest

import tensorkv.checkpoint

PKG = "tensorkv.checkpoint"
ROOT = pathlib.Path(tensorkv.checkpoint.__file__).parent
SRC = ROOT.parent
TESTS = pathlib.Path(__file__).parents[1]
# Each module imports only modules listed before it (as the package docstring says).
ORDER = [
    "layout", "gather", "progress", "access", "claims",
    "manifest", "dense", "keylists", "staging", "runs",
    "writer", "objects", "shards", "tables",
    "refs", "bulk", "sweep",
    "steps", "handle",
    "save", "load",
    "tags", "check",
    "__init__",
]


def _imports(tree):
    """(module, names, line) of every import, in functions too, outside TYPE_CHECKING blocks."""
    out = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(node):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
        visit(node)

    visit(tree)
    return out


def _checkpoint_deps(path):
    deps = set()
    for module, names, _ in _imports(ast.parse(path.read_text())):
        if module == PKG:
            deps |= {n for n in names if n in ORDER}
        elif module.startswith(PKG + "."):
            deps.add(module.split(".")[2])
    return deps - {path.stem}


def test_every_module_is_in_the_order():
    assert sorted(p.stem for p in ROOT.glob("*.py")) == sorted(ORDER)


@pytest.mark.parametrize("name", ORDER)
def test_modules_import_only_modules_below_them(name):
    below = set(ORDER[: ORDER.index(name)])
    assert _checkpoint_deps(ROOT / f"{name}.py") <= below
