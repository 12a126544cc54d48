"""What changed between two tags: variables added, removed and changed; table keys and rows.

Dense tensors compare by their chunk digests first (equal digests: unchanged, nothing read).
Tables are joined on their keys one hash range at a time: both tags' rows of a range of the
key hash (the order blocks are stored in) are read, sorted and matched with whole-array
operations, so memory holds one range of each tag, never a whole table. A row is *changed*
when any of its value, optimizer slots, frequency or version differs (bitwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorkv.checkpoint.tables import Rows
from tensorkv.viewer.catalog import Catalog
from tensorkv.viewer.rows import TableView, concat_rows, copy_rows, row_bytes

#: Bytes of rows per tag held at once by a table diff (one hash range of each tag).
RANGE_BYTES = 256 * 1024 * 1024


@dataclass
class RowChange:
    """One changed row: how far its value moved and its metadata at both tags."""

    key: int
    delta: float  # L2 norm of value_b - value_a
    norm_a: float
    norm_b: float
    freq_a: int
    freq_b: int
    version_a: int
    version_b: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return dict(self.__dict__)


@dataclass
class TableDiff:
    """Keys and rows of one table that differ between two tags.

    ``added_keys``/``removed_keys`` hold up to ``sample`` keys each (the smallest); ``largest``
    the ``top`` rows whose value moved most.
    """

    name: str
    rows_a: int
    rows_b: int
    added: int
    removed: int
    changed: int
    unchanged: int
    added_keys: list[int] = field(default_factory=list)
    removed_keys: list[int] = field(default_factory=list)
    largest: list[RowChange] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        d = dict(self.__dict__)
        d["largest"] = [c.as_dict() for c in self.largest]
        return d


@dataclass
class DenseDiff:
    """One dense tensor at two tags."""

    name: str
    shape_a: list[int]
    shape_b: list[int]
    dtype_a: str
    dtype_b: str
    changed: bool
    changed_elements: int | None = None  # None: shapes or dtypes differ
    max_abs_diff: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return dict(self.__dict__)


@dataclass
class TagDiff:
    """Two tags compared.

    Attributes
    ----------
    tag_a, tag_b
        The tags (``a`` is the older side of the comparison as given).
    added, removed, changed, unchanged
        Variable names in each state (added: in ``b`` only).
    tables, dense
        Details of each variable present in both tags.
    """

    tag_a: str
    tag_b: str
    added: list[str]
    removed: list[str]
    changed: list[str]
    unchanged: list[str]
    tables: dict[str, TableDiff]
    dense: dict[str, DenseDiff]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        d = {k: getattr(self, k) for k in ("tag_a", "tag_b", "added", "removed", "changed",
                                           "unchanged")}
        d["tables"] = {n: t.as_dict() for n, t in self.tables.items()}
        d["dense"] = {n: t.as_dict() for n, t in self.dense.items()}
        return d


def hash_ranges(n: int) -> list[tuple[int, int]]:
    """``n`` inclusive ranges that split the 64-bit hash space evenly."""
    bounds = [-(-(i << 64) // n) for i in range(n + 1)]  # ceil(i * 2**64 / n)
    return [(bounds[i], bounds[i + 1] - 1) for i in range(n) if bounds[i + 1] > bounds[i]]


def _rows_in(view: TableView, rng: tuple[int, int]) -> Rows:
    got = [copy_rows(ch.rows) for ch in view.chunks(hash_range=rng)]
    rows = concat_rows(got, view.empty())
    order = np.argsort(rows.keys, kind="stable")
    return Rows(*(a[order] for a in rows))


def _bits(a: np.ndarray) -> np.ndarray:
    """Rows of ``a`` as unsigned integers of the same width (bitwise comparison, NaN-safe)."""
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.kind == "f" else a


def diff_table(a: TableView, b: TableView, *, top: int = 10, sample: int = 10) -> TableDiff:
    """Compare one table at two tags (see the module docstring)."""
    nbytes = max(a.rows * row_bytes(a.entry), b.rows * row_bytes(b.entry))
    ranges = hash_ranges(max(1, math.ceil(nbytes / RANGE_BYTES)))
    out = TableDiff(a.name, a.rows, b.rows, 0, 0, 0, 0)
    added_k: list[np.ndarray] = []
    removed_k: list[np.ndarray] = []
    best: list[tuple[np.ndarray, ...]] = []
    same_shape = a.dim == b.dim and a.slot_columns == b.slot_columns
    for rng in ranges:
        ra, rb = _rows_in(a, rng), _rows_in(b, rng)
        common, ia, ib = np.intersect1d(ra.keys, rb.keys, assume_unique=True,
                                        return_indices=True)
        only_b = np.setdiff1d(rb.keys, common, assume_unique=True)
        only_a = np.setdiff1d(ra.keys, common, assume_unique=True)
        out.added += len(only_b)
        out.removed += len(only_a)
        added_k.append(only_b[:sample])
        removed_k.append(only_a[:sample])
        if not len(common):
            continue
        va, vb = ra.values[ia], rb.values[ib]
        if same_shape and va.dtype == vb.dtype:
            diff = ((_bits(va) != _bits(vb)).any(axis=1)
                    | (_bits(ra.slots[ia]) != _bits(rb.slots[ib])).any(axis=1)
                    | (ra.freq[ia] != rb.freq[ib]) | (ra.version[ia] != rb.version[ib]))
        else:
            diff = np.ones(len(common), bool)
        out.changed += int(diff.sum())
        out.unchanged += int(len(common) - diff.sum())
        idx = np.flatnonzero(diff)
        if not len(idx) or a.dim != b.dim:
            continue
        d = vb[idx].astype(np.float64) - va[idx].astype(np.float64)
        delta = np.sqrt(np.einsum("ij,ij->i", d, d))
        if len(idx) > top:
            keep = np.argpartition(-np.nan_to_num(delta, nan=np.inf), top - 1)[:top]
            idx, delta = idx[keep], delta[keep]
        best.append((common[idx], delta, va[idx], vb[idx], ra.freq[ia[idx]], rb.freq[ib[idx]],
                     ra.version[ia[idx]], rb.version[ib[idx]]))
    out.added_keys = [int(k) for k in np.sort(np.concatenate(added_k))[:sample]] if added_k else []
    out.removed_keys = ([int(k) for k in np.sort(np.concatenate(removed_k))[:sample]]
                        if removed_k else [])
    if best:
        cols = [np.concatenate(c) for c in zip(*best, strict=True)]
        order = np.lexsort((cols[0], -np.nan_to_num(cols[1], nan=np.inf)))[:top]
        na = np.linalg.norm(cols[2].astype(np.float64), axis=1)
        nb = np.linalg.norm(cols[3].astype(np.float64), axis=1)
        out.largest = [RowChange(int(cols[0][i]), float(cols[1][i]), float(na[i]), float(nb[i]),
                                 int(cols[4][i]), int(cols[5][i]), int(cols[6][i]),
                                 int(cols[7][i])) for i in order]
    return out


def diff_dense(cat: Catalog, name: str, tag_a: str, tag_b: str) -> DenseDiff:
    """Compare one dense tensor at two tags (equal chunk digests: nothing is read)."""
    ea = cat.manifest(tag_a)["dense"][name]
    eb = cat.manifest(tag_b)["dense"][name]
    out = DenseDiff(name, list(ea["shape"]), list(eb["shape"]), ea["dtype"], eb["dtype"], True)
    if out.shape_a != out.shape_b or out.dtype_a != out.dtype_b:
        return out
    if ea["chunks"] == eb["chunks"] and ea.get("chunk_bytes") == eb.get("chunk_bytes"):
        out.changed, out.changed_elements, out.max_abs_diff = False, 0, 0.0
        return out
    xa = cat.dense(name, tag_a)
    xb = cat.dense(name, tag_b)
    ne = _bits(xa.reshape(-1)) != _bits(xb.reshape(-1))
    out.changed_elements = int(ne.sum())
    out.changed = out.changed_elements > 0
    if xa.dtype.kind in "fiub" and xa.size:
        with np.errstate(invalid="ignore"):
            out.max_abs_diff = float(np.nanmax(np.abs(xb.astype(np.float64)
                                                      - xa.astype(np.float64))))
    return out


def diff_tags(cat: Catalog, tag_a: str | None, tag_b: str | None, *,
              variables: list[str] | None = None, top: int = 10, sample: int = 10) -> TagDiff:
    """Compare two tags of a catalog (optionally only some variables).

    Raises
    ------
    TagNotFoundError, VariableNotFoundError
        A tag, or a variable named in ``variables`` that neither tag holds.
    """
    da, db = cat.manifest(tag_a), cat.manifest(tag_b)
    names_a = set(da["dense"]) | set(da["tables"])
    names_b = set(db["dense"]) | set(db["tables"])
    if variables is not None:
        for v in variables:
            if v not in names_a and v not in names_b:
                cat.variable(v, db["tag"])  # raises, listing what exists
        names_a &= set(variables)
        names_b &= set(variables)
    out = TagDiff(da["tag"], db["tag"], sorted(names_b - names_a), sorted(names_a - names_b),
                  [], [], {}, {})
    for n in sorted(names_a & names_b):
        if n in da["tables"] and n in db["tables"]:
            td = diff_table(cat.table(n, da["tag"]), cat.table(n, db["tag"]), top=top,
                            sample=sample)
            out.tables[n] = td
            moved = td.added or td.removed or td.changed
        elif n in da["dense"] and n in db["dense"]:
            dd = diff_dense(cat, n, da["tag"], db["tag"])
            out.dense[n] = dd
            moved = dd.changed
        else:  # a table at one tag, a dense tensor at the other
            moved = True
        (out.changed if moved else out.unchanged).append(n)
    return out
