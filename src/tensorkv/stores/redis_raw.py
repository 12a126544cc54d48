"""A raw RESP path for batches of prebuilt commands: one send, replies parsed with numba.

:meth:`RedisStore.execute_raw <tensorkv.stores.redis.RedisStore.execute_raw>` sends commands
already framed as RESP bytes (:mod:`tensorkv.kernels.resp`) on connections taken from
redis-py's pools, so AUTH/ACL, TLS, Sentinel-resolved masters and Cluster routing stay
redis-py's, and reads every reply with ``recv_into`` into one buffer, parsed as it arrives.
Anything this path does not handle (a redirect, a script not loaded, a reply of another shape,
a dropped connection) raises :class:`RawFallback` after disconnecting the connections it used,
so the caller re-runs the batch on the generic path; other error replies raise redis-py's
exception for the message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from redis import exceptions as rex
from redis._parsers.base import BaseParser

from tensorkv.errors import TensorKVError
from tensorkv.kernels import resp
from tensorkv.stores.redis_keys import key_slots

#: Bytes asked of one ``recv_into`` call.
RECV_BYTES = 1 << 20
#: Pieces of a batch smaller than this are joined before they are sent.
COALESCE_BYTES = 1 << 16
#: Error replies the generic path handles (redirects, retries, script loading).
_FALLBACK_ERRORS = (rex.MovedError, rex.AskError, rex.TryAgainError, rex.ClusterDownError,
                    rex.NoScriptError, rex.BusyLoadingError, rex.ReadOnlyError,
                    rex.MasterDownError)


def _dropped(exc: BaseException) -> bool:
    """Whether ``exc`` is a dropped or timed-out connection (not a tensorkv error)."""
    return (isinstance(exc, (rex.ConnectionError, rex.TimeoutError, OSError))
            and not isinstance(exc, TensorKVError))


class RawFallback(Exception):
    """The raw path cannot finish this batch; run it on the generic path (it is idempotent)."""


@dataclass
class Replies:
    """The parsed replies of one connection (see :func:`tensorkv.kernels.resp.parse_replies`).

    ``rows``: the array elements of the asked row width, in reply order; ``commands``: the
    indices (in the batch) of the commands these replies answer, in order.
    """

    buf: np.ndarray
    rtype: np.ndarray
    rval: np.ndarray
    roff: np.ndarray
    eoff: np.ndarray
    elen: np.ndarray
    rows: np.ndarray
    commands: list[int] = field(default_factory=list)
    #: The socket the replies came on (a new socket is a new connection, maybe to another
    #: server process: a restart or a failover drops every socket to the old one).
    sock: Any = None

    def text(self, i: int) -> str:
        """Reply ``i``'s string (a simple string or an error message)."""
        a = int(self.roff[i])
        return self.buf[a:a + int(self.rval[i])].tobytes().decode("utf-8", "replace")


def read_replies(sock: Any, n_replies: int, max_elems: int, size_hint: int,
                 recv_bytes: int = RECV_BYTES, row_width: int = 0) -> Replies:
    """Read ``n_replies`` replies from ``sock`` (up to ``max_elems`` array elements in all).

    ``size_hint``: the expected reply bytes (the buffer grows past it when needed);
    ``row_width``: array elements of this size are copied into ``rows`` as they come. Reads
    exactly the replies' bytes' worth of parsing: bytes after the last reply raise
    :class:`RawFallback` (the connection must then be dropped).
    """
    buf = np.empty(max(size_hint, 64), np.uint8)
    view = buf.data
    st = np.zeros(5, np.int64)
    rep = [np.zeros(n_replies, np.int64) for _ in range(3)]
    eoff = np.zeros(max_elems, np.int64)
    elen = np.zeros(max_elems, np.int64)
    rows = np.empty((max_elems if row_width else 0, max(row_width, 1)), np.uint8)
    end = 0
    while True:
        if end == buf.size:
            bigger = np.empty(2 * buf.size, np.uint8)
            bigger[:end] = buf[:end]
            buf, view = bigger, bigger.data
        got = sock.recv_into(view[end:], min(recv_bytes, buf.size - end))
        if not got:
            raise rex.ConnectionError("the server closed the connection mid-reply")
        end += got
        status = resp.parse_replies(buf, end, st, *rep, eoff, elen, rows)
        if status == resp.UNEXPECTED or (status == resp.DONE and st[0] != end):
            raise RawFallback("a reply the raw path does not parse")
        if status == resp.DONE:
            return Replies(buf, rep[0], rep[1], rep[2], eoff, elen, rows[:st[4]])


def element_errors(replies: Replies) -> None:
    """Raise redis-py's exception for the first error inside an array reply (EXEC's)."""
    bad = np.flatnonzero(replies.elen == -3)
    if bad.size:
        a = int(replies.eoff[bad[0]])
        msg = replies.buf[a:].tobytes().split(b"\r\n", 1)[0].decode("utf-8", "replace")
        raise BaseParser.parse_error(msg)


