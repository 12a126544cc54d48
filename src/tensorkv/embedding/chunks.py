"""Exported rows of a table (:class:`ExportChunk`) and the checks every import applies.

Checkpoints store these rows as table blocks (docs/format.md, "Table blocks").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from tensorkv.errors import ShapeError
from tensorkv.kernels import arena as ak


class ExportChunk(NamedTuple):
    """Rows exported from a table (see :meth:`EmbeddingTable.export`)."""

    keys: np.ndarray  #: int64 [m]
    values: np.ndarray  #: [m, dim] in the storage dtype (float32, float16 or bfloat16)
    slots: np.ndarray  #: float32 [m, num_slots * dim]
    freq: np.ndarray  #: int64 [m]
    version: np.ndarray  #: int64 [m], last-update step
    seq: np.ndarray  #: int64 [m], mutation sequence of the row's last change


class ChunkArrays(NamedTuple):
    """An imported chunk, checked: arrays ready to be written into a table's rows."""

    keys: np.ndarray  #: int64 [m]
    values: np.ndarray  #: [m, dim], the table's storage dtype or float32
    slots: np.ndarray  #: float32 [m, slot_width]
    freq: np.ndarray  #: int64 [m]
    version: np.ndarray  #: int64 [m]


def is_single_chunk(chunks: Any) -> bool:
    """Whether ``chunks`` is one chunk tuple rather than an iterable of chunks."""
    return isinstance(chunks, tuple) and len(chunks) >= 5 and isinstance(chunks[0], np.ndarray)


def check_chunk(
    chunk: Any,
    *,
    dim: int,
    slot_width: int,
    storage_dtype: np.dtype,
    optimizer: str,
    as_keys: Callable[[Any], np.ndarray],
    what: str = "import_",
) -> ChunkArrays:
    """Check an imported chunk against a table and return its arrays.

    Parameters
    ----------
    chunk
        An :class:`ExportChunk` or a tuple ``(keys, values, slots, freq, version[, seq])``.
    dim, slot_width, storage_dtype, optimizer
        The table's row width, slot columns, value storage dtype and optimizer name.
    as_keys
        The table's key normalisation (str/bytes keys are hashed).
    what
        The operation, for messages.

    Returns
    -------
    ChunkArrays
        Values in the storage dtype stay as they are (copied bit for bit); other float
        values are returned as float32 (rounded to the storage dtype when written).

    Raises
    ------
    ShapeError
        A chunk that does not fit the table; nothing has been written then.
    """
    try:
        keys, values, slots, freq, version = tuple(chunk)[:5]
    except (TypeError, ValueError):
        raise ShapeError(
            f"{what} got {type(chunk).__name__}; give ExportChunk objects or tuples "
            "(keys, values, slots, freq, version)"
        ) from None
    keys = as_keys(keys)
    m = keys.shape[0]
    values = np.asarray(values)
    if values.ndim != 2 or values.shape[1] != dim or (
            values.dtype.kind != "f" and values.dtype != storage_dtype):
        got = values.shape[-1] if values.ndim else "?"
        raise ShapeError(
            f"imported values have shape {values.shape} and dtype {values.dtype} (dim {got}) "
            f"but the table stores float rows of dim={dim}; import into a table with "
            f"dim={got}"
        )
    if values.dtype != storage_dtype:
        values = values.astype(np.float32, copy=False)
    slots = np.asarray(slots)
    if slots.size == 0 and slot_width == 0:
        slots = np.zeros((m, 0), np.float32)
    if slots.shape != (m, slot_width) or slots.dtype.kind != "f":
        raise ShapeError(
            f"imported slots have shape {slots.shape} ({slots.dtype}) but this table's "
            f"optimizer {optimizer!r} needs float32 ({m}, {slot_width}); import with the "
            "same optimizer"
        )
    freq = np.asarray(freq).reshape(-1)
    version = np.asarray(version).reshape(-1)
    if values.shape[0] != m or freq.shape[0] != m or version.shape[0] != m:
        raise ShapeError(
            f"imported chunk has {m} keys but {values.shape[0]} value rows, "
            f"{freq.shape[0]} freq and {version.shape[0]} version entries"
        )
    return ChunkArrays(keys, np.ascontiguousarray(values),
                       np.ascontiguousarray(slots, dtype=np.float32),
                       freq.astype(np.int64, copy=False), version.astype(np.int64, copy=False))


