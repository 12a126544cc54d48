"""Redis key helpers: cluster hash slots, SCAN glob escaping, URL redaction, batch bounds.

Pure functions (numpy, plus a numba kernel compiled on first use) shared by
:mod:`tensorkv.stores.redis`; kept apart so the store module stays readable.
"""

from __future__ import annotations

import operator
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorkv.stores.base import prefix_upper_bound

__all__ = ["bounds", "glob_escape", "key_slots", "range_prefix", "redact_url", "send_packed",
           "take", "value_sizes"]

_GLOB_SPECIAL = frozenset(b"\\*?[]")


# ---------------------------------------------------------------------------- hash slots
def _crc16_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.int64)
    for i in range(256):
        crc = i << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        table[i] = crc & 0xFFFF
    return table


_CRC16_TABLE = _crc16_table()


def _slots_py(buf: np.ndarray, offsets: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Redis Cluster hash slot (CRC16/XMODEM of the key or its hash tag, mod 16384)."""
    n = offsets.shape[0] - 1
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        a = offsets[i]
        b = offsets[i + 1]
        j = a
        while j < b and buf[j] != 123:  # '{'
            j += 1
        if j < b:
            k = j + 1
            while k < b and buf[k] != 125:  # '}'
                k += 1
            if k < b and k != j + 1:
                a = j + 1
                b = k
        crc = 0
        for p in range(a, b):
            crc = ((crc << 8) & 0xFFFF) ^ table[((crc >> 8) ^ buf[p]) & 0xFF]
        out[i] = crc & 16383
    return out


_slots_kernel: Any = None
_kernel_lock = threading.Lock()


def key_slots(keys: Sequence[bytes]) -> np.ndarray:
    """Redis Cluster hash slot of each key, as an int64 array (numba kernel).

    Parameters
    ----------
    keys
        Full Redis keys (namespace included). A key holding ``{tag}`` with a non-empty tag
        hashes the tag alone, so keys sharing a tag share a slot.

    Returns
    -------
    numpy.ndarray
        Slots in ``[0, 16384)``, one per key.
    """
    global _slots_kernel
    if _slots_kernel is None:
        with _kernel_lock:
            if _slots_kernel is None:
                from numba import njit

                _slots_kernel = njit(nogil=True, cache=True)(_slots_py)
    n = len(keys)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, keys), dtype=np.int64, count=n), out=offsets[1:])
    buf = np.frombuffer(b"".join(keys), dtype=np.uint8)
    return _slots_kernel(buf, offsets, _CRC16_TABLE)


# ---------------------------------------------------------------------------- helpers
def glob_escape(prefix: bytes) -> bytes:
    r"""Escape Redis glob characters (``\\ * ? [ ]``) so ``prefix`` matches literally."""
    if not _GLOB_SPECIAL.intersection(prefix):
        return prefix
    out = bytearray()
    for c in prefix:
        if c in _GLOB_SPECIAL:
            out.append(0x5C)
        out.append(c)
    return bytes(out)


_PASSWORD_IN_NETLOC = re.compile(r"(://[^/@?]*?:)[^/@?]*@")
_PASSWORD_IN_QUERY = re.compile(r"([?&]password=)[^&]*")


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages, ``repr`` and stats)."""
    return _PASSWORD_IN_QUERY.sub(r"\1***", _PASSWORD_IN_NETLOC.sub(r"\1***@", url))


def range_prefix(lo: bytes | None, hi: bytes | None) -> bytes:
    """Longest P such that every key in ``[lo, hi)`` starts with P."""
    if lo is None:
        return b""
    for n in range(len(lo), 0, -1):
        p = lo[:n]
        ub = prefix_upper_bound(p)
        if ub is None or (hi is not None and hi <= ub):
            return p
    return b""


def take(seq: Sequence[Any], idx: np.ndarray) -> list[Any]:
    """``[seq[i] for i in idx]`` without a Python-level loop."""
    if len(idx) == 0:
        return []
    if len(idx) == 1:
        return [seq[int(idx[0])]]
    return list(operator.itemgetter(*idx.tolist())(seq))


def bounds(n: int, max_keys: int, sizes: np.ndarray | None = None,
            max_bytes: int = 0, groups: np.ndarray | None = None) -> np.ndarray:
    """Chunk boundaries over ``n`` items.

    At most ``max_keys`` items per chunk, a new chunk wherever ``groups`` changes, and a split
    whenever the running byte total of ``sizes`` crosses a multiple of ``max_bytes``.
    """
    if groups is not None and n:
        change = np.empty(n, dtype=bool)
        change[0] = True
        np.not_equal(groups[1:], groups[:-1], out=change[1:])
        starts = np.flatnonzero(change)
        start_of = starts[np.cumsum(change) - 1]
        pos = np.arange(n) - start_of
        cuts = np.flatnonzero(pos % max_keys == 0)
    else:
        cuts = np.arange(0, n, max_keys)
    if sizes is not None and n and max_bytes:
        total = np.cumsum(sizes)
        marks = np.arange(max_bytes, int(total[-1]), max_bytes)
        extra = np.searchsorted(total, marks, side="right")
        extra = extra[(extra > 0) & (extra < n)]
        cuts = np.union1d(cuts, extra)  # a split inside a slot group stays in that slot
    return np.append(cuts, n).astype(np.int64)


def value_sizes(values: Sequence[Any]) -> np.ndarray:
    """Byte length of each value to be written (int64 array)."""
    # check_value hands over bytes or 1-D unsigned-byte memoryviews, so len() is bytes
    return np.fromiter(map(len, values), dtype=np.int64, count=len(values))


def send_packed(pool: Any, commands: list[tuple[Any, ...]], *, retries: int,
                backoff: float) -> list[Any]:
    """Send ``commands`` at once on one connection of ``pool``; return the raw replies.

    Every command is packed by hiredis (str, bytes and numbers), skipping redis-py's
    per-argument work; replies are not post-processed (HSCAN gives ``[cursor, [field, value,
    ...]]``). A dropped connection is retried ``retries`` times after ``backoff`` seconds,
    doubled each time (the commands must be idempotent). A command's error reply is raised
    once every reply has been read.
    """
    import hiredis
    from redis import exceptions as rex

    packed = b"".join(map(hiredis.pack_command, commands))
    out: list[Any] = []
    for attempt in range(retries + 1):
        conn = pool.get_connection()
        try:
            conn.send_packed_command([packed])
            out = []
            for _ in commands:
                try:
                    out.append(conn.read_response())
                except rex.ResponseError as exc:
                    out.append(exc)
            break
        except (rex.ConnectionError, rex.TimeoutError, OSError):
            conn.disconnect()
            if attempt == retries:
                raise
            time.sleep(backoff * 2 ** attempt)
        finally:
            pool.release(conn)
    for r in out:
        if isinstance(r, rex.ResponseError):
            raise r
    return out