def check_errors(replies: Replies) -> None:
    """Raise redis-py's exception for the first error reply of ``replies``.

    Errors the generic path handles (redirects, scripts, loading, failover) raise
    :class:`RawFallback` instead.
    """
    bad = np.flatnonzero(replies.rtype == resp.ERROR)
    if bad.size:
        exc = BaseParser.parse_error(replies.text(int(bad[0])))
        if isinstance(exc, _FALLBACK_ERRORS):
            raise RawFallback(str(exc)) from exc
        raise exc


@contextmanager
def session(store: Any) -> Iterator[Callable[..., Replies]]:
    """One connection to a standalone or Sentinel-managed primary, for several round trips.

    Yields ``call(pieces, n_replies, elems=0, size=64)``: sends the RESP ``pieces`` and
    reads ``n_replies`` replies (error replies are returned, not raised: inside MULTI they
    belong to the caller). Any exception drops the connection (so no WATCH outlives the
    session); a dropped connection raises :class:`RawFallback`. A Cluster raises
    :class:`RawFallback` at once (a transaction spans one hash slot there).
    """
    if store.mode == "cluster":
        raise RawFallback("a Cluster transaction spans one hash slot")
    store._check_open()
    store._check_writable()
    store._unwaited = True  # flush() waits for the replicas (wait_replicas)
    with store._errors():
        pool = store._client.connection_pool
        conn = pool.get_connection()
        try:
            def call(pieces: list[Any], n_replies: int, elems: int = 0,
                     size: int = 64) -> Replies:
                conn.send_packed_command(pieces)
                return read_replies(conn._sock, n_replies, elems, size)

            yield call
        except BaseException as exc:
            conn.disconnect()
            if _dropped(exc):
                raise RawFallback(f"connection failed: {exc}") from exc
            raise
        finally:
            pool.release(conn)


def coalesce(pieces: list[Any], limit: int = COALESCE_BYTES) -> list[Any]:
    """``pieces`` with runs of small ones joined (one ``sendall`` each, not one per piece)."""
    out: list[Any] = []
    run: list[Any] = []
    size = 0
    for p in pieces:
        n = memoryview(p).nbytes
        if n >= limit:
            if run:
                out.append(b"".join(run))
                run, size = [], 0
            out.append(p)
            continue
        run.append(p)
        size += n
        if size >= limit:
            out.append(b"".join(run))
            run, size = [], 0
    if run:
        out.append(b"".join(run))
    return out


def _pools(store: Any, keys: list[bytes], read: bool) -> list[tuple[Any, list[int]]]:
    """``[(connection pool, command indices)]``: where each command goes."""
    if store.mode != "cluster":
        client = store._reader if read else store._client
        return [(client.connection_pool, list(range(len(keys))))]
    client = store._client
    nm = client.nodes_manager
    strategy = client.load_balancing_strategy if read else None
    groups: dict[str, tuple[Any, list[int]]] = {}
    for i, slot in enumerate(key_slots(keys).tolist()):
        node = nm.get_node_from_slot(slot, load_balancing_strategy=strategy)
        groups.setdefault(node.name, (node, []))[1].append(i)
    return [(client.get_redis_connection(node).connection_pool, idx)
            for node, idx in groups.values()]


def run(store: Any, keys: list[bytes], chunks: list[list[Any]], elems: list[int],
        reply_bytes: list[int], *, read: bool, recv_bytes: int = RECV_BYTES,
        row_width: int = 0) -> list[Replies]:
    """Send every command, then read every reply; one :class:`Replies` per connection.

    An error reply raises (:func:`check_errors`) once every reply has been read.

    Parameters
    ----------
    store
        An open :class:`~tensorkv.stores.redis.RedisStore`.
    keys
        The key routing each command (Cluster: its slot's node).
    chunks
        Each command's RESP bytes, as a list of bytes-like pieces.
    elems, reply_bytes
        Each command's expected array elements and reply bytes (sizes the buffers).
    read
        The commands only read (they may go to replicas).
    recv_bytes, row_width
        See :func:`read_replies`.
    """
    sent: list[tuple[Any, Any, list[int]]] = []
    try:
        for pool, idx in _pools(store, keys, read):
            conn = pool.get_connection()
            sent.append((pool, conn, idx))
            conn.send_packed_command(coalesce([p for i in idx for p in chunks[i]]))
        out = []
        for _, conn, idx in sent:
            r = read_replies(conn._sock, len(idx), sum(elems[i] for i in idx),
                             sum(reply_bytes[i] for i in idx), recv_bytes, row_width)
            r.commands = idx
            r.sock = conn._sock
            out.append(r)
        for r in out:
            check_errors(r)
    except rex.ResponseError:
        raise  # an error reply: every reply was read, the connections are clean
    except BaseException as exc:
        for _, conn, _ in sent:
            conn.disconnect()
        if _dropped(exc):
            raise RawFallback(f"connection failed: {exc}") from exc
        raise
    finally:
        for pool, conn, _ in sent:
            pool.release(conn)
    return out


__all__ = ["COALESCE_BYTES", "RECV_BYTES", "RawFallback", "Replies", "check_errors", "coalesce",
           "element_errors", "read_replies", "run", "session"]
