r"""RESP (the Redis protocol) for fixed-size arguments: commands built and replies parsed in bulk.

A Redis command is an array of bulk strings, ``*<n>\r\n`` then ``$<len>\r\n<bytes>\r\n``
per argument. When every trailing argument of a batch has the same size (8-byte hash fields,
packed rows), the framing of each row of arguments is one fixed-size record:
:func:`frame_columns` fills all of them with a few array assignments, and :func:`array_head`
frames the few leading arguments of each command. :func:`parse_replies` reads the replies of a
pipeline from raw bytes, resumably (a reply may arrive over many ``recv`` calls), copying the
array elements of a given size into a row array as they arrive. Used by
:mod:`tensorkv.stores.redis_raw`; see docs/redis_table.md ("Wire format").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

#: Reply types of :func:`parse_replies` (``rtype``).
INT, SIMPLE, ERROR, BULK, NIL, ARRAY = 0, 1, 2, 3, 4, 5
#: :func:`parse_replies` results.
DONE, MORE, UNEXPECTED = 0, 1, -1


def bulk(arg: bytes) -> bytes:
    """One argument framed as a RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def array_head(n_args: int, leading: Sequence[bytes]) -> bytes:
    """The start of a command of ``n_args`` arguments: the array header and ``leading``."""
    return b"*%d\r\n" % n_args + b"".join(map(bulk, leading))


def frame_columns(cols: Sequence[np.ndarray], order: np.ndarray | None = None) -> np.ndarray:
    r"""Frame row ``i`` of every column as consecutive bulk strings: ``uint8[n, record]``.

    ``cols``: ``uint8[n, w_c]`` arrays, one per argument of a row (for HSET, the field then the
    value). Row ``i`` of the result is ``$w_0\r\n<cols[0][i]>\r\n$w_1\r\n...``, the bytes
    of those arguments inside a command. ``order``: frame rows ``order`` of the columns
    instead (taken straight into the result).
    """
    n = cols[0].shape[0] if order is None else order.shape[0]
    heads = [b"$%d\r\n" % c.shape[1] for c in cols]
    width = sum(len(h) + c.shape[1] + 2 for h, c in zip(heads, cols, strict=True))
    out = np.empty((n, width), np.uint8)
    at = 0
    for h, c in zip(heads, cols, strict=True):
        w = c.shape[1]
        out[:, at:at + len(h)] = np.frombuffer(h, np.uint8)
        at += len(h)
        if order is None:
            out[:, at:at + w] = c
        else:  # mode="clip" takes straight into the strided view (no temporary)
            np.take(c, order, axis=0, out=out[:, at:at + w], mode="clip")
        at += w
        out[:, at] = 13
        out[:, at + 1] = 10
        at += 2
    return out


@njit(nogil=True, cache=True)
def _number(buf, pos, end):  # pragma: no cover - compiled
    """``(value, index after its CRLF)``; index -1: incomplete, -2: malformed."""
    i = pos
    neg = i < end and buf[i] == 45
    if neg:
        i += 1
    v = 0
    digits = 0
    while i < end and buf[i] >= 48 and buf[i] <= 57:
        v = v * 10 + (buf[i] - 48)
        i += 1
        digits += 1
    if i + 1 >= end:
        return 0, -1
    if digits == 0 or buf[i] != 13 or buf[i + 1] != 10:
        return 0, -2
    return (-v if neg else v), i + 2


@njit(nogil=True, cache=True)
def _line_end(buf, pos, end):  # pragma: no cover - compiled
    """Index of the CRLF ending the line at ``pos``; -1 while incomplete."""
    for i in range(pos, end - 1):
        if buf[i] == 13 and buf[i + 1] == 10:
            return i
    return -1


@njit(nogil=True, cache=True)
def _string_end(buf, q, v, end):  # pragma: no cover - compiled
    """Index after the CRLF of the ``v`` bytes at ``q``; -1: incomplete, -2: malformed."""
    if q + v + 2 > end:
        return -1
    if buf[q + v] != 13 or buf[q + v + 1] != 10:
        return -2
    return q + v + 2


