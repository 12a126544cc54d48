"""Viewer commands of the ``tensorkv`` CLI: ls, show, search, stats, diff, export.

Every command reads (never writes) the store at a URL of any backend, at ``--tag`` (default:
the newest tag); prints tables for people, or JSON with ``--json``; and exits with one of the
statuses of ``cli/exits.py`` (``docs/viewer.md``), the error itself as one line on stderr.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import click
import numpy as np

from tensorkv.cli import viewer_fmt as fmt
from tensorkv.cli.exits import (  # the statuses of every command (cli/exits.py)
    EXIT_INTERNAL,
    EXIT_NO_MATCH,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_STORE,
    EXIT_USAGE,
    exit_code_of,
)
from tensorkv.errors import QueryError, TensorKVError

#: Most rows ``show`` and ``search`` print; a larger ``--head`` is capped (with a note).
HEAD_CAP = 1000

_EPILOG = ("Exit status: 0 ok, 1 no match (search) or differences (diff --exit-code), "
           "2 usage error, 3 store/tag/variable/key not found, 4 store error, "
           "5 unexpected error. See docs/viewer.md.")


class ViewerFailure(click.ClickException):
    """A viewer command's error: printed as one line, exiting with ``exit_code``."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        setattr(self, "exit_code", exit_code)  # noqa: B010 (click declares it a ClassVar)


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a command's errors into :class:`ViewerFailure` with the documented statuses."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as exc:
            code = exit_code_of(exc)
            text = " ".join(str(exc).split()) or type(exc).__name__
            if isinstance(exc, OSError) and not isinstance(exc, TensorKVError):
                text = f"{type(exc).__name__}: {exc.strerror or text}" + (
                    f": {exc.filename!r}" if exc.filename else "")
            elif code == EXIT_INTERNAL:
                text = (f"unexpected {type(exc).__name__}: {text} (run again with "
                        "TENSORKV_DEBUG=1 for the traceback and report it)")
            raise ViewerFailure(text, code) from exc

    return run


def _emit(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, allow_nan=False, default=_json_default))


def _json_default(x: Any) -> Any:
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        f = float(x)
        return f if np.isfinite(f) else str(f)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def _note(text: str) -> None:
    click.echo(f"tensorkv: note: {text}", err=True)


def _head(head: int) -> tuple[int, bool]:
    if head < 0:
        raise QueryError(f"--head {head} must be >= 0")
    if head > HEAD_CAP:
        _note(f"--head {head} is capped at {HEAD_CAP} rows; use `tensorkv export` for more")
        return HEAD_CAP, True
    return head, False


def _keys(values: tuple[str, ...]) -> list[str]:
    """Keys from repeated options, each possibly comma- or space-separated."""
    return [k for v in values for k in v.replace(",", " ").split()]


def _catalog(url: str) -> Any:
    from tensorkv.viewer import Catalog

    return Catalog(url, release_pages=True)  # one scan per process: keep RSS small


_url = click.argument("url")
_tag = click.option("--tag", "tag", default=None, metavar="TAG",
                    help="Tag to read (default: the newest).")
_json = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


