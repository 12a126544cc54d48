"""Documented behaviours of the viewer's queries, each against an exact reference.

- a predicate with the number on the left (``1 < freq``) means what it says, for every
  operator and every field;
- ``diff`` counts a row whose optimizer slots alone changed as changed;
- nearest neighbours are exact when scores tie or nearly tie (float32 rounding), and ties go
  to the smaller key.
"""

from __future__ import annotations

import json
import operator
import uuid

import numpy as np
import pytest
from click.testing import CliRunner
from tests.checkpoint.helpers import make_table, rows_of

import tensorkv
from tensorkv.checkpoint.tables import Rows
from tensorkv.cli.main import main
from tensorkv.embedding import EmbeddingTable
from tensorkv.viewer import Catalog, parse_predicate, search
from tensorkv.viewer import diff as vdiff
from tensorkv.viewer.where import FIELDS, field_values

OPS = {"==": operator.eq, "=": operator.eq, "!=": operator.ne, "<": operator.lt,
       "<=": operator.le, ">": operator.gt, ">=": operator.ge}
#: Keys at the ends of int64 and next to each other there (a float comparison merges them).
EDGE_KEYS = [-(2**63), -(2**63) + 1, 2**53, 2**53 + 1, 2**63 - 2, 2**63 - 1]


def _rows() -> Rows:
    """Rows of a trained table (values, slots, freq, version vary), edge keys, NaN and Inf."""
    t = make_table(200, 4)
    t.lookup(np.array(EDGE_KEYS, np.int64))
    r = rows_of(t)
    values = r[1].copy()
    values[3, 1], values[4, 0] = np.nan, np.inf  # finite == 0 and absmax == inf for two rows
    return Rows(r[0], values, r[2], r[3], r[4])


ROWS = _rows()


