"""The web viewer is read-only, serves nothing outside its store, and binds loopback only."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner
from tests.viewer_web.conftest import EVIL

from tensorkv.cli.main import main

PATHS = ["/", "/api/tags", "/api/rows", "/api/nonexistent", "/static/viewer.js", "/static/x"]


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_write_methods_are_refused(client, method):
    before = client.get("/api/tags").json()
    for path in PATHS:
        r = client.request(method, path, params={"var": "emb"}, content=b"{}")
        assert r.status_code == 405, (method, path, r.status_code)
        assert "read-only" in r.text
        assert r.headers["allow"] == "GET, HEAD"
    assert client.get("/api/tags").json() == before


def test_head_and_get_are_answered(client):
    assert client.head("/api/tags").status_code == 200
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY"


@pytest.mark.parametrize("path", [
    "/static/../app.py",
    "/static/%2e%2e/app.py",
    "/static/..%2fapp.py",
    "/static/%2e%2e%2f%2e%2e%2fapi.py",
    "/static/vendor/../../server.py",
    "/static//etc/passwd",
    "/static/%2fetc%2fpasswd",
    "/static/....//app.py",
])
def test_static_paths_outside_the_folder_are_refused(client, path):
    # send the path as given: the client must not normalise the dots away
    r = client.get(path.replace("/static", "http://127.0.0.1:8737/static", 1))
    assert r.status_code in (400, 404), (path, r.status_code)
    assert "create_app" not in r.text and "root:" not in r.text


def test_page_markup_holds_no_store_text(client, ckpt):
    # the page is static: names reach it only as JSON, which the script sets as text
    html = client.get("/").text
    assert EVIL not in html and "tkvPwned" not in html
    body = client.get("/api/variables", params={"tag": "t1"})
    assert body.headers["content-type"].startswith("application/json")
    assert EVIL in [v["name"] for v in body.json()["variables"]]
    js = client.get("/static/viewer.js").text
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "eval(" not in js


def test_foreign_host_header_is_refused(client):
    # a page on another site resolving its name to 127.0.0.1 (DNS rebinding) gets nothing
    for host in ("attacker.example:8737", "attacker.example", "127.0.0.1.attacker.example",
                 "[::2]:8737", ""):
        r = client.get("/api/tags", headers={"host": host})
        assert r.status_code == 400 and "refused" in r.text, host
    for host in ("localhost:8737", "LOCALHOST", "127.0.0.1", "[::1]:8737", "[::1]"):
        assert client.get("/api/tags", headers={"host": host}).status_code == 200, host


def test_remote_viewer_answers_any_host(ckpt):
    from starlette.testclient import TestClient

    from tensorkv.viewer.web.app import create_app

    app = create_app(ckpt["url"], allowed_hosts=["*"])
    with TestClient(app, base_url="http://viewer.example:8737") as c:
        assert c.get("/api/tags").status_code == 200
        assert c.post("/api/tags").status_code == 405


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"])
def test_loopback_hosts(host):
    from tensorkv.viewer.web.server import check_host

    check_host(host, allow_remote=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com"])
def test_non_loopback_bind_needs_the_flag(host, ckpt):
    from tensorkv.errors import ConfigError
    from tensorkv.viewer.web.server import check_host

    with pytest.raises(ConfigError, match="--allow-remote"):
        check_host(host, allow_remote=False)
    check_host(host, allow_remote=True)
    res = CliRunner().invoke(main, ["view", ckpt["url"], "--host", host, "--port", "0"])
    assert res.exit_code == 2
    assert f"refusing to bind {host!r}" in res.output and "--allow-remote" in res.output


def test_port_in_use_is_a_clear_error(ckpt):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        res = CliRunner().invoke(main, ["view", ckpt["url"], "--port", str(port)])
    assert res.exit_code == 2
    assert f"port {port} on 127.0.0.1 is in use" in res.output and "--port" in res.output
    res = CliRunner().invoke(main, ["view", ckpt["url"], "--port", "70000"])
    assert res.exit_code == 2 and "out of range" in res.output


def test_bad_store_and_tag_fail_before_serving(ckpt, tmp_path):
    res = CliRunner().invoke(main, ["view", f"lmdb://{tmp_path}/absent", "--port", "0"])
    assert res.exit_code == 3 and "absent" in res.output
    res = CliRunner().invoke(main, ["view", ckpt["url"], "--port", "0", "--tag", "t9"])
    assert res.exit_code == 3 and "t9" in res.output and "t1" in res.output
    pytest.importorskip("redis")
    from tests import servers

    port = servers.free_port()
    res = CliRunner().invoke(main, ["view", f"redis://127.0.0.1:{port}/0?connect_timeout=1",
                                    "--port", "0"])
    assert res.exit_code == 4 and f"cannot reach Redis server 127.0.0.1:{port}" in res.output


def test_missing_web_stack_names_the_extra(monkeypatch):
    import sys

    from tensorkv.errors import MissingDependencyError
    from tensorkv.viewer.web.app import create_app

    monkeypatch.setitem(sys.modules, "starlette", None)
    with pytest.raises(MissingDependencyError, match=r"tensorkv\[view\]"):
        create_app("memory://nothing")


def test_every_asset_ships_in_the_package_pinned(client):
    # no CDN: the page loads only files of its own server, and they are the pinned ones
    import hashlib
    import re

    from tensorkv.viewer.web.app import STATIC_DIR

    html = client.get("/").text
    refs = re.findall(r'(?:src|href)="([^"#]*)"', html)
    assert refs and all(r.startswith("/static/") or r.startswith("data:") for r in refs), refs
    for ref in refs:
        if ref.startswith("/static/"):
            assert client.get(ref).status_code == 200, ref
    for path in STATIC_DIR.rglob("*"):
        if path.suffix in (".js", ".css", ".html"):
            text = path.read_text(encoding="utf-8")
            urls = set(re.findall(r"https?://[^\s\"')]+", text))
            assert urls <= {"https://github.com/leeoniya/uPlot"}, (path.name, urls)  # a comment
    vendor = STATIC_DIR / "vendor"
    pinned = dict(re.findall(r"^\| (\S+) \| [^|]+ \| ([0-9a-f]{64}) \|$",
                             (vendor / "VENDOR.md").read_text(), re.M))
    assert {"uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE"} <= set(pinned)
    for name in ("uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE"):
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == pinned[name], name


def test_the_store_password_is_never_shown(redis_acl_server):
    # neither the commands (output, errors) nor the page's API echo the URL's password
    pytest.importorskip("redis")
    import numpy as np
    from starlette.testclient import TestClient

    import tensorkv
    from tensorkv.viewer.web.app import create_app

    url = f"redis://app:s3cret@127.0.0.1:{redis_acl_server.port}/0?prefix=viewer-secret/"
    table = tensorkv.EmbeddingTable(4)
    table.lookup(np.arange(10))
    tensorkv.save({"emb": table}, url, "x")
    runner = CliRunner()
    for args in (["ls", url], ["ls", url, "x", "--json"], ["show", url, "nope"],
                 ["stats", url, "emb", "--tag", "zz"],
                 ["ls", url.replace("s3cret", "wrong-pw")]):
        res = runner.invoke(main, args)
        assert "s3cret" not in res.output and "wrong-pw" not in res.output, res.output
    res = runner.invoke(main, ["stats", url, "emb", "--tag", "zz"])
    assert "redis://app:***@" in res.output
    with TestClient(create_app(url), base_url="http://127.0.0.1") as c:
        assert c.get("/api/info").json()["url"].startswith("redis://app:***@")
        for path in ("tags", "variables", "rows?var=nope", "stats?var=emb&tag=zz"):
            assert "s3cret" not in c.get(f"/api/{path}").text, path
