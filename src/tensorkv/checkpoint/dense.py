"""Dense tensors: conversion from numpy/torch, fixed-size content-addressed chunks, reads.

A tensor's C-order bytes are cut into pieces of ``chunk_bytes`` (the last may be shorter).
Each piece is stored raw under ``ckpt/c/<xxh3-128 hex of the piece>``; the manifest lists the
digests in order. Identical pieces (in any tensor of any tag) are stored once, so a tag that
repeats its parent's tensors writes nothing new for them (see "Dense tensors" in
``docs/format.md``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from tensorkv.checkpoint import layout
from tensorkv.checkpoint.progress import OnBytes
from tensorkv.codec import BFLOAT16, dtype_code
from tensorkv.errors import (
    BadIndexError,
    CheckpointError,
    CodecError,
    CorruptRecordError,
    ShapeError,
)
from tensorkv.pages import FreshPages
from tensorkv.stores.base import KVStore

if TYPE_CHECKING:
    from tensorkv.checkpoint.writer import BlockWriter


def is_torch_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch.Tensor (without importing torch)."""
    t = type(x)
    return t.__module__.startswith("torch") and hasattr(x, "detach") and hasattr(x, "dtype")


def _c_order(arr: np.ndarray) -> np.ndarray:
    # np.ascontiguousarray would turn 0-d arrays into 1-d ones
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def to_numpy(name: str, x: Any) -> tuple[np.ndarray, str | None]:
    """Convert a numpy array or torch tensor to a C-contiguous numpy array.

    Returns
    -------
    (array, torch_dtype)
        ``torch_dtype`` is the torch dtype name (e.g. ``"bfloat16"``) for torch input, else None.
        torch bfloat16 becomes a numpy ``ml_dtypes.bfloat16`` array with the same bits.
    """
    if is_torch_tensor(x):
        import torch

        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_sparse or getattr(t, "is_quantized", False):
            raise CheckpointError(f"tensor {name!r} is sparse or quantized; save t.to_dense()")
        tname = str(t.dtype).replace("torch.", "")
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            arr = t.view(torch.int16).numpy().view(BFLOAT16)
        else:
            try:
                arr = t.numpy()
            except TypeError as exc:
                raise CheckpointError(
                    f"tensor {name!r} has torch dtype {tname}, which cannot be stored: {exc}"
                ) from None
        return _c_order(arr), tname
    if isinstance(x, np.ndarray) or np.isscalar(x):
        arr = _c_order(np.asarray(x))
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        try:
            dtype_code(arr.dtype)
        except CodecError as exc:
            raise CheckpointError(f"variable {name!r}: {exc}") from None
        return arr, None
    raise CheckpointError(
        f"variable {name!r} has type {type(x).__name__}; values must be numpy arrays, torch "
        "tensors or EmbeddingTables"
    )


def to_torch(arr: np.ndarray, torch_dtype: str | None) -> Any:
    """Convert a loaded numpy array back to a torch tensor of ``torch_dtype``."""
    import torch

    if arr.dtype == BFLOAT16:
        return torch.from_numpy(np.array(arr.view(np.int16))).view(torch.bfloat16)
    t = torch.from_numpy(np.array(arr))
    if torch_dtype and str(t.dtype).replace("torch.", "") != torch_dtype:
        t = t.to(getattr(torch, torch_dtype))
    return t


def digest(piece: bytes | memoryview) -> str:
    """Content digest of a chunk: xxh3-128 as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(piece)


def iter_pieces(arr: np.ndarray, chunk_bytes: int) -> Iterator[memoryview]:
    """The tensor's bytes cut into pieces of ``chunk_bytes``."""
    flat = arr.reshape(-1).view(np.uint8).data if arr.size else memoryview(b"")
    for off in range(0, flat.nbytes, chunk_bytes):
        yield flat[off : off + chunk_bytes]


