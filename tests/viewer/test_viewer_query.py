"""The viewer's query layer on real stores: catalog, rows, predicates, search, stats, diff."""

from __future__ import annotations

import numpy as np
import pytest

from tensorkv.errors import (
    QueryError,
    RowNotFoundError,
    StoreNotFoundError,
    TagNotFoundError,
    VariableNotFoundError,
)
from tensorkv.viewer import Catalog, parse_index, parse_predicate, search, stats
from tensorkv.viewer import diff as vdiff
from tensorkv.viewer.rows import TableView
from tensorkv.viewer.where import row_norms


def _sorted(rows):
    order = np.argsort(rows.keys)
    return tuple(np.asarray(a)[order] for a in rows)


def _assert_rows_equal(got, want):
    for x, y in zip(_sorted(got), want, strict=True):
        np.testing.assert_array_equal(x, y)


# ---------------------------------------------------------------------------------- catalog
def test_catalog_lists_tags_and_variables(saved_lmdb):
    s = saved_lmdb
    with Catalog(s.url) as cat:
        tags = cat.tags()
        assert [t.tag for t in tags] == ["a", "b"]
        assert tags[0].step == 10 and tags[1].parent == "a" and tags[1].incremental
        assert tags[0].table_rows == len(s.rows["a"][0])
        assert tags[1].table_rows == len(s.rows["b"][0])
        assert cat.resolve() == cat.resolve("latest") == "b"
        vs = {v.name: v for v in cat.variables("a")}
        assert [v.name for v in cat.variables("a")] == ["emb", "bias", "w"]  # tables first
        assert vs["emb"].kind == "table" and vs["emb"].dim == 8 and vs["emb"].slots == 8
        assert vs["emb"].optimizer == "adagrad" and vs["emb"].rows == 3000
        assert vs["emb"].nbytes == 3000 * (24 + 8 * 4 * 2)
        assert vs["w"].as_dict() == {"name": "w", "kind": "dense", "dtype": "float32",
                                     "shape": [12, 5], "bytes": 240, "rows": None, "dim": None,
                                     "optimizer": None, "slots": None}


def test_catalog_errors_list_what_exists(saved_lmdb, tmp_path):
    with Catalog(saved_lmdb.url) as cat:
        with pytest.raises(TagNotFoundError, match=r"tag 'zz' does not exist.*'a', 'b'"):
            cat.variables("zz")
        with pytest.raises(VariableNotFoundError,
                           match=r"no variable 'nope'; it has emb \(table\), bias \(dense\)"):
            cat.variable("nope")
        with pytest.raises(VariableNotFoundError, match="'w' of tag 'b' is a dense tensor"):
            cat.table("w")
        with pytest.raises(VariableNotFoundError, match="'emb' of tag 'b' is an embedding table"):
            cat.dense("emb")
    with pytest.raises(StoreNotFoundError):
        Catalog(f"lmdb://{tmp_path}/missing")


def test_empty_store_has_no_latest_tag():
    with Catalog("memory://viewer-empty") as cat:
        assert cat.tags() == []
        with pytest.raises(TagNotFoundError, match="holds no checkpoint tags"):
            cat.resolve()


def test_dense_slices_read_through_read_tensor(saved_lmdb):
    with Catalog(saved_lmdb.url) as cat:
        w = saved_lmdb.dense["b"]["w"]
        np.testing.assert_array_equal(cat.dense("w", None, "2:9:3, 1:"), w[2:9:3, 1:])
        np.testing.assert_array_equal(cat.dense("w", "a", "-1"), saved_lmdb.dense["a"]["w"][-1])
        np.testing.assert_array_equal(cat.dense("w", "b", "..., 0"), w[..., 0])
        np.testing.assert_array_equal(cat.dense("bias"), saved_lmdb.dense["a"]["bias"])
        with pytest.raises(QueryError, match=r"slice \[\(0, 0\)\] does not fit shape \[7\]"):
            cat.dense("bias", None, (0, 0))  # checked before anything is read


