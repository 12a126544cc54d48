"""Tensor records: a numpy array <-> bytes with a small header and a checksum.

:func:`encode` and :func:`decode` (zero-copy: the returned array is a read-only view into the
given buffer), :func:`read_header` for the header alone. The layout is specified in
docs/format.md.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import xxhash

from tensorkv.errors import CodecError, CorruptRecordError

MAGIC = b"TKVR"
FORMAT_VERSION = 1
MAX_NDIM = 32
_FIXED = struct.Struct("<4sBBBBQ")  # magic, version, dtype code, ndim, flags, xxh3-64
FIXED_HEADER_BYTES = _FIXED.size  # 16

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# Codes are part of the on-disk format: never renumber, only append.
_DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.bool_),
    2: np.dtype(np.int8),
    3: np.dtype(np.uint8),
    4: np.dtype(np.int16),
    5: np.dtype(np.uint16),
    6: np.dtype(np.int32),
    7: np.dtype(np.uint32),
    8: np.dtype(np.int64),
    9: np.dtype(np.uint64),
    10: np.dtype(np.float16),
    11: np.dtype(np.float32),
    12: np.dtype(np.float64),
    13: BFLOAT16,
    14: np.dtype(np.complex64),
    15: np.dtype(np.complex128),
}
_CODES: dict[np.dtype, int] = {dt.newbyteorder("<"): code for code, dt in _DTYPES.items()}
_CODES[BFLOAT16] = 13


def dtype_code(dtype: np.dtype | str) -> int:
    """Return the record code of a numpy dtype (raises CodecError for unsupported ones)."""
    dt = np.dtype(dtype) if not isinstance(dtype, np.dtype) else dtype
    if dt == BFLOAT16:
        return 13
    code = _CODES.get(dt.newbyteorder("<"))
    if code is None:
        supported = ", ".join(sorted(str(d) for d in _DTYPES.values()))
        raise CodecError(f"dtype {dt} cannot be stored; supported dtypes: {supported}")
    return code


def dtype_from_code(code: int, key: bytes | str | None = None) -> np.dtype:
    """Return the numpy dtype of a record code."""
    try:
        return _DTYPES[code]
    except KeyError:
        raise CorruptRecordError(
            f"unknown dtype code {code} in the record header{_where(key)}; the record is "
            "corrupted or was written by a newer tensorkv"
        ) from None


def checksum(data: bytes | memoryview | np.ndarray) -> int:
    """64-bit xxh3 checksum used by records and checkpoints."""
    if isinstance(data, np.ndarray):
        data = data.data  # the array's buffer as a memoryview
    return xxhash.xxh3_64_intdigest(data)


def header_size(ndim: int) -> int:
    """Bytes of a record header for an array of ``ndim`` dimensions (a multiple of 8)."""
    return FIXED_HEADER_BYTES + 8 * ndim


def encode_parts(array: np.ndarray) -> tuple[bytes, memoryview]:
    """Encode ``array`` as (header bytes, payload view) without copying the payload.

    Writers that can send two buffers (a file, a socket) avoid the join that
    :func:`encode` does.
    """
    if not isinstance(array, np.ndarray):
        raise CodecError(
            f"expected a numpy array, got {type(array).__name__}; "
            "convert with numpy.asarray() (torch: tensor.detach().cpu().numpy())"
        )
    if array.ndim > MAX_NDIM:
        raise CodecError(f"array has {array.ndim} dimensions; records hold at most {MAX_NDIM}")
    code = dtype_code(array.dtype)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(array).reshape(array.shape)  # keeps 0-d arrays 0-d
    payload = arr.reshape(-1).view(np.uint8).data if arr.size else memoryview(b"")
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, code, arr.ndim, 0, checksum(payload))
    shape = struct.pack(f"<{arr.ndim}Q", *arr.shape)
    return head + shape, payload


def encode(array: np.ndarray) -> bytes:
    """Encode a numpy array as one record (header, shape, payload)."""
    head, payload = encode_parts(array)
    return b"".join((head, payload))


@dataclass(frozen=True)
class RecordHeader:
    """The parsed header of a record."""

    dtype: np.dtype
    shape: tuple[int, ...]
    checksum: int
    header_bytes: int

    @property
    def payload_bytes(self) -> int:
        """Bytes of array data following the header."""
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def _where(key: bytes | str | None) -> str:
    return f" for key {key!r}" if key is not None else ""


def _record_view(buf: object, key: bytes | str | None) -> memoryview:
    """``buf`` as a memoryview of bytes; anything else is refused with a CodecError."""
    if buf is None:
        raise CodecError(
            f"there is no record{_where(key)} to decode (None): a store's get() returns None "
            "for a missing key; check the key before decoding"
        )
    try:
        mv = memoryview(buf)  # type: ignore[arg-type]
    except (TypeError, BufferError) as exc:
        raise CodecError(
            f"a record{_where(key)} is C-contiguous bytes (bytes, bytearray, memoryview), "
            f"got {type(buf).__name__} ({exc})"
        ) from None
    if not mv.c_contiguous:
        raise CodecError(f"a record{_where(key)} is C-contiguous bytes; got a strided "
                         f"{type(buf).__name__}: copy it first (bytes(buf))")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def read_header(buf: bytes | memoryview, key: bytes | str | None = None) -> RecordHeader:
    """Parse and validate a record header without touching the payload."""
    mv = _record_view(buf, key)
    if mv.nbytes < FIXED_HEADER_BYTES:
        raise CorruptRecordError(
            f"record{_where(key)} is truncated: {mv.nbytes} bytes, "
            f"the header alone needs {FIXED_HEADER_BYTES}"
        )
    magic, version, code, ndim, _flags, digest = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptRecordError(
            f"record{_where(key)} does not start with {MAGIC!r} (found {bytes(magic)!r}); "
            "it is not a tensorkv tensor record or it is corrupted"
        )
    if version != FORMAT_VERSION:
        raise CodecError(
            f"record{_where(key)} has format version {version}; this tensorkv reads "
            f"version {FORMAT_VERSION}; upgrade tensorkv"
        )
    if ndim > MAX_NDIM:
        raise CorruptRecordError(f"record{_where(key)} claims {ndim} dimensions")
    hsize = header_size(ndim)
    if mv.nbytes < hsize:
        raise CorruptRecordError(f"record{_where(key)} is truncated inside its shape")
    shape = struct.unpack_from(f"<{ndim}Q", mv, FIXED_HEADER_BYTES)
    return RecordHeader(dtype_from_code(code, key), tuple(int(s) for s in shape), digest, hsize)


def decode(
    buf: bytes | bytearray | memoryview, key: bytes | str | None = None, *, verify: bool = True
) -> np.ndarray:
    """Decode a record into a read-only numpy array that views ``buf`` (no copy).

    Parameters
    ----------
    buf
        The record bytes.
    key
        The key the record was stored under; named in error messages.
    verify
        Check the payload checksum (xxh3 runs at tens of GB/s, so this is cheap).

    Raises
    ------
    CorruptRecordError
        The record is truncated, has trailing bytes, or fails its checksum.
    """
    mv = _record_view(buf, key)
    head = read_header(mv, key)
    end = head.header_bytes + head.payload_bytes
    if mv.nbytes != end:
        what = "truncated" if mv.nbytes < end else "longer than its header says"
        raise CorruptRecordError(
            f"record{_where(key)} is {what}: {mv.nbytes} bytes, expected {end}"
        )
    payload = mv[head.header_bytes : end]
    if verify and checksum(payload) != head.checksum:
        raise CorruptRecordError(f"record{_where(key)} fails its checksum; the data is corrupted")
    arr = np.frombuffer(payload, dtype=head.dtype, count=head.payload_bytes // head.dtype.itemsize)
    arr = arr.reshape(head.shape)
    if arr.flags.writeable:
        arr.flags.writeable = False
    return arr
