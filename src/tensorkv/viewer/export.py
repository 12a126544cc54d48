"""A variable of a tag written to a file: ``.npz``, ``.safetensors``, ``.parquet`` or ``.csv``.

A table becomes five columns, ``keys`` (int64), ``values`` ``[rows, dim]``, ``slots``
``[rows, slot columns]`` (float32), ``freq`` and ``version`` (int64), in scan order; a dense
tensor one array named after it. Tables stream: their rows are written chunk by chunk (for
``.npz`` and ``.safetensors`` into temporary column files next to the target, then joined
behind the header), so a table larger than memory exports. The file appears complete or not
at all (written as ``FILE.partial``, then renamed). ``.parquet`` needs pyarrow
(``pip install "tensorkv[viewer]"``); ``.safetensors`` is written by this module (the format
is a JSON header and raw little-endian bytes) and read by any safetensors reader.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from tensorkv.checkpoint.progress import bar
from tensorkv.checkpoint.tables import FIELDS, Rows, take
from tensorkv.errors import QueryError, import_optional
from tensorkv.viewer.catalog import Catalog, VariableInfo
from tensorkv.viewer.rows import TableView, row_bytes
from tensorkv.viewer.where import Predicate, parse_predicate

FORMATS = ("npz", "safetensors", "parquet", "csv")
_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
              "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
              "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL"}


@dataclass
class ExportResult:
    """What :func:`export_variable` wrote."""

    path: str
    format: str
    kind: str
    rows: int
    nbytes: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return dict(self.__dict__)


def format_of(path: str, fmt: str | None = None) -> str:
    """The export format: ``fmt``, else the file's extension.

    Raises
    ------
    QueryError
        Neither names one of :data:`FORMATS`.
    """
    f = (fmt or os.path.splitext(path)[1].lstrip(".")).lower()
    if f not in FORMATS:
        raise QueryError(f"cannot export to {path!r}: format {f or '(none)'!r} is not one of "
                         f"{', '.join('.' + x for x in FORMATS)}; name the file so or pass the "
                         "format")
    return f


def export_variable(cat: Catalog, name: str, path: str, *, tag: str | None = None,
                    fmt: str | None = None, where: str | Predicate | None = None,
                    progress: bool | None = None) -> ExportResult:
    """Write variable ``name`` of ``tag`` to ``path`` (format from ``fmt`` or the extension).

    Parameters
    ----------
    where
        Tables only: export only the rows satisfying this predicate.
    progress
        Progress bar on stderr: None (auto: on a terminal, after a moment), True, False.
    """
    f = format_of(path, fmt)
    info = cat.variable(name, tag)
    pred = parse_predicate(where) if isinstance(where, str) else where
    if pred is not None and info.kind != "table":
        raise QueryError(f"--where filters table rows; {name!r} is a dense tensor")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise QueryError(f"cannot export to {path!r}: directory {d!r} does not exist")
    part = path + ".partial"
    try:
        if info.kind == "dense":
            arr = _read_dense(cat, info, cat.resolve(tag), progress)
            _write_dense(arr, name, part, f)
            rows, nbytes = (int(arr.shape[0]) if arr.ndim else 1), int(arr.nbytes)
        else:
            view = cat.table(name, tag)
            rows, nbytes = _write_table(view, part, f, pred, progress)
        os.replace(part, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(part)
        raise
    return ExportResult(path, f, info.kind, rows, nbytes)


# ------------------------------------------------------------------ dense
#: Bytes of a dense tensor read at a time (rows of axis 0) while its progress bar counts.
DENSE_READ_BYTES = 64 << 20


def _read_dense(cat: Catalog, info: VariableInfo, tag: str, progress: bool | None) -> np.ndarray:
    """A whole dense tensor, read :data:`DENSE_READ_BYTES` of axis 0 at a time under a bar."""
    shape = info.shape
    pbar = bar(info.nbytes, f"export {info.name}", progress)
    try:
        if not shape or shape[0] == 0:
            arr = cat.dense(info.name, tag)
            pbar.update(arr.nbytes)
            return arr
        step = max(1, DENSE_READ_BYTES // max(1, info.nbytes // shape[0]))
        out: np.ndarray | None = None
        for lo in range(0, shape[0], step):  # one read per group of rows
            part = cat.dense(info.name, tag, (slice(lo, lo + step),))
            if out is None:
                out = np.empty(shape, part.dtype)
            out[lo:lo + len(part)] = part
            pbar.update(part.nbytes)
        assert out is not None
        return out
    finally:
        pbar.close()


def _write_dense(arr: np.ndarray, name: str, path: str, f: str) -> None:
    if f == "npz":
        savez: Any = np.savez  # numpy's stub types **kwds as the options
        with open(path, "wb") as fh:
            savez(fh, **{name: arr})
    elif f == "safetensors":
        cols = {name: arr}
        with open(path, "wb") as fh:
            _safetensors_header(fh, {name: (arr.dtype, arr.shape, arr.nbytes)},
                                {"variable": name})
            fh.write(np.ascontiguousarray(cols[name]).tobytes())
    elif f == "parquet":
        pa = import_optional("pyarrow", "export to .parquet", "viewer")
        pq = import_optional("pyarrow.parquet", "export to .parquet", "viewer")
        a2 = arr.reshape(arr.shape[0] if arr.ndim else 1, -1)
        pq.write_table(pa.table({name: _list_column(pa, a2)}), path)
    else:
        a2 = arr.reshape(arr.shape[0] if arr.ndim else 1, -1)
        fmt = "%d" if a2.dtype.kind in "iub" else "%.9g"
        with open(path, "w") as fh:
            fh.write(",".join(f"{name}_{i}" for i in range(a2.shape[1])) + "\n")
            np.savetxt(fh, a2, fmt=fmt, delimiter=",")


# ------------------------------------------------------------------ tables
def _chunks(view: TableView, pred: Predicate | None, progress: bool | None) -> Iterator[Rows]:
    pbar = bar(view.rows * row_bytes(view.entry), f"export {view.name}", progress)
    it = view.chunks()
    try:
        for ch in it:
            rows = ch.rows
            pbar.update(len(rows.keys) * row_bytes(view.entry))
            if pred is not None:
                rows = take(rows, pred(rows))
            if len(rows.keys):
                yield rows
    finally:
        it.close()
        pbar.close()


def _write_table(view: TableView, path: str, f: str, pred: Predicate | None,
                 progress: bool | None) -> tuple[int, int]:
    if f in ("npz", "safetensors"):
        return _write_columns(view, path, f, pred, progress)
    if f == "parquet":
        return _write_parquet(view, path, pred, progress)
    return _write_csv(view, path, pred, progress)


def _write_columns(view: TableView, path: str, f: str, pred: Predicate | None,
                   progress: bool | None) -> tuple[int, int]:
    """Stream each column into a temporary file, then join them behind the header."""
    empty = view.empty()
    n = 0
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(path)),
                                     prefix=".tensorkv-export-") as tmp:
        files = {fl: open(os.path.join(tmp, fl), "w+b") for fl in FIELDS}  # noqa: SIM115
        try:
            for rows in _chunks(view, pred, progress):
                for fl, a in zip(FIELDS, rows, strict=True):
                    files[fl].write(np.ascontiguousarray(a).tobytes())
                n += len(rows.keys)
            specs = {fl: (a.dtype, (n, *a.shape[1:]), n * int(np.prod(a.shape[1:], dtype=int))
                          * a.dtype.itemsize) for fl, a in zip(FIELDS, empty, strict=True)}
            with open(path, "wb") as out:
                if f == "safetensors":
                    _safetensors_header(out, specs, {"table": view.name, "tag": view.tag})
                    for fl in FIELDS:
                        files[fl].seek(0)
                        shutil.copyfileobj(files[fl], out, 16 << 20)
                else:
                    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
                        for fl in FIELDS:
                            dt, shape, _ = specs[fl]
                            with z.open(f"{fl}.npy", "w", force_zip64=True) as member:
                                np.lib.format.write_array_header_2_0(member, {
                                    "descr": np.lib.format.dtype_to_descr(np.dtype(dt)),
                                    "fortran_order": False, "shape": shape})
                                files[fl].seek(0)
                                shutil.copyfileobj(files[fl], member, 16 << 20)
        finally:
            for fh in files.values():
                fh.close()
    return n, sum(s[2] for s in specs.values())


def _safetensors_header(fh: IO[bytes], specs: dict[str, tuple[Any, Any, int]],
                        metadata: dict[str, str]) -> None:
    """Write a safetensors header for tensors stored in ``specs`` order."""
    head: dict[str, Any] = {"__metadata__": metadata}
    off = 0
    for name, (dt, shape, nbytes) in specs.items():
        code = _ST_DTYPES.get(np.dtype(dt).name)
        if code is None:
            raise QueryError(f"safetensors cannot hold {name!r} of dtype {np.dtype(dt)}; "
                             "export to .npz instead")
        head[name] = {"dtype": code, "shape": [int(s) for s in shape],
                      "data_offsets": [off, off + int(nbytes)]}
        off += int(nbytes)
    body = json.dumps(head, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # the data starts 8-aligned
    fh.write(struct.pack("<Q", len(body)) + body)


def _write_parquet(view: TableView, path: str, pred: Predicate | None,
                   progress: bool | None) -> tuple[int, int]:
    pa = import_optional("pyarrow", "export to .parquet", "viewer")
    pq = import_optional("pyarrow.parquet", "export to .parquet", "viewer")

    def table_of(rows: Rows) -> Any:
        cols = {}
        for fl, a in zip(FIELDS, rows, strict=True):
            a = np.ascontiguousarray(a)
            if a.ndim == 2:
                cols[fl] = _list_column(pa, a)
            else:
                cols[fl] = pa.array(a)
        return pa.table(cols)

    n = nbytes = 0
    writer = None
    try:
        for rows in _chunks(view, pred, progress):
            t = table_of(rows)
            if writer is None:
                writer = pq.ParquetWriter(path, t.schema)
            writer.write_table(t)
            n += len(rows.keys)
            nbytes += sum(a.nbytes for a in rows)
        if writer is None:
            pq.write_table(table_of(view.empty()), path)
    finally:
        if writer is not None:
            writer.close()
    return n, nbytes


def _list_column(pa: Any, a: np.ndarray) -> Any:
    """A ``[rows, width]`` array as a parquet column of fixed-size lists (width 0: empty lists).

    bfloat16, which Arrow lacks, is written as float32.
    """
    flat = np.ascontiguousarray(a).reshape(-1)
    if flat.dtype.name == "bfloat16":
        flat = flat.astype(np.float32)
    if a.shape[1] == 0:
        return pa.ListArray.from_arrays(pa.array(np.zeros(a.shape[0] + 1, np.int32)),
                                        pa.array(flat))
    return pa.FixedSizeListArray.from_arrays(pa.array(flat), a.shape[1])


def _write_csv(view: TableView, path: str, pred: Predicate | None,
               progress: bool | None) -> tuple[int, int]:
    cols = ["key", "freq", "version"] + [f"value_{i}" for i in range(view.dim)] + [
        f"slot_{i}" for i in range(view.slot_columns)]
    fmt = ["%d", "%d", "%d"] + ["%.9g"] * (view.dim + view.slot_columns)
    n = nbytes = 0
    with open(path, "w") as fh:
        fh.write(",".join(cols) + "\n")
        for rows in _chunks(view, pred, progress):
            m = len(rows.keys)
            dt = np.dtype([("k", "<i8"), ("f", "<i8"), ("v", "<i8"),
                           ("x", "<f8", (view.dim,)), ("s", "<f8", (view.slot_columns,))])
            rec = np.empty(m, dt)
            rec["k"], rec["f"], rec["v"] = rows.keys, rows.freq, rows.version
            rec["x"] = rows.values
            rec["s"] = rows.slots
            flat = rec.view(np.dtype([(f"c{i}", "<i8" if i < 3 else "<f8")
                                      for i in range(len(cols))]))
            np.savetxt(fh, flat, fmt=",".join(fmt))
            n += m
            nbytes += sum(a.nbytes for a in rows)
    return n, nbytes