@pytest.mark.parametrize(("text", "want"), [
    ("0:10, :", (slice(0, 10), slice(None))), ("5", (5,)), ("::2,3", (slice(None, None, 2), 3)),
    ("..., -1", (Ellipsis, -1)), (" : ", (slice(None),)),
])
def test_parse_index(text, want):
    assert parse_index(text) == want


@pytest.mark.parametrize(("text", "pos"), [("0:a", 0), ("1, x", 3), ("1,,2", 2), ("::0", 0)])
def test_parse_index_errors_point_at_the_part(text, pos):
    with pytest.raises(QueryError) as e:
        parse_index(text)
    assert e.value.position == pos


# ---------------------------------------------------------------------------------- rows
@pytest.mark.parametrize("tag", ["a", "b"])
def test_scan_equals_the_table_bit_for_bit(saved_lmdb, tag):
    with Catalog(saved_lmdb.url) as cat:
        view = cat.table("emb", tag)
        assert view.chained == (tag == "b")
        everything = view.page(0, 10**9)
        assert len(everything.keys) == view.rows == len(saved_lmdb.rows[tag][0])
        _assert_rows_equal(everything, saved_lmdb.rows[tag])
        # pages at any offset are slices of the scan order
        for off, lim in [(0, 7), (255, 3), (1000, 500), (view.rows - 2, 10), (view.rows, 5)]:
            page = view.page(off, lim)
            np.testing.assert_array_equal(page.keys, everything.keys[off:off + lim])
            np.testing.assert_array_equal(page.values, everything.values[off:off + lim])
        offsets = [c.offset for c in view.chunks()]
        assert offsets == sorted(offsets) and offsets[0] == 0
        # hash ranges partition the rows
        parts = [np.concatenate([c.rows.keys for c in view.chunks(hash_range=r)] or [[]])
                 for r in vdiff.hash_ranges(3)]
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), saved_lmdb.rows[tag][0])


def test_lookup_reads_rows_of_keys(saved_lmdb):
    s = saved_lmdb
    with Catalog(s.url) as cat:
        view = cat.table("emb", "b")
        want = [s.changed[0], s.removed[0], 42, s.added[1], s.changed[0]]
        rows, found = view.lookup(want)
        assert found.tolist() == [True, False, False, True, True]
        np.testing.assert_array_equal(rows.keys, [s.changed[0], s.added[1]])
        ref = s.rows["b"]
        i = np.searchsorted(ref[0], rows.keys)
        for got, r in zip(rows, ref, strict=True):
            np.testing.assert_array_equal(got, r[i])
        old, found_a = cat.table("emb", "a").lookup([s.removed[0]])
        assert found_a.tolist() == [True] and old.keys.tolist() == [s.removed[0]]
        with pytest.raises(QueryError, match="'x1' is not an integer"):
            view.lookup(["x1"])


def test_sample_takes_rows_of_the_table(saved_lmdb):
    with Catalog(saved_lmdb.url) as cat:
        view = cat.table("emb", "a")
        rows = view.sample(100, seed=3)
        assert len(rows.keys) == 100 and len(np.unique(rows.keys)) == 100
        assert np.isin(rows.keys, saved_lmdb.rows["a"][0]).all()
        assert len(view.sample(10**6).keys) == view.rows


# ---------------------------------------------------------------------------------- where
def _fields(rows):
    return {"key": rows[0], "norm": row_norms(rows[1]), "freq": rows[3], "version": rows[4],
            "slot_norm": row_norms(rows[2])}


