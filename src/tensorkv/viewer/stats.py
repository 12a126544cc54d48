"""Statistics of a table's rows in one streaming pass: counts, histograms, anomalies.

Per row the pass keeps three numbers (the value's norm, the frequency and the version, 20
bytes a row) so that the histograms' bins can span the exact range of each; every other figure
is accumulated chunk by chunk. A row is *never updated* when its value is still the initial
value the table's initializer gives its key (the initial value depends only on the table's
seed and the key), which is computed for every row too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorkv.errors import QueryError
from tensorkv.viewer.rows import Chunk, TableView
from tensorkv.viewer.where import Predicate, parse_predicate, row_norms


@dataclass
class Histogram:
    """Counts of values in ``bins`` equal-width bins between ``edges[0]`` and ``edges[-1]``."""

    edges: np.ndarray
    counts: np.ndarray

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"edges": [float(e) for e in self.edges], "counts": [int(c) for c in self.counts]}


@dataclass
class Summary:
    """min, max, mean and standard deviation of one field (NaN-free rows only)."""

    min: float
    max: float
    mean: float
    std: float

    def as_dict(self) -> dict[str, float]:
        """JSON-ready."""
        return {"min": self.min, "max": self.max, "mean": self.mean, "std": self.std}


@dataclass
class TableStats:
    """What :func:`table_stats` measured.

    Attributes
    ----------
    name, tag, dim
        The table.
    rows
        Rows counted (those satisfying ``where`` when one was given).
    nonfinite_rows
        Rows whose value holds a NaN or an infinity.
    nan_values, inf_values
        NaN and infinite elements over all values.
    nonfinite_slot_rows
        Rows whose optimizer slots hold a NaN or an infinity.
    never_updated
        Rows whose value equals their key's initial value (None when the initializer is
        unknown to this tensorkv).
    zero_rows
        Rows whose value is all zeros.
    norm, freq, version
        Summaries of the value's L2 norm, the frequency and the version.
    histograms
        ``norm``, ``freq`` and ``version`` histograms.
    total_rows
        Rows of the table (``rows`` counts those measured).
    sampled
        Whether the figures come from a sample of the rows (``sample=``).
    """

    name: str
    tag: str
    dim: int
    rows: int
    nonfinite_rows: int
    nan_values: int
    inf_values: int
    nonfinite_slot_rows: int
    never_updated: int | None
    zero_rows: int
    norm: Summary
    freq: Summary
    version: Summary
    histograms: dict[str, Histogram]
    total_rows: int = 0
    sampled: bool = False

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        d = {k: getattr(self, k) for k in (
            "name", "tag", "dim", "rows", "nonfinite_rows", "nan_values", "inf_values",
            "nonfinite_slot_rows", "never_updated", "zero_rows", "total_rows", "sampled")}
        d.update({k: getattr(self, k).as_dict() for k in ("norm", "freq", "version")})
        d["histograms"] = {k: h.as_dict() for k, h in self.histograms.items()}
        return d


def _initial_values(view: TableView) -> Any:
    """A function keys -> initial values of the table, or None when it cannot be rebuilt."""
    meta = view.meta
    default = meta.get("default_value")
    if default is not None:
        arr = np.asarray(default, np.float32)

        def const(keys: np.ndarray) -> np.ndarray:
            return np.broadcast_to(arr, (keys.shape[0], view.dim))

        return const
    try:
        from tensorkv.embedding.initializers import get_initializer

        init = get_initializer(meta.get("initializer"))
    except Exception:  # an initializer of another tensorkv version: not counted
        return None
    seed = int(meta.get("seed", 0))

    def fresh(keys: np.ndarray) -> np.ndarray:
        return init.values(keys, view.dim, seed)

    return fresh


def _summary(a: np.ndarray) -> Summary:
    a = a[np.isfinite(a)] if a.dtype.kind == "f" else a
    if a.size == 0:
        return Summary(float("nan"), float("nan"), float("nan"), float("nan"))
    return Summary(float(a.min()), float(a.max()), float(a.mean(dtype=np.float64)),
                   float(a.std(dtype=np.float64)))


def histogram(a: np.ndarray, bins: int, integer: bool = False) -> Histogram:
    """Equal-width histogram over the finite range of ``a`` (integers: bins on whole numbers)."""
    a = a[np.isfinite(a)] if a.dtype.kind == "f" else a
    if a.size == 0:
        return Histogram(np.zeros(2), np.zeros(1, np.int64))
    lo, hi = float(a.min()), float(a.max())
    if integer:
        span = int(a.max()) - int(a.min()) + 1
        bins = max(1, min(bins, span))
        hi = lo + span
    elif hi == lo:
        hi = lo + 1.0
    counts, edges = np.histogram(a, bins=bins, range=(lo, hi))
    return Histogram(edges, counts.astype(np.int64))


def table_stats(view: TableView, *, bins: int = 20, where: str | Predicate | None = None,
                never_updated: bool = True, sample: int | None = None,
                seed: int = 0) -> TableStats:
    """Statistics of every row of a table (or of those satisfying ``where``), in one pass.

    Parameters
    ----------
    bins
        Bins per histogram.
    where
        Only rows satisfying this predicate.
    never_updated
        Count the rows still holding their initial value (computes each row's initial value).
    sample
        Measure about this many rows taken from whole blocks chosen at random
        (:meth:`TableView.sample`) instead of every row: a fast, approximate picture of a
        large table (a web page's histograms).
    seed
        Seed of the sample.
    """
    if sample is not None and sample < 1:
        raise QueryError(f"sample={sample} must be >= 1 (or None for every row)")
    pred = parse_predicate(where) if isinstance(where, str) else where
    initial = _initial_values(view) if never_updated else None
    norms: list[np.ndarray] = []
    freqs: list[np.ndarray] = []
    versions: list[np.ndarray] = []
    nonfinite = nan_v = inf_v = slot_bad = zero = fresh = 0
    it: Iterator[Any] = (iter([Chunk(0, view.sample(sample, seed))]) if sample is not None
                         else view.chunks())
    try:
        for ch in it:
            rows = ch.rows
            if pred is not None:
                m = pred(rows)
                if not m.all():
                    from tensorkv.checkpoint.tables import take

                    rows = take(rows, m)
            if rows.keys.shape[0] == 0:
                continue
            v = rows.values
            nan = np.isnan(v)
            inf = np.isinf(v)
            nan_v += int(nan.sum())
            inf_v += int(inf.sum())
            nonfinite += int((nan | inf).any(axis=1).sum())
            if rows.slots.shape[1]:
                slot_bad += int((~np.isfinite(rows.slots)).any(axis=1).sum())
            n = row_norms(v)
            zero += int((n == 0).sum())
            norms.append(n)
            freqs.append(np.array(rows.freq, np.int64))
            versions.append(np.array(rows.version, np.int64))
            if initial is not None:
                init = np.asarray(initial(rows.keys)).astype(v.dtype, copy=False)
                fresh += int((v == init).all(axis=1).sum())
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    norm = np.concatenate(norms) if norms else np.empty(0, np.float32)
    freq = np.concatenate(freqs) if freqs else np.empty(0, np.int64)
    version = np.concatenate(versions) if versions else np.empty(0, np.int64)
    return TableStats(
        name=view.name, tag=view.tag, dim=view.dim, rows=int(norm.shape[0]),
        nonfinite_rows=nonfinite, nan_values=nan_v, inf_values=inf_v,
        nonfinite_slot_rows=slot_bad, never_updated=fresh if initial is not None else None,
        zero_rows=zero, norm=_summary(norm), freq=_summary(freq), version=_summary(version),
        histograms={"norm": histogram(norm, bins), "freq": histogram(freq, bins, True),
                    "version": histogram(version, bins, True)},
        total_rows=view.rows, sampled=sample is not None,
    )
