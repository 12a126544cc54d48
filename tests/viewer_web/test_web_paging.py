"""The web API's pages of filtered rows hold every match once, for every page size.

``/api/rows?where=P&limit=L&cursor=C`` answers the next ``L`` matches from scan position
``C`` and the position of the match after them (``next_cursor``, None when none is left).
Following ``next_cursor`` from 0 must give every matching row once, in scan order, with no
empty page at the end, whatever ``L`` and wherever the table's blocks begin and end. The
same goes for the key-range search's ``complete``.
"""

from __future__ import annotations

import numpy as np
import pytest

from tensorkv.viewer import Catalog, parse_predicate


def _pages(client, where: str, limit: int) -> list[list[int]]:
    """The keys of each page of /api/rows?where=..., following next_cursor to the end."""
    pages: list[list[int]] = []
    cursor = 0
    while True:
        r = client.get("/api/rows", params={"tag": "t1", "var": "emb", "where": where,
                                            "limit": limit, "cursor": cursor})
        assert r.status_code == 200, r.text
        page = r.json()
        assert page["cursor"] == cursor
        pages.append([int(k) for k in page["rows"]["key"]])
        if page["next_cursor"] is None:
            return pages
        assert len(pages[-1]) == limit and page["next_cursor"] > cursor  # a full page
        cursor = page["next_cursor"]
        assert len(pages) <= 601, "the pages do not advance"


def _matches(url: str, where: str) -> list[int]:
    """Keys of the rows of t1 that satisfy ``where``, in scan order, from one full read."""
    with Catalog(url) as cat:
        view = cat.table("emb", "t1")
        rows = view.page(0, view.rows)
        assert len(rows.keys) == view.rows == 600
        return rows.keys[parse_predicate(where)(rows)].tolist()


@pytest.mark.parametrize(("where", "sizes"), [
    # every size from 1 to 60 over a filter; the case (every row) at sizes that end
    # pages at, before and after block boundaries
    ("freq >= 2", range(1, 61)),
    ("freq >= 0", [1, 7, 13, 33, 34, 35, 39, 53, 59, 60, 73, 500]),
    ("version == 3 and norm < 0.2 or key < 0", range(1, 61, 4)),
])
def test_filtered_pages_hold_every_match_once(client, ckpt, where, sizes):
    want = _matches(ckpt["url"], where)
    assert len(want) > 0
    for limit in sizes:
        pages = _pages(client, where, limit)
        assert [k for p in pages for k in p] == want, f"limit={limit}"
        assert all(pages), f"limit={limit}: an empty page"


def test_key_range_search_says_when_it_left_rows_out(client, ckpt):
    # the page's "(the first ones found; narrow the range ...)" hint reads `complete`
    with Catalog(ckpt["url"]) as cat:
        keys = np.sort(cat.table("emb", "t2").page(0, 630).keys)
    lo, hi = int(keys[100]), int(keys[160])  # 61 keys
    for limit in range(1, 70):
        r = client.get("/api/search", params={"var": "emb", "keys": f"{lo}..{hi}",
                                              "limit": limit})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert len(doc["rows"]["key"]) == min(limit, 61)
        assert doc["complete"] == (limit >= 61), limit