@pytest.mark.parametrize(("text", "ref"), [
    ("freq >= 2", lambda f: f["freq"] >= 2),
    ("freq >= 2 and norm < 0.08 or not (version == 3)",
     lambda f: ((f["freq"] >= 2) & (f["norm"] < 0.08)) | ~(f["version"] == 3)),
    ("NOT freq == 1 AND version != 0", lambda f: ~(f["freq"] == 1) & (f["version"] != 0)),
    ("0.05 < norm <= 0.1", lambda f: (f["norm"] > 0.05) & (f["norm"] <= 0.1)),
    ("2 <= freq", lambda f: f["freq"] >= 2),
    ("freq = 1 && (norm>0.1 || slot_norm < 1e-3)",
     lambda f: (f["freq"] == 1) & ((f["norm"] > 0.1) | (f["slot_norm"] < 1e-3))),
    ("!(freq == 1)", lambda f: f["freq"] != 1),
    ("key in [25214903917, -5]", lambda f: np.isin(f["key"], [25214903917, -5])),
    ("key >= 25214903917", lambda f: f["key"] >= 25214903917),
    ("norm < inf and finite == 1", lambda f: np.isfinite(f["norm"])),
    ("freq > version", lambda f: f["freq"] > f["version"]),
])
def test_predicates_match_numpy(saved_lmdb, text, ref):
    rows = saved_lmdb.rows["a"]
    from tensorkv.checkpoint.tables import Rows

    mask = parse_predicate(text)(Rows(*rows))
    np.testing.assert_array_equal(mask, ref(_fields(rows)))


@pytest.mark.parametrize(("text", "pos", "what"), [
    ("", 0, "empty"),
    ("freq >= ", 8, "expected a field or a number"),
    ("freq >= 10 and", 14, "expected a field or a number"),
    ("freq >= 10 x", 11, "unknown field 'x'"),
    ("freq >= 10 10", 11, "expected 'and', 'or'"),
    ("(freq > 1", 9, "expected '\\)'"),
    ("norm", 4, "expected a comparison"),
    ("1 < 2", 0, "needs a field"),
    ("freq >= 10 and norm < 0.1 or weight > 3", 29, "unknown field 'weight'"),
    ("__import__('os').system('x')", 0, "unknown field"),
    ("freq $ 3", 5, "unexpected character '\\$'"),
    ("key in [1, x]", 11, "unknown field"),
    ("key in 1", 7, "expected '\\['"),
    ("3 in [1]", 0, "'in' needs a field"),
    ("key == 99999999999999999999", 7, "outside the int64 range"),
])
def test_malformed_predicates_point_at_the_position(text, pos, what):
    with pytest.raises(QueryError, match=what) as e:
        parse_predicate(text)
    assert e.value.position == pos
    assert f"at character {pos}" in str(e.value) or "int64" in str(e.value)


# ---------------------------------------------------------------------------------- search
def test_search_by_keys_range_and_predicate(saved_lmdb):
    s = saved_lmdb
    ref = s.rows["b"]
    with Catalog(s.url) as cat:
        view = cat.table("emb", "b")
        m = search.by_keys(view, [s.added[0], 7])
        assert m.rows.keys.tolist() == [s.added[0]] and m.missing.tolist() == [7]
        lo, hi = int(ref[0][100]), int(ref[0][200])
        m = search.key_range(view, lo, hi, limit=10**6)
        np.testing.assert_array_equal(np.sort(m.rows.keys), ref[0][100:201])
        assert m.complete and m.matched == 101 and m.scanned == view.rows
        m = search.key_range(view, lo, hi, limit=5, count=False)
        assert len(m) == 5 and not m.complete and m.matched >= 5
        m = search.where(view, "freq >= 2 and version == 11", limit=3)
        want = (ref[3] >= 2) & (ref[4] == 11)
        assert m.matched == int(want.sum()) and len(m) == 3
        assert np.isin(m.rows.keys, ref[0][want]).all()
        everything = view.page(0, 10**9)
        np.testing.assert_array_equal(everything.keys[m.offsets], m.rows.keys)
        with pytest.raises(QueryError, match="empty"):
            search.key_range(view, 5, 1, limit=1)


