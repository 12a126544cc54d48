"""Every ``>>>`` example in the docstrings of ``src/tensorkv`` runs as a doctest and passes.

The modules are found by reading the source files (any file holding ``>>>``), so a module
that gains an example, or moves to another package, is tested without editing this file.
Each module's examples run in a fresh temporary working directory. An example that needs
what a test cannot start quickly (a Ray cluster) carries ``# doctest: +SKIP`` and says why
in its docstring; :func:`test_every_example_is_collected` makes sure no other example is
silently left out (one in a nested function or a string the finder does not see).
"""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "tensorkv"
PROMPT = re.compile(r"^\s*>>> ", re.MULTILINE)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


#: ``(module name, number of >>> lines in its file)`` of every module with an example.
MODULES = sorted(
    (module_name(path), len(PROMPT.findall(text)))
    for path in PACKAGE.rglob("*.py")
    if PROMPT.search(text := path.read_text())
)


def doctests_of(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [t for t in finder.find(module, name) if t.examples]


def test_examples_exist():
    assert len(MODULES) >= 10, MODULES  # the finder above still reads the sources


@pytest.mark.parametrize(("name", "prompts"), MODULES, ids=[m for m, _ in MODULES])
def test_every_example_is_collected(name, prompts):
    examples = sum(len(t.examples) for t in doctests_of(name))
    assert examples == prompts, (
        f"{name}: {prompts} '>>>' lines in the file, but the doctest finder collects "
        f"{examples} examples; put examples only in the docstrings of the module, its "
        "classes and their functions, where doctest finds them"
    )


@pytest.mark.parametrize(("name", "prompts"), MODULES, ids=[m for m, _ in MODULES])
def test_docstring_examples_pass(name, prompts, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    for test in doctests_of(name):
        runner.run(test, out=report.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(report)
