"""The README starts with its setup commands and its backend table matches the classes.

Its code blocks run in tests/test_docs.py, with every other doc's.
"""

import re
from pathlib import Path

from tensorkv.cli.main import scheme_capabilities
from tensorkv.stores import schemes

README = Path(__file__).resolve().parents[1] / "README.md"
COLUMNS = {
    "ordered scans?": "ordered_scans",
    "atomic batches?": "atomic_batches",
    "durable on return?": "durable_on_return",
    "shared between processes?": "multi_process",
    "distributed?": "distributed",
}


def backend_table(text: str) -> tuple[list[str], list[list[str]]]:
    lines = text.split("\n## Backends\n", 1)[1].splitlines()
    rows = [line for line in lines if line.startswith("|")]
    split = [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows]
    return split[0], [r for r in split[2:]]


def test_readme_setup_commands_come_first():
    text = README.read_text()
    first_code = text.index("```")
    assert text[first_code:].startswith("```sh\nmake demo")
    block = text[first_code : text.index("```", first_code + 3)]
    assert "make test" in block


def test_readme_backend_table_matches_capabilities():
    head, rows = backend_table(README.read_text())
    assert head[:2] == ["backend", "URL"]
    assert [COLUMNS.get(h) for h in head[2:]] == list(COLUMNS.values())
    seen: set[str] = set()
    for row in rows:
        urls = re.findall(r"`([a-z+]+)://", row[1])
        assert urls, f"no URL in row {row}"
        seen.update(urls)
        caps = scheme_capabilities(urls[0]).as_dict()
        for name, cell in zip(head[2:], row[2:], strict=True):
            word = cell.split()[0].lower()
            assert word in {"yes", "no"}, f"{row[0]}: {name} cell {cell!r} must start yes/no"
            assert (word == "yes") == caps[COLUMNS[name]], (
                f"README says {row[0]} {name} {word}; the class says {caps[COLUMNS[name]]}"
            )
        for scheme in urls[1:]:  # every scheme in a row has the same guarantees
            assert scheme_capabilities(scheme) == scheme_capabilities(urls[0]), (row[0], scheme)
    assert seen == set(schemes()), f"schemes missing from the README table: {set(schemes()) - seen}"


def section(text: str, heading: str) -> str:
    """The text of the ``## heading`` section, up to the next ``## ``."""
    body = text.split(f"\n## {heading}\n", 1)[1]
    return body.split("\n## ", 1)[0]


def test_readme_links_every_doc():
    docs = section(README.read_text(), "Documentation")
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)[#)]", docs))
    on_disk = {p.name for p in (README.parent / "docs").glob("*.md")}
    assert on_disk <= linked, f"docs not linked from the README's list: {on_disk - linked}"
    assert "make docs" in docs and "](docs/reference/" in docs  # the API reference


def test_readme_architecture_names_every_package():
    arch = section(README.read_text(), "Architecture")
    src = README.parent / "src" / "tensorkv"
    parts = {f"{p.parent.name}/" for p in src.glob("*/__init__.py")}
    parts |= {p.name for p in src.glob("*.py") if p.name != "__init__.py"}
    named = set(re.findall(r"`([\w.]+/?)`", arch))
    assert parts <= named, f"missing from the README's Architecture: {parts - named}"


def test_readme_has_a_pytorch_example():
    torch_section = section(README.read_text(), "PyTorch")
    code = torch_section.split("```python\n", 1)[1].split("```", 1)[0]
    for call in ("DynamicEmbeddingBag(", ".backward()", ".step()", "save("):
        assert call in code, f"the README's PyTorch example no longer shows {call}"