def _brute(ref, q, metric, skip=None):
    v = ref[1].astype(np.float64)
    q = q.astype(np.float64)
    if metric == "l2":
        s = np.sqrt(((v - q) ** 2).sum(axis=1))
    elif metric == "dot":
        s = v @ q
    else:
        s = (v @ q) / (np.linalg.norm(v, axis=1) * np.linalg.norm(q))
    keys = ref[0]
    keep = keys != skip if skip is not None else np.ones(len(keys), bool)
    s, keys = s[keep], keys[keep]
    order = np.lexsort((keys, s if metric == "l2" else -s))
    return keys[order], s[order]


@pytest.mark.parametrize("metric", ["cosine", "l2", "dot"])
def test_nearest_equals_brute_force(saved_lmdb, metric):
    ref = saved_lmdb.rows["b"]
    with Catalog(saved_lmdb.url) as cat:
        view = cat.table("emb", "b")
        key = int(saved_lmdb.changed[3])
        nn = search.nearest(view, key=key, k=15, metric=metric)
        q = ref[1][np.searchsorted(ref[0], key)]
        wk, ws = _brute(ref, q, metric, skip=key)
        np.testing.assert_array_equal(nn.keys, wk[:15])
        np.testing.assert_allclose(nn.scores, ws[:15], rtol=1e-12)
        np.testing.assert_array_equal(nn.rows.values, ref[1][np.searchsorted(ref[0], nn.keys)])
        assert nn.scanned == view.rows - 1
        vec = np.random.default_rng(5).standard_normal(8).astype(np.float32)
        nn = search.nearest(view, vector=", ".join(map(str, vec)), k=4, metric=metric)
        wk, ws = _brute(ref, np.array([float(str(x)) for x in vec], np.float32), metric)
        np.testing.assert_array_equal(nn.keys, wk[:4])


def test_nearest_with_a_predicate_and_bad_inputs(saved_lmdb):
    ref = saved_lmdb.rows["a"]
    with Catalog(saved_lmdb.url) as cat:
        view = cat.table("emb", "a")
        q = np.ones(8, np.float32)
        nn = search.nearest(view, vector=q, k=5, metric="dot", where="freq >= 2")
        sel = ref[3] >= 2
        wk, _ = _brute(tuple(a[sel] for a in ref), q, "dot")
        np.testing.assert_array_equal(nn.keys, wk[:5])
        with pytest.raises(QueryError, match="metric 'manhattan'"):
            search.nearest(view, vector=q, metric="manhattan")
        with pytest.raises(QueryError, match="k=0"):
            search.nearest(view, vector=q, k=0)
        with pytest.raises(RowNotFoundError, match="key 12 is not in table 'emb'"):
            search.nearest(view, key=12)
        with pytest.raises(QueryError, match="3 numbers but the table's rows have dim 8"):
            search.nearest(view, vector="1, 2, 3")
        with pytest.raises(QueryError, match="'b' at character 3 is not a number"):
            search.nearest(view, vector="1, b, 3")
        with pytest.raises(QueryError, match="all zeros"):
            search.nearest(view, vector=np.zeros(8))
        with pytest.raises(QueryError, match="exactly one"):
            search.nearest(view)
        with pytest.raises(QueryError, match="the query vector holds nan at position 2"):
            search.nearest(view, vector="1, 2, nan, 4, 5, 6, 7, 8")
        with pytest.raises(QueryError, match="holds inf at position 7"):
            search.nearest(view, vector="1, 2, 3, 4, 5, 6, 7, 1e40")  # beyond float32


