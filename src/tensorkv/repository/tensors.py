"""Content-addressed tensors: ids, row chunks, placement over providers, sliced reads.

A tensor's id is the xxh3-128 of its dtype, shape and bytes. Its data is cut along axis 0
into chunks of whole rows (about ``chunk_bytes`` each); chunk ``i`` is one tensor record
(:mod:`tensorkv.codec`: header, shape, checksum) under ``repo/t/<id>/<i>``. A read of
``tensor[a:b]`` fetches only the chunks that hold rows ``a..b``. Every chunk of a tensor
lives on one provider, chosen by rendezvous hashing of the id over the providers' ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from tensorkv.codec import BFLOAT16, decode, encode_parts
from tensorkv.errors import BadIndexError, CorruptRecordError

#: Default size of a chunk of rows in bytes (4 MiB).
DEFAULT_CHUNK_BYTES = 4 << 20
PREFIX = b"repo/"
DATA = PREFIX + b"t/"


def tensor_id(arr: np.ndarray) -> str:
    """Content id of a C-contiguous array: xxh3-128 of dtype, shape and bytes (32 hex)."""
    h = xxhash.xxh3_128()
    h.update(f"{dtype_name(arr.dtype)}|{','.join(map(str, arr.shape))}|".encode())
    if arr.size:
        h.update(arr.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def dtype_name(dt: np.dtype) -> str:
    """The dtype's name as manifests write it (``bfloat16`` for ml_dtypes' bfloat16)."""
    return "bfloat16" if dt == BFLOAT16 else str(dt)


def dtype_of(name: str) -> np.dtype:
    """Inverse of :func:`dtype_name`."""
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def rows_per_chunk(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> int:
    """Rows of axis 0 in one chunk (0 for a 0-d tensor: one chunk holds it whole)."""
    if not shape:
        return 0
    row = itemsize * int(np.prod(shape[1:], dtype=np.int64))
    return max(1, chunk_bytes // max(row, 1))


def n_chunks(shape: tuple[int, ...], rows: int) -> int:
    """Number of chunks of a tensor cut ``rows`` rows at a time."""
    if not shape or rows == 0 or shape[0] == 0:
        return 1
    return -(-shape[0] // rows)


def describe(arr: np.ndarray, torch_dtype: str | None, chunk_bytes: int) -> dict[str, Any]:
    """Manifest entry of a tensor: id, dtype, shape, bytes, rows per chunk, chunk count."""
    rows = rows_per_chunk(arr.shape, arr.dtype.itemsize, chunk_bytes)
    return {
        "id": tensor_id(arr),
        "dtype": dtype_name(arr.dtype),
        "torch_dtype": torch_dtype,
        "shape": list(arr.shape),
        "nbytes": int(arr.nbytes),
        "rows": rows,
        "chunks": n_chunks(arr.shape, rows),
    }


def chunk_key(tid: str, i: int) -> bytes:
    """Store key of chunk ``i`` of tensor ``tid``."""
    return DATA + f"{tid}/{i}".encode()


def chunk_keys(entry: dict[str, Any], idx: range | None = None) -> list[bytes]:
    """Keys of the chunks ``idx`` (default: all) of a manifest entry."""
    return [chunk_key(entry["id"], i) for i in (idx or range(entry["chunks"]))]


def record_into(head: bytes, payload: memoryview, out: np.ndarray) -> None:
    """Write a record (``head`` then ``payload``) into ``out``; numpy copies, freeing the GIL."""
    out[: len(head)] = np.frombuffer(head, np.uint8)
    if payload.nbytes:
        np.copyto(out[len(head):], np.frombuffer(payload, np.uint8))


def chunk_parts(arr: np.ndarray, entry: dict[str, Any]
                ) -> Iterator[tuple[bytes, bytes, memoryview]]:
    """(key, record header, payload) of each chunk of a tensor, the payload not copied."""
    rows = entry["rows"]
    for i in range(entry["chunks"]):
        part = arr if entry["chunks"] == 1 else arr[i * rows:(i + 1) * rows]
        yield (chunk_key(entry["id"], i), *encode_parts(part))


def encode_chunks(arr: np.ndarray, entry: dict[str, Any]) -> list[tuple[bytes, np.ndarray]]:
    """The (key, record) pairs of a tensor's chunks."""
    return [(k, record_of(h, p)) for k, h, p in chunk_parts(arr, entry)]


def record_of(head: bytes, payload: memoryview) -> np.ndarray:
    """A record (``head`` then ``payload``) as a new uint8 array."""
    out = np.empty(len(head) + payload.nbytes, np.uint8)
    record_into(head, payload, out)
    return out


def rank(tid: str, provider_ids: list[str]) -> list[int]:
    """Providers in rendezvous order for ``tid``: its home first, then the fallbacks."""
    if len(provider_ids) == 1:
        return [0]
    scores = [xxhash.xxh3_64_intdigest(f"{pid}/{tid}".encode()) for pid in provider_ids]
    return sorted(range(len(provider_ids)), key=lambda i: -scores[i])


