"""The web viewer's JSON API over a real LMDB checkpoint (Starlette's TestClient)."""

from __future__ import annotations

import numpy as np
import pytest
from tests.checkpoint.helpers import rows_of
from tests.viewer_web.conftest import DIM, EVIL


def _get(client, path, **params):
    r = client.get(f"/api/{path}", params=params)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    return r.json()


def _error(client, path, status, **params):
    r = client.get(f"/api/{path}", params=params)
    assert r.status_code == status, r.text
    return r.json()["error"]


def _as_arrays(cols):
    keys = np.array([int(k) for k in cols["key"]], np.int64)
    return keys, np.array(cols["freq"]), np.array(cols["version"]), np.array(cols["head"])


def test_info_tags_variables(client, ckpt):
    info = _get(client, "info")
    assert info["tags"] == 2 and info["tag"] == "t2" and info["url"].startswith("lmdb://")
    tags = _get(client, "tags")["tags"]
    assert [t["tag"] for t in tags] == ["t1", "t2"]
    assert [t["step"] for t in tags] == [1, 2]
    v = _get(client, "variables", tag="t1")
    assert v["tag"] == "t1"
    by_name = {x["name"]: x for x in v["variables"]}
    assert by_name["emb"]["kind"] == "table" and by_name["emb"]["dim"] == DIM
    assert by_name["emb"]["rows"] == 600
    assert by_name["mlp.weight"]["shape"] == [40, 24]
    assert EVIL in by_name  # returned as data; the page sets it as text
    assert _get(client, "variables")["tag"] == "t2"  # default: the latest


def test_the_tag_the_viewer_opens_on(ckpt):
    # `tensorkv view URL --tag t1`: requests naming no tag answer for t1, not the latest
    from starlette.testclient import TestClient

    from tensorkv.viewer.web.app import create_app

    with TestClient(create_app(ckpt["url"], tag="t1"), base_url="http://127.0.0.1") as c:
        assert _get(c, "info")["tag"] == "t1"
        assert _get(c, "variables")["tag"] == "t1"
        assert _get(c, "rows", var="emb")["total"] == 600  # t2 has 630 rows
        assert _get(c, "rows", var="emb", tag="t2")["total"] == 630


def test_rows_pages_cover_the_table_exactly(client, ckpt):
    first = _get(client, "rows", tag="t2", var="emb", limit=500)
    assert first["total"] == 630 and first["offset"] == 0 and first["next"] == 500
    assert first["prev"] is None
    second = _get(client, "rows", tag="t2", var="emb", offset=500, limit=500)
    assert second["next"] is None and second["prev"] == 0
    keys = np.concatenate([_as_arrays(first["rows"])[0], _as_arrays(second["rows"])[0]])
    ref = rows_of(ckpt["table"])
    assert np.array_equal(np.sort(keys), ref[0])
    # values, freq and version of the page equal the table's rows (float32 exactly)
    k, freq, version, head = _as_arrays(first["rows"])
    pos = np.searchsorted(ref[0], k)
    np.testing.assert_array_equal(freq, ref[3][pos])
    np.testing.assert_array_equal(version, ref[4][pos])
    np.testing.assert_array_equal(head.astype(np.float32), ref[1][pos][:, :8])
    norms = np.array(first["rows"]["norm"])
    np.testing.assert_allclose(norms, np.linalg.norm(ref[1][pos].astype(np.float64), axis=1))


def test_rows_bad_input(client):
    assert "limit=0 is out of range" in _error(client, "rows", 400, var="emb", limit=0)
    assert "is not an integer" in _error(client, "rows", 400, var="emb", offset="x")
    err = _error(client, "rows", 404, var="nope")
    assert "'nope'" in err and "emb" in err  # lists what exists
    err = _error(client, "rows", 404, var="emb", tag="t9")
    assert "t9" in err and "t1" in err
    assert "var=" in _error(client, "rows", 400)
    assert "no API endpoint" in _error(client, "nonexistent", 404)


def test_where_filter_pages_match_numpy(client, ckpt):
    ref = rows_of(ckpt["table"])
    want = np.sort(ref[0][(ref[3] >= 2) & (ref[4] >= 3)])
    got: list[int] = []
    cursor = 0
    while cursor is not None:
        page = _get(client, "rows", var="emb", where="freq >= 2 and version >= 3", limit=37,
                    cursor=cursor)
        got += [int(k) for k in page["rows"]["key"]]
        cursor = page["next_cursor"]
    assert len(got) == len(set(got))
    np.testing.assert_array_equal(np.sort(np.array(got, np.int64)), want)
    err = _error(client, "rows", 400, var="emb", where="freq >= and norm")
    assert "character" in err  # the position of the fault