@njit(nogil=True, cache=True)
def _parse(buf, end, st, rtype, rval, roff, eoff, elen, rows):  # pragma: no cover - compiled
    pos, r, rem, e, nrow = st[0], st[1], st[2], st[3], st[4]
    nrep = rtype.shape[0]
    cap = eoff.shape[0]
    width = rows.shape[1] if rows.shape[0] else -1
    status = DONE
    while True:
        if rem > 0:  # an element of an array: a bulk string, a nil or an integer
            if pos >= end:
                status = MORE
                break
            c = buf[pos]
            if c == 58:  # ':' (the replies of EXEC)
                v, q = _number(buf, pos + 1, end)
                if q < 0:
                    status = MORE if q == -1 else UNEXPECTED
                    break
                eoff[e] = v
                elen[e] = -2
                pos = q
            elif c == 45:  # '-': an error (of a command inside EXEC)
                eol = _line_end(buf, pos + 1, end)
                if eol < 0:
                    status = MORE
                    break
                eoff[e] = pos + 1
                elen[e] = -3
                pos = eol + 2
            elif c == 36:  # '$'
                v, q = _number(buf, pos + 1, end)
                if q < 0:
                    status = MORE if q == -1 else UNEXPECTED
                    break
                if v < 0:
                    eoff[e] = q
                    elen[e] = -1
                    pos = q
                else:
                    t = _string_end(buf, q, v, end)
                    if t < 0:
                        status = MORE if t == -1 else UNEXPECTED
                        break
                    eoff[e] = q
                    elen[e] = v
                    pos = t
                    if v == width:
                        rows[nrow, :] = buf[q:q + v]
                        nrow += 1
            elif c == 95:  # '_': RESP3 null
                t = _string_end(buf, pos + 1, 0, end)
                if t < 0:
                    status = MORE if t == -1 else UNEXPECTED
                    break
                eoff[e] = pos
                elen[e] = -1
                pos = t
            else:
                status = UNEXPECTED
                break
            e += 1
            rem -= 1
            continue
        if r == nrep:
            break
        if pos >= end:
            status = MORE
            break
        c = buf[pos]
        if c == 42 or c == 58 or c == 36:  # '*' array, ':' integer, '$' bulk string
            v, q = _number(buf, pos + 1, end)
            if q < 0:
                status = MORE if q == -1 else UNEXPECTED
                break
            if c == 58:
                rtype[r] = INT
                rval[r] = v
            elif v < 0:
                rtype[r] = NIL
            elif c == 42:
                if e + v > cap:
                    status = UNEXPECTED
                    break
                rtype[r] = ARRAY
                rval[r] = v
                roff[r] = e
                rem = v
            else:
                t = _string_end(buf, q, v, end)
                if t < 0:
                    status = MORE if t == -1 else UNEXPECTED
                    break
                rtype[r] = BULK
                rval[r] = v
                roff[r] = q
                q = t
            pos = q
        elif c == 43 or c == 45:  # '+' simple string, '-' error
            eol = _line_end(buf, pos + 1, end)
            if eol < 0:
                status = MORE
                break
            rtype[r] = SIMPLE if c == 43 else ERROR
            roff[r] = pos + 1
            rval[r] = eol - pos - 1
            pos = eol + 2
        elif c == 95:  # '_': RESP3 null
            t = _string_end(buf, pos + 1, 0, end)
            if t < 0:
                status = MORE if t == -1 else UNEXPECTED
                break
            rtype[r] = NIL
            pos = t
        else:
            status = UNEXPECTED
            break
        r += 1
    st[0], st[1], st[2], st[3], st[4] = pos, r, rem, e, nrow
    return status


_NO_ROWS = np.zeros((0, 1), np.uint8)


def parse_replies(buf: np.ndarray, end: int, st: np.ndarray, rtype: np.ndarray,
                  rval: np.ndarray, roff: np.ndarray, eoff: np.ndarray,
                  elen: np.ndarray, rows: np.ndarray | None = None) -> int:
    """Parse replies from ``buf[:end]``, resuming at the state ``st``; returns a status.

    Parameters
    ----------
    buf, end
        The bytes received so far (``uint8``) and how many there are.
    st
        ``int64[5]``, zeros at first: position, replies done, elements left in the current
        array, elements done, rows copied. Updated in place.
    rtype, rval, roff
        Per reply (their length is the number of replies): its type (:data:`INT`,
        :data:`SIMPLE`, :data:`ERROR`, :data:`BULK`, :data:`NIL`, :data:`ARRAY`); the integer,
        the length of a string or the element count of an array; the offset of a string in
        ``buf`` or the index of an array's first element.
    eoff, elen
        Per array element: offset in ``buf`` and length (-1: nil); for an integer its value
        and -2; for an error the offset of its message (ended by CRLF) and -3. Arrays may
        hold bulk strings, nils, integers and errors only.
    rows
        ``uint8[m, width]`` (None: no copies): every array element of exactly ``width`` bytes
        is copied into the next row as soon as it is complete (``st[4]`` rows so far), so the
        copy runs while later replies are still on their way.

    Returns
    -------
    int
        :data:`DONE` (every reply parsed; ``st[0]`` is where they end), :data:`MORE` (more
        bytes needed) or :data:`UNEXPECTED` (a reply this parser does not handle, or more
        array elements than ``eoff`` holds).
    """
    return int(_parse(buf, np.int64(end), st, rtype, rval, roff, eoff, elen,
                      _NO_ROWS if rows is None else rows))


__all__ = ["ARRAY", "BULK", "DONE", "ERROR", "INT", "MORE", "NIL", "SIMPLE", "UNEXPECTED",
           "array_head", "bulk", "frame_columns", "parse_replies"]