# ------------------------------------------------------------------------------------ ls
@click.command("ls", epilog=_EPILOG)
@_url
@click.argument("tag_arg", metavar="[TAG]", required=False)
@_tag
@_json
@_guarded
def ls_cmd(url: str, tag_arg: str | None, tag: str | None, as_json: bool) -> None:
    """List the tags in the store at URL; with TAG, the variables of that tag.

    Tags: step, creation time, parent, variables, table rows and size. Variables: kind
    (table or dense), dtype, shape (tables: rows x dim), bytes, optimizer.
    """
    tag = tag_arg or tag
    with _catalog(url) as cat:
        if tag is None:
            tags = cat.tags()
            if as_json:
                _emit([t.as_dict() for t in tags])
                return
            if not tags:
                click.echo(f"no tags in {cat.url}")
                return
            body = [[t.tag, "-" if t.step is None else t.step, fmt.when(t.created),
                     (t.parent + "+") if t.incremental and t.parent else (t.parent or "-"),
                     t.tables + t.dense, t.table_rows, fmt.size(t.nbytes)] for t in tags]
            click.echo(fmt.table(["tag", "step", "created (UTC)", "parent", "variables",
                                  "rows", "size"], body, right=[1, 4, 5, 6]))
            return
        info = cat.tag_info(tag)
        vs = cat.variables(info.tag)
        if as_json:
            _emit({"tag": info.as_dict(), "variables": [v.as_dict() for v in vs]})
            return
        base = f", incremental on {info.parent}" if info.incremental else ""
        click.echo(f"tag {info.tag} (step {'-' if info.step is None else info.step}{base}), "
                   f"created {fmt.when(info.created)} UTC, {fmt.size(info.nbytes)}")
        body = [[v.name, v.kind, v.dtype, " x ".join(map(str, v.shape)) or "scalar",
                 fmt.size(v.nbytes), v.optimizer or "-"] for v in vs]
        click.echo(fmt.table(["variable", "kind", "dtype", "shape", "bytes", "optimizer"],
                             body, right=[4]))


# ------------------------------------------------------------------------------------ show
def _table_head(view: Any) -> str:
    opt = view.meta.get("optimizer", {}).get("config", {}).get("name", "?")
    return (f"table {view.name} of tag {view.tag}: {view.rows} rows, dim {view.dim}, "
            f"{view.dtype}, optimizer {opt} ({view.slot_columns} slot columns)")


@click.command("show", epilog=_EPILOG)
@_url
@click.argument("var")
@_tag
@click.option("--keys", "keys", multiple=True, metavar="K[,K...]",
              help="Table rows of these keys (repeat, or separate with commas).")
@click.option("--head", type=int, default=10, show_default=True,
              help=f"Rows to show (at most {HEAD_CAP}).")
@click.option("--offset", type=int, default=0, show_default=True,
              help="Table: first row to show (scan order).")
@click.option("--slice", "index", default=None, metavar="INDEX",
              help="Dense: a numpy basic index such as '0:10, :' (reads only the chunks "
                   "that hold it).")
@click.option("--full", is_flag=True, help="Print whole vectors, not their first elements.")
@_json
@_guarded
def show_cmd(url: str, var: str, tag: str | None, keys: tuple[str, ...], head: int,
             offset: int, index: str | None, full: bool, as_json: bool) -> None:
    """Show the values of variable VAR: table rows, or a slice of a dense tensor.

    Table rows print with their value, optimizer slots, frequency and version: the rows of
    --keys, else --head rows from --offset. Exits 3 when none of --keys exists.
    """
    head, capped = _head(head)
    with _catalog(url) as cat:
        info = cat.variable(var, tag)
        if info.kind == "dense":
            if keys:
                raise QueryError(f"--keys selects table rows; {var!r} is a dense tensor "
                                 "(use --slice)")
            _show_dense(cat, info, tag, index, head, full, as_json, capped)
            return
        if index is not None:
            raise QueryError(f"--slice selects part of a dense tensor; {var!r} is a table "
                             "(use --keys, --head, --offset)")
        view = cat.table(var, tag)
        from tensorkv.viewer import search

        if keys:
            m = search.by_keys(view, _keys(keys))
            rows, missing, offsets = m.rows, m.missing, None
            if len(rows.keys) > head:
                _note(f"{len(rows.keys)} keys found; showing the first {head} (--head)")
                rows = type(rows)(*(a[:head] for a in rows))
        else:
            if offset < 0:
                raise QueryError(f"--offset {offset} must be >= 0")
            rows, missing = view.page(offset, head), np.empty(0, np.int64)
            offsets = np.arange(offset, offset + len(rows.keys))
        if as_json:
            _emit({"variable": var, "tag": view.tag, "kind": "table", "rows_total": view.rows,
                   "dim": view.dim, "capped": capped,
                   "rows": fmt.rows_json(rows, offsets=offsets),
                   "missing": [int(k) for k in missing]})
        else:
            click.echo(_table_head(view))
            if len(rows.keys):
                click.echo(fmt.rows_text(rows, full=full, offsets=offsets))
            if not keys:
                end = offset + len(rows.keys)
                more = f"; --offset {end} for more" if end < view.rows else ""
                click.echo(f"rows {offset}..{max(offset, end - 1)} of {view.rows}{more}"
                           if len(rows.keys) else f"no rows at offset {offset} of {view.rows}")
        if missing.size:
            _note(f"not in table {var!r}: {', '.join(str(int(k)) for k in missing[:20])}"
                  + (" ..." if missing.size > 20 else ""))
            if not len(rows.keys):
                raise ViewerFailure(f"none of the keys is in table {var!r} of tag {view.tag!r}",
                                    EXIT_NOT_FOUND)