# ---------------------------------------------------------------------------------- stats
def test_stats_match_numpy(saved_lmdb):
    ref = saved_lmdb.rows["b"]
    with Catalog(saved_lmdb.url) as cat:
        st = stats.table_stats(cat.table("emb", "b"), bins=10)
    assert st.rows == len(ref[0])
    norms = row_norms(ref[1])
    assert st.norm.max == pytest.approx(float(norms.max()))
    assert st.freq.mean == pytest.approx(float(ref[3].mean()))
    assert st.histograms["norm"].counts.sum() == st.rows
    assert st.histograms["freq"].counts.tolist() == np.bincount(ref[3] - ref[3].min()).tolist()
    assert st.nonfinite_rows == st.nan_values == st.inf_values == 0
    # make_table trains its first 1000 keys; tag b trained 20 more and added 5 fresh ones
    made = (np.arange(3000, dtype=np.int64) * 7919) ^ 0x5DEECE66D
    trained = np.union1d(made[:1000], saved_lmdb.changed)
    assert st.never_updated == st.rows - int(np.isin(ref[0], trained).sum())
    d = st.as_dict()
    assert d["histograms"]["version"]["counts"] and d["rows"] == st.rows


def test_stats_count_non_finite_rows(tmp_path):
    import tensorkv
    from tensorkv.checkpoint import layout, tables
    from tensorkv.embedding.table import EmbeddingTable

    t = EmbeddingTable(3, seed=1)
    t.lookup(np.arange(10))
    url = f"lmdb://{tmp_path}/nan"
    tensorkv.save({"emb": t}, url, "x", bucket_bits=0)
    # a diverged model: rewrite the one block with NaN and Inf values (a valid record)
    with tensorkv.open_store(url) as store:
        [key] = [k for k in store.keys(layout.TABLE) if b"/b/" in k]
        rows = tables.decode_block(store.get(key), "block")
        vals = np.array(rows.values)
        at = {int(k): i for i, k in enumerate(rows.keys)}
        vals[at[2], 1] = np.nan
        vals[at[5]] = np.inf
        store.put(key, tables.encode_block(rows._replace(values=vals)).tobytes())
    with Catalog(url) as cat:
        st = stats.table_stats(cat.table("emb"))
    assert (st.nonfinite_rows, st.nan_values, st.inf_values) == (2, 1, 3)
    assert st.never_updated == 8
    with Catalog(url) as cat:
        m = search.where(cat.table("emb"), "finite == 0", limit=10)
        with pytest.raises(QueryError, match="the value of key 5 holds inf at position 0"):
            search.nearest(cat.table("emb"), key=5)
    assert sorted(m.rows.keys.tolist()) == [2, 5]


# ---------------------------------------------------------------------------------- diff
def test_diff_of_two_tags(saved_lmdb, monkeypatch):
    s = saved_lmdb
    monkeypatch.setattr(vdiff, "RANGE_BYTES", 20_000)  # several hash ranges
    with Catalog(s.url) as cat:
        d = vdiff.diff_tags(cat, "a", "b", top=5, sample=3)
    assert d.changed == ["emb", "w"] and d.unchanged == ["bias"] and not d.added
    td = d.tables["emb"]
    assert (td.added, td.removed) == (len(s.added), len(s.removed))
    a, b = s.rows["a"], s.rows["b"]
    common, ia, ib = np.intersect1d(a[0], b[0], return_indices=True)
    moved = np.zeros(len(common), bool)
    for x, y in zip(a[1:], b[1:], strict=True):
        moved |= (x[ia] != y[ib]).reshape(len(common), -1).any(axis=1)
    assert td.changed == int(moved.sum()) and td.unchanged == len(common) - td.changed
    assert td.added_keys == s.added[:3].tolist() and td.removed_keys == s.removed[:3].tolist()
    delta = np.linalg.norm(b[1][ib].astype(np.float64) - a[1][ia].astype(np.float64), axis=1)
    top = np.argsort(-delta)[:5]
    assert [c.key for c in td.largest] == common[top].tolist()
    np.testing.assert_allclose([c.delta for c in td.largest], delta[top])
    dw = d.dense["w"]
    assert dw.changed and dw.changed_elements == 1 and dw.max_abs_diff == pytest.approx(83.0)
    assert d.dense["bias"].changed is False
    assert d.as_dict()["tables"]["emb"]["largest"][0]["key"] == td.largest[0].key


