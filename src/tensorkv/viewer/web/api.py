"""The JSON endpoints of the web viewer, as plain functions of (state, query parameters).

Each endpoint reads through the query layer (:class:`tensorkv.viewer.Catalog`,
:class:`tensorkv.viewer.TableView` and the ``search``/``stats``/``diff`` modules), which
streams tables in chunks; nothing here loads a whole table. Results that cost a full scan
(statistics) or a sample (PCA) are cached per tag and variable: a tag's content never
changes once written. Keys leave as strings (JavaScript numbers are exact to 2**53 only).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorkv.errors import QueryError
from tensorkv.stores.base import KVStore
from tensorkv.viewer import Catalog, limits

#: Rows per page of the rows table (the most a page may ask for).
MAX_PAGE = 500
#: Values of a row shown in a rows table (the row page shows them all).
HEAD_VALUES = 8
#: Keys one key search may name.
MAX_KEYS = 1000
#: Rows above which the statistics are measured on a sample of this many rows by default.
STATS_SAMPLE = 50_000
#: Rows the PCA scatter samples (the most a request may ask for).
PCA_SAMPLE = 2000
MAX_PCA_SAMPLE = 20000
#: Cells (rows x columns) a heat map may show.
MAX_CELLS = 512 * 512
#: Default heat-map window per axis.
DEFAULT_WINDOW = 128
#: Neighbours a nearest-neighbour query may ask for.
MAX_K = 1000
#: Characters of a request parameter without a limit of its own below.
MAX_PARAM_CHARS = limits.MAX_NUMBER_CHARS
#: Characters each parameter may hold (the query layer checks its own limits too: a tag's
#: bytes, a predicate's nesting); longer ones are refused before anything reads them.
PARAM_LIMITS = {
    "tag": limits.MAX_TAG_BYTES, "a": limits.MAX_TAG_BYTES, "b": limits.MAX_TAG_BYTES,
    "var": limits.MAX_NAME_BYTES,
    "where": limits.MAX_PREDICATE_CHARS,
    "slice": limits.MAX_SLICE_CHARS,
    "keys": MAX_KEYS * 24,  # an int64 and its separator
    "vector": 32 * 1024,  # dim numbers: 2,048 of 16 characters
}


class ViewerState:
    """What the app keeps between requests: the catalog and caches of table views/results."""

    def __init__(self, store: KVStore, default_tag: str | None = None, cache_size: int = 64):
        # a long-running server: table scans unmap what they read from an LMDB map, so the
        # process keeps one read group resident, not every page a scan touched
        self.catalog = Catalog(store, release_pages=True)
        self.default_tag = default_tag
        if default_tag is not None:
            self.catalog.resolve(default_tag)  # an unknown tag fails now, listing the tags
        self._cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._key_locks: dict[tuple[Any, ...], threading.Lock] = {}

    def close(self) -> None:
        """Forget the caches (the store is closed by whoever opened it)."""
        with self._lock:
            self._cache.clear()

    def tag(self, params: dict[str, str], name: str = "tag") -> str:
        """The tag a request names (default: the app's tag, else the latest)."""
        return self.catalog.resolve(params.get(name) or self.default_tag)

    def cached(self, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        """``compute()``'s result for ``key``, computed once even under concurrent requests."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            lock = self._key_locks.setdefault(key, threading.Lock())
        with lock:
            with self._lock:
                if key in self._cache:
                    return self._cache[key]
            value = compute()
            with self._lock:
                self._cache[key] = value
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
                self._key_locks.pop(key, None)
            return value

    def table(self, params: dict[str, str]) -> Any:
        """The TableView a request names (``tag``, ``var``), cached per tag."""
        tag = self.tag(params)
        name = required(params, "var")
        doc = self.catalog.manifest(tag)
        return self.cached(("table", tag, doc.get("created"), name),
                           lambda: self.catalog.table(name, tag))


# --- parameters ----------------------------------------------------------------------------
def check_params(params: dict[str, str]) -> dict[str, str]:
    """``params`` when every value is within its limit (:data:`PARAM_LIMITS`).

    Raises
    ------
    QueryError
        A parameter is longer than its limit; the message names it and the limit.
    """
    for name, value in params.items():
        limit = PARAM_LIMITS.get(name, MAX_PARAM_CHARS)
        limits.check_length(f"parameter {limits.shown(name, 20)}:", value, limit)
    return params


def required(params: dict[str, str], name: str) -> str:
    """A parameter that must be given."""
    value = params.get(name, "")
    if not value:
        raise QueryError(f"the request needs the parameter {name}=...")
    return value


def integer(params: dict[str, str], name: str, default: int, lo: int, hi: int) -> int:
    """An integer parameter in ``[lo, hi]`` (``default`` when absent)."""
    text = params.get(name, "")
    if not text:
        return default
    limits.check_length(name, text, limits.MAX_NUMBER_CHARS)
    try:
        value = int(text)
    except ValueError:
        raise QueryError(f"{name}={limits.shown(text)} is not an integer") from None
    if not lo <= value <= hi:
        raise QueryError(f"{name}={value} is out of range; use {lo}..{hi}")
    return value


def parse_keys(text: str) -> tuple[np.ndarray | None, tuple[int, int] | None]:
    """Keys (``"12, 7"``) or an inclusive key range (``"100..200"``) of a key search."""
    from tensorkv.viewer.rows import as_keys

    text = text.strip()
    if ".." in text:
        lo_text, _, hi_text = text.partition("..")
        bounds = as_keys([lo_text.strip(), hi_text.strip()])
        if bounds[0] > bounds[1]:
            raise QueryError(f"key range {text!r} is empty: its start is above its end")
        return None, (int(bounds[0]), int(bounds[1]))
    parts = [p for p in text.replace(",", " ").split() if p]
    if not parts:
        raise QueryError("no keys given; write keys as '12, 7' or a range as '100..200'")
    if len(parts) > MAX_KEYS:
        raise QueryError(f"{len(parts)} keys given; a search takes at most {MAX_KEYS}")
    return as_keys(parts), None


# --- row summaries -------------------------------------------------------------------------
def norms(values: np.ndarray) -> np.ndarray:
    """L2 norm of each row (float32 rows, computed in float64)."""
    v = np.asarray(values, dtype=np.float64)
    return np.sqrt(np.einsum("ij,ij->i", v, v)) if v.ndim == 2 else np.abs(v)


def columns(rows: Any, extra: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Rows as the pages list them, column by column: key, freq, version, norm, first values.

    Columns (not one dict per row) keep the work vectorised; the page zips them.
    """
    values = np.asarray(rows.values, dtype=np.float32)
    cols: dict[str, Any] = {
        "key": rows.keys.astype(str).tolist(),
        "freq": np.asarray(rows.freq),
        "version": np.asarray(rows.version),
        "norm": norms(values),
        "head": values[:, :HEAD_VALUES],
        "more": values.ndim == 2 and values.shape[1] > HEAD_VALUES,
    }
    cols.update(extra or {})
    return cols


def slot_names(meta: dict[str, Any], count: int) -> list[str]:
    """Names of a table's optimizer slots (``slot0``... when the optimizer is unknown)."""
    from tensorkv.embedding.optimizers import optimizer_from_config

    cfg = (meta.get("optimizer") or {}).get("config")
    try:
        names = list(optimizer_from_config(cfg).slot_names()) if cfg else []
    except Exception:  # an optimizer of a newer tensorkv: keep the columns, unnamed
        names = []
    return names if len(names) == count else [f"slot{i}" for i in range(count)]


# --- endpoints -----------------------------------------------------------------------------
def info(state: ViewerState, params: dict[str, str]) -> dict[str, Any]:
    """The store's URL, its tag count and the tag pages open on."""
    names = state.catalog.tag_names()
    return {"url": state.catalog.url, "tags": len(names),
            "tag": state.default_tag or (names[-1] if names else None)}


def tags(state: ViewerState, params: dict[str, str]) -> dict[str, Any]:
    """Every tag, oldest first."""
    return {"tags": [t.as_dict() for t in state.catalog.tags()]}


def variables(state: ViewerState, params: dict[str, str]) -> dict[str, Any]:
    """A tag's variables: tables, then dense tensors."""
    tag = state.tag(params)
    return {"tag": tag, "variables": [v.as_dict() for v in state.catalog.variables(tag)]}


def rows(state: ViewerState, params: dict[str, str]) -> dict[str, Any]:
    """A page of a table's rows in scan order; with ``where``, the next rows that match.

    A filtered page scans from ``cursor`` (a scan position) until it has ``limit`` rows and
    returns the scan position of the next match (``next_cursor``; None when no row after
    the page matches): the pages from cursor 0 on hold every match once.
    """
    view = state.table(params)
    limit = integer(params, "limit", 50, 1, MAX_PAGE)
    where = params.get("where", "").strip()
    if not where:
        offset = integer(params, "offset", 0, 0, max(len(view) - 1, 0))
        page = view.page(offset, limit)
        end = offset + len(page.keys)
        return {"tag": view.tag, "var": view.name, "total": len(view), "offset": offset,
                "rows": columns(page), "prev": max(offset - limit, 0) if offset else None,
                "next": end if end < len(view) else None}
    from tensorkv.viewer import parse_predicate, search

    start = integer(params, "cursor", 0, 0, max(len(view), 0))
    found = search.scan(view, parse_predicate(where), limit=limit, count=False, start=start)
    return {"tag": view.tag, "var": view.name, "total": len(view), "where": where,
            "rows": columns(found.rows), "cursor": start, "next_cursor": found.next_offset,
            "scanned": found.scanned}


def row(state: ViewerState, params: dict[str, str]) -> dict[str, Any]:
    """One row in full: value, optimizer slots by name, frequency, version, norm."""
    from tensorkv.errors import VariableNotFoundError
    from tensorkv.viewer.rows import as_keys

    view = state.table(params)
    key = as_keys([required(params, "key")])
    found, mask = view.lookup(key)
    if not mask[0]:
        raise VariableNotFoundError(
            f"table {view.name!r} of tag {view.tag!r} has no row with key {int(key[0])}")
    values = np.asarray(found.values[0], dtype=np.float32)
    slots = np.asarray(found.slots[0], dtype=np.float32)
    dim = values.shape[0]
    count = slots.shape[0] // dim if dim else 0
    names = slot_names(view.meta, count)
    return {"tag": view.tag, "var": view.name, "key": str(int(found.keys[0])),
            "freq": int(found.freq[0]), "version": int(found.version[0]),
            "norm": float(norms(values[None, :])[0]), "value": values,
            "slots": {n: slots[i * dim:(i + 1) * dim] for i, n in enumerate(names)}}


def search_keys(state: ViewerState, params: dict[str, str]) -> dict[str, Any]:
    """Rows of given keys or of a key range.

    ``keys=12,7`` reads only the blocks that can hold them; ``keys=100..200`` (inclusive)
    scans the table and keeps at most ``limit`` rows; ``complete`` says whether they are
    every row of the range.
    """
    from tensorkv.viewer import search

    view = state.table(params)
    text = required(params, "keys")
    keys, bounds = parse_keys(text)
    if keys is not None:
        found = search.by_keys(view, keys)
        asked = len(keys)
    else:
        assert bounds is not None
        found = search.key_range(view, bounds[0], bounds[1], count=False,
                                 limit=integer(params, "limit", 100, 1, MAX_PAGE))
        asked = None
    return {"tag": view.tag, "var": view.name, "keys": text, "asked": asked,
            "rows": columns(found.rows), "missing": found.missing.astype(str).tolist(),
            "complete": found.next_offset is None}


def nearest(state: ViewerState, params: dict[str, str]) -> dict[str, Any]:
    """The ``k`` rows nearest to a key's value (``key``) or a vector (``vector``), exactly."""
    from tensorkv.viewer import search

    view = state.table(params)
    key, vector = params.get("key") or None, params.get("vector") or None
    res = search.nearest(view, key=key, vector=vector, k=integer(params, "k", 10, 1, MAX_K),
                         metric=params.get("metric") or "cosine")
    return {"tag": view.tag, "var": view.name, "metric": res.metric, "scanned": res.scanned,
            "rows": columns(res.rows, {"score": np.asarray(res.scores)})}


def stats(state: ViewerState, params: dict[str, str]) -> dict[str, Any]:
    """Counts and histograms of norm, frequency and version (cached per tag).

    Tables above :data:`STATS_SAMPLE` rows are measured on a sample of that many rows unless
    ``exact=1`` (a full pass: seconds at 10M rows); the answer says ``sampled``.
    """
    from tensorkv.viewer.stats import table_stats

    view = state.table(params)
    bins = integer(params, "bins", 30, 2, 200)
    exact = integer(params, "exact", 0, 0, 1) == 1
    sample = None if exact or len(view) <= STATS_SAMPLE else STATS_SAMPLE

    def compute() -> dict[str, Any]:
        d = table_stats(view, bins=bins, sample=sample).as_dict()
        h = d.pop("histograms")
        return {**d, "count": d["rows"], "nan": d["nan_values"], "inf": d["inf_values"],
                "norm_hist": h["norm"], "freq_hist": h["freq"], "version_hist": h["version"]}

    return state.cached(("stats", view.tag, view.doc.get("created"), view.name, bins, sample),
                        compute)


def diff(state: ViewerState, params: dict[str, str]) -> dict[str, Any]:
    """Variables and table keys added, removed and changed between tags ``a`` and ``b``."""
    from tensorkv.viewer.diff import diff_tags

    a, b = state.tag(params, "a"), state.tag(params, "b")
    var = params.get("var") or None

    def compute() -> dict[str, Any]:
        d = diff_tags(state.catalog, a, b, variables=[var] if var else None)
        out = []
        for name in d.added + d.removed + d.changed + d.unchanged:
            status = ("added" if name in d.added else "removed" if name in d.removed
                      else "changed" if name in d.changed else "unchanged")
            entry: dict[str, Any] = {"name": name, "status": status, "kind": None}
            if name in d.tables:
                t = d.tables[name]
                largest = [{"key": str(c.key), "change": c.delta} for c in t.largest]
                entry.update(kind="table", added=t.added, removed=t.removed,
                             changed=t.changed, largest=largest,
                             max_change=largest[0]["change"] if largest else None)
            elif name in d.dense:
                e = d.dense[name]
                entry.update(kind="dense", changed=e.changed_elements,
                             max_change=e.max_abs_diff)
            out.append(entry)
        return {"a": d.tag_a, "b": d.tag_b, "variables": out}

    created = (state.catalog.manifest(a).get("created"), state.catalog.manifest(b).get("created"))
    return state.cached(("diff", a, b, created, var), compute)


def pca(state: ViewerState, params: dict[str, str]) -> dict[str, Any]:
    """A 2-D PCA projection of a sample of a table's rows (SVD of the centred sample)."""
    view = state.table(params)
    n = integer(params, "n", PCA_SAMPLE, 2, MAX_PCA_SAMPLE)
    return state.cached(("pca", view.tag, view.doc.get("created"), view.name, n),
                        lambda: project(view.sample(n)))


def project(sample: Any) -> dict[str, Any]:
    """The first two principal components of the rows of ``sample``.

    The components are the singular vectors of the centred sample's ``dim x dim`` scatter
    matrix (``np.linalg.svd`` of ``X.T @ X``, the right singular vectors of ``X``): the
    product is one BLAS call and the SVD is of a small square matrix, which keeps a request
    at milliseconds where an SVD of the tall ``n x dim`` sample can take a second when
    OpenBLAS threads compete for a few busy cores.
    """
    v = np.asarray(sample.values, dtype=np.float64)
    keep = np.isfinite(v).all(axis=1) if v.size else np.zeros(0, bool)
    v, keys = v[keep], sample.keys[keep]
    if v.shape[0] < 2:
        return {"sampled": int(v.shape[0]), "explained": [],
                "points": {"x": [], "y": [], "key": []}}
    centred = v - v.mean(axis=0)
    vecs, var, _ = np.linalg.svd(centred.T @ centred, hermitian=True)
    xy = centred @ vecs[:, :2]
    if xy.shape[1] < 2:
        xy = np.column_stack([xy, np.zeros(len(xy))])
    total = float(var.sum())
    explained = var[:2] / total if total > 0 else np.zeros(min(2, len(var)))
    return {"sampled": int(v.shape[0]), "explained": explained,
            "points": {"x": xy[:, 0], "y": xy[:, 1], "key": keys.astype(str).tolist()}}


def default_window(shape: tuple[int, ...]) -> str:
    """The slice a dense tensor's page opens on: a corner of at most 128 x 128 cells."""
    if not shape:
        return "..."
    parts = [f"0:{min(shape[0], DEFAULT_WINDOW)}"]
    if len(shape) >= 2:
        parts.append(f"0:{min(shape[1], DEFAULT_WINDOW)}")
    parts += ["0"] * (len(shape) - 2)
    return ", ".join(parts)


def slice_(state: ViewerState, params: dict[str, str]) -> dict[str, Any]:
    """A 2-D slice of a dense tensor for the heat map; only that slice is read."""
    from tensorkv.viewer import parse_index
    from tensorkv.viewer.catalog import index_shape

    tag = state.tag(params)
    name = required(params, "var")
    var = state.catalog.variable(name, tag)
    if var.kind != "dense":
        raise QueryError(f"{name!r} is an embedding table; open its rows instead of a slice")
    text = params.get("slice", "").strip() or default_window(var.shape)
    index = parse_index(text)
    shown = index_shape(var.shape, index, text)
    if len(shown) > 2:
        raise QueryError(f"slice [{text}] of shape {list(var.shape)} has {len(shown)} axes "
                         f"{list(shown)}; a heat map shows 2: fix the other axes with an integer, "
                         "e.g. '0:64, 0:64, 0'")
    cells = int(np.prod(shown)) if shown else 1
    if cells > MAX_CELLS:
        raise QueryError(f"slice [{text}] has {cells:,} cells {list(shown)}; a heat map shows "
                         f"at most {MAX_CELLS:,}: take a smaller slice, e.g. "
                         f"'{default_window(var.shape)}'")
    values = np.asarray(state.catalog.dense(name, tag, index), dtype=np.float64)
    grid = values.reshape(1, -1) if values.ndim < 2 else values
    finite = grid[np.isfinite(grid)]
    note = None
    if finite.size < grid.size:
        note = f"{grid.size - finite.size} non-finite values (shown in magenta)"
    return {"tag": tag, "var": name, "dtype": var.dtype, "shape": list(var.shape),
            "slice": text, "shown": list(shown), "values": grid,
            "min": float(finite.min()) if finite.size else 0.0,
            "max": float(finite.max()) if finite.size else 0.0, "note": note}


ENDPOINTS: dict[str, Callable[[ViewerState, dict[str, str]], Any]] = {
    "info": info,
    "tags": tags,
    "variables": variables,
    "rows": rows,
    "row": row,
    "search": search_keys,
    "nearest": nearest,
    "stats": stats,
    "pca": pca,
    "diff": diff,
    "slice": slice_,
}
