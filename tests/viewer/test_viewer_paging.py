"""Pages of matches: every match of a scan appears in exactly one page, whatever the page size.

A page (``search.scan(..., limit=L, start=cursor)``) ends at a match, not at a chunk, and says
where the next match is (``next_offset``); the next page starts there. These tests walk the
pages of every page size from 1 to past the number of matches (to 40, then around the block
sizes and the number of matches), over tables whose chunks are small, large, one for the
whole table, in two shards, or cut by an incremental tag's exclusions, and compare the rows
gathered with the matches of one full read.
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.checkpoint.helpers import make_table

import tensorkv
from tensorkv.cli.main import main
from tensorkv.viewer import Catalog, parse_predicate, search

ROWS = 200


def _layouts() -> dict[str, tuple[object, str]]:
    """Stores of one table in several block layouts: name -> (store, tag)."""
    out: dict[str, tuple[object, str]] = {}
    for name, opts in {"blocks of ~7": {"block_rows": 7},
                       "blocks of ~64": {"block_rows": 64},
                       "one block": {"block_rows": 4096, "bucket_bits": 0}}.items():
        store = tensorkv.open_store("memory://")
        tensorkv.save({"emb": make_table(ROWS, 4)}, store, "t", **opts)
        out[name] = (store, "t")
    # a sharded save: each shard's blocks in turn
    store = tensorkv.open_store("memory://")
    for shard in (0, 1):
        part = make_table(ROWS // 2, 4, seed=shard, start=shard * 10_000)
        tensorkv.save({"emb": part}, store, "s", shard=shard, num_shards=2, block_rows=20)
    out["two shards"] = (store, "s")
    # an incremental tag: its newest link first, then the older link's rows it did not replace
    t = make_table(ROWS, 4)
    store = tensorkv.open_store("memory://")
    tensorkv.save({"emb": t}, store, "base", block_rows=16)
    keys = np.sort(np.asarray(next(t.export(chunk_rows=1 << 20)).keys))
    t.apply_gradients(keys[::9], np.ones((len(keys[::9]), 4), np.float32), step=9)
    t.remove(keys[5::31])
    t.lookup(np.arange(10**9, 10**9 + 11, dtype=np.int64))
    tensorkv.save({"emb": t}, store, "inc", incremental=True, block_rows=16)
    out["incremental"] = (store, "inc")
    return out


LAYOUTS = _layouts()
PREDICATES = ["freq >= 0", "freq >= 2", "version == 3 and norm < 0.2", "key < 0"]


def _truth(view, mask) -> np.ndarray:
    """Scan positions of every match, from one read of the whole table."""
    rows = view.page(0, view.rows)
    assert len(rows.keys) == view.rows
    return np.flatnonzero(mask(rows))


def _walk(view, mask, limit: int, count: bool = False) -> list[np.ndarray]:
    """The offsets of each page, from cursor 0 to the end (checking each page's shape)."""
    everything = view.page(0, view.rows).keys
    pages: list[np.ndarray] = []
    start = 0
    while True:
        m = search.scan(view, mask, limit=limit, count=count, start=start)
        np.testing.assert_array_equal(everything[m.offsets], m.rows.keys)
        if m.next_offset is None:
            assert m.complete
            pages.append(m.offsets)
            return pages
        # a page is full, and the next one starts at a match after it
        assert len(m) == limit and not (m.complete and not count)
        assert m.next_offset > (m.offsets[-1] if len(m) else start - 1)
        assert m.matched >= len(m) + 1
        pages.append(m.offsets)
        start = m.next_offset
        assert len(pages) <= view.rows + 1, "the pages do not advance"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("text", PREDICATES)
def test_every_page_size_gives_every_match_once(layout, text):
    store, tag = LAYOUTS[layout]
    with Catalog(store) as cat:
        view = cat.table("emb", tag)
        pred = parse_predicate(text)
        want = _truth(view, pred)
        sizes = set(range(1, min(len(want), 40) + 3)) | {63, 64, 65}
        sizes |= {len(want) - 1, len(want), len(want) + 1}
        for limit in sorted(x for x in sizes if x > 0):
            pages = _walk(view, pred, limit)
            got = np.concatenate(pages)
            np.testing.assert_array_equal(got, want, err_msg=f"limit {limit}")
            assert all(len(p) for p in pages) or not len(want)  # no empty trailing page


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_counting_pages_match_the_stopping_ones(layout):
    # count=True goes on to the end: the same pages, and the exact number of matches
    store, tag = LAYOUTS[layout]
    with Catalog(store) as cat:
        view = cat.table("emb", tag)
        pred = parse_predicate("freq >= 2")
        want = _truth(view, pred)
        for limit in (1, 7, 64, len(want)):
            counted = _walk(view, pred, limit, count=True)
            stopped = _walk(view, pred, limit, count=False)
            assert [p.tolist() for p in counted] == [p.tolist() for p in stopped]
            m = search.scan(view, pred, limit=limit, count=True)
            assert m.matched == len(want) and m.complete and m.scanned == view.rows


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(sorted(LAYOUTS)), picks=st.sets(st.integers(0, ROWS + 10),
                                                               max_size=40),
       limit=st.integers(0, 45), start=st.integers(0, ROWS + 12))