def test_diff_variables_added_and_removed(tmp_path):
    import tensorkv

    url = f"lmdb://{tmp_path}/d"
    tensorkv.save({"x": np.zeros(3), "y": np.ones(2)}, url, "one")
    tensorkv.save({"y": np.ones(2), "z": np.ones(1)}, url, "two")
    with Catalog(url) as cat:
        d = vdiff.diff_tags(cat, "one", "two")
        assert (d.added, d.removed, d.unchanged, d.changed) == (["z"], ["x"], ["y"], [])
        with pytest.raises(VariableNotFoundError, match="no variable 'q'"):
            vdiff.diff_tags(cat, "one", "two", variables=["q"])


# ---------------------------------------------------------------------------------- backends
def test_every_backend_serves_queries(saved_any):
    s = saved_any
    with Catalog(s.url) as cat:
        assert cat.tag_names() == ["a", "b"]
        view = cat.table("emb", "b")
        assert isinstance(view, TableView)
        _assert_rows_equal(view.page(0, 10**9), s.rows["b"])
        rows, found = view.lookup(s.added)
        assert found.all()
        nn = search.nearest(view, key=int(s.changed[0]), k=3, metric="l2")
        ref = s.rows["b"]
        wk, _ = _brute(ref, ref[1][np.searchsorted(ref[0], s.changed[0])], "l2",
                       skip=int(s.changed[0]))
        np.testing.assert_array_equal(nn.keys, wk[:3])


def test_stats_of_a_sample(saved_lmdb):
    with Catalog(saved_lmdb.url) as cat:
        view = cat.table("emb", "a")
        st = stats.table_stats(view, sample=500, seed=2)
        assert st.sampled and st.rows == 500 and st.total_rows == 3000
        assert st.histograms["norm"].counts.sum() == 500
        assert st.as_dict()["sampled"] is True
        full = stats.table_stats(view)
        assert not full.sampled and full.rows == full.total_rows == 3000
        with pytest.raises(QueryError, match="sample=0"):
            stats.table_stats(view, sample=0)


def test_a_sharded_save_reads_as_one_table(tmp_path):
    from tests.checkpoint.helpers import make_table, rows_of

    import tensorkv

    url = f"lmdb://{tmp_path}/sharded"
    t0, t1 = make_table(700, 4, seed=1), make_table(500, 4, seed=2, start=10_000)
    tensorkv.save({"emb": t0}, url, "s", shard=0, num_shards=2, block_rows=128)
    tensorkv.save({"emb": t1}, url, "s", shard=1, num_shards=2, block_rows=128)
    ref = [np.concatenate(c) for c in zip(rows_of(t0), rows_of(t1), strict=True)]
    order = np.argsort(ref[0])
    ref = tuple(a[order] for a in ref)
    with Catalog(url) as cat:
        view = cat.table("emb", "s")
        assert view.rows == 1200
        _assert_rows_equal(view.page(0, 10**6), ref)
        rows, found = view.lookup([ref[0][0], ref[0][-1]])
        assert found.all()
        nn = search.nearest(view, vector=np.ones(4, np.float32), k=7, metric="dot")
        wk, _ = _brute(ref, np.ones(4, np.float32), "dot")
        np.testing.assert_array_equal(nn.keys, wk[:7])


