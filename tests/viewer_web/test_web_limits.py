"""Over-long and over-deep request parameters get a 400 naming the limit, never a 500.

Every parameter is bounded before anything reads it (``api.PARAM_LIMITS``), and the query
layer's own limits (a tag's bytes, a predicate's nesting) answer 400 too. An error is one
line of JSON that shows at most a few dozen characters of what it refused.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorkv.viewer import limits
from tensorkv.viewer.web import api

DEEP = "(" * 250 + "freq > 0" + ")" * 250


def _refused(client, path: str, **params) -> str:
    r = client.get(f"/api/{path}", params=params)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    assert len(r.content) < 500 and "Traceback" not in r.text
    return r.json()["error"]


@pytest.mark.parametrize(("path", "params", "what"), [
    ("rows", {"var": "emb", "where": DEEP}, "nest more than 32 levels deep"),
    ("rows", {"var": "emb", "where": "not " * 40 + "freq > 0"}, "nest more than 32 levels"),
    ("rows", {"var": "emb", "where": "freq > 0 and " * 400 + "freq > 0"},
     "at most 4096 characters"),
    ("rows", {"var": "emb", "tag": "t" * 201}, "at most 200 characters"),
    ("rows", {"var": "emb", "tag": "é" * 101}, "202 bytes long; the viewer accepts at most 200"),
    ("rows", {"var": "emb", "tag": "a/b"}, "contains '/'"),
    ("variables", {"tag": "x~y"}, "contains '~'"),
    ("stats", {"var": "emb", "tag": "{t1}"}, "contains '{'"),
    ("diff", {"a": "t1", "b": "b" * 5000}, "at most 200 characters"),
    ("rows", {"var": "v" * 1025}, "at most 1024 characters"),
    ("row", {"var": "é" * 513, "key": "1"}, "1026 bytes long; the viewer accepts at most 1024"),
    ("rows", {"var": "emb", "where": "freq > 0", "cursor": "9" * 65}, "at most 64 characters"),
    ("rows", {"var": "emb", "where": "freq > 0", "cursor": "9" * 64}, "out of range"),
    ("rows", {"var": "emb", "offset": "1" * 100}, "at most 64 characters"),
    ("row", {"var": "emb", "key": "7" * 65}, "at most 64 characters"),
    ("search", {"var": "emb", "keys": "1.." + "2" * 70}, "at most 64 characters"),
    ("search", {"var": "emb", "keys": "1," * 12_001}, "at most 24000 characters"),
    ("slice", {"var": "mlp.bias", "slice": "0," * 600}, "at most 1024 characters"),
    ("nearest", {"var": "emb", "vector": "1 " * 20_000}, "at most 32768 characters"),
    ("nearest", {"var": "emb", "key": "1", "metric": "m" * 100}, "at most 64 characters"),
    ("pca", {"var": "emb", "n": "1e999"}, "is not an integer"),
    ("tags", {"unknown": "u" * 100}, "at most 64 characters"),
])
def test_long_and_deep_parameters_are_refused(client, path, params, what):
    assert what in _refused(client, path, **params)


def test_inputs_at_the_limits_are_answered(client):
    # a tag of 200 bytes is a name a tag can have: 404, it does not exist
    r = client.get("/api/rows", params={"var": "emb", "tag": "t" * 200})
    assert r.status_code == 404 and "does not exist" in r.json()["error"]
    r = client.get("/api/rows", params={"var": "emb", "where": "(" * 32 + "freq>0" + ")" * 32})
    assert r.status_code == 200, r.text
    text = "freq >= 2" + " " * (limits.MAX_PREDICATE_CHARS - 9)
    r = client.get("/api/rows", params={"var": "emb", "where": text, "limit": 500})
    assert r.status_code == 200 and r.json()["rows"]["key"], r.text
    r = client.get("/api/variables", params={"tag": "t1", "unknown": "u" * api.MAX_PARAM_CHARS})
    assert r.status_code == 200


def test_an_unexpected_error_is_one_line_and_logged(ckpt, monkeypatch, caplog):
    # a bug in an endpoint: a 500 with one line of JSON; the traceback goes to the log
    from starlette.testclient import TestClient

    from tensorkv.viewer.web.app import create_app

    def broken(state, params):
        raise ZeroDivisionError("x" * 10_000)

    monkeypatch.setitem(api.ENDPOINTS, "info", broken)
    monkeypatch.delenv("TENSORKV_DEBUG", raising=False)
    with TestClient(create_app(ckpt["url"]), base_url="http://127.0.0.1") as c:
        r = c.get("/api/info")
    assert r.status_code == 500 and len(r.content) < 500
    assert r.json()["error"].startswith("unexpected ZeroDivisionError: xxx")
    assert "report it" in r.json()["error"]
    assert any("Traceback" in (rec.exc_text or "") or rec.exc_info for rec in caplog.records)
    monkeypatch.setenv("TENSORKV_DEBUG", "1")  # debugging: the exception itself
    with (TestClient(create_app(ckpt["url"]), base_url="http://127.0.0.1") as c,
          pytest.raises(ZeroDivisionError)):
        c.get("/api/info")


def test_integer_parameters_are_bounded_when_called_directly():
    # the endpoints are plain functions that scripts may call with their own parameters
    from tensorkv.errors import QueryError

    with pytest.raises(QueryError, match="65 characters long; the viewer accepts at most 64"):
        api.integer({"cursor": "9" * 65}, "cursor", 0, 0, 10)
    with pytest.raises(QueryError, match="cursor='x") as e:
        api.integer({"cursor": "x" * 64}, "cursor", 0, 0, 10)
    assert len(str(e.value)) < 200


NASTY = ["", "x", "-1", "0", "1", "t1", "t2", "emb", "mlp.bias", "cube", "latest", "a/b", "~x",
         "{x}", "\x00", "é", "1..5", "5..1", "..", "0x10", "1,2,x", "0:2", ":, :, :", "...",
         "cosine", "nan", "inf", "1e999", "9" * 64, "9" * 65, "t" * 200, "t" * 201,
         "(" * 40 + "freq > 0" + ")" * 40, "not " * 40 + "freq > 0", "freq > 0 and " * 400,
         "3=freq" + "=3=freq" * 580, "0," * 600, "x" * 5000]
PARAMS = {"variables": ["tag"], "rows": ["tag", "var", "offset", "limit", "where", "cursor"],
          "row": ["tag", "var", "key"], "search": ["tag", "var", "keys", "limit"],
          "nearest": ["tag", "var", "key", "vector", "k", "metric"],
          "stats": ["tag", "var", "bins", "exact"], "pca": ["tag", "var", "n"],
          "diff": ["a", "b", "var"], "slice": ["tag", "var", "slice"]}


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_parameter_makes_an_endpoint_fail(client, data):
    # whatever the parameters, an endpoint answers its result or a short 400/404: no 500
    path = data.draw(st.sampled_from(sorted(PARAMS)))
    values = st.one_of(st.sampled_from(NASTY), st.text(max_size=30))
    params = data.draw(st.dictionaries(st.sampled_from(PARAMS[path]), values))
    r = client.get(f"/api/{path}", params=params)
    assert r.status_code in (200, 400, 404), (path, params, r.status_code, r.text[:300])
    if r.status_code != 200:
        assert len(r.content) < 1000 and r.json()["error"], r.text[:300]
