"""Every fenced code block of README.md and docs/*.md runs as written (with the rewrites below).

A block's test id is ``FILE:LINE`` of its opening fence. By language:

* ``python``: executed in a fresh interpreter whose working directory (and ``TMPDIR``) is a
  fresh temporary directory. Blocks under the same heading build on each other: a block runs
  after the earlier python blocks of its section, in one namespace. A string literal with a
  ``{name}`` placeholder must not appear in what the block prints (a template printed as is).
* ``sh``, ``bash``, ``shell``, ``console``: each command (``\\`` continuations joined,
  comments and a ``$`` prompt dropped) is matched against :data:`COMMANDS`: ``tensorkv ...``
  (or ``python -m tensorkv.cli.main ...``) runs in a subprocess and must exit 0
  (``tensorkv bench`` with ``--dry-run``: the CLI checks the workload and its parameters, as
  a benchmark runs for minutes; tests/test_bench_*.py run each workload at a tiny size); the
  other rules skip a command, each with its reason. A command no rule matches fails the test.
* ``json``: parsed. ``text``: output, diagrams, schemas; not run.
* A block without a language, or with another one, fails: give it one.

``<!-- doctest: skip REASON -->`` on the line before a fence skips that block with REASON
(keep such marks rare: prefer a block that runs).

Before a block runs, :data:`REWRITES` turns what it cannot use here into what it can: server
URLs into a real ``redis-server`` of the test session, absolute data paths into the temporary
directory, and the sizes of documented benchmark scripts into small ones (their figures are
not checked). A rewrite that no longer matches its file fails
:func:`test_every_rewrite_still_matches`, so a changed block is never run unrewritten.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = {"python"}
SHELL = {"sh", "bash", "shell", "console"}
NOT_RUN = {"text"}
TIMEOUT_S = 300

FENCE = re.compile(r"^```(\S*)\s*$")
HEADING = re.compile(r"^#{1,6} ")
#: A plain (not f-) string literal holding a ``{name}`` placeholder.
TEMPLATE = re.compile(r"""(?<![\w'"])["']([^"'\n]*\{\w*\}[^"'\n]*)["']""")
SKIP_MARK = re.compile(r"^<!--\s*doctest:\s*skip\b\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Rewrite:
    """Replace ``old`` (a regex) by ``new`` in the blocks of ``file`` ("*": every file).

    ``new`` may name ``{tmp}`` (the block's temporary directory), ``{redis}`` (the session's
    redis-server, ``redis://127.0.0.1:PORT``) and ``{root}`` (the repository).
    """

    file: str
    old: str
    new: str
    why: str


REDIS_URL = Rewrite("*", r"redis://(?:localhost|host):6379", "{redis}",
                    "a real redis-server on a free port (tests/servers.py)")
REWRITES = [
    REDIS_URL,
    Rewrite("*", r"(?<![\w.])/(data|tmp|work/bench-data)(?=/|\s|$)", "{tmp}/\\1",
            "absolute data paths: the block's temporary directory"),
    Rewrite("docs/backends.md", r"n, dim, chunk = 50_000, 128, 1000",
            "n, dim, chunk = 2_000, 128, 1000", "benchmark script: small size"),
    Rewrite("docs/redis.md", r'sys\.path\.insert\(0, "tests"\)',
            'sys.path.insert(0, "{root}/tests")',
            "the block says 'run from the repository root'; it runs in a temporary directory"),
    Rewrite("docs/redis.md", r"range\(100_000\)", "range(2_000)",
            "benchmark script: small size"),
    Rewrite("docs/distributed.md", r"start_local_ray\(num_cpus=2\)",
            'start_local_ray(num_cpus=2, _temp_dir="/tmp/tensorkv-ray")',
            "Ray's socket paths must stay under 108 bytes; the block's TMPDIR is longer"),
    Rewrite("docs/coming_from.md", r"start_local_ray\(num_cpus=2\)",
            'start_local_ray(num_cpus=2, _temp_dir="/tmp/tensorkv-ray")',
            "Ray's socket paths must stay under 108 bytes; the block's TMPDIR is longer"),
]

#: Shell commands, by program (``python -m MODULE`` counts as program MODULE; a path before
#: the program name is ignored): "run", or the reason it is skipped.
COMMANDS = {
    "tensorkv": "run",
    "tensorkv.cli.main": "run",
    "make": "builds the virtualenv and installs packages (make test runs this file)",
    "pip": "installs packages",
    "apt-get": "installs system packages",
    "pytest": "runs tests: the suite runs them itself",
}
#: Added to ``tensorkv bench`` commands (see the module docstring).
BENCH_DRY_RUN = "--dry-run"


@dataclass(frozen=True)
class Block:
    """One fenced code block."""

    file: str  # relative to the repository
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    section: str  # the nearest heading above it
    skip: str | None  # the reason of a doctest: skip mark

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def blocks_of(path: Path, rel: str | None = None) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order (``rel``: its name in the ids)."""
    rel = rel or path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    out: list[Block] = []
    section = ""
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if HEADING.match(lines[i]):
            section = lines[i]
        elif m:
            end = i + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            if end == len(lines):
                raise AssertionError(f"{rel}:{i + 1}: code block never closed")
            mark = SKIP_MARK.match(lines[i - 1]) if i else None
            out.append(Block(rel, i + 1, m.group(1), "\n".join(lines[i + 1 : end]) + "\n",
                             section, mark.group(1) if mark else None))
            i = end
        i += 1
    return out


BLOCKS = [b for path in DOC_FILES for b in blocks_of(path)]


def rewrite(block: Block, **values: str) -> str:
    """The block's code with every rewrite for its file applied."""
    code = block.code
    for r in REWRITES:
        if r.file in ("*", block.file):
            code = re.sub(r.old, r.new.format(**values), code)
    return code


def needs_redis(block: Block) -> bool:
    """Whether a block names a server URL that the session's redis-server stands in for."""
    return re.search(REDIS_URL.old, block.code) is not None


def _env(tmp: Path) -> dict[str, str]:
    (tmp / "tmp").mkdir(exist_ok=True)
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp / "tmp"),
            "TENSORKV_PROGRESS": "0"}


RUNNER = """
import json, sys
ns = {"__name__": "__main__"}
for path, line, code in json.load(sys.stdin):
    exec(compile("\\n" * line + code, path, "exec"), ns)
"""


def run_python(blocks: list[tuple[Block, str]], tmp: Path) -> None:
    """Run the blocks in order in one namespace of a fresh interpreter (cwd ``tmp``)."""
    payload = json.dumps([(b.file, b.line, code) for b, code in blocks])
    r = subprocess.run([sys.executable, "-c", RUNNER], input=payload, cwd=tmp, env=_env(tmp),
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    if r.returncode != 0:
        code = "\n".join(f"{blocks[-1][0].line + 1 + n:5}  {text}"
                         for n, text in enumerate(blocks[-1][1].splitlines()))
        pytest.fail(f"{blocks[-1][0].id} failed (exit {r.returncode}):\n{code}\n"
                    f"--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}", pytrace=False)
    for template in TEMPLATE.findall(blocks[-1][1]):  # a str.format template printed as is
        assert template not in r.stdout, (
            f"{blocks[-1][0].id} printed the template {template!r} instead of its value:\n"
            f"{r.stdout}"
        )


def commands(code: str) -> list[list[str]]:
    """The commands of a shell block as argument lists."""
    text = re.sub(r"\\\n", " ", code)
    out = []
    for line in text.splitlines():
        line = re.sub(r"^\s*\$\s+", "", line)
        argv = shlex.split(line, comments=True)
        if argv:
            out.append(argv)
    return out


def program(argv: list[str]) -> tuple[str, list[str]]:
    """The program a command runs and its arguments (``python -m M args`` runs ``M``)."""
    name = Path(argv[0]).name
    if re.fullmatch(r"python[\d.]*", name) and argv[1:2] == ["-m"] and len(argv) > 2:
        return argv[2], argv[3:]
    return name, argv[1:]


def run_shell(block: Block, code: str, tmp: Path) -> None:
    """Run the block's tensorkv commands; skip it when none of its commands may run."""
    ran, skipped = 0, []
    for argv in commands(code):
        prog, args = program(argv)
        rule = COMMANDS.get(prog)
        if rule is None:
            pytest.fail(f"{block.id}: no rule for the command {shlex.join(argv)!r}; add one "
                        "to COMMANDS in tests/test_docs.py", pytrace=False)
        if rule != "run":
            skipped.append(f"{prog}: {rule}")
            continue
        if args[:1] == ["bench"]:
            args = [*args, BENCH_DRY_RUN]
        r = subprocess.run([sys.executable, "-m", "tensorkv.cli.main", *args], cwd=tmp,
                           env=_env(tmp), capture_output=True, text=True, timeout=TIMEOUT_S)
        assert r.returncode == 0, (f"{block.id}: `tensorkv {shlex.join(args)}` exited "
                                   f"{r.returncode}\n{r.stdout}\n{r.stderr}")
        ran += 1
    if skipped:
        print(f"{block.id}: not run: " + "; ".join(skipped))
    if not ran:
        pytest.skip("; ".join(dict.fromkeys(skipped)) or "no commands")


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_doc_block_runs(block: Block, tmp_path: Path, request: pytest.FixtureRequest):
    if block.skip is not None:
        assert block.skip, f"{block.id}: a doctest: skip mark needs a reason"
        pytest.skip(block.skip)
    assert block.lang in PYTHON | SHELL | NOT_RUN | {"json"}, (
        f"{block.id}: fence language {block.lang!r}; use python, sh, json or text "
        "(see tests/test_docs.py)"
    )
    if block.lang in NOT_RUN:
        pytest.skip("text block: not run")
    values = {"tmp": str(tmp_path), "root": str(ROOT), "redis": ""}
    if needs_redis(block) or (block.lang in PYTHON and any(
            needs_redis(b) for b in BLOCKS
            if b.file == block.file and b.section == block.section and b.line < block.line)):
        server = request.getfixturevalue("redis_server")
        values["redis"] = f"redis://127.0.0.1:{server.port}"
    if block.lang == "json":
        json.loads(block.code)
    elif block.lang in SHELL:
        run_shell(block, rewrite(block, **values), tmp_path)
    else:
        chain = [b for b in BLOCKS if b.file == block.file and b.section == block.section
                 and b.lang in PYTHON and b.line <= block.line and b.skip is None]
        run_python([(b, rewrite(b, **values)) for b in chain], tmp_path)


@pytest.mark.parametrize("r", [r for r in REWRITES if r.file != "*"],
                         ids=lambda r: f"{r.file}:{r.old.replace(chr(92), '')}")
def test_every_rewrite_still_matches(r: Rewrite):
    assert any(re.search(r.old, b.code) for b in BLOCKS if b.file == r.file), (
        f"no block of {r.file} matches {r.old!r} any more: update REWRITES in tests/test_docs.py"
    )


def test_blocks_are_found():
    files = {b.file for b in BLOCKS}
    assert {"README.md", "docs/tiers.md", "docs/backends.md"} <= files
    assert sum(b.lang == "python" for b in BLOCKS) >= 10


def test_the_rules_read_blocks_sections_marks_and_commands(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(
        "# A\n```python\nx = 1\n```\n<!-- doctest: skip needs a GPU -->\n```python\ny = x\n```\n"
        "## B\n```sh\n$ tensorkv bench kv -p a=1 \\\n    -p b=2  # comment\n"
        "python3 -m pytest -q tests\n.venv/bin/pytest\n```\n```\nno language\n```\n"
    )
    a, b, c, d = blocks_of(md, "x.md")
    assert (a.id, a.lang, a.section, a.skip, a.code) == ("x.md:2", "python", "# A", None, "x = 1\n")
    assert (b.section, b.skip) == ("# A", "needs a GPU")
    assert (c.section, c.lang, d.lang) == ("## B", "sh", "")
    argvs = commands(c.code)
    assert argvs[0] == ["tensorkv", "bench", "kv", "-p", "a=1", "-p", "b=2"]
    assert [program(a)[0] for a in argvs] == ["tensorkv", "pytest", "pytest"]
    assert all(program(a)[0] in COMMANDS for a in argvs)
    code = rewrite(Block("docs/x.md", 1, "python", 'open_store("redis://localhost:6379/0")\n'
                         'p = "/data/emb"; q = "lmdb:///tmp/x"; r = "src/data/y"\n', "", None),
                   tmp="/T", redis="redis://127.0.0.1:1", root="/R")
    assert code == ('open_store("redis://127.0.0.1:1/0")\n'
                    'p = "/T/data/emb"; q = "lmdb:///T/tmp/x"; r = "src/data/y"\n')
    with pytest.raises(AssertionError, match="never closed"):
        md.write_text("```python\nx = 1\n")
        blocks_of(md, "x.md")