def test_a_damaged_block_is_reported(tmp_path):
    from tests.checkpoint.helpers import make_table

    import tensorkv
    from tensorkv.checkpoint import layout
    from tensorkv.errors import CorruptRecordError

    url = f"lmdb://{tmp_path}/damaged"
    tensorkv.save({"emb": make_table(300, 4)}, url, "x", bucket_bits=0)
    with tensorkv.open_store(url) as store:
        [key] = [k for k in store.keys(layout.TABLE) if b"/b/" in k]
        raw = bytearray(store.get(key))
        raw[-20] ^= 0xFF
        store.put(key, bytes(raw))
    with Catalog(url) as cat:
        view = cat.table("emb")
        with pytest.raises(CorruptRecordError, match="table 'emb' .*block 0"):
            search.where(view, "freq > 0", limit=1)


def test_release_pages_gives_the_same_answers(saved_lmdb, monkeypatch):
    from tensorkv.viewer import rows as vrows

    monkeypatch.setattr(vrows, "READ_GROUP_BYTES", 50_000)  # many groups, each unmapped
    with Catalog(saved_lmdb.url, release_pages=True) as cat:
        view = cat.table("emb", "b")
        assert view.release_pages
        _assert_rows_equal(view.page(0, 10**6), saved_lmdb.rows["b"])
        nn = search.nearest(view, key=int(saved_lmdb.changed[0]), k=4, metric="l2")
    with Catalog(saved_lmdb.url) as cat:
        again = search.nearest(cat.table("emb", "b"), key=int(saved_lmdb.changed[0]), k=4,
                               metric="l2")
    np.testing.assert_array_equal(nn.keys, again.keys)


def test_export_draws_a_progress_bar(saved_lmdb, tmp_path, monkeypatch, capsys):
    from tensorkv import config
    from tensorkv.viewer.export import export_variable

    monkeypatch.setattr(config, "PROGRESS_MIN_SECONDS", 0.0)  # draw at once
    with Catalog(saved_lmdb.url) as cat:
        res = export_variable(cat, "emb", str(tmp_path / "e.npz"), progress=True)
        assert res.rows == 2998
        assert "export emb" in capsys.readouterr().err
        export_variable(cat, "emb", str(tmp_path / "f.npz"), progress=False)
        assert "export emb" not in capsys.readouterr().err


def test_dense_export_reads_in_parts_under_a_bar(tmp_path, monkeypatch, capsys):
    import ml_dtypes
    from safetensors.numpy import load_file

    import tensorkv
    from tensorkv import config
    from tensorkv.viewer import export
    from tensorkv.viewer.export import export_variable

    monkeypatch.setattr(config, "PROGRESS_MIN_SECONDS", 0.0)  # draw at once
    monkeypatch.setattr(export, "DENSE_READ_BYTES", 1000)  # many parts
    big = np.arange(300 * 7, dtype=np.float32).reshape(300, 7)
    bf = np.arange(40, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(20, 2)
    url = f"lmdb://{tmp_path}/dense"
    tensorkv.save({"big": big, "bf": bf, "s": np.float64(2.5).reshape(()),
                   "none": np.zeros((0, 3), np.float32)}, url, "t", chunk_bytes=2048)
    with Catalog(url) as cat:
        reads = []
        dense = cat.dense
        monkeypatch.setattr(cat, "dense", lambda *a: reads.append(a[2:]) or dense(*a))
        export_variable(cat, "big", str(tmp_path / "big.npz"), progress=True)
        assert reads[:2] == [((slice(0, 35),),), ((slice(35, 70),),)] and len(reads) == 9
        assert "export big" in capsys.readouterr().err
        np.testing.assert_array_equal(np.load(tmp_path / "big.npz")["big"], big)
        for name, want in (("bf", bf), ("s", np.float64(2.5)), ("none", np.zeros((0, 3)))):
            export_variable(cat, name, str(tmp_path / f"{name}.safetensors"), progress=False)
            got = load_file(str(tmp_path / f"{name}.safetensors"))[name]
            assert got.shape == np.shape(want)
            np.testing.assert_array_equal(got.astype(np.float64), np.asarray(want, np.float64))
        assert capsys.readouterr().err == ""
