"""The viewer commands (ls, show, search, stats, diff, export): output, JSON, exit statuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from tests import servers
from tests.checkpoint.helpers import make_table
from tests.viewer.conftest import save_two_tags, store_url

from tensorkv.cli.main import main
from tensorkv.cli.viewer_cmds import (
    EXIT_NO_MATCH,
    EXIT_NOT_FOUND,
    EXIT_STORE,
    EXIT_USAGE,
    HEAD_CAP,
)
from tensorkv.viewer.where import row_norms


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args: str, code: int = 0):
        res = runner.invoke(main, [str(a) for a in args])
        assert res.exit_code == code, (res.stdout, res.stderr, res.exception)
        return res

    return invoke


def _json(res):
    return json.loads(res.stdout)


# ---------------------------------------------------------------------------------- ls
def test_ls_tags_and_variables(run, saved_lmdb):
    url = saved_lmdb.url
    out = run("ls", url).stdout.splitlines()
    assert out[0].split() == ["tag", "step", "created", "(UTC)", "parent", "variables", "rows",
                              "size"]
    assert out[1].split()[:2] == ["a", "10"] and out[2].split()[:2] == ["b", "11"]
    assert " a+ " in out[2] and "2998" in out[2]
    tags = _json(run("ls", url, "--json"))
    assert [t["tag"] for t in tags] == ["a", "b"] and tags[0]["table_rows"] == 3000
    for args in (("ls", url, "a"), ("ls", url, "--tag", "a")):
        text = run(*args).stdout
        assert text.startswith("tag a (step 10)")
        assert "emb       table  float32  3000 x 8" in text and "w         dense  float32" in text
    doc = _json(run("ls", url, "--json"))
    latest = _json(run("ls", url, "latest", "--json"))
    assert latest["tag"]["tag"] == doc[-1]["tag"] == "b"
    assert {v["name"]: v["kind"] for v in latest["variables"]} == {
        "emb": "table", "w": "dense", "bias": "dense"}


def test_ls_of_an_empty_store(run):
    assert "no tags" in run("ls", "memory://viewer-cli-empty").stdout
    assert _json(run("ls", "memory://viewer-cli-empty", "--json")) == []


# ---------------------------------------------------------------------------------- show
def test_show_table_rows(run, saved_lmdb):
    s = saved_lmdb
    text = run("show", s.url, "emb", "--head", "3", "--offset", "2").stdout
    assert text.startswith("table emb of tag b: 2998 rows, dim 8, float32, optimizer adagrad")
    assert "rows 2..4 of 2998; --offset 5 for more" in text
    doc = _json(run("show", s.url, "emb", "--head", "3", "--offset", "2", "--json"))
    assert [r["offset"] for r in doc["rows"]] == [2, 3, 4]
    ref = s.rows["b"]
    for r in doc["rows"]:
        i = np.searchsorted(ref[0], r["key"])
        assert r["value"] == ref[1][i].astype(np.float64).tolist()
        assert r["slots"] == ref[2][i].astype(np.float64).tolist()
        assert (r["freq"], r["version"]) == (ref[3][i], ref[4][i])
        assert r["norm"] == pytest.approx(float(row_norms(ref[1][i:i + 1])[0]))
    key = int(s.changed[0])
    doc = _json(run("show", s.url, "emb", "--keys", f"{key},5", "--json"))
    assert [r["key"] for r in doc["rows"]] == [key] and doc["missing"] == [5]
    res = run("show", s.url, "emb", "--keys", "5", "--keys", "6", code=EXIT_NOT_FOUND)
    assert "not in table 'emb': 5, 6" in res.stderr and "none of the keys" in res.stderr
    full = run("show", s.url, "emb", "--keys", str(key), "--full", "--tag", "a").stdout
    assert "..." not in full.splitlines()[1]


def test_show_head_is_capped(run, saved_lmdb):
    res = run("show", saved_lmdb.url, "emb", "--head", str(HEAD_CAP + 1), "--json")
    assert f"--head {HEAD_CAP + 1} is capped at {HEAD_CAP} rows" in res.stderr
    doc = _json(res)
    assert doc["capped"] and len(doc["rows"]) == HEAD_CAP
    run("show", saved_lmdb.url, "emb", "--head", "-1", code=EXIT_USAGE)
    res = run("search", saved_lmdb.url, "emb", "--where", "freq >= 1", "--head", "5000",
              "--json")
    assert f"--head 5000 is capped at {HEAD_CAP} rows" in res.stderr
    doc = _json(res)
    assert doc["capped"] and len(doc["rows"]) == HEAD_CAP and doc["matched"] == 2998


def test_show_dense_slices(run, saved_lmdb):
    s = saved_lmdb
    w = s.dense["b"]["w"]
    doc = _json(run("show", s.url, "w", "--slice", "2:9:3, 1:", "--json"))
    assert np.array_equal(np.array(doc["values"]), w[2:9:3, 1:])
    assert doc["slice_shape"] == [3, 4] and doc["shape"] == [12, 5]
    text = run("show", s.url, "w", "--slice", "3", "--tag", "b").stdout
    assert "[3] -> shape [5]" in text and "100." in text
    doc = _json(run("show", s.url, "w", "--head", "2", "--json"))
    assert np.array_equal(np.array(doc["values"]), w[:2]) and doc["index"] == "0:2"
    res = run("show", s.url, "w", "--slice", "0:x", code=EXIT_USAGE)
    assert "'0:x' at character 0" in res.stderr
    res = run("show", s.url, "w", "--slice", "40", code=EXIT_USAGE)
    assert "slice [40] does not fit shape [12, 5]: index 40 is out of bounds" in res.stderr
    res = run("show", s.url, "w", "--slice", "0:3, :4, 5", code=EXIT_USAGE)
    assert "slice [0:3, :4, 5] does not fit shape [12, 5]: too many indices" in res.stderr
    run("show", s.url, "w", "--keys", "1", code=EXIT_USAGE)
    run("show", s.url, "emb", "--slice", "0:2", code=EXIT_USAGE)


def test_show_slice_reads_only_the_chunks_it_needs(run, tmp_path):
    # a tensor of 16 chunks whose chunks past the first two are gone: a slice of the first
    # rows (and the default --head) still shows, one of the last rows names what is missing
    import tensorkv
    from tensorkv.checkpoint import layout

    big = np.arange(1024 * 16, dtype=np.float32).reshape(1024, 16)
    url = f"lmdb://{tmp_path}/chunks"
    tensorkv.save({"big": big}, url, "t", chunk_bytes=4096)  # 64 rows a chunk
    with tensorkv.open_store(url) as store:
        chunks = tensorkv.tag_manifest(store, "t")["dense"]["big"]["chunks"]
        assert len(chunks) == 16
        store.delete_many([layout.chunk_key(d) for d in chunks[2:]])
    doc = _json(run("show", url, "big", "--slice", "0:128, ::2", "--head", "200", "--json"))
    np.testing.assert_array_equal(np.array(doc["values"], np.float32), big[:128, ::2])
    doc = _json(run("show", url, "big", "--json"))
    np.testing.assert_array_equal(np.array(doc["values"], np.float32), big[:10])
    res = run("show", url, "big", "--slice", "1000:1010", code=EXIT_STORE)
    assert "missing" in res.stderr and res.stderr.count("\n") == 1


# ---------------------------------------------------------------------------------- search
def test_search_where_and_range(run, saved_lmdb):
    ref = saved_lmdb.rows["b"]
    url = saved_lmdb.url
    doc = _json(run("search", url, "emb", "--where", "freq >= 2 and version == 11", "--json"))
    want = (ref[3] >= 2) & (ref[4] == 11)
    assert doc["matched"] == int(want.sum()) and doc["complete"]
    assert sorted(r["key"] for r in doc["rows"]) == ref[0][want].tolist()
    text = run("search", url, "emb", "--where", "freq >= 2", "--head", "2").stdout
    assert text.startswith(f"{int((ref[3] >= 2).sum())} rows matched in table emb of tag b")
    assert "showing 2 (--head)" in text
    lo, hi = int(ref[0][10]), int(ref[0][30])
    doc = _json(run("search", url, "emb", "--range", f"{lo}:{hi}", "--where", "freq == 1",
                    "--head", "100", "--json"))
    inside = (ref[0] >= lo) & (ref[0] <= hi) & (ref[3] == 1)
    assert sorted(r["key"] for r in doc["rows"]) == ref[0][inside].tolist()
    doc = _json(run("search", url, "emb", "--where", "freq >= 1", "--head", "3", "--no-count",
                    "--json"))
    assert not doc["complete"] and len(doc["rows"]) == 3
    doc = _json(run("search", url, "emb", "--keys", f"{int(ref[0][0])} 7", "--json"))
    assert [r["key"] for r in doc["rows"]] == [int(ref[0][0])] and doc["missing"] == [7]


@pytest.mark.parametrize("metric", ["cosine", "l2", "dot"])
def test_search_nearest_equals_brute_force(run, saved_lmdb, metric):
    ref = saved_lmdb.rows["b"]
    key = int(saved_lmdb.changed[2])
    doc = _json(run("search", saved_lmdb.url, "emb", "--nearest", str(key), "--k", "6",
                    "--metric", metric, "--json"))
    q = ref[1][np.searchsorted(ref[0], key)].astype(np.float64)
    v = ref[1].astype(np.float64)
    if metric == "l2":
        s = -np.linalg.norm(v - q, axis=1)
    elif metric == "dot":
        s = v @ q
    else:
        s = (v @ q) / (np.linalg.norm(v, axis=1) * np.linalg.norm(q))
    s[ref[0] == key] = -np.inf
    best = ref[0][np.lexsort((ref[0], -s))[:6]]
    assert [r["key"] for r in doc["rows"]] == best.tolist()
    assert doc["query"]["key"] == key and doc["scanned"] == len(ref[0]) - 1
    text = run("search", saved_lmdb.url, "emb", "--vector", ",".join(["0.1"] * 8),
               "--k", "2").stdout
    assert text.startswith("2 nearest rows to the vector by cosine")


def test_search_exit_statuses(run, saved_lmdb):
    url = saved_lmdb.url
    res = run("search", url, "emb", "--where", "freq > 100", code=EXIT_NO_MATCH)
    assert res.stdout.startswith("0 rows matched")
    res = run("search", url, "emb", "--where", "freq >= 10 and norm < 0.1 or weight > 3",
              code=EXIT_USAGE)
    assert "unknown field 'weight' at character 29" in res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("tensorkv: error: ")
    res = run("search", url, "emb", "--keys", "1", "--nearest", "2", code=EXIT_USAGE)
    assert "--keys and --nearest" in res.stderr
    run("search", url, "emb", code=EXIT_USAGE)
    run("search", url, "emb", "--range", "5", code=EXIT_USAGE)
    run("search", url, "emb", "--range", "9:1", code=EXIT_USAGE)
    run("search", url, "emb", "--vector", "1,2", code=EXIT_USAGE)
    run("search", url, "emb", "--metric", "hamming", "--nearest", "1", code=2)
    res = run("search", url, "emb", "--nearest", "12345", code=EXIT_NOT_FOUND)
    assert "key 12345 is not in table 'emb'" in res.stderr
    res = run("search", url, "w", "--where", "freq > 1", code=EXIT_NOT_FOUND)
    assert "'w' of tag 'b' is a dense tensor" in res.stderr


# ---------------------------------------------------------------------------------- stats
def test_stats(run, saved_lmdb):
    ref = saved_lmdb.rows["b"]
    text = run("stats", saved_lmdb.url, "emb", "--bins", "4").stdout
    assert text.startswith("table emb of tag b: 2998 rows, dim 8")
    for label in ("non-finite rows", "never updated", "norm histogram:", "freq histogram:",
                  "version histogram:"):
        assert label in text
    doc = _json(run("stats", saved_lmdb.url, "emb", "--json", "--where", "freq >= 2"))
    assert doc["rows"] == int((ref[3] >= 2).sum()) and doc["where"] == "freq >= 2"
    assert sum(doc["histograms"]["norm"]["counts"]) == doc["rows"]
    doc = _json(run("stats", saved_lmdb.url, "w", "--json", "--bins", "3"))
    w = saved_lmdb.dense["b"]["w"]
    assert (doc["elements"], doc["max"], doc["zeros"]) == (60, 100.0, 1)
    assert doc["histogram"]["counts"] == np.histogram(w, 3)[0].tolist()
    run("stats", saved_lmdb.url, "emb", "--where", "norm <", code=EXIT_USAGE)
    text = run("stats", saved_lmdb.url, "emb", "--sample", "300").stdout
    assert text.startswith("table emb of tag b: 300 rows (a sample of the 2998), dim 8")
    run("stats", saved_lmdb.url, "w", "--sample", "3", code=EXIT_USAGE)


# ---------------------------------------------------------------------------------- diff
def test_diff(run, saved_lmdb):
    s = saved_lmdb
    text = run("diff", s.url, "a", "b", "--top", "2", "--sample", "2").stdout
    assert text.startswith("diff a -> b\n  changed: emb, w\n  unchanged: bias\n")
    assert f"table emb: 3000 -> 2998 rows; 5 added, 7 removed, {len(s.changed)} changed" in text
    assert "dense w: 1 of 60 elements changed, max |diff| 83" in text
    doc = _json(run("diff", s.url, "a", "b", "emb", "--json"))
    assert doc["differ"] and list(doc["tables"]) == ["emb"] and not doc["dense"]
    assert doc["tables"]["emb"]["added_keys"] == s.added.tolist()
    run("diff", s.url, "a", "b", "--exit-code", code=EXIT_NO_MATCH)
    run("diff", s.url, "a", "a", "--exit-code")
    assert run("diff", s.url, "a", "latest", "--json").stdout == run(
        "diff", s.url, "a", "b", "--json").stdout  # "latest" names the newest tag
    res = run("diff", s.url, "a", "nope", code=EXIT_NOT_FOUND)
    assert "available tags: 'a', 'b'" in res.stderr


# ---------------------------------------------------------------------------------- export
@pytest.mark.parametrize("ext", ["npz", "safetensors", "parquet", "csv"])
def test_export_round_trips(run, saved_lmdb, tmp_path, ext):
    ref = saved_lmdb.rows["b"]
    path = tmp_path / f"emb.{ext}"
    doc = _json(run("export", saved_lmdb.url, "emb", "--to", path, "--json"))
    assert doc["rows"] == len(ref[0]) and doc["format"] == ext and doc["tag"] == "b"
    cols = _read(path, ext, 8)
    order = np.argsort(cols["keys"])
    for name, want in zip(("keys", "values", "slots", "freq", "version"), ref, strict=True):
        np.testing.assert_array_equal(cols[name][order], want)
    dpath = tmp_path / f"w.{ext}"
    text = run("export", saved_lmdb.url, "w", "--to", dpath, "--tag", "a").stdout
    assert text.startswith("wrote w of tag a (dense tensor, 240 B)")
    w = _read_dense(dpath, ext)
    np.testing.assert_array_equal(w, saved_lmdb.dense["a"]["w"])


def _read(path, ext, dim):
    if ext == "npz":
        z = np.load(path)
        return {k: z[k] for k in z.files}
    if ext == "safetensors":
        from safetensors.numpy import load_file

        return load_file(str(path))
    if ext == "parquet":
        import pyarrow.parquet as pq

        t = pq.read_table(path)
        out = {}
        for name in t.column_names:
            col = t.column(name).combine_chunks()
            out[name] = (np.asarray(col.flatten()).reshape(len(col), -1)
                         if name in ("values", "slots") else np.asarray(col))
        return out
    raw = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64)
    ints = np.loadtxt(path, delimiter=",", skiprows=1, usecols=(0, 1, 2), dtype=np.int64)
    return {"keys": ints[:, 0], "freq": ints[:, 1], "version": ints[:, 2],
            "values": raw[:, 3:3 + dim].astype(np.float32),
            "slots": raw[:, 3 + dim:].astype(np.float32)}


def _read_dense(path, ext):
    if ext == "npz":
        return np.load(path)["w"]
    if ext == "safetensors":
        from safetensors.numpy import load_file

        return load_file(str(path))["w"]
    if ext == "parquet":
        import pyarrow.parquet as pq

        col = pq.read_table(path).column("w").combine_chunks()
        return np.asarray(col.flatten()).reshape(len(col), -1)
    return np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float32)


@pytest.mark.parametrize("ext", ["npz", "safetensors", "parquet", "csv"])
def test_export_progress_bar_in_every_format(run, saved_lmdb, tmp_path, monkeypatch, ext):
    from tensorkv import config

    monkeypatch.setattr(config, "PROGRESS_MIN_SECONDS", 0.0)  # draw at once
    res = run("export", saved_lmdb.url, "emb", "--to", tmp_path / f"e.{ext}", "--progress")
    assert "export emb:" in res.stderr and "B/s" in res.stderr, res.stderr
    res = run("export", saved_lmdb.url, "emb", "--to", tmp_path / f"f.{ext}", "--no-progress")
    assert res.stderr == ""


def test_export_filters_and_refuses_bad_targets(run, saved_lmdb, tmp_path):
    ref = saved_lmdb.rows["b"]
    path = tmp_path / "hot.npz"
    run("export", saved_lmdb.url, "emb", "--to", path, "--where", "freq >= 2", "--no-progress")
    assert sorted(np.load(path)["keys"].tolist()) == ref[0][ref[3] >= 2].tolist()
    res = run("export", saved_lmdb.url, "emb", "--to", tmp_path / "x.txt", code=EXIT_USAGE)
    assert "'txt' is not one of .npz, .safetensors, .parquet, .csv" in res.stderr
    run("export", saved_lmdb.url, "emb", "--to", tmp_path / "no" / "x.npz", code=EXIT_USAGE)
    run("export", saved_lmdb.url, "w", "--to", tmp_path / "w.npz", "--where", "freq > 1",
        code=EXIT_USAGE)
    assert not list(tmp_path.glob("*.partial"))


# ---------------------------------------------------------------------------------- errors
def test_unknown_names_list_what_exists(run, saved_lmdb, tmp_path):
    url = saved_lmdb.url
    res = run("show", url, "nope", code=EXIT_NOT_FOUND)
    assert res.stderr == ("tensorkv: error: tag 'b' has no variable 'nope'; it has emb (table), "
                          "bias (dense), w (dense)\n")
    for cmd in (("ls", url, "zz"), ("show", url, "emb", "--tag", "zz"),
                ("stats", url, "emb", "--tag", "zz")):
        res = run(*cmd, code=EXIT_NOT_FOUND)
        assert "tag 'zz' does not exist" in res.stderr and "'a', 'b'" in res.stderr
    res = run("ls", f"lmdb://{tmp_path}/none", code=EXIT_NOT_FOUND)
    assert "no lmdb store" in res.stderr
    run("ls", "nosuch://x", code=EXIT_USAGE)


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster", "redis+sentinel"])
def test_unreachable_store(run, scheme):
    pytest.importorskip("redis")
    port = servers.free_port()
    path = "/mymaster/0" if scheme == "redis+sentinel" else "/0"
    res = run("ls", f"{scheme}://127.0.0.1:{port}{path}?connect_timeout=1", code=EXIT_STORE)
    assert res.stderr.startswith("tensorkv: error: cannot reach Redis")
    assert f"127.0.0.1:{port}" in res.stderr and res.stderr.count("\n") == 1
    assert "<redis." not in res.stderr  # no object reprs of redis-py in the message


# ---------------------------------------------------------------------------------- backends
@pytest.mark.parametrize("kind", ["memory", "rocksdb", "leveldb", "redis"])
def test_commands_on_other_backends(run, kind, tmp_path, request):
    url = store_url(kind, tmp_path, request)
    s = save_two_tags(url, n=400, dim=4)
    assert [t["tag"] for t in _json(run("ls", url, "--json"))] == ["a", "b"]
    doc = _json(run("show", url, "emb", "--keys", str(int(s.added[0])), "--json"))
    assert doc["rows"][0]["key"] == int(s.added[0])
    doc = _json(run("search", url, "emb", "--nearest", str(int(s.changed[0])), "--k", "2",
                    "--json"))
    assert len(doc["rows"]) == 2
    assert _json(run("stats", url, "emb", "--json"))["rows"] == len(s.rows["b"][0])


@pytest.mark.skipif(not servers.available(), reason="redis-server is not installed")
def test_every_command_on_a_redis_cluster(run, redis_cluster, tmp_path):
    pytest.importorskip("redis")
    url = servers.with_options(redis_cluster.url, prefix=servers.prefix("viewer"))
    s = save_two_tags(url, n=300, dim=4)
    text = run("ls", url).stdout
    assert text.splitlines()[1].split()[:2] == ["a", "10"]
    assert "emb       table  float32  298 x 4" in run("ls", url, "b").stdout
    doc = _json(run("show", url, "emb", "--keys", ",".join(map(str, s.changed[:3])), "--json"))
    assert [r["key"] for r in doc["rows"]] == s.changed[:3].tolist()
    doc = _json(run("show", url, "w", "--slice", "0:2", "--json", "--tag", "a"))
    assert np.array_equal(np.array(doc["values"]), s.dense["a"]["w"][:2])
    ref = s.rows["b"]
    doc = _json(run("search", url, "emb", "--where", "freq >= 2", "--json", "--head", "1000"))
    assert sorted(r["key"] for r in doc["rows"]) == ref[0][ref[3] >= 2].tolist()
    doc = _json(run("search", url, "emb", "--nearest", str(int(s.changed[0])), "--k", "3",
                    "--metric", "l2", "--json", "--tag", "a"))
    assert len(doc["rows"]) == 3 and doc["scanned"] == len(s.rows["a"][0]) - 1
    assert _json(run("stats", url, "emb", "--json"))["rows"] == len(ref[0])
    doc = _json(run("diff", url, "a", "b", "emb", "--json"))
    assert doc["tables"]["emb"]["added_keys"] == s.added.tolist()
    path = tmp_path / "emb.npz"
    run("export", url, "emb", "--to", path, "--tag", "a")
    np.testing.assert_array_equal(np.sort(np.load(path)["keys"]), s.rows["a"][0])


def test_sgd_half_precision_and_odd_tensors(run, tmp_path):
    import ml_dtypes

    import tensorkv
    from tensorkv.embedding.table import EmbeddingTable

    t = EmbeddingTable(4, dtype="float16", seed=0)  # SGD: no slot columns
    t.lookup(np.arange(50))
    bf = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3)
    url = f"lmdb://{tmp_path}/odd"
    tensorkv.save({"t16": t, "s": np.float32(3.5).reshape(()), "bf": bf}, url, "x")
    lines = run("ls", url, "x").stdout.splitlines()
    assert lines[2].split() == ["t16", "table", "float16", "50", "x", "4", "1.6", "KiB", "sgd"]
    assert lines[4].split()[:4] == ["s", "dense", "float32", "scalar"]
    assert _json(run("show", url, "s", "--json"))["values"] == 3.5
    assert _json(run("show", url, "bf", "--json"))["values"] == [[0, 1, 2], [3, 4, 5]]
    doc = _json(run("show", url, "t16", "--head", "2", "--json"))
    assert doc["rows"][0]["slots"] == [] and len(doc["rows"][0]["value"]) == 4
    run("search", url, "t16", "--nearest", "3", "--k", "2")
    keys = np.sort(np.asarray(t.keys()))
    for ext in ("npz", "safetensors", "parquet", "csv"):
        run("export", url, "t16", "--to", tmp_path / f"t.{ext}")
        cols = _read(tmp_path / f"t.{ext}", ext, 4)
        np.testing.assert_array_equal(np.sort(cols["keys"]), keys)
        assert cols["values"].shape == (50, 4) and cols["slots"].size == 0
        run("export", url, "bf", "--to", tmp_path / f"bf.{ext}")


def test_error_statuses_by_kind():
    from tensorkv.cli.viewer_cmds import EXIT_INTERNAL, exit_code_of
    from tensorkv.errors import CorruptRecordError, QueryError, TagNotFoundError

    assert exit_code_of(QueryError("x")) == EXIT_USAGE
    assert exit_code_of(TagNotFoundError("x")) == EXIT_NOT_FOUND
    assert exit_code_of(CorruptRecordError("x")) == EXIT_STORE
    assert exit_code_of(PermissionError(13, "denied")) == EXIT_STORE
    assert exit_code_of(ZeroDivisionError()) == EXIT_INTERNAL


def test_os_errors_and_bugs_exit_4_and_5(run, saved_lmdb, monkeypatch):
    from tensorkv.cli import viewer_fmt
    from tensorkv.cli.viewer_cmds import EXIT_INTERNAL

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", "/data/x")

    monkeypatch.setattr(viewer_fmt, "table", denied)
    res = run("ls", saved_lmdb.url, code=EXIT_STORE)
    assert res.stderr == "tensorkv: error: PermissionError: Permission denied: '/data/x'\n"

    def bug(*a, **k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(viewer_fmt, "table", bug)
    res = run("ls", saved_lmdb.url, code=EXIT_INTERNAL)
    assert res.stderr.startswith("tensorkv: error: unexpected ZeroDivisionError: division by "
                                 "zero (run again with TENSORKV_DEBUG=1 for the traceback")
    monkeypatch.setenv("TENSORKV_DEBUG", "1")
    res = CliRunner().invoke(main, ["ls", saved_lmdb.url])
    assert isinstance(res.exception, ZeroDivisionError)  # the traceback, not one line


def test_a_damaged_store_exits_4(run, tmp_path):
    import tensorkv
    from tensorkv.checkpoint import layout

    url = f"lmdb://{tmp_path}/damaged"
    tensorkv.save({"emb": make_table(300, 4)}, url, "x", bucket_bits=0)
    with tensorkv.open_store(url) as store:
        [key] = [k for k in store.keys(layout.TABLE) if b"/b/" in k]
        raw = bytearray(store.get(key))
        raw[-20] ^= 0xFF
        store.put(key, bytes(raw))
    res = run("stats", url, "emb", code=EXIT_STORE)
    assert res.stderr.startswith("tensorkv: error: table 'emb'") and res.stderr.count("\n") == 1