def _show_dense(cat: Any, info: Any, tag: str | None, index: str | None, head: int,
                full: bool, as_json: bool, capped: bool) -> None:
    from tensorkv.viewer import parse_index

    shape = info.shape
    if index is None:
        idx: tuple[Any, ...] = (slice(0, head),) if shape else ()
        shown = f"0:{min(head, shape[0])}" if shape else ""
    else:
        idx = parse_index(index)
        shown = index
    arr = cat.dense(info.name, tag, index if index is not None else (idx or None))
    note = ""
    if arr.ndim and arr.shape[0] > head:
        note = f"showing the first {head} of {arr.shape[0]} rows of the slice (--head)"
        arr = arr[:head]
    tag_name = cat.resolve(tag)
    if as_json:
        vals = arr.astype(np.float64) if arr.dtype.kind == "f" and arr.dtype.itemsize < 4 \
            else arr
        _emit({"variable": info.name, "tag": tag_name, "kind": "dense", "dtype": info.dtype,
               "shape": list(shape), "index": shown, "slice_shape": list(arr.shape),
               "capped": capped or bool(note), "values": np.asarray(vals).tolist()})
        return
    click.echo(f"dense {info.name} of tag {tag_name}: {info.dtype}{list(shape)}, "
               f"{fmt.size(info.nbytes)}")
    click.echo(f"[{shown}] -> shape {list(arr.shape)}")
    opts = {"threshold": arr.size + 1} if full else {"threshold": 200, "edgeitems": 3}
    click.echo(np.array2string(arr, max_line_width=100, precision=5, **opts))
    if note:
        _note(note)


# ------------------------------------------------------------------------------------ search
@click.command("search", epilog=_EPILOG)
@_url
@click.argument("var")
@_tag
@click.option("--keys", "keys", multiple=True, metavar="K[,K...]", help="Rows of these keys.")
@click.option("--range", "key_range", default=None, metavar="LO:HI",
              help="Keys from LO to HI inclusive (either end may be empty).")
@click.option("--where", "where", default=None, metavar="PREDICATE",
              help="e.g. 'freq >= 10 and norm < 0.1'; fields: key, freq, version, norm, "
                   "slot_norm, absmax, finite.")
@click.option("--nearest", "nearest", default=None, metavar="KEY",
              help="Nearest neighbours of this key's value.")
@click.option("--vector", default=None, metavar="V",
              help="Nearest neighbours of this vector ('0.1, -0.2, ...', dim numbers).")
@click.option("--k", "k", type=int, default=10, show_default=True, help="Neighbours to find.")
@click.option("--metric", type=click.Choice(["cosine", "l2", "dot"]), default="cosine",
              show_default=True, help="Similarity of --nearest / --vector.")
@click.option("--head", type=int, default=20, show_default=True,
              help=f"Matching rows to print (at most {HEAD_CAP}).")
@click.option("--offset", type=int, default=None, metavar="N",
              help="--where / --range: scan from scan position N (the next page of matches "
                   "starts where the previous one says).")
@click.option("--no-count", is_flag=True,
              help="Stop at --head matches instead of counting them all.")