def _numbers(col: np.ndarray) -> list[str]:
    """Numbers to compare a column with: values it holds (exactly), one between, the ends."""
    if col.dtype.kind == "i":
        vals = np.unique(col)
        picks = [vals[0], vals[len(vals) // 2], vals[-1], vals[len(vals) // 3] + 1]
        return [str(int(v)) for v in picks] + ["1.5", "-inf", "inf"]
    fin = np.unique(col[np.isfinite(col)])
    picks = [fin[0], fin[len(fin) // 2], fin[-1]]
    return [repr(float(v)) for v in picks] + ["0.05", "inf", "nan"]


def _reference(num: str, op: str, col: np.ndarray) -> np.ndarray:
    """``num op x`` for every x of the column, in exact Python arithmetic."""
    n: int | float = float(num) if any(c in num.lower() for c in ".ein") else int(num)
    conv = int if col.dtype.kind == "i" else float
    return np.array([OPS[op](n, conv(x)) for x in col.tolist()], bool)


@pytest.mark.parametrize("field", list(FIELDS))
@pytest.mark.parametrize("op", list(OPS))
def test_a_number_on_the_left_compares_as_written(field, op):
    col = field_values(ROWS, field)
    for num in _numbers(col):
        got = parse_predicate(f"{num} {op} {field}")(ROWS)
        want = _reference(num, op, col)
        np.testing.assert_array_equal(got, want, err_msg=f"{num} {op} {field}")
        # the same comparison written the other way round gives the same rows
        flipped = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}.get(op, op)
        np.testing.assert_array_equal(parse_predicate(f"{field} {flipped} {num}")(ROWS), want)


def test_int64_keys_compare_exactly_with_the_number_on_the_left():
    # 2**63 - 2 and 2**63 - 1 are one float64 apart from nothing: only exact integers part them
    got = parse_predicate(f"{2**63 - 2} < key")(ROWS)
    assert ROWS.keys[got].tolist() == [2**63 - 1]
    got = parse_predicate(f"{2**53 + 1} == key or {-(2**63)} >= key")(ROWS)
    assert sorted(ROWS.keys[got].tolist()) == [-(2**63), 2**53 + 1]
    got = parse_predicate(f"{2**53} < key <= {2**63 - 2}")(ROWS)
    assert sorted(ROWS.keys[got].tolist()) == [2**53 + 1, 2**63 - 2]


# ------------------------------------------------------------------------------------ diff
@pytest.fixture(scope="module")
def slots_only(tmp_path_factory):
    """Tags a; b (incremental) and c (full) whose only change is the slots of six rows."""
    url = f"lmdb://{tmp_path_factory.mktemp('viewer-slots')}/store"
    t = make_table(500, 4)
    tensorkv.save({"emb": t}, url, "a", block_rows=64)
    ch = next(t.export(chunk_rows=1 << 20))
    order = np.argsort(ch.keys)
    keys = ch.keys[order][[3, 50, 51, 200, 333, 499]]
    pick = np.searchsorted(ch.keys[order], keys)
    rows = [np.asarray(a)[order][pick] for a in (ch.keys, ch.values, ch.slots, ch.freq,
                                                  ch.version)]
    rows[2] = rows[2] + 1.0  # the optimizer's accumulators only
    t.import_(tuple(rows))
    tensorkv.save({"emb": t}, url, "b", incremental=True, block_rows=64)
    tensorkv.save({"emb": t}, url, "c", block_rows=64)
    return url, np.sort(keys)


@pytest.mark.parametrize("tag_b", ["b", "c"])
def test_diff_counts_a_change_of_the_slots_alone(slots_only, tag_b):
    url, keys = slots_only
    with Catalog(url) as cat:
        a, b = cat.table("emb", "a"), cat.table("emb", tag_b)
        np.testing.assert_array_equal(np.sort(a.page(0, 500).keys), np.sort(b.page(0, 500).keys))
        d = vdiff.diff_tags(cat, "a", tag_b, top=10)
    assert d.changed == ["emb"] and not d.unchanged
    td = d.tables["emb"]
    assert (td.added, td.removed, td.changed, td.unchanged) == (0, 0, 6, 494)
    # the value did not move: |delta| 0, listed by key
    assert [c.key for c in td.largest] == keys.tolist()
    assert all(c.delta == 0 and c.norm_a == c.norm_b for c in td.largest)
    res = CliRunner().invoke(main, ["diff", url, "a", tag_b, "--exit-code", "--json"])
    assert res.exit_code == 1, res.output  # the tags differ
    doc = json.loads(res.stdout)
    assert doc["differ"] and doc["tables"]["emb"]["changed"] == 6


def test_web_diff_counts_a_change_of_the_slots_alone(slots_only):
    pytest.importorskip("starlette", reason='the web viewer needs "tensorkv[view]"')
    from starlette.testclient import TestClient

    from tensorkv.viewer.web.app import create_app

    url, keys = slots_only
    with TestClient(create_app(url), base_url="http://127.0.0.1") as c:
        r = c.get("/api/diff", params={"a": "a", "b": "b"})
    assert r.status_code == 200, r.text
    [emb] = r.json()["variables"]
    assert emb["status"] == "changed" and emb["changed"] == 6
    assert sorted(int(x["key"]) for x in emb["largest"]) == keys.tolist()


# ---------------------------------------------------------------------------------- nearest
def _brute(keys, values, q, metric):
    """Keys and float64 scores best first (ties: the smaller key), by numpy over every row."""
    v = values.astype(np.float64)
    q = np.asarray(q, np.float64)
    if metric == "l2":
        s = np.sqrt(((v - q) ** 2).sum(axis=1))
    elif metric == "dot":
        s = v @ q
    else:
        s = (v @ q) / (np.linalg.norm(v, axis=1) * np.linalg.norm(q))
    order = np.lexsort((keys, s if metric == "l2" else -s))
    return keys[order], s[order]


def _store_of(keys, values, **opts):
    t = EmbeddingTable(values.shape[1], seed=0)
    t.upsert(keys, values)
    store = tensorkv.open_store(f"memory://viewer-nn-{uuid.uuid4().hex}")
    tensorkv.save({"emb": t}, store, "t", **opts)
    return store


@pytest.mark.parametrize("layout", [{"block_rows": 4096, "bucket_bits": 0},  # one chunk
                                    {"block_rows": 40}])  # ties spread over many chunks
@pytest.mark.parametrize("metric", ["cosine", "l2", "dot"])
def test_nearest_ties_go_to_the_smaller_key(layout, metric):
    # 700 rows of one value among 300 others: a query at that value ties 700 rows
    rng = np.random.default_rng(3)
    keys = rng.choice(10**12, 1000, replace=False).astype(np.int64)
    values = rng.standard_normal((1000, 4)).astype(np.float32)
    tied = rng.choice(1000, 700, replace=False)
    values[tied] = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
    store = _store_of(keys, values, **layout)
    with Catalog(store) as cat:
        view = cat.table("emb")
        assert max(len(c.rows.keys) for c in view.chunks()) > 64 or layout["block_rows"] < 64
        for k in (1, 5, 80):
            nn = search.nearest(view, vector=values[tied[0]], k=k, metric=metric)
            want = np.sort(keys[tied])[:k]
            np.testing.assert_array_equal(nn.keys, want)
            # the query key itself is left out; the next smallest tied keys come instead
            nn = search.nearest(view, key=int(want[0]), k=k, metric=metric)
            np.testing.assert_array_equal(nn.keys, np.sort(keys[tied])[1:k + 1])
            # with a predicate, among the rows it keeps
            cut = int(np.sort(keys[tied])[10])
            nn = search.nearest(view, vector=values[tied[0]], k=k, metric=metric,
                                where=f"key >= {cut}")
            np.testing.assert_array_equal(nn.keys, np.sort(keys[tied])[10:10 + k])


@pytest.mark.parametrize(("metric", "big", "seed"), [("dot", 2**20, 1), ("cosine", 2**20, 2),
                                                     ("l2", 2**10, 2)])
def test_nearest_is_exact_where_float32_rounding_reorders_rows(metric, big, seed):
    # rows [big, 62 numbers near a common base, -big] in one chunk: their float32 scores
    # cancel the big terms after rounding the small ones to big's precision, so float32
    # orders the rows by its rounding errors, not by their scores. Only the float64 scores
    # tell them apart; the answer must be theirs, the best k of every row.
    rng = np.random.default_rng(seed)
    n, d = 1000, 64
    small = rng.uniform(0, 1, d - 2) + rng.uniform(-0.01, 0.01, (n, d - 2))
    values = np.column_stack([np.full(n, big), small, np.full(n, -big)]).astype(np.float32)
    ends = [0.0] if metric == "l2" else [1.0]  # l2: the big terms of |v|^2 carry the error
    q = np.concatenate([ends, rng.uniform(0.5, 1.5, d - 2), ends]).astype(np.float32)
    keys = rng.choice(10**12, n, replace=False).astype(np.int64)
    store = _store_of(keys, values, block_rows=4096, bucket_bits=0)
    wk, ws = _brute(keys, values, q, metric)
    with Catalog(store) as cat:
        view = cat.table("emb")
        for k in (1, 3):
            nn = search.nearest(view, vector=q, k=k, metric=metric)
            np.testing.assert_array_equal(nn.keys, wk[:k])
            np.testing.assert_allclose(nn.scores, ws[:k], rtol=1e-12)


@pytest.mark.parametrize("scale", [1.0, 1e-26])
def test_nearest_by_cosine_is_exact_for_rows_too_small_to_square_in_float32(scale):
    # 700 rows of norm ~7e-23 (their squares underflow float32) point near the query; 300
    # rows of norm ~1 are almost orthogonal to it. The best cosines are the small rows'.
    rng = np.random.default_rng(4)
    q0 = rng.standard_normal(8)
    values = rng.standard_normal((1000, 8))
    values -= np.outer(values @ q0 / (q0 @ q0), q0)
    values += 0.01 * q0 / np.linalg.norm(q0)
    small = rng.choice(1000, 700, replace=False)
    values[small] = (q0 + 0.5 * rng.standard_normal((700, 8))) * 2e-23
    values = values.astype(np.float32)
    keys = rng.choice(10**12, 1000, replace=False).astype(np.int64)
    store = _store_of(keys, values, block_rows=4096, bucket_bits=0)
    q = (q0 * scale).astype(np.float32)
    wk, ws = _brute(keys, values, q, "cosine")
    assert set(wk[:5].tolist()) <= set(keys[small].tolist())
    with Catalog(store) as cat:
        nn = search.nearest(cat.table("emb"), vector=q, k=5, metric="cosine")
    np.testing.assert_array_equal(nn.keys, wk[:5])
    np.testing.assert_allclose(nn.scores, ws[:5], rtol=1e-12)

