"""Over-long and over-deep inputs are refused with a QueryError naming the limit (exit 2).

The limits (``tensorkv.viewer.limits``): predicates of at most 4,096 characters whose
brackets and ``not`` nest at most 32 deep, tags of 200 bytes, variable names of 1,024 bytes,
slices of 1,024 characters, keys of 64 characters. Anything longer is refused before it is
parsed, and the message shows at most 60 characters of it.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.checkpoint.helpers import make_table

import tensorkv
from tensorkv.checkpoint.tables import Rows
from tensorkv.cli.main import main
from tensorkv.errors import QueryError, TagNotFoundError, VariableNotFoundError
from tensorkv.viewer import Catalog, limits, parse_index, parse_predicate
from tensorkv.viewer.rows import as_keys
from tensorkv.viewer.search import parse_vector


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    u = f"lmdb://{tmp_path_factory.mktemp('viewer-limits')}/store"
    tensorkv.save({"emb": make_table(100, 4), "w": np.ones((3, 4), np.float32)}, u, "t")
    return u


def _rows() -> Rows:
    keys = np.arange(-5, 5, dtype=np.int64)
    return Rows(keys, np.ones((10, 2), np.float32), np.zeros((10, 0), np.float32),
                np.arange(10, dtype=np.int64), np.zeros(10, np.int64))


# ------------------------------------------------------------------------------ predicates
@pytest.mark.parametrize(("text", "pos"), [
    ("(" * 250 + "freq > 0" + ")" * 250, 32),  # the 33rd bracket
    ("not " * 250 + "freq > 0", 4 * 32),  # the 33rd 'not'
    ("!" * 40 + "(freq > 0)", 32),
    ("not (" * 20 + "freq > 0" + ")" * 20, 5 * 16),  # 'not' and brackets count alike
])
def test_deep_nesting_is_refused_at_the_level_past_the_limit(text, pos):
    with pytest.raises(QueryError, match="nest more than 32 levels deep") as e:
        parse_predicate(text)
    assert e.value.position == pos and f"at character {pos}" in str(e.value)
    assert len(str(e.value)) < 400  # the text shown is cut


def test_nesting_up_to_the_limit_works():
    rows = _rows()
    want = rows.freq > 3
    np.testing.assert_array_equal(parse_predicate("(" * 32 + "freq > 3" + ")" * 32)(rows), want)
    np.testing.assert_array_equal(parse_predicate("not " * 32 + "freq > 3")(rows), want)
    np.testing.assert_array_equal(parse_predicate("not " * 31 + "freq > 3")(rows), ~want)


def test_long_chains_do_not_nest():
    # 'and' / 'or' / comparison chains of any length are one node: no recursion limit is
    # reached evaluating the longest text the limit allows
    rows = _rows()
    chain = "3=freq" + "=3=freq" * 580  # 1,161 comparisons, more than Python's stack holds
    assert len(chain) < limits.MAX_PREDICATE_CHARS
    np.testing.assert_array_equal(parse_predicate(chain)(rows), rows.freq == 3)
    ands = "&&".join(["key<4"] * 580)
    assert len(ands) < limits.MAX_PREDICATE_CHARS
    np.testing.assert_array_equal(parse_predicate(ands)(rows), rows.keys < 4)
    ors = " or ".join(f"key=={k}" for k in range(-300, 0))
    assert len(ors) < limits.MAX_PREDICATE_CHARS
    np.testing.assert_array_equal(parse_predicate(ors)(rows), rows.keys < 0)


def test_a_predicate_longer_than_the_limit_is_refused():
    text = "freq >= 0" + " " * (limits.MAX_PREDICATE_CHARS - 9)
    assert parse_predicate(text).fields == {"freq"}  # exactly the limit: accepted
    with pytest.raises(QueryError, match="is 4097 characters long; the viewer accepts at most "
                                         "4096 characters") as e:
        parse_predicate(text + " ")
    assert len(str(e.value)) < 300


# ------------------------------------------------------------------------------ names
def test_tags_longer_than_a_save_allows_are_refused(url):
    with Catalog(url) as cat:
        with pytest.raises(TagNotFoundError):
            cat.manifest("x" * 200)  # a name a tag may have: just not there
        with pytest.raises(QueryError, match="is 201 bytes long; the viewer accepts at most "
                                             "200 bytes"):
            cat.manifest("x" * 201)
        with pytest.raises(QueryError, match="202 bytes"):
            cat.table("emb", "é" * 101)
        with pytest.raises(QueryError, match="contains '/'"):
            cat.variables("a/b")
        with pytest.raises(QueryError, match="not UTF-8"):
            cat.manifest("t\udcff")  # an undecodable byte of a command line


def test_variable_names_longer_than_the_limit_are_refused(url):
    with Catalog(url) as cat:
        with pytest.raises(VariableNotFoundError, match="has no variable 'xxxx") as e:
            cat.variable("x" * 1024)
        assert len(str(e.value)) < 300  # the name shown is cut
        for call in (cat.variable, cat.table, cat.dense):
            with pytest.raises(QueryError, match="1025 bytes long; the viewer accepts at most "
                                                 "1024 bytes"):
                call("x" * 1025)


def test_slices_keys_and_vectors_longer_than_the_limits_are_refused():
    assert parse_index("0:2, " + " " * 1010 + "1") == (slice(0, 2), 1)
    with pytest.raises(QueryError, match="1025 characters long; the viewer accepts at most 1024"):
        parse_index("0" + " " * 1024)
    with pytest.raises(QueryError, match="outside the int64 range"):
        as_keys(["9" * 64])
    with pytest.raises(QueryError, match="65 characters long; the viewer accepts at most 64"):
        as_keys(["9" * 65])
    with pytest.raises(QueryError, match="is not a number") as e:
        parse_vector("1, " + "x" * 10_000, 2)
    assert len(str(e.value)) < 300


# ------------------------------------------------------------------------------ commands
@pytest.mark.parametrize(("args", "what"), [
    (["search", "{url}", "emb", "--where", "(" * 250 + "freq > 0" + ")" * 250],
     "nest more than 32 levels deep"),
    (["stats", "{url}", "emb", "--where", "not " * 40 + "freq > 0"],
     "nest more than 32 levels deep"),
    (["export", "{url}", "emb", "--to", "x.npz", "--where", "freq>0 " * 600],
     "the viewer accepts at most 4096 characters"),
    (["show", "{url}", "emb", "--tag", "t" * 300], "at most 200 bytes"),
    (["ls", "{url}", "t" * 300], "at most 200 bytes"),
    (["diff", "{url}", "t", "a/b"], "contains '/'"),
    (["show", "{url}", "v" * 2000], "at most 1024 bytes"),
    (["show", "{url}", "w", "--slice", "0," * 600], "at most 1024 characters"),
    (["search", "{url}", "emb", "--keys", "1" * 100], "at most 64 characters"),
    (["search", "{url}", "emb", "--range", "1:" + "2" * 100], "at most 64 characters"),
    (["search", "{url}", "emb", "--vector", "1, " + "y" * 5000], "is not a number"),
])
def test_commands_refuse_long_and_deep_inputs_with_status_2(url, tmp_path, monkeypatch, args,
                                                           what):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, [a.replace("{url}", url) for a in args])
    assert res.exit_code == 2, (res.stdout, res.stderr, res.exception)
    assert res.stderr.startswith("tensorkv: error: ") and res.stderr.count("\n") == 1
    assert what in res.stderr and len(res.stderr) < 400
    assert not (tmp_path / "x.npz").exists()


TOKENS = ["freq", "norm", "key", "absmax", "(", ")", "not", "!", "and", "&&", "or", "<", "<=",
          "==", "!=", "1", "-3", "0.5", "-inf", "nan", "in", "[", "]", ",", "9" * 1000, "x" * 1000,
          "$", "é"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=700), st.sampled_from([" ", ""]))
def test_any_text_parses_or_gets_one_short_query_error(tokens, sep):
    # whatever the text (up to and past the length limit), the parser answers a predicate
    # or a QueryError of a few hundred characters: never another exception, never the text
    text = sep.join(tokens)
    try:
        pred = parse_predicate(text)
    except QueryError as exc:
        assert len(str(exc)) < 600, str(exc)[:200]
        return
    pred(_rows())