@click.option("--full", is_flag=True, help="Print whole vectors.")
@_json
@_guarded
def search_cmd(url: str, var: str, tag: str | None, keys: tuple[str, ...],
               key_range: str | None, where: str | None, nearest: str | None,
               vector: str | None, k: int, metric: str, head: int, offset: int | None,
               no_count: bool, full: bool, as_json: bool) -> None:
    """Search the rows of table VAR: by keys, a key range, a predicate, or nearest neighbours.

    The table is streamed in chunks (never loaded whole); --where combines with every other
    mode. Matches of --where and --range come a page at a time: --head of them from scan
    position --offset, and the position of the next match for the next page. Nearest
    neighbours are exact over every row. Exits 1 when nothing matched.
    """
    from tensorkv.viewer import search
    from tensorkv.viewer.where import parse_predicate

    modes = [m for m, v in (("--keys", keys), ("--range", key_range), ("--nearest", nearest),
                            ("--vector", vector)) if v]
    if len(modes) > 1:
        raise QueryError(f"give one of --keys, --range, --nearest, --vector (got "
                         f"{' and '.join(modes)}); --where combines with any of them")
    if not modes and where is None:
        raise QueryError("give --keys, --range, --where, --nearest or --vector")
    head, capped = _head(head)
    if offset is not None and (keys or nearest is not None or vector is not None):
        raise QueryError("--offset pages the matches of --where and --range; --keys, --nearest "
                         "and --vector take none")
    start = 0 if offset is None else offset
    if start < 0:
        raise QueryError(f"--offset {start} must be >= 0")
    pred = parse_predicate(where) if where is not None else None
    with _catalog(url) as cat:
        view = cat.table(var, tag)
        if nearest is not None or vector is not None:
            nn = search.nearest(view, key=nearest, vector=vector, k=k, metric=metric,
                                where=pred)
            shown = min(head, len(nn.keys))
            out_rows = type(nn.rows)(*(a[:shown] for a in nn.rows))
            if as_json:
                _emit({"variable": var, "tag": view.tag, "mode": "nearest", "metric": metric,
                       "k": k, "scanned": nn.scanned, "matched": len(nn.keys),
                       "capped": capped,
                       "query": {"key": None if nearest is None else int(nearest, 0),
                                 "vector": [float(x) for x in nn.query]},
                       "rows": fmt.rows_json(out_rows, scores=nn.scores[:shown])})
            else:
                q = f"key {nearest}" if nearest is not None else "the vector"
                noun = "row" if len(nn.keys) == 1 else "rows"
                click.echo(f"{len(nn.keys)} nearest {noun} to {q} by {metric} in table {var} "
                           f"of tag {view.tag} ({nn.scanned} rows compared)")
                if shown:
                    name = "distance" if metric == "l2" else metric
                    click.echo(fmt.rows_text(out_rows, full=full, scores=nn.scores[:shown],
                                             score_name=name))
            if not len(nn.keys):
                raise click.exceptions.Exit(EXIT_NO_MATCH)
            return
        if keys:
            m = search.by_keys(view, _keys(keys))
            if pred is not None:
                sel = pred(m.rows)
                m.rows = type(m.rows)(*(a[sel] for a in m.rows))
                m.offsets, m.matched = m.offsets[sel], int(sel.sum())
            mode = "keys"
        elif key_range is not None:
            lo, hi = _parse_range(key_range)
            lo_v = -(2**63) if lo is None else lo
            hi_v = 2**63 - 1 if hi is None else hi
            if lo_v > hi_v:
                raise QueryError(f"--range {key_range!r} is empty: LO is above HI")

            def mask(r: Any) -> np.ndarray:
                inside = (r.keys >= lo_v) & (r.keys <= hi_v)
                return inside if pred is None else inside & pred(r)

            m = search.scan(view, mask, limit=head, count=not no_count, start=start)
            mode = "range"
        else:
            assert pred is not None
            m = search.scan(view, pred, limit=head, count=not no_count, start=start)
            mode = "where"
        rows = type(m.rows)(*(a[:head] for a in m.rows))
        offs = m.offsets[:head]
        if as_json:
            paged = {} if mode == "keys" else {"offset": start, "next_offset": m.next_offset}
            _emit({"variable": var, "tag": view.tag, "mode": mode, "where": where,
                   "matched": m.matched, "complete": m.complete, "scanned": m.scanned,
                   "capped": capped, **paged, "rows": fmt.rows_json(rows, offsets=offs),
                   "missing": [int(x) for x in m.missing]})
        else:
            more = "" if m.complete else "+"
            scanned = "" if m.scanned < 0 else f" of {m.scanned} rows scanned"
            if start:
                scanned += f" from scan position {start}"
            stop = "" if m.complete else " (stopped at --head; drop --no-count to count all)"
            noun = "row" if m.matched == 1 and m.complete else "rows"
            click.echo(f"{m.matched}{more} {noun} matched in table {var} of tag {view.tag}"
                       f"{scanned}{stop}")
            if len(rows.keys):
                click.echo(fmt.rows_text(rows, full=full,
                                         offsets=None if mode == "keys" else offs))
            if m.next_offset is not None:
                click.echo(f"showing {len(rows.keys)} (--head); --offset {m.next_offset} "
                           "for the next ones")
            elif m.matched > len(rows.keys):
                click.echo(f"showing {len(rows.keys)} (--head)")
            if m.missing.size:
                _note(f"not in table {var!r}: "
                      + ", ".join(str(int(x)) for x in m.missing[:20]))
        if m.matched == 0:
            raise click.exceptions.Exit(EXIT_NO_MATCH)