def describe(arr: np.ndarray, torch_dtype: str | None, chunk_bytes: int,
             chunks: list[str] | None = None) -> dict[str, Any]:
    """Manifest entry of one tensor, with the digests of its chunks (computes no I/O).

    ``chunks``: the digests, if computed already.
    """
    if chunks is None:
        chunks = [digest(p) for p in iter_pieces(arr, chunk_bytes)]
    return {
        "dtype": str(arr.dtype) if arr.dtype != BFLOAT16 else "bfloat16",
        "torch_dtype": torch_dtype,
        "shape": list(arr.shape),
        "nbytes": int(arr.nbytes),
        "chunk_bytes": int(chunk_bytes),
        "chunks": chunks,
    }


@dataclass
class DenseSnapshot:
    """A dense tensor as a save's snapshot took it: its entry, and the bytes it may need.

    The digests of every chunk are computed when the snapshot is taken; the chunks the target
    store is not known to hold (:func:`stored_digests`) are copied then, the others are read
    from the live tensor only if the store turns out to lack them, and written only if their
    digest still matches (:func:`write_tensors`).

    Attributes
    ----------
    arr
        The tensor's numpy array: the caller's (``owned`` False) or a private copy.
    entry
        Its manifest entry (:func:`describe`).
    copies
        Chunk index -> private copy of the chunk's bytes (chunks not known stored).
    owned
        Whether ``arr`` belongs to the save (converted or copied), so nothing changes it.
    """

    arr: np.ndarray
    entry: dict[str, Any]
    copies: dict[int, np.ndarray]
    owned: bool

    @property
    def nbytes(self) -> int:
        """Bytes the snapshot holds (the private copies)."""
        if self.owned:
            return int(self.arr.nbytes)
        return int(sum(c.nbytes for c in self.copies.values()))


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(2, thread_name_prefix="tensorkv-ckpt-hash")
        return _pool


def _forget_pool_after_fork() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def start_digests(arr: np.ndarray, chunk_bytes: int) -> list[Future[str]]:
    """The chunk digests of ``arr``, computed on two helper threads (xxhash frees the GIL)."""
    pool = _hash_pool()
    return [pool.submit(digest, p) for p in iter_pieces(arr, chunk_bytes)]


def snapshot_tensor(arr: np.ndarray, torch_dtype: str | None, chunk_bytes: int, owned: bool,
                    stored: set[str], digests: list[Future[str]] | None = None
                    ) -> DenseSnapshot:
    """Describe ``arr`` and copy the chunks of it that ``stored`` lacks (unless ``owned``).

    ``digests``: its chunk digests started by :func:`start_digests` (else computed here).
    """
    entry = describe(arr, torch_dtype, chunk_bytes, None if digests is None else
                     [f.result() for f in digests])
    copies: dict[int, np.ndarray] = {}
    if not owned:
        flat = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
        for i, d in enumerate(entry["chunks"]):
            if d not in stored:
                copies[i] = flat[i * chunk_bytes:(i + 1) * chunk_bytes].copy()
    return DenseSnapshot(arr, entry, copies, owned)


_STORED: dict[str, set[str]] = {}
_STORED_LOCK = threading.Lock()
STORED_MAX = 1 << 20  # digests remembered over all stores before the memory is cleared


def stored_digests(where: str) -> set[str]:
    """Digests of dense chunks the last save of this process into ``where`` found stored."""
    with _STORED_LOCK:
        return set(_STORED.get(where, ()))


def remember_stored(where: str, digests: set[str]) -> None:
    """Remember ``digests`` as what store ``where`` holds (what its saves found and wrote)."""
    with _STORED_LOCK:
        if sum(len(s) for s in _STORED.values()) + len(digests) > STORED_MAX:
            _STORED.clear()
        _STORED[where] = set(digests)


