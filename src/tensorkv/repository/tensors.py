"""Content-addressed tensors: ids, row chunks, placement over providers, sliced reads.

A tensor's bytes are cut along axis 0 into chunks of whole rows (about ``chunk_bytes``
each). One pass over the bytes computes each chunk's xxh3-128 digest; the tensor's id is the
xxh3-128 of its dtype, shape, rows per chunk and those digests (a two-level hash tree), and
each chunk's checksum is its xxh3-64 (the low half of its xxh3-128 digest for chunks over
240 bytes, so the pass yields it too). Chunk ``i`` is stored as its raw bytes under
``repo/t/<id>/<i>``, written straight from the tensor's memory; its dtype, shape and checksum
live in the manifest entry (``sums``). Entries without ``sums`` come from earlier versions,
whose chunks are tensor records (:mod:`tensorkv.codec`: header, shape, checksum). A read of
``tensor[a:b]`` fetches only the chunks that hold rows ``a..b``. Every chunk of a tensor lives
on one provider, chosen by rendezvous hashing of the id over the providers' ids.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import xxhash

from tensorkv.codec import BFLOAT16, decode
from tensorkv.errors import BadIndexError, CorruptRecordError

#: Default size of a chunk of rows in bytes (4 MiB).
DEFAULT_CHUNK_BYTES = 4 << 20
PREFIX = b"repo/"
DATA = PREFIX + b"t/"
#: Domain tag of tensor ids (the version of how they are derived).
ID_TAG = "tensorkv.tensor/2"
#: Above this many bytes the low half of xxh3-128 is xxh3-64 (same accumulators, same merge).
_LOW_HALF_IS_XXH3_64 = 240
_MASK64 = (1 << 64) - 1
_DTYPE_NAMES: dict[np.dtype, str] = {}


def stage(arr: np.ndarray, torch_dtype: str | None,
          chunk_bytes: int) -> tuple[dict[str, Any], memoryview]:
    """Manifest entry of a C-contiguous array, and its bytes, from one pass over them.

    The entry holds the id, dtype, shape, bytes, rows per chunk, chunk count and each
    chunk's xxh3-64 checksum (hex); the bytes are a view of the array's memory, not a copy.
    """
    shape = arr.shape
    dname = dtype_name(arr.dtype)
    nbytes = int(arr.nbytes)
    rows = rows_per_chunk(shape, arr.dtype.itemsize, chunk_bytes)
    n = n_chunks(shape, rows)
    flat = arr.reshape(-1).view(np.uint8).data if nbytes else memoryview(b"")
    step = rows * (nbytes // shape[0]) if n > 1 else nbytes
    h = xxhash.xxh3_128(f"{ID_TAG}|{dname}|{','.join(map(str, shape))}|{rows}|".encode())
    sums = []
    for i in range(n):
        part = flat[i * step:(i + 1) * step] if n > 1 else flat
        d = xxhash.xxh3_128_intdigest(part)
        h.update(d.to_bytes(16, "big"))
        s = d & _MASK64 if part.nbytes > _LOW_HALF_IS_XXH3_64 else xxhash.xxh3_64_intdigest(part)
        sums.append(f"{s:016x}")
    entry = {"id": h.hexdigest(), "dtype": dname, "torch_dtype": torch_dtype,
             "shape": list(shape), "nbytes": nbytes, "rows": rows, "chunks": n, "sums": sums}
    return entry, flat


def describe(arr: np.ndarray, torch_dtype: str | None, chunk_bytes: int) -> dict[str, Any]:
    """Manifest entry of a tensor (see :func:`stage`)."""
    return stage(arr, torch_dtype, chunk_bytes)[0]


def dtype_name(dt: np.dtype) -> str:
    """The dtype's name as manifests write it (``bfloat16`` for ml_dtypes' bfloat16)."""
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = "bfloat16" if dt == BFLOAT16 else str(dt)
    return name


def dtype_of(name: str) -> np.dtype:
    """Inverse of :func:`dtype_name`."""
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def rows_per_chunk(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> int:
    """Rows of axis 0 in one chunk (0 for a 0-d tensor: one chunk holds it whole)."""
    if not shape:
        return 0
    row = itemsize * math.prod(shape[1:])
    return max(1, chunk_bytes // max(row, 1))


def n_chunks(shape: tuple[int, ...], rows: int) -> int:
    """Number of chunks of a tensor cut ``rows`` rows at a time."""
    if not shape or rows == 0 or shape[0] == 0:
        return 1
    return -(-shape[0] // rows)


def chunk_key(tid: str, i: int) -> bytes:
    """Store key of chunk ``i`` of tensor ``tid``."""
    return DATA + f"{tid}/{i}".encode()


def chunk_keys(entry: dict[str, Any], idx: range | None = None) -> list[bytes]:
    """Keys of the chunks ``idx`` (default: all) of a manifest entry."""
    return [chunk_key(entry["id"], i) for i in (idx or range(entry["chunks"]))]


def chunk_values(flat: memoryview, entry: dict[str, Any]) -> list[tuple[bytes, memoryview]]:
    """(key, bytes) of each chunk of a tensor staged by :func:`stage`, views of its memory."""
    n = entry["chunks"]
    if n == 1:
        return [(chunk_key(entry["id"], 0), flat)]
    step = entry["rows"] * (entry["nbytes"] // entry["shape"][0])
    tid = entry["id"]
    return [(chunk_key(tid, i), flat[i * step:(i + 1) * step]) for i in range(n)]


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


def _chunk_shape(entry: dict[str, Any], i: int) -> tuple[int, ...]:
    """Shape of chunk ``i`` of a tensor."""
    shape = tuple(entry["shape"])
    if entry["chunks"] == 1 or not shape:
        return shape
    rows = entry["rows"]
    return (min(rows, shape[0] - i * rows), *shape[1:])


def chunk_array(entry: dict[str, Any], i: int, buf: Any, key: bytes, name: str,
                verify: bool = True) -> np.ndarray:
    """Chunk ``i`` of a tensor as a read-only array viewing ``buf``, checked and verified.

    Raises :class:`CorruptRecordError` naming the key when the chunk's size, shape or dtype
    disagrees with the manifest, or (``verify``) its checksum fails.
    """
    dtype = dtype_of(entry["dtype"])
    want = _chunk_shape(entry, i)
    sums = entry.get("sums")
    if sums is None:  # a tensor record (header, shape, checksum) of an earlier version
        a = decode(buf, key, verify=verify)
        if a.shape != want or a.dtype != dtype:
            raise CorruptRecordError(
                f"tensor {name!r}: chunk {key.decode()} holds {a.dtype}{a.shape}, the manifest "
                f"says {dtype}{want}"
            )
        return a
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    count = int(np.prod(want, dtype=np.int64))
    if mv.nbytes != count * dtype.itemsize:
        raise CorruptRecordError(
            f"tensor {name!r}: chunk {key.decode()} holds {mv.nbytes} bytes, the manifest says "
            f"{dtype}{want} ({count * dtype.itemsize} bytes); the data is damaged"
        )
    if verify and xxhash.xxh3_64_intdigest(mv) != int(sums[i], 16):
        raise CorruptRecordError(f"tensor {name!r}: chunk {key.decode()} fails its checksum; "
                                 "the data is corrupted")
    a = np.frombuffer(mv, dtype=dtype, count=count).reshape(want)
    if a.flags.writeable:
        a.flags.writeable = False
    return a


def place(entry: dict[str, Any], idx: range, i: int, buf: Any, key: bytes, out: np.ndarray,
          name: str, verify: bool = True) -> None:
    """Copy chunk ``i`` (checked, verified) into its rows of ``out`` (the rows of ``idx``)."""
    a = chunk_array(entry, i, buf, key, name, verify)
    if entry["chunks"] == 1 or not entry["shape"]:
        np.copyto(out, a)
    else:
        lo = (i - idx.start) * entry["rows"]
        np.copyto(out[lo:lo + a.shape[0]], a)


def view_of(entry: dict[str, Any], idx: range, i: int, buf: Any, key: bytes, name: str,
            verify: bool = True) -> np.ndarray:
    """Chunk ``i`` as a read-only array viewing ``buf`` (the only chunk of ``idx``)."""
    return chunk_array(entry, i, buf, key, name, verify)


def as_torch(arr: np.ndarray, torch_dtype: str) -> Any:
    """A torch tensor sharing the memory of ``arr`` (a new, writable array we own)."""
    import torch

    if arr.dtype == BFLOAT16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    t = torch.from_numpy(arr)
    if str(t.dtype).replace("torch.", "") != torch_dtype:
        t = t.to(getattr(torch, torch_dtype))
    return t