def _parse_range(text: str) -> tuple[int | None, int | None]:
    from tensorkv.viewer.limits import shown
    from tensorkv.viewer.rows import as_keys

    if ":" not in text:
        raise QueryError(f"--range {shown(text)} must be LO:HI (either end may be empty, e.g. "
                         "'100:' or ':-1')", text, 0)
    lo_s, hi_s = text.split(":", 1)
    lo = int(as_keys([lo_s.strip()])[0]) if lo_s.strip() else None
    hi = int(as_keys([hi_s.strip()])[0]) if hi_s.strip() else None
    return lo, hi


# ------------------------------------------------------------------------------------ stats
@click.command("stats", epilog=_EPILOG)
@_url
@click.argument("var")
@_tag
@click.option("--bins", type=click.IntRange(1, 1000), default=20, show_default=True,
              help="Bins per histogram.")
@click.option("--where", "where", default=None, metavar="PREDICATE",
              help="Only the rows satisfying this predicate (tables).")
@click.option("--sample", type=click.IntRange(1), default=None, metavar="N",
              help="Tables: measure about N rows from blocks chosen at random, not every row.")
@_json
@_guarded
def stats_cmd(url: str, var: str, tag: str | None, bins: int, where: str | None,
              sample: int | None, as_json: bool) -> None:
    """Statistics of variable VAR in one streaming pass.

    Tables: row count, NaN/Inf rows, rows never updated (still holding their initial value),
    all-zero rows, and min/max/mean/std and histograms of norm, frequency and version.
    Dense tensors: element count, NaN/Inf, min/max/mean/std and a histogram of the values.
    """
    from tensorkv.viewer import stats

    with _catalog(url) as cat:
        info = cat.variable(var, tag)
        if info.kind == "dense":
            if where is not None or sample is not None:
                raise QueryError(f"--where and --sample select table rows; {var!r} is a "
                                 "dense tensor")
            _dense_stats(cat, info, tag, bins, as_json)
            return
        st = stats.table_stats(cat.table(var, tag), bins=bins, where=where, sample=sample)
    if as_json:
        _emit({**st.as_dict(), "where": where})
        return
    sel = f" where {where}" if where else ""
    of = f" (a sample of the {st.total_rows})" if st.sampled else ""
    click.echo(f"table {st.name} of tag {st.tag}{sel}: {st.rows} rows{of}, dim {st.dim}")
    never = "-" if st.never_updated is None else st.never_updated
    click.echo(fmt.table(["", ""], [
        ["rows", st.rows],
        ["non-finite rows", f"{st.nonfinite_rows} ({st.nan_values} NaN, {st.inf_values} Inf "
                            "values)"],
        ["non-finite slot rows", st.nonfinite_slot_rows],
        ["never updated", never],
        ["all-zero rows", st.zero_rows],
    ]).split("\n", 1)[1])
    click.echo(fmt.table(["field", "min", "max", "mean", "std"], [
        [f, fmt.num(s.min), fmt.num(s.max), fmt.num(s.mean), fmt.num(s.std)]
        for f, s in (("norm", st.norm), ("freq", st.freq), ("version", st.version))],
        right=[1, 2, 3, 4]))
    for name, h in st.histograms.items():
        click.echo(f"{name} histogram:")
        click.echo(fmt.histogram_text(h.edges, h.counts, integer=name != "norm"))