def test_a_page_is_the_next_matches_from_its_start(layout, picks, limit, start):
    # any set of matching positions, any page size (0 too), any start: the page holds the
    # first `limit` matches at or after `start`, and next_offset is the match after them
    store, tag = LAYOUTS[layout]
    with Catalog(store) as cat:
        view = cat.table("emb", tag)
        everything = view.page(0, view.rows).keys
        chosen = everything[sorted(p for p in picks if p < len(everything))]

        def mask(rows):
            return np.isin(rows.keys, chosen)

        want = np.flatnonzero(np.isin(everything, chosen))
        want = want[want >= start]
        m = search.scan(view, mask, limit=limit, count=False, start=start)
        np.testing.assert_array_equal(m.offsets, want[:limit])
        assert m.next_offset == (int(want[limit]) if len(want) > limit else None)


def test_key_range_says_whether_it_found_every_row():
    # the web viewer's "the first ones found" hint: complete only when no row is left out
    store, tag = LAYOUTS["blocks of ~64"]
    with Catalog(store) as cat:
        view = cat.table("emb", tag)
        keys = np.sort(view.page(0, view.rows).keys)
        lo, hi = int(keys[20]), int(keys[80])
        for limit in range(1, 64):
            m = search.key_range(view, lo, hi, limit=limit, count=False)
            assert (m.next_offset is None) == (limit >= 61), limit
            assert len(m) == min(limit, 61)


def test_cli_pages_of_matches_cover_them_once():
    # `tensorkv search --where P --head N --offset CURSOR`, following "--offset N for the
    # next ones", prints every match once
    url = f"memory://viewer-paging-cli-{uuid.uuid4().hex}"
    tensorkv.save({"emb": make_table(ROWS, 4)}, url, "t", block_rows=7)
    runner = CliRunner()
    with Catalog(url) as cat:
        view = cat.table("emb")
        want = view.page(0, view.rows).keys
    for head in (6, 7, 8, 64, len(want), len(want) + 1):
        got: list[int] = []
        offset = 0
        while True:
            res = runner.invoke(main, ["search", url, "emb", "--where", "freq >= 0",
                                       "--head", str(head), "--offset", str(offset), "--json"])
            assert res.exit_code == 0, res.output
            doc = json.loads(res.stdout)
            assert doc["offset"] == offset
            got += [r["key"] for r in doc["rows"]]
            if doc["next_offset"] is None:
                break
            offset = doc["next_offset"]
        assert got == want.tolist(), head
    res = runner.invoke(main, ["search", url, "emb", "--where", "freq >= 2", "--head", "3"])
    nxt = json.loads(runner.invoke(main, ["search", url, "emb", "--where", "freq >= 2",
                                          "--head", "3", "--json"]).stdout)["next_offset"]
    assert f"showing 3 (--head); --offset {nxt} for the next ones" in res.stdout
    res = runner.invoke(main, ["search", url, "emb", "--keys", "1", "--offset", "3"])
    assert res.exit_code == 2 and "--offset pages the matches of --where and --range" in res.stderr
    res = runner.invoke(main, ["search", url, "emb", "--where", "freq > 1", "--offset", "-1"])
    assert res.exit_code == 2 and "--offset -1 must be >= 0" in res.stderr
