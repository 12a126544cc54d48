"""Searches over a table's rows: keys, key ranges, predicates, exact nearest neighbours.

Every search streams the table in chunks (:meth:`TableView.chunks`) and works on each chunk
with whole-array numpy operations; only the matches kept are copied.

Scans page: a scan keeps the first ``limit`` matches from a scan position on and says where
the next match is (:attr:`Matches.next_offset`), so scanning again from there continues
exactly where the last one stopped: across the pages every match appears once, whatever the
page size, the predicate and where the chunks begin and end.

Nearest neighbours are exact: each chunk's scores come from one float32 matrix-vector
product; the rows that can be among the best are those whose score lies within a bound of
float32's rounding error of the chunk's ``pool``-th best (``np.partition``), ties included,
and (cosine) the rows too small for float32 to square; they are scored again in float64, and
a running top-k keeps the best ``k``, ties broken by the smaller key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorkv.checkpoint import tables
from tensorkv.checkpoint.tables import Rows
from tensorkv.errors import QueryError, RowNotFoundError
from tensorkv.viewer.limits import shown
from tensorkv.viewer.rows import TableView, as_keys, concat_rows, copy_rows
from tensorkv.viewer.where import Predicate, parse_predicate

#: The metrics of :func:`nearest`: cosine and dot are similarities (larger is nearer), l2 a
#: distance (smaller is nearer).
METRICS = ("cosine", "l2", "dot")


@dataclass
class Matches:
    """Rows a search found.

    Attributes
    ----------
    rows
        The rows kept (copies), at most the search's ``limit``, in scan order (key searches:
        in the order the keys were given).
    offsets
        Scan position of each row kept (-1 for key searches, which read no positions).
    matched
        Rows that matched: all of them (from the scan's start on) when ``complete``, else
        at least ``len(rows) + 1``.
    scanned
        Rows read (-1 for key searches).
    complete
        Whether every row from the scan's start to the end of the table was examined.
    missing
        Key searches: the keys asked for that the table lacks.
    next_offset
        Scans: the scan position of the first match after the rows kept, where the next
        page starts (``scan(..., start=next_offset)``); None when the rows kept are every
        match from the scan's start on. Key searches: None.
    """

    rows: Rows
    offsets: np.ndarray
    matched: int
    scanned: int
    complete: bool
    missing: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    next_offset: int | None = None

    def __len__(self) -> int:
        return int(self.rows.keys.shape[0])


def by_keys(view: TableView, keys: Any) -> Matches:
    """The rows of the given keys (reads only the blocks that can hold them)."""
    k = as_keys(keys)
    rows, found = view.lookup(k)
    missing = np.unique(k[~found])
    return Matches(rows, np.full(len(rows.keys), -1, np.int64), len(rows.keys), -1, True,
                   missing)


def scan(view: TableView, mask: Callable[[Rows], np.ndarray], *, limit: int,
         count: bool = True, start: int = 0) -> Matches:
    """The first ``limit`` rows, from scan position ``start`` on, for which ``mask`` is True.

    A page of matches: :attr:`Matches.next_offset` is the scan position of the first match
    after the rows kept (None when there is none), and ``scan(view, mask, limit=...,
    start=next_offset)`` returns the next page. Each match is in exactly one page, for any
    ``limit`` and any chunk boundaries: a page ends at a match, not at a chunk.

    Parameters
    ----------
    mask
        A vectorised test of a chunk's rows (a :class:`Predicate` is one).
    limit
        Keep at most this many rows.
    count
        Go on counting matches to the end of the table after ``limit`` rows were kept
        (``matched`` is then exact); False stops at the first match past the rows kept.
    start
        The scan position to begin at (a previous page's ``next_offset``).

    Raises
    ------
    QueryError
        ``limit`` or ``start`` is negative.
    """
    if limit < 0:
        raise QueryError(f"limit={limit} must be >= 0")
    kept: list[Rows] = []
    offs: list[np.ndarray] = []
    n_kept = matched = scanned = 0
    next_offset: int | None = None
    it = view.chunks(start=start)
    try:
        for ch in it:
            m = np.asarray(mask(ch.rows), dtype=bool)
            scanned += len(m)
            hit = np.flatnonzero(m)
            matched += len(hit)
            room = limit - n_kept
            if next_offset is not None or not len(hit):
                continue
            if room:
                take = hit[:room]
                kept.append(copy_rows(tables.take(ch.rows, take)))
                offs.append(ch.offset + take)
                n_kept += len(take)
            if len(hit) > room:  # the page is full: the next one starts at this match
                next_offset = int(ch.offset + hit[room])
                if not count:
                    break
    finally:
        it.close()
    offsets = np.concatenate(offs) if offs else np.empty(0, np.int64)
    complete = next_offset is None or count
    return Matches(concat_rows(kept, view.empty()), offsets, matched, scanned, complete,
                   next_offset=next_offset)


def key_range(view: TableView, lo: int | None, hi: int | None, *, limit: int,
              count: bool = True, start: int = 0) -> Matches:
    """Rows whose key lies in ``[lo, hi]`` (inclusive; None: unbounded), in scan order.

    A page of them, as :func:`scan` returns: ``next_offset`` is None when the rows are all
    the rows of the range from ``start`` on.
    """
    lo_v = -(2**63) if lo is None else int(as_keys([lo])[0])
    hi_v = 2**63 - 1 if hi is None else int(as_keys([hi])[0])
    if lo_v > hi_v:
        raise QueryError(f"key range {lo}..{hi} is empty: the low end is above the high end")
    return scan(view, lambda r: (r.keys >= lo_v) & (r.keys <= hi_v), limit=limit, count=count,
                start=start)


def where(view: TableView, predicate: str | Predicate, *, limit: int,
          count: bool = True, start: int = 0) -> Matches:
    """Rows satisfying a predicate (``"freq >= 10 and norm < 0.1"``, see :mod:`.where`).

    A page of them, as :func:`scan` returns.
    """
    pred = parse_predicate(predicate) if isinstance(predicate, str) else predicate
    return scan(view, pred, limit=limit, count=count, start=start)


@dataclass
class Neighbours:
    """The nearest rows to a query, best first.

    Attributes
    ----------
    keys, scores
        Keys and scores (float64: cosine similarity, dot product, or L2 distance).
    rows
        The rows (copies), in the same order.
    metric
        ``cosine``, ``l2`` or ``dot``.
    query
        The query vector (float32).
    scanned
        Rows compared.
    """

    keys: np.ndarray
    scores: np.ndarray
    rows: Rows
    metric: str
    query: np.ndarray
    scanned: int


def parse_vector(text: str, dim: int) -> np.ndarray:
    """A query vector from ``"0.1, -0.2, ..."`` (commas or spaces), checked against ``dim``."""
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        with np.errstate(over="ignore"):  # beyond float32: inf, refused by nearest()
            vec = np.array([float(p) for p in parts], np.float32)
    except ValueError:
        bad = next(p for p in parts if not _is_float(p))
        raise QueryError(f"vector {shown(text)}: {shown(bad)} at character {text.find(bad)} "
                         "is not a number", text, text.find(bad)) from None
    if vec.shape[0] != dim:
        raise QueryError(f"vector has {vec.shape[0]} numbers but the table's rows have dim "
                         f"{dim}", text, None)
    return vec


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _exact(metric: str, v: np.ndarray, q64: np.ndarray, qn: float) -> np.ndarray:
    """Scores of rows ``v`` in float64 (cosine: 0-norm rows get NaN)."""
    v64 = v.astype(np.float64)
    if metric == "l2":
        d = v64 - q64
        return np.sqrt(np.einsum("ij,ij->i", d, d))
    dot = v64 @ q64
    if metric == "dot":
        return dot
    norms = np.sqrt(np.einsum("ij,ij->i", v64, v64))
    with np.errstate(divide="ignore", invalid="ignore"):
        return dot / (norms * qn)


def _approx(metric: str, v: np.ndarray, q: np.ndarray, qn: float, gamma: float
            ) -> tuple[np.ndarray, float, np.ndarray | None]:
    """float32 scores of rows ``v`` that order them as ``metric`` does, and their error bound.

    Returns ``(scores, tol, force)``: every score is within ``tol`` of its exact value,
    except the rows of ``force`` (None: no row), which must be scored exactly. ``gamma``
    bounds the relative rounding error of a float32 dot product of the rows' length; ``tiny``
    below bounds what products and squares that underflow to subnormals or zero lose.
    """
    tiny = 2.0 ** -149 * (2 * v.shape[1] + 4)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        nv = np.einsum("ij,ij->i", v, v)
        if metric == "cosine":  # the order of v.q / |v|, with |q| = 1 (a tiny q cannot underflow)
            s = v @ (q.astype(np.float64) / qn).astype(np.float32)
            s = s / np.sqrt(nv)
            s = np.where(np.isnan(s), -np.inf, s)
            # a norm float32 cannot square without underflow: score the row exactly (a zero
            # row's cosine is undefined: it comes last and needs no exact score)
            small = np.flatnonzero(nv < 2.0 ** -100)
            force = None
            if small.size:
                force = np.zeros(v.shape[0], bool)
                force[small[v[small].any(axis=1)]] = True
            return s, 2 * gamma + tiny * 2.0 ** 50, force
        s = v @ q
        vmax = float(np.sqrt(nv.max()))
        if metric == "l2":  # the order of |v - q|^2 (|q|^2 is the same for every row)
            return nv - 2 * s, 2 * gamma * (vmax * vmax + 2 * vmax * qn) + 3 * tiny, None
        return s, gamma * vmax * qn + tiny, None


def _candidates(s: np.ndarray, larger: bool, pool: int, tol: float,
                force: np.ndarray | None = None) -> np.ndarray:
    """Indices of the rows whose exact score can be among the best ``pool`` of the chunk.

    ``s`` are float32 scores, each within ``tol`` of its exact value but those of ``force``
    (a mask, or None), which are candidates whatever their score. A row whose score is more
    than ``2 * tol`` worse than the ``pool``-th best of the others has ``pool`` rows exactly
    better than it, so it cannot be among the best ``k <= pool``; every other row is a
    candidate, ties with the ``pool``-th best included.
    """
    n = s.shape[0]
    if n <= pool or not np.isfinite(tol):
        return np.arange(n)
    worse = np.where(np.isnan(s), np.inf, -s if larger else s)  # smaller is better, NaN last
    rest = worse if force is None else worse[~force]
    if rest.shape[0] <= pool:
        return np.arange(n)
    bound = np.partition(rest, pool - 1)[pool - 1] + 2 * tol
    if not np.isfinite(bound):
        return np.arange(n)
    keep = worse <= bound
    return np.flatnonzero(keep if force is None else keep | force)


def _order(scores: np.ndarray, keys: np.ndarray, larger_better: bool) -> np.ndarray:
    """Indices best first: by score (NaN last), then by key."""
    s = np.where(np.isnan(scores), -np.inf if larger_better else np.inf, scores)
    return np.lexsort((keys, -s if larger_better else s))


def nearest(view: TableView, *, key: Any = None, vector: Any = None, k: int = 10,
            metric: str = "cosine", exclude_query: bool = True,
            where: str | Predicate | None = None) -> Neighbours:
    """The ``k`` rows nearest to a key's value or to a vector, over every row (exact).

    Parameters
    ----------
    key, vector
        The query: a key of the table (its value is the vector), or a vector of ``dim``
        numbers (an array, or text such as ``"0.1, 0.2, ..."``). Give exactly one.
    k
        How many neighbours.
    metric
        ``cosine`` (similarity), ``l2`` (distance) or ``dot`` (inner product).
    exclude_query
        Leave the query key itself out of the result.
    where
        Consider only the rows satisfying this predicate.

    Raises
    ------
    QueryError
        Bad metric, k or vector.
    RowNotFoundError
        The table holds no row for ``key``.
    """
    if metric not in METRICS:
        raise QueryError(f"metric {shown(metric)} is not one of {', '.join(METRICS)}")
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise QueryError(f"k={k!r} must be an int >= 1")
    if (key is None) == (vector is None):
        raise QueryError("give a key or a vector to search near (exactly one)")
    pred = parse_predicate(where) if isinstance(where, str) else where
    skip_key = None
    if key is not None:
        kk = as_keys([key])
        rows, found = view.lookup(kk)
        if not found[0]:
            raise RowNotFoundError(f"key {int(kk[0])} is not in table {view.name!r} of tag "
                             f"{view.tag!r}; search near a key it holds, or give a vector")
        q = np.asarray(rows.values[0], np.float32)
        skip_key = int(kk[0]) if exclude_query else None
    elif isinstance(vector, str):
        q = parse_vector(vector, view.dim)
    else:
        q = np.asarray(vector, np.float32).reshape(-1)
        if q.shape[0] != view.dim:
            raise QueryError(f"vector has {q.shape[0]} numbers but the table's rows have dim "
                             f"{view.dim}")
    bad = np.flatnonzero(~np.isfinite(q))
    if bad.size:
        what = "the query vector" if key is None else f"the value of key {int(kk[0])}"
        raise QueryError(f"{what} holds {q[bad[0]]} at position {int(bad[0])}: neighbours "
                         "of a vector that is not finite are undefined; give finite numbers")
    larger = metric != "l2"
    q64 = q.astype(np.float64)
    qn = float(np.sqrt(q64 @ q64))
    if metric == "cosine" and qn == 0:
        raise QueryError("the query vector is all zeros: cosine similarity is undefined; "
                         "use --metric l2 or dot")
    pool = max(4 * k, 64)  # the pool-th best score of a chunk bounds its candidates
    # a bound of the relative rounding error of a float32 sum of dim + 3 products (the dot
    # product, the norm, the division), with a factor 2 to spare
    eps = 2.0 ** -24 * (view.dim + 3)
    gamma = 2 * eps / (1 - eps) if eps < 0.5 else np.inf
    best_s = np.empty(0, np.float64)
    best_k = np.empty(0, np.int64)
    best_rows: Rows = view.empty()
    scanned = 0
    it = view.chunks()
    try:
        for ch in it:
            rows = ch.rows
            if pred is not None or skip_key is not None:
                m = np.ones(len(rows.keys), bool) if pred is None else pred(rows)
                if skip_key is not None:
                    m &= rows.keys != skip_key
                if not m.all():
                    rows = tables.take(rows, m)
            n = len(rows.keys)
            scanned += n
            if n == 0:
                continue
            v = rows.values if rows.values.dtype == np.float32 else rows.values.astype(np.float32)
            if n > pool:  # only rows near the chunk's pool-th best are scored again
                s, tol, force = _approx(metric, v, q, qn, gamma)
                cand = _candidates(s, larger, pool, tol, force)
            else:
                cand = np.arange(n)
            exact = _exact(metric, v[cand], q64, qn)
            ks = rows.keys[cand]
            all_s = np.concatenate((best_s, exact))
            all_k = np.concatenate((best_k, ks))
            top = _order(all_s, all_k, larger)[:k]
            new_rows = copy_rows(tables.take(rows, cand))
            merged = concat_rows([best_rows, new_rows]) if len(best_k) else new_rows
            best_s, best_k, best_rows = all_s[top], all_k[top], tables.take(merged, top)
    finally:
        it.close()
    return Neighbours(best_k, best_s, best_rows, metric, q, scanned)