def _dense_stats(cat: Any, info: Any, tag: str | None, bins: int, as_json: bool) -> None:
    from tensorkv.viewer.stats import histogram

    arr = cat.dense(info.name, tag).reshape(-1)
    a64 = arr.astype(np.float64) if arr.dtype.kind in "fiub" else arr
    nan = int(np.isnan(a64).sum()) if a64.dtype.kind == "f" else 0
    inf = int(np.isinf(a64).sum()) if a64.dtype.kind == "f" else 0
    fin = a64[np.isfinite(a64)] if a64.dtype.kind == "f" else a64
    d = {"name": info.name, "tag": cat.resolve(tag), "kind": "dense", "dtype": info.dtype,
         "shape": list(info.shape), "elements": int(arr.size), "nan_values": nan,
         "inf_values": inf, "zeros": int((a64 == 0).sum()),
         "min": float(fin.min()) if fin.size else None,
         "max": float(fin.max()) if fin.size else None,
         "mean": float(fin.mean()) if fin.size else None,
         "std": float(fin.std()) if fin.size else None}
    h = histogram(a64, bins)
    if as_json:
        _emit({**d, "histogram": h.as_dict()})
        return
    click.echo(f"dense {d['name']} of tag {d['tag']}: {info.dtype}{list(info.shape)}, "
               f"{d['elements']} elements")
    click.echo(f"NaN {nan}  Inf {inf}  zeros {d['zeros']}")
    if fin.size:
        click.echo(f"min {fmt.num(d['min'])}  max {fmt.num(d['max'])}  mean "
                   f"{fmt.num(d['mean'])}  std {fmt.num(d['std'])}")
    click.echo("value histogram:")
    click.echo(fmt.histogram_text(h.edges, h.counts))


# ------------------------------------------------------------------------------------ diff
@click.command("diff", epilog=_EPILOG)
@_url
@click.argument("tag_a")
@click.argument("tag_b")
@click.argument("var", required=False)
@click.option("--top", type=click.IntRange(0, 10_000), default=10, show_default=True,
              help="Largest row changes to list per table.")
@click.option("--sample", type=click.IntRange(0, 10_000), default=10, show_default=True,
              help="Added and removed keys to list per table.")