def test_row_detail_is_the_stored_row(client, ckpt):
    ref = rows_of(ckpt["table"])
    key = int(ckpt["changed"][3])
    r = _get(client, "row", var="emb", key=str(key))
    i = int(np.searchsorted(ref[0], key))
    assert r["key"] == str(key)
    np.testing.assert_array_equal(np.array(r["value"], np.float32), ref[1][i])
    assert r["freq"] == int(ref[3][i]) and r["version"] == int(ref[4][i])
    assert list(r["slots"]) == ["accumulator"]
    np.testing.assert_array_equal(np.array(r["slots"]["accumulator"], np.float32), ref[2][i])
    assert "no row with key 5" in _error(client, "row", 404, var="emb", key="5")
    assert "not an integer" in _error(client, "row", 400, var="emb", key="abc")


def test_pca_of_a_sample(client):
    p = _get(client, "pca", var="emb", n=200)
    assert p["sampled"] == 200
    assert len(p["points"]["x"]) == len(p["points"]["y"]) == len(p["points"]["key"]) == 200
    assert len(p["explained"]) == 2 and 0 < sum(p["explained"]) <= 1 + 1e-9
    assert p["explained"][0] >= p["explained"][1]
    assert "n=1 is out of range" in _error(client, "pca", 400, var="emb", n=1)


def test_dense_slice_reads_what_was_asked(client, ckpt):
    w2 = ckpt["dense"]["mlp.weight"]
    s = _get(client, "slice", tag="t2", var="mlp.weight", slice="3:9, ::4")
    assert s["shown"] == [6, 6] and s["shape"] == [40, 24]
    np.testing.assert_array_equal(np.array(s["values"], np.float32), w2[3:9, ::4])
    assert s["min"] == float(w2[3:9, ::4].min())
    d = _get(client, "slice", var="mlp.weight")  # default window
    assert d["slice"] == "0:40, 0:24" and d["shown"] == [40, 24]
    one = _get(client, "slice", var="mlp.bias", slice="2:5")
    assert one["values"] == [[2.0, 3.0, 4.0]]
    cube = _get(client, "slice", var="cube")
    assert cube["slice"] == "0:6, 0:5, 0" and cube["shown"] == [6, 5]
    assert "3 axes" in _error(client, "slice", 400, var="cube", slice=":, :, :")
    assert "does not fit" in _error(client, "slice", 400, var="mlp.bias", slice="0, 0")
    assert "character" in _error(client, "slice", 400, var="mlp.bias", slice="0:x")
    assert "embedding table" in _error(client, "slice", 400, var="emb")


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_values_travel_as_text(value):
    from tensorkv.viewer.web.app import jsonable

    out = jsonable({"v": np.array([1.0, value], np.float32), "k": np.int64(3)})
    assert out == {"v": [1.0, "NaN" if np.isnan(value) else "Inf"], "k": 3}


def test_key_search_and_range(client, ckpt):
    ref = rows_of(ckpt["table"])
    want = ref[0][[5, 17, 99]]
    r = _get(client, "search", var="emb", keys=f"{want[2]}, {want[0]} {want[1]}, 12345")
    assert r["asked"] == 4 and r["missing"] == ["12345"]
    k, freq, _, head = _as_arrays(r["rows"])
    np.testing.assert_array_equal(k, want[[2, 0, 1]])  # in the order asked
    np.testing.assert_array_equal(head.astype(np.float32), ref[1][[99, 5, 17]][:, :8])
    lo, hi = int(ref[0][10]), int(ref[0][40])
    rng = _get(client, "search", var="emb", keys=f"{lo}..{hi}", limit=500)
    np.testing.assert_array_equal(np.sort(_as_arrays(rng["rows"])[0]), ref[0][10:41])
    assert "empty" in _error(client, "search", 400, var="emb", keys=f"{hi}..{lo}")
    assert "not an integer" in _error(client, "search", 400, var="emb", keys="1, two")
    assert "at most" in _error(client, "search", 400, var="emb",
                               keys=",".join(map(str, range(1001))))


def test_nearest_is_exact(client, ckpt):
    ref = rows_of(ckpt["table"])
    key = int(ref[0][7])
    r = _get(client, "nearest", var="emb", key=str(key), k=5, metric="l2")
    assert r["metric"] == "l2" and r["scanned"] >= len(ref[0]) - 1
    d = np.linalg.norm(ref[1].astype(np.float64) - ref[1][7].astype(np.float64), axis=1)
    d[7] = np.inf  # the query itself is left out
    best = np.argsort(d, kind="stable")[:5]
    np.testing.assert_array_equal(_as_arrays(r["rows"])[0], ref[0][best])
    np.testing.assert_allclose(r["rows"]["score"], d[best])
    vec = ", ".join(repr(float(x)) for x in ref[1][7])
    r = _get(client, "nearest", var="emb", vector=vec, k=5, metric="l2")
    d[7] = 0.0  # a vector query keeps the row equal to it
    best = np.argsort(d, kind="stable")[:5]
    np.testing.assert_array_equal(_as_arrays(r["rows"])[0], ref[0][best])
    assert "dim" in _error(client, "nearest", 400, var="emb", vector="1, 2")
    assert "metric" in _error(client, "nearest", 400, var="emb", key=str(key), metric="manhattan")
    assert "not in table" in _error(client, "nearest", 404, var="emb", key="5")