def write_tensors(
    w: BlockWriter,
    snaps: dict[str, DenseSnapshot],
    known: set[str],
    on_bytes: OnBytes | None = None,
) -> int:
    """Queue the chunks of each tensor whose digest is not in ``known``; return their bytes.

    ``w`` is a :class:`tensorkv.checkpoint.writer.BlockWriter`: the chunks are written on
    its thread while the caller goes on, and are in the store once ``w.flush()`` returns.
    A chunk comes from the snapshot's copy, or its owned array; else from the live tensor,
    whose bytes must still have the digest taken at the snapshot. ``on_bytes`` is told at
    once about chunks skipped as already stored; ``w`` reports the others. ``known`` is
    updated with the digests queued.

    Raises
    ------
    CheckpointError
        A chunk the store lacks changed in the live tensor since the snapshot (the store lost
        a chunk it held when the snapshot was taken, and the tensor changed); nothing of the
        tag is visible and the save can be run again.
    """
    queued = 0
    for name, snap in snaps.items():
        ent = snap.entry
        for i, (d, piece) in enumerate(zip(ent["chunks"], iter_pieces(snap.arr,
                                                                      ent["chunk_bytes"]),
                                           strict=True)):
            if d in known:
                if on_bytes:
                    on_bytes(piece.nbytes)
                continue
            if i in snap.copies:
                piece = snap.copies[i].data
            elif not snap.owned and digest(piece) != d:
                raise CheckpointError(
                    f"variable {name!r}: chunk {i} changed since the save's snapshot, and the "
                    "store no longer holds the copy it held then (removed by gc or a "
                    "delete meanwhile); nothing was published: save again")
            known.add(d)
            w.put(layout.chunk_key(d), piece)
            queued += piece.nbytes
    return queued


def entry_dtype(entry: dict[str, Any]) -> np.dtype:
    """Numpy dtype of a manifest tensor entry."""
    return BFLOAT16 if entry["dtype"] == "bfloat16" else np.dtype(entry["dtype"])


def check_piece(name: str, entry: dict[str, Any], i: int, key: bytes, val: Any) -> memoryview:
    """Verify chunk ``i`` of a tensor as read (present, digest); return it as a memoryview."""
    if val is None:
        raise CorruptRecordError(
            f"variable {name!r}: chunk {i} ({key.decode()}) is missing from the store; "
            "the tag is damaged (was the data garbage-collected?)"
        )
    if digest(val) != entry["chunks"][i]:
        raise CorruptRecordError(
            f"variable {name!r}: chunk {i} ({key.decode()}) fails its checksum; "
            "the stored data is corrupted"
        )
    return memoryview(val)


def place_piece(name: str, entry: dict[str, Any], i: int, piece: memoryview,
                flat: np.ndarray, pages: FreshPages | None = None) -> None:
    """Copy verified chunk ``i`` into ``flat`` (the tensor's bytes), checking its length.

    ``pages`` (a :class:`tensorkv.pages.FreshPages` tracking ``flat``) maps the
    fresh pages before the copy.
    """
    cb = entry["chunk_bytes"]
    off = i * cb
    want = min(cb, entry["nbytes"] - off)
    if piece.nbytes != want:
        raise CorruptRecordError(
            f"variable {name!r}: chunk {i} has {piece.nbytes} bytes, expected {want}"
        )
    dst = flat[off : off + want]
    if pages is not None:
        pages.prepare(dst)
    dst[:] = np.frombuffer(piece, dtype=np.uint8)


def _fetch(
    store: KVStore, name: str, entry: dict[str, Any], idx: list[int]
) -> list[memoryview]:
    keys = [layout.chunk_key(entry["chunks"][i]) for i in idx]
    return [
        check_piece(name, entry, i, key, val)
        for i, key, val in zip(idx, keys, store.get_many(keys), strict=True)
    ]