@click.option("--exit-code", is_flag=True, help="Exit 1 when the tags differ (like diff(1)).")
@_json
@_guarded
def diff_cmd(url: str, tag_a: str, tag_b: str, var: str | None, top: int, sample: int,
             exit_code: bool, as_json: bool) -> None:
    """Compare TAG_A with TAG_B (optionally only variable VAR).

    Lists variables added, removed, changed and unchanged; per table, keys added and removed
    and rows changed (value, slots, frequency or version), with the rows whose value moved
    most; per dense tensor, the elements changed (equal chunks are not even read).
    """
    from tensorkv.viewer.diff import diff_tags

    with _catalog(url) as cat:
        d = diff_tags(cat, tag_a, tag_b, variables=None if var is None else [var], top=top,
                      sample=sample)
    differ = bool(d.added or d.removed or d.changed)
    if as_json:
        _emit({**d.as_dict(), "differ": differ})
    else:
        click.echo(f"diff {d.tag_a} -> {d.tag_b}")
        for label, names in (("added", d.added), ("removed", d.removed),
                             ("changed", d.changed), ("unchanged", d.unchanged)):
            if names:
                click.echo(f"  {label}: {', '.join(names)}")
        for name, t in d.tables.items():
            click.echo(f"table {name}: {t.rows_a} -> {t.rows_b} rows; {t.added} added, "
                       f"{t.removed} removed, {t.changed} changed, {t.unchanged} unchanged")
            if t.added_keys:
                click.echo(f"  added keys: {', '.join(map(str, t.added_keys))}"
                           + (" ..." if t.added > len(t.added_keys) else ""))
            if t.removed_keys:
                click.echo(f"  removed keys: {', '.join(map(str, t.removed_keys))}"
                           + (" ..." if t.removed > len(t.removed_keys) else ""))
            if t.largest:
                click.echo("  largest changes:")
                body = [[c.key, fmt.num(c.delta), fmt.num(c.norm_a), fmt.num(c.norm_b),
                         f"{c.freq_a}->{c.freq_b}", f"{c.version_a}->{c.version_b}"]
                        for c in t.largest]
                text = fmt.table(["key", "|delta|", "norm a", "norm b", "freq", "version"],
                                 body, right=[0, 1, 2, 3])
                click.echo("\n".join("    " + line for line in text.splitlines()))
        for name, dd in d.dense.items():
            if dd.changed_elements is None:
                click.echo(f"dense {name}: {dd.dtype_a}{dd.shape_a} -> {dd.dtype_b}{dd.shape_b}")
            elif dd.changed:
                total = int(np.prod(dd.shape_a)) if dd.shape_a else 1
                mx = "" if dd.max_abs_diff is None else f", max |diff| {fmt.num(dd.max_abs_diff)}"
                click.echo(f"dense {name}: {dd.changed_elements} of {total} elements changed{mx}")
            else:
                click.echo(f"dense {name}: unchanged")
    if exit_code and differ:
        raise click.exceptions.Exit(EXIT_NO_MATCH)


# ------------------------------------------------------------------------------------ export
@click.command("export", epilog=_EPILOG)
@_url
@click.argument("var")
@click.option("--to", "path", required=True, metavar="FILE",
              help="Output file: .npz, .safetensors, .parquet or .csv.")
@_tag
@click.option("--format", "format_", type=click.Choice(["npz", "safetensors", "parquet", "csv"]),
              default=None, help="Format (default: from the file name).")
@click.option("--where", "where", default=None, metavar="PREDICATE",
              help="Tables: only the rows satisfying this predicate.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr (default: on a terminal, after a moment).")
@_json
@_guarded
def export_cmd(url: str, var: str, path: str, tag: str | None, format_: str | None,
               where: str | None, progress: bool | None, as_json: bool) -> None:
    """Write variable VAR to a file (.npz, .safetensors, .parquet or .csv).

    A table becomes the columns keys, values, slots, freq and version; a dense tensor one
    array. The file appears complete or not at all. .parquet needs pyarrow
    (pip install "tensorkv[viewer]").
    """
    from tensorkv.viewer.export import export_variable

    with _catalog(url) as cat:
        res = export_variable(cat, var, path, tag=tag, fmt=format_, where=where,
                              progress=progress)
        tag_name = cat.resolve(tag)
    if as_json:
        _emit({**res.as_dict(), "variable": var, "tag": tag_name})
        return
    what = f"{res.rows} rows" if res.kind == "table" else "dense tensor"
    click.echo(f"wrote {var} of tag {tag_name} ({what}, {fmt.size(res.nbytes)}) to {res.path}")


COMMANDS = [ls_cmd, show_cmd, search_cmd, stats_cmd, diff_cmd, export_cmd]

#: The statuses stay importable from here (``EXIT_*``, ``exit_code_of``: cli/exits.py).
__all__ = ["COMMANDS", "EXIT_INTERNAL", "EXIT_NOT_FOUND", "EXIT_NO_MATCH", "EXIT_OK",
           "EXIT_STORE", "EXIT_USAGE", "ViewerFailure", "exit_code_of"]