def test_stats_histograms_count_every_row(client, ckpt):
    ref = rows_of(ckpt["table"])
    s = _get(client, "stats", var="emb")
    assert s["count"] == len(ref[0]) and s["nan"] == 0 and s["inf"] == 0
    assert sum(s["norm_hist"]["counts"]) == len(ref[0])
    assert sum(s["freq_hist"]["counts"]) == len(ref[0])
    assert len(s["norm_hist"]["edges"]) == len(s["norm_hist"]["counts"]) + 1
    assert s is not None and _get(client, "stats", var="emb") == s  # cached, same answer
    assert not s["sampled"]


def test_stats_of_large_tables_sample_unless_exact(client, ckpt, monkeypatch):
    from tensorkv.viewer.web import api

    n = len(rows_of(ckpt["table"])[0])
    monkeypatch.setattr(api, "STATS_SAMPLE", n // 4)
    s = _get(client, "stats", var="emb")
    assert s["sampled"] and s["total_rows"] == n and 0 < s["rows"] < n
    assert sum(s["norm_hist"]["counts"]) == s["rows"]
    exact = _get(client, "stats", var="emb", exact="1")
    assert not exact["sampled"] and exact["rows"] == n
    assert "exact" in _error(client, "stats", 400, var="emb", exact="2")


def test_diff_of_two_tags(client, ckpt):
    d = _get(client, "diff", a="t1", b="t2")
    assert (d["a"], d["b"]) == ("t1", "t2")
    by = {v["name"]: v for v in d["variables"]}
    assert by["emb"]["status"] == "changed" and by["emb"]["added"] == 30
    assert by["emb"]["removed"] == 0 and by["emb"]["changed"] >= 20
    assert by["mlp.weight"]["status"] == "changed" and by["mlp.bias"]["status"] == "unchanged"
    largest = {int(c["key"]) for c in by["emb"]["largest"]}
    assert largest <= set(ckpt["changed"].tolist()) | set(range(10**6, 10**6 + 30))
    assert "t9" in _error(client, "diff", 404, a="t1", b="t9")


def test_pca_matches_the_svd_of_the_sample():
    from types import SimpleNamespace

    from tensorkv.viewer.web.api import project

    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 6)) * np.array([5, 3, 1, 0.5, 0.2, 0.1])
    out = project(SimpleNamespace(values=x.astype(np.float32), keys=np.arange(300)))
    c = x.astype(np.float32).astype(np.float64)
    c = c - c.mean(axis=0)
    _, s, vt = np.linalg.svd(c, full_matrices=False)
    ref = c @ vt[:2].T
    got = np.column_stack([out["points"]["x"], out["points"]["y"]])
    signs = np.sign((got * ref).sum(axis=0))  # a component's sign is arbitrary
    np.testing.assert_allclose(got * signs, ref, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(out["explained"], s[:2] ** 2 / (s**2).sum(), rtol=1e-9)


def test_heat_map_reads_only_the_chunks_of_its_slice():
    # a tensor of 16 chunks whose chunks past the first two are gone: a slice of the first
    # rows still works (it never asks for the others), one of the last rows does not
    from starlette.testclient import TestClient

    import tensorkv
    from tensorkv.checkpoint import layout
    from tensorkv.viewer.web.app import create_app

    big = np.arange(1024 * 16, dtype=np.float32).reshape(1024, 16)
    store = tensorkv.open_store("memory://")
    tensorkv.save({"big": big}, store, tag="t", chunk_bytes=4096)  # 64 rows a chunk
    chunks = tensorkv.tag_manifest(store, "t")["dense"]["big"]["chunks"]
    assert len(chunks) == 16
    store.delete_many([layout.chunk_key(d) for d in chunks[2:]])
    with TestClient(create_app(store), base_url="http://127.0.0.1") as c:
        r = c.get("/api/slice", params={"var": "big", "slice": "0:128, ::2"})
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(np.array(r.json()["values"], np.float32), big[:128, ::2])
        r = c.get("/api/slice", params={"var": "big", "slice": "1000:1010, :"})
        assert r.status_code != 200 and "missing" in r.json()["error"]
