"""The suite's lanes stay true: every ``slow`` entry names a test, Ray tests share a worker.

``SLOW`` and ``GROUPS`` (tests/conftest.py) name tests by node id and by test name; a renamed
or moved test would silently fall out of them. These checks read the test sources, so they
run in a fraction of a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import conftest

ROOT = Path(__file__).resolve().parents[1]
#: Where tests are defined: the test packages and the conformance suites they run.
SOURCES = [*sorted((ROOT / "tests").rglob("test_*.py")),
           *sorted((ROOT / "src" / "tensorkv" / "testing").glob("*.py"))]


def _defines(text: str, name: str) -> bool:
    return re.search(rf"^\s*(async\s+)?def {re.escape(name)}\(", text, re.M) is not None


@pytest.mark.parametrize("entry", sorted(conftest.SLOW))
def test_every_slow_entry_names_a_test(entry):
    if "/" not in entry:  # a test name: defined somewhere
        assert any(_defines(p.read_text(), entry) for p in SOURCES), (
            f"SLOW names {entry!r}, which no test file defines: remove or rename the entry")
        return
    path = ROOT / entry.split("::")[0]
    assert path.is_file(), f"SLOW names {entry!r}, but {path} does not exist"
    if "::" in entry:
        name = entry.split("::")[-1].split("[")[0]
        assert _defines(path.read_text(), name), f"SLOW names {entry!r}: no {name} in {path}"
    assert conftest.SLOW[entry].strip(), f"SLOW entry {entry!r} gives no reason"


def test_node_id_prefixes_match_whole_names():
    m = conftest._matches
    assert m("tests/a.py::test_x", "tests/a.py::test_x")
    assert m("tests/a.py::test_x[lmdb-1]", "tests/a.py::test_x")
    assert m("tests/a.py::T::test_x", "tests/a.py")
    assert m("tests/d/test_b.py::test_y", "tests/d/")
    assert m("tests/a.py::test_x[lmdb-1]", "tests/a.py::test_x[lmdb")
    assert not m("tests/a.py::test_xy", "tests/a.py::test_x")
    assert not m("tests/ab.py::test_x", "tests/a")


def test_ray_tests_share_one_group():
    assert conftest.group_of("tests/distributed/test_ps.py::test_shards") == "ray"
    assert conftest.group_of(
        "tests/test_docs.py::test_doc_block_runs[docs/distributed.md:13]") == "ray"
    assert conftest.group_of("tests/test_docs.py::test_doc_block_runs[docs/torch.md:24]") is None
    assert conftest.group_of("tests/stores/test_lmdb.py::test_bad_urls") is None
    assert conftest.group_of("tests/test_architecture.py::test_layers") == "architecture"


def test_every_test_file_that_starts_ray_is_in_the_ray_group():
    """A Ray test outside the group would start another Ray on another worker."""
    starts_ray = re.compile(r"\bray_cluster\b|start_local_ray|\bray\.init\(|ParameterServer\(")
    outside = [p.relative_to(ROOT).as_posix() for p in SOURCES
               if p.is_relative_to(ROOT / "tests") and p != Path(__file__).resolve()
               and starts_ray.search(p.read_text())
               and conftest.group_of(p.relative_to(ROOT).as_posix() + "::t") != "ray"]
    # test_docs.py: only its docs/distributed.md blocks start Ray, and they are in the group
    assert [p for p in outside if p != "tests/test_docs.py"] == [], (
        f"{outside} start Ray: add them to GROUPS['ray'] in tests/conftest.py")