def nonfinite_rows(values: np.ndarray, slots: np.ndarray | None = None,
                   storage_dtype: np.dtype | None = None) -> np.ndarray:
    """``bool[n]``: the rows of ``values`` (or ``slots``) holding a NaN or an Inf.

    ``values`` is ``[n, dim]`` of any float dtype; with a 16-bit ``storage_dtype`` other than
    its own, values that round to Inf in it (beyond float16's range) count as well. One
    kernel pass per array (the gradient check of ``apply_gradients``), no per-row Python.
    """
    with np.errstate(over="ignore", invalid="ignore"):  # what overflows is what we look for
        f32 = np.ascontiguousarray(values, dtype=np.float32)
        bad = ak.nonfinite_positions(f32)
        if storage_dtype is not None and storage_dtype.itemsize == 2 and \
                values.dtype != storage_dtype:
            bad |= ak.nonfinite_positions(f32.astype(storage_dtype).astype(np.float32))
    if slots is not None and slots.size:
        bad |= ak.nonfinite_positions(np.ascontiguousarray(slots, dtype=np.float32))
    return bad


#: ``place(keys, fields)`` of :meth:`EmbeddingTable.export_into`: given a chunk's keys and the
#: ``(dtype, row shape)`` of keys, values, slots, freq and version, the groups ``(index, outs)``
#: to fill.
Place = Callable[
    [np.ndarray, tuple[tuple[np.dtype, tuple[int, ...]], ...]],
    Sequence[tuple[np.ndarray, Sequence[np.ndarray]]],
]


def place_chunks(place: Place, chunks: Iterable[Any]) -> Iterator[int]:
    """``export_into`` over exported chunks: each chunk's rows copied with ``np.take``."""
    for ch in chunks:
        arrays = [np.asarray(x) for x in tuple(ch)[:5]]
        if arrays[0].shape[0] == 0:
            continue
        specs = tuple((x.dtype, tuple(x.shape[1:])) for x in arrays)
        for idx, outs in place(arrays[0], specs):
            for src, out in zip(arrays, outs, strict=True):
                np.take(src, idx, axis=0, out=out)
        yield int(arrays[0].shape[0])


def gather_into(place: Place, keys: np.ndarray, a: Any, rows: np.ndarray) -> int:
    """Rows ``rows`` of host arena ``a`` (whose keys are ``keys``) gathered into ``place``.

    One chunk of ``export_into``: ``place(keys, fields)`` hands out the buffers, which get
    the keys, values, slots, freq and version of the rows; returns the chunk's row count.
    """
    fields = ((keys.dtype, ()), (a.np_dtype, (a.dim,)), (np.dtype(np.float32), (a.slot_width,)),
              (a.freq.dtype, ()), (a.version.dtype, ()))
    for idx, outs in place(keys, fields):
        r = rows[idx]
        np.take(keys, idx, out=outs[0])
        if r.size and a.dim:
            ak.gather_rows(a.values, r, outs[1].view(a.values.dtype))
        if r.size and a.slot_width:
            ak.gather_rows(a.slots, r, outs[2])
        np.take(a.freq, r, out=outs[3])
        np.take(a.version, r, out=outs[4])
    return int(rows.size)


__all__ = ["ChunkArrays", "ExportChunk", "Place", "check_chunk", "gather_into",
           "is_single_chunk", "nonfinite_rows", "place_chunks"]
