"""Text and JSON renderings of the viewer commands' results (tables for people)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorkv.checkpoint.tables import Rows
from tensorkv.cli.fmt import human_bytes
from tensorkv.viewer.where import row_norms

#: Elements of a vector printed in a table cell before "..." (``--full`` prints them all).
VECTOR_HEAD = 6


def when(t: float | None) -> str:
    """A UTC time stamp, or ``-``."""
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def table(head: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """Columns aligned under their heads; columns listed in ``right`` align right."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(head)]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if i in right else v.ljust(w)
                         for i, (v, w) in enumerate(zip(vals, widths, strict=True))).rstrip()

    return "\n".join([line(head), *(line(r) for r in cells)])


def num(x: float) -> str:
    """A float in 4 significant digits (``nan``, ``inf`` as such)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


def vector(v: np.ndarray, full: bool = False) -> str:
    """``[0.1, -0.2, ...]``: the first :data:`VECTOR_HEAD` elements unless ``full``."""
    vals = [num(float(x)) for x in (v if full else v[:VECTOR_HEAD])]
    more = "" if full or len(v) <= VECTOR_HEAD else f", ... ({len(v)})"
    return "[" + ", ".join(vals) + more + "]"


def rows_json(rows: Rows, scores: np.ndarray | None = None,
              offsets: np.ndarray | None = None) -> list[dict[str, Any]]:
    """One dict per row: key, freq, version, norm, value, slots (and score / offset)."""
    norms = row_norms(rows.values)
    out = []
    for i in range(len(rows.keys)):  # output of at most --head rows
        d: dict[str, Any] = {"key": int(rows.keys[i]), "freq": int(rows.freq[i]),
                             "version": int(rows.version[i]), "norm": _jf(norms[i])}
        if scores is not None:
            d["score"] = _jf(scores[i])
        if offsets is not None and offsets[i] >= 0:
            d["offset"] = int(offsets[i])
        d["value"] = [_jf(x) for x in np.asarray(rows.values[i], np.float64)]
        d["slots"] = [_jf(x) for x in np.asarray(rows.slots[i], np.float64)]
        out.append(d)
    return out


def _jf(x: Any) -> float | str:
    """A float for JSON: NaN and infinities as strings (JSON has no literal for them)."""
    f = float(x)
    return f if math.isfinite(f) else str(f)


def rows_text(rows: Rows, *, full: bool = False, scores: np.ndarray | None = None,
              score_name: str = "score", offsets: np.ndarray | None = None) -> str:
    """Rows as a table: [offset], key, [score], freq, version, norm, value, slots."""
    norms = row_norms(rows.values)
    head = (["#"] if offsets is not None else []) + ["key"] + (
        [score_name] if scores is not None else []) + ["freq", "version", "norm", "value"]
    if rows.slots.shape[1]:
        head.append("slots")
    right = {head.index(h) for h in ("#", "key", score_name, "freq", "version", "norm")
             if h in head}
    body = []
    for i in range(len(rows.keys)):
        r: list[Any] = [int(offsets[i])] if offsets is not None else []
        r.append(int(rows.keys[i]))
        if scores is not None:
            r.append(f"{float(scores[i]):.6g}")
        r += [int(rows.freq[i]), int(rows.version[i]), num(float(norms[i])),
              vector(np.asarray(rows.values[i]), full)]
        if rows.slots.shape[1]:
            r.append(vector(np.asarray(rows.slots[i]), full))
        body.append(r)
    return table(head, body, sorted(right))


def histogram_text(edges: Sequence[float] | np.ndarray, counts: Sequence[int] | np.ndarray,
                   width: int = 40,
                   integer: bool = False) -> str:
    """Horizontal bars, one line per bin: ``[lo, hi)  count  ####``."""
    top = max(counts) if len(counts) else 0
    lines = []
    for i, c in enumerate(counts):
        lo, hi = edges[i], edges[i + 1]
        label = (f"{int(lo)}" if integer and hi - lo <= 1 else
                 f"[{int(lo)}, {int(hi)})" if integer else f"[{num(lo)}, {num(hi)})")
        bar = "#" * (0 if top == 0 else max(1 if c else 0, round(width * c / top)))
        lines.append((label, str(int(c)), bar))
    if not lines:
        return "  (no rows)"
    lw = max(len(x[0]) for x in lines)
    cw = max(len(x[1]) for x in lines)
    return "\n".join(f"  {a.ljust(lw)}  {b.rjust(cw)}  {c}".rstrip() for a, b, c in lines)


def size(n: int) -> str:
    """Bytes for people."""
    return human_bytes(n)