def chunk_range(entry: dict[str, Any], index: Any) -> tuple[range, int, Any]:
    """Chunks holding the rows ``index`` touches, their first row, and ``index`` from there.

    Raises an ``IndexError`` subclass for a bad index.
    """
    shape = tuple(entry["shape"])
    if index is None or not shape or entry["chunks"] == 1:
        return range(entry["chunks"]), 0, index
    idx = index if isinstance(index, tuple) else (index,)
    first, rest = (idx[0], idx[1:]) if idx else (Ellipsis, ())
    n0, rows = shape[0], entry["rows"]
    if first is Ellipsis or first is None:
        return range(entry["chunks"]), 0, index
    if isinstance(first, (int, np.integer)) and not isinstance(first, bool):
        i = int(first)
        if not -n0 <= i < n0:
            raise BadIndexError(f"index {i} is out of bounds for axis 0 with size {n0}")
        i %= n0
        return range(i // rows, i // rows + 1), (i // rows) * rows, (i - (i // rows) * rows,
                                                                    *rest)
    if isinstance(first, slice):
        r = range(*first.indices(n0))
        if len(r) == 0:
            return range(0), 0, (slice(0, 0), *rest)
        lo, hi = min(r[0], r[-1]), max(r[0], r[-1]) + 1
        c0, c1 = lo // rows, (hi - 1) // rows + 1
        base = c0 * rows
        rel: Any = (slice(r.start - base, r.stop - base, r.step) if r.step > 0
                    else np.asarray(r, dtype=np.int64) - base)
        return range(c0, c1), base, (rel, *rest)
    raise BadIndexError(
        f"index {index!r} is not a basic index; read_tensor takes ints, slices, None and ..."
    )


def out_shape(entry: dict[str, Any], idx: range) -> tuple[int, ...]:
    """Shape of the rows that chunks ``idx`` of a tensor hold."""
    shape = tuple(entry["shape"])
    if not shape or entry["chunks"] == 1:
        return shape
    rows = entry["rows"]
    lo, hi = idx.start * rows, min(idx.stop * rows, shape[0])
    return (max(hi - lo, 0), *shape[1:])


def empty_for(entry: dict[str, Any], idx: range) -> np.ndarray:
    """A new array for the rows that chunks ``idx`` of a tensor hold."""
    return np.empty(out_shape(entry, idx), dtype=dtype_of(entry["dtype"]))


#: Reads of several tensors totalling this many bytes or more share one allocation.
BLOCK_MIN_BYTES = 4 << 20


def empty_many(plans: list[tuple[dict[str, Any], range]]) -> list[np.ndarray]:
    """New arrays for several tensors' rows, carved from one block when they are large.

    One big allocation is mapped in huge pages where the OS offers them, and faults in
    several times faster than many separate ones. The arrays then share that block (it is
    freed when the last of them is).
    """
    shapes = [(out_shape(e, r), dtype_of(e["dtype"])) for e, r in plans]
    sizes = [int(np.prod(sh, dtype=np.int64)) * dt.itemsize for sh, dt in shapes]
    total = sum(-(-n // 64) * 64 for n in sizes)
    if len(plans) < 2 or total < BLOCK_MIN_BYTES:
        return [np.empty(sh, dt) for sh, dt in shapes]
    block = np.empty(total, np.uint8)
    out, pos = [], 0
    for (sh, dt), n in zip(shapes, sizes, strict=True):
        out.append(block[pos:pos + n].view(dt).reshape(sh))
        pos += -(-n // 64) * 64
    return out


def _check(entry: dict[str, Any], idx: range, i: int, a: np.ndarray, key: bytes,
           dtype: np.dtype, name: str) -> int:
    """Check a decoded chunk's shape and dtype against the manifest; return its first row."""
    shape = tuple(entry["shape"])
    if entry["chunks"] == 1 or not shape:
        want: tuple[int, ...] = shape
        lo = 0
    else:
        rows = entry["rows"]
        lo = (i - idx.start) * rows
        want = (min(rows, shape[0] - i * rows), *shape[1:])
    if a.shape != want or a.dtype != dtype:
        raise CorruptRecordError(
            f"tensor {name!r}: chunk {key.decode()} holds {a.dtype}{a.shape}, the manifest "
            f"says {dtype}{want}"
        )
    return lo


def place(entry: dict[str, Any], idx: range, i: int, buf: Any, key: bytes, out: np.ndarray,
          name: str, verify: bool = True) -> None:
    """Decode chunk ``i`` (verifying it) into its rows of ``out`` (the rows of ``idx``)."""
    a = decode(buf, key, verify=verify)
    lo = _check(entry, idx, i, a, key, out.dtype, name)
    if entry["chunks"] == 1 or not entry["shape"]:
        np.copyto(out, a)
    else:
        np.copyto(out[lo:lo + a.shape[0]], a)


def view_of(entry: dict[str, Any], idx: range, i: int, buf: Any, key: bytes, name: str,
            verify: bool = True) -> np.ndarray:
    """Chunk ``i`` decoded as a read-only array viewing ``buf`` (the only chunk of ``idx``)."""
    a = decode(buf, key, verify=verify)
    _check(entry, idx, i, a, key, dtype_of(entry["dtype"]), name)
    return a


def as_torch(arr: np.ndarray, torch_dtype: str) -> Any:
    """A torch tensor sharing the memory of ``arr`` (a new, writable array we own)."""
    import torch

    if arr.dtype == BFLOAT16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    t = torch.from_numpy(arr)
    if str(t.dtype).replace("torch.", "") != torch_dtype:
        t = t.to(getattr(torch, torch_dtype))
    return t
