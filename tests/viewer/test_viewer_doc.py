"""docs/viewer.md shows real output: its examples match what the commands and the API print.

The page's example checkpoint (its first python block) is saved into a temporary directory,
then each ``text`` block that starts with ``$ tensorkv`` is run in-process and its stdout,
stderr and ``[exit N]`` line are compared with the block, creation times aside. The JSON
example is compared with ``show --keys 1 --json``, and the ``curl`` of the web viewer's API
with what the app answers over the page's web demo store.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner
from tests import servers

from tensorkv.cli.main import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "viewer.md"
DEMO_URL = "lmdb:///tmp/viewer-demo"
#: The unreachable Redis server of the page's error example (replaced by a free port).
DEAD_REDIS = "127.0.0.1:6390"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def _blocks(lang: str) -> list[str]:
    return [code for lng, code in FENCE.findall(DOC.read_text()) if lng == lang]


def _examples() -> list[tuple[str, str]]:
    out = []
    for code in _blocks("text"):
        first, _, want = code.partition("\n")
        if first.startswith("$ tensorkv "):
            out.append((first[2:], want))
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> str:
    """The page's example checkpoint, saved where the test can write."""
    url = f"lmdb://{tmp_path_factory.mktemp('viewer-doc')}/viewer-demo"
    code = _blocks("python")[0]
    assert DEMO_URL in code, "the first python block of docs/viewer.md builds the example"
    exec(compile(code.replace(DEMO_URL, url), str(DOC), "exec"), {"__name__": "viewer_doc"})
    return url


def _run(argv: list[str]) -> str:
    res = CliRunner().invoke(main, argv)
    return res.stdout + res.stderr + (f"[exit {res.exit_code}]\n" if res.exit_code else "")


def test_the_page_shows_every_command():
    shown = {shlex.split(cmd)[1] for cmd, _ in _examples()}
    assert shown >= {"ls", "show", "search", "stats", "diff", "export"}


@pytest.mark.parametrize(("cmd", "want"), _examples(), ids=[c for c, _ in _examples()])
def test_example_output_is_what_the_command_prints(cmd, want, demo, tmp_path, monkeypatch):
    if "redis://" in cmd:
        pytest.importorskip("redis")
    monkeypatch.chdir(tmp_path)  # export writes its file here
    dead = f"127.0.0.1:{servers.free_port()}"
    argv = [a.replace(DEMO_URL, demo).replace(DEAD_REDIS, dead) for a in shlex.split(cmd)[1:]]
    got = _run(argv).replace(demo, DEMO_URL).replace(dead, DEAD_REDIS)
    assert TIME.sub("TIME", got) == TIME.sub("TIME", want), (
        f"docs/viewer.md shows other output for `{cmd}`; update the page with:\n{got}")


def test_json_example_is_what_the_command_prints(demo):
    [doc] = _blocks("json")
    got = _run(["show", demo, "user_emb", "--keys", "1", "--json"])
    assert json.loads(got) == json.loads(doc)


def test_curl_example_is_what_the_api_answers(tmp_path):
    # the web viewer's example: the page's demo store, then the curl of /api/row
    pytest.importorskip("starlette", reason='the web viewer needs "tensorkv[view]"')
    from starlette.testclient import TestClient

    from tensorkv.viewer.web.app import create_app

    demo_url = "lmdb:///tmp/tensorkv-view-demo"
    [code] = [c for c in _blocks("python") if demo_url in c]
    url = f"lmdb://{tmp_path}/view-demo"
    exec(compile(code.replace(demo_url, url), str(DOC), "exec"), {"__name__": "viewer_doc"})
    [block] = [c for c in _blocks("text") if c.startswith("$ curl ")]
    first, _, want = block.partition("\n")
    m = re.search(r"'http://127\.0\.0\.1:8737(/api/[^']+)' \| python -m json\.tool \| head -(\d+)",
                  first)
    assert m, first
    with TestClient(create_app(url), base_url="http://127.0.0.1:8737") as c:
        r = c.get(m.group(1))
    assert r.status_code == 200, r.text
    got = json.dumps(r.json(), indent=4).splitlines()[: int(m.group(2))]
    assert got == want.splitlines()