def read_full(
    store: KVStore, name: str, entry: dict[str, Any], on_bytes: OnBytes | None = None
) -> np.ndarray:
    """Read and verify a whole tensor into a new writable array."""
    dt = entry_dtype(entry)
    out = np.empty(tuple(entry["shape"]), dtype=dt)
    flat = out.reshape(-1).view(np.uint8)
    n = len(entry["chunks"])
    cb = entry["chunk_bytes"]
    step = max(1, (64 * 1024 * 1024) // max(cb, 1))
    for lo in range(0, n, step):
        idx = list(range(lo, min(n, lo + step)))
        for i, piece in zip(idx, _fetch(store, name, entry, idx), strict=True):
            place_piece(name, entry, i, piece, flat)
            if on_bytes:
                on_bytes(piece.nbytes)
    return out


def _axis0_range(index: Any, n0: int) -> tuple[int, int, Any]:
    """Rows [lo, hi) of axis 0 an index touches, and the index relative to those rows."""
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index[:1]) or not index:
        return 0, n0, index
    first, rest = index[0], index[1:]
    if first is None:
        return 0, n0, index
    if isinstance(first, (int, np.integer)) and not isinstance(first, bool):
        i = int(first)
        if not -n0 <= i < n0:
            raise BadIndexError(f"index {i} is out of bounds for axis 0 with size {n0}")
        i %= n0
        return i, i + 1, (0, *rest)
    if isinstance(first, slice):
        start, stop, step = first.indices(n0)
        rng = range(start, stop, step)
        if len(rng) == 0:
            return 0, 0, (slice(0, 0), *rest)
        lo, hi = min(rng[0], rng[-1]), max(rng[0], rng[-1]) + 1
        rel: Any = slice(0, hi - lo) if step == 1 else np.asarray(rng, dtype=np.int64) - lo
        return lo, hi, (rel, *rest)
    raise BadIndexError(
        f"index {index!r} is not a basic index; read_tensor takes ints, slices, None and ..."
    )


def read_slice(store: KVStore, name: str, entry: dict[str, Any], index: Any) -> np.ndarray:
    """Read ``tensor[index]`` fetching only the chunks that hold the rows of axis 0 it needs.

    Raises
    ------
    BadIndexError
        The index is out of bounds or not a basic index (an ``IndexError``).
    """
    shape = tuple(entry["shape"])
    dt = entry_dtype(entry)
    if not shape:
        return read_full(store, name, entry)[index]
    lo, hi, rel = _axis0_range(index, shape[0])
    row_bytes = dt.itemsize * int(np.prod(shape[1:], dtype=np.int64))
    sub = np.empty((hi - lo, *shape[1:]), dtype=dt)
    b0, b1 = lo * row_bytes, hi * row_bytes
    if b1 > b0:
        cb = entry["chunk_bytes"]
        idx = list(range(b0 // cb, (b1 - 1) // cb + 1))
        flat = sub.reshape(-1).view(np.uint8)
        for i, piece in zip(idx, _fetch(store, name, entry, idx), strict=True):
            c0 = i * cb
            s0, s1 = max(b0, c0), min(b1, c0 + piece.nbytes)
            flat[s0 - b0 : s1 - b0] = np.frombuffer(piece, dtype=np.uint8)[s0 - c0 : s1 - c0]
    try:
        return sub[rel]
    except IndexError as exc:
        raise BadIndexError(f"read_tensor({name!r}, {index!r}): {exc}") from None


def check_against(name: str, entry: dict[str, Any], target: np.ndarray) -> None:
    """Raise ShapeError unless ``target`` has the stored shape and dtype."""
    dt = entry_dtype(entry)
    if tuple(target.shape) != tuple(entry["shape"]) or target.dtype != dt:
        raise ShapeError(
            f"variable {name!r}: the checkpoint holds {entry['dtype']}{tuple(entry['shape'])} but "
            f"the target has {target.dtype}{tuple(target.shape)}; load it with load(None, ...) "
            "or give a target of the stored shape and dtype"
        )
