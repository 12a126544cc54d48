"""Small data-path requests as one ``bytes`` frame each way.

Ray serialises every argument of an actor call on its own, and pickles tuples and numpy
arrays; for a pull of a few keys that costs more than the call itself. A request whose arrays
are small (:func:`fits`) therefore travels as one ``bytes`` argument to
:meth:`ShardServer.frame <tensorkv.distributed.shard.ShardServer.frame>`, and its answer as
one ``bytes`` value: a fixed header, the table and client names, the shards of an operation
staged in two phases (:mod:`tensorkv.distributed.ops`), then the raw arrays. Large requests
keep the numpy path (Ray moves their buffers through its object store).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

#: Method codes of a request frame.
METHODS = {"pull": 1, "peek": 2, "push": 3}
_NAMES = {v: k for k, v in METHODS.items()}

#: Largest payload (bytes of keys, counts, gradients or rows) sent as a frame: Ray inlines
#: values up to 100 KiB in the call itself, larger ones go through its object store.
FRAME_BYTES = 64 * 1024

#: Answer of a request that found the shard behind the client (it lost updates in a restart).
BEHIND = "behind"
#: Answer of a change a shard refuses for now: a save is taking its snapshot (retry later).
REFUSED = "refused"
#: Answer of a repeated commit of a lookup whose rows are gone: read them again.
REREAD = "reread"
#: Answer of a shard to a staged part: ``(STAGED, would)`` (``would``: it would change rows).
STAGED = "staged"

# method, flags, len(name), len(worker), shards of the operation, seq, operation, step, keys,
# dim of the gradients
_REQ = struct.Struct("<BBHHHqqqqq")
# status (0 answer, 1 behind, 2 refused, 3 reread), ckpt, delta, seq, kind, a, b, c
_REP = struct.Struct("<Bqqqbqqq")
_STATUS = {BEHIND: 1, REFUSED: 2, REREAD: 3}
_STATUS_OF = {v: k for k, v in _STATUS.items()}
_INSERT, _TOUCH, _TICK, _STEP = 1, 2, 4, 8
_ROWS, _TOUCHED, _PUSHED, _STAGED = 0, 1, 2, 3


def fits(method: str, args: tuple, dim: int) -> bool:
    """Whether a request (and its answer, rows of ``dim``) is small enough for a frame."""
    if method not in METHODS:
        return False
    n = args[0].shape[-1]
    return n * max(16, 4 * dim) <= FRAME_BYTES


def pack_request(method: str, name: str, worker: str, seq: int, args: tuple, op: int = 0,
                 parts: tuple[int, ...] = ()) -> bytes:
    """One frame of a request.

    ``args``: ``(keys_counts, insert, touch)`` of a ``pull``, ``(keys_counts,)`` of a
    ``peek``, ``(keys, grads, step, tick)`` of a ``push``. ``op`` (with the operation's
    shards ``parts``): the request stages part ``op`` of an operation over several shards
    rather than applying it; 0 applies it.
    """
    nb, wb = name.encode(), worker.encode()
    if method == "push":
        keys, grads, step, tick = args
        flags = (_TICK if tick else 0) | (0 if step is None else _STEP)
        data = (np.ascontiguousarray(keys, np.int64).tobytes()
                + np.ascontiguousarray(grads, np.float32).tobytes())
        n, dim = keys.shape[0], grads.shape[1]
        step_v = 0 if step is None else int(step)
    else:
        kc = args[0]
        insert, touch = (args[1], args[2]) if method == "pull" else (False, False)
        flags = (_INSERT if insert else 0) | (_TOUCH if touch else 0)
        data = np.ascontiguousarray(kc, np.int64).tobytes()
        n, dim = kc.shape[1], 0
        step_v = 0
    head = _REQ.pack(METHODS[method], flags, len(nb), len(wb), len(parts), int(seq), int(op),
                     step_v, n, dim)
    return b"".join((head, nb, wb, np.asarray(parts, np.int32).tobytes(), data))


def unpack_request(frame: bytes) -> tuple[str, str, str, int, tuple, int, tuple[int, ...]]:
    """``(method, name, worker, seq, args, op, parts)`` of a frame (arrays: views of it)."""
    code, flags, ln, lw, lp, seq, op, step, n, dim = _REQ.unpack_from(frame)
    at = _REQ.size
    name = frame[at:at + ln].decode()
    worker = frame[at + ln:at + ln + lw].decode()
    at += ln + lw
    parts = tuple(int(x) for x in np.frombuffer(frame, np.int32, lp, at))
    at += 4 * lp
    method = _NAMES[code]
    if method == "push":
        keys = np.frombuffer(frame, np.int64, n, at)
        at += 8 * n
        grads = np.frombuffer(frame, np.float32, n * dim, at).reshape(n, dim)
        args: tuple = (keys, grads, step if flags & _STEP else None, bool(flags & _TICK))
    else:
        kc = np.frombuffer(frame, np.int64, 2 * n, at).reshape(2, n)
        args = (kc, bool(flags & _INSERT), bool(flags & _TOUCH)) if method == "pull" else (kc,)
    return method, name, worker, seq, args, op, parts


def pack_reply(out: Any) -> bytes:
    """One frame of a shard's answer: ``(value, ckpt, delta, seq)``, or a status string."""
    if isinstance(out, str):
        return _REP.pack(_STATUS[out], 0, 0, 0, 0, 0, 0, 0)
    value, ckpt, delta, seq = out
    if isinstance(value, tuple) and isinstance(value[0], str):  # (STAGED, would)
        return _REP.pack(0, ckpt, delta, seq, _STAGED, int(bool(value[1])), 0, 0)
    if isinstance(value, np.ndarray):
        rows = np.ascontiguousarray(value, np.float32)
        return _REP.pack(0, ckpt, delta, seq, _ROWS, rows.shape[0], rows.shape[1], 0) + \
            rows.tobytes()
    first, second = value
    if isinstance(first, np.ndarray):  # a touch: (absent, rows of the absent keys)
        absent = np.ascontiguousarray(first, np.bool_)
        rows = np.ascontiguousarray(second, np.float32)
        return b"".join((_REP.pack(0, ckpt, delta, seq, _TOUCHED, absent.shape[0],
                                   rows.shape[0], rows.shape[1]),
                         absent.tobytes(), rows.tobytes()))
    return _REP.pack(0, ckpt, delta, seq, _PUSHED, int(first), int(second), 0)


def unpack_reply(frame: bytes) -> Any:
    """The ``(value, ckpt, delta, seq)`` (or status string) of a reply frame."""
    status, ckpt, delta, seq, kind, a, b, c = _REP.unpack_from(frame)
    if status:
        return _STATUS_OF[status]
    at = _REP.size
    if kind == _STAGED:
        value: Any = (STAGED, bool(a))
    elif kind == _ROWS:
        value = np.frombuffer(frame, np.float32, a * b, at).reshape(a, b)
    elif kind == _TOUCHED:
        absent = np.frombuffer(frame, np.bool_, a, at)
        value = (absent, np.frombuffer(frame, np.float32, b * c, at + a).reshape(b, c))
    else:
        value = (a, b)
    return value, ckpt, delta, seq


__all__ = ["BEHIND", "FRAME_BYTES", "METHODS", "REFUSED", "REREAD", "STAGED", "fits", "pack_reply",
           "pack_request", "unpack_reply", "unpack_request"]
