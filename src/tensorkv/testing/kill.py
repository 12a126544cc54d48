"""Killing a process inside a backend's commit, for the atomic-batch conformance check.

:func:`kill_inside_next_write` arms a store so that this process SIGKILLs itself inside its
next write, after the backend was handed a chosen share of the batch and before it commits.
Everything here runs only in child processes that it kills, and a killed process never
writes coverage data, so the coverage report omits this module (pyproject.toml).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, cast

from tensorkv.stores import KVStore


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Counter:
    """Ops of the armed batch handed to the backend so far; SIGKILL once ``target`` are."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.target: int | None = None  # set by the first write after arming
        self.done = 0

    def start(self, n: int) -> None:
        if self.target is None:
            self.target = min(n, max(1, int(round(self.at * n))))

    def take(self, n: int) -> tuple[int, bool]:
        """``(k, die)``: hand over ``k`` of the next ``n`` ops, then die if ``die``."""
        if self.target is None or self.done + n < self.target:
            self.done += n
            return n, False
        k, self.done = self.target - self.done, self.target
        return k, True


class _CountingBatch:
    """A backend write batch (or database) whose puts and deletes are counted."""

    def __init__(self, real: Any, counter: _Counter) -> None:
        self._real = real
        self._counter = counter

    def _op(self, name: str, *args: Any) -> Any:
        _, die = self._counter.take(1)
        out = getattr(self._real, name)(*args)
        if die:
            _die()
        return out

    def put(self, *args: Any) -> Any:
        return self._op("put", *args)

    def delete(self, *args: Any) -> Any:
        return self._op("delete", *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _CountingDB(_CountingBatch):
    """A database whose own puts and deletes count, as do those of its write batches."""

    def write_batch(self, **kw: Any) -> _CountingBatch:  # plyvel
        return _CountingBatch(self._real.write_batch(**kw), self._counter)

    def write(self, batch: Any, *args: Any) -> Any:  # rocksdict
        return self._real.write(getattr(batch, "_real", batch), *args)


class _CountingModule:
    """The ``rocksdict`` module, but its ``WriteBatch`` objects count their puts and deletes."""

    def __init__(self, real: Any, counter: _Counter) -> None:
        self._real = real
        self._counter = counter

    def WriteBatch(self, **kw: Any) -> _CountingBatch:  # noqa: N802 - rocksdict's name
        return _CountingBatch(self._real.WriteBatch(**kw), self._counter)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _wait_until_read(sock: Any, timeout: float = 10.0) -> None:
    """Wait until the peer process has read everything sent on ``sock`` (Linux; else 0.5 s).

    Our send queue must be empty (``TIOCOUTQ``) and the peer's receive queue too (its line
    in ``/proc/net/tcp``, found by the port pair).
    """
    import fcntl
    import struct

    deadline = time.monotonic() + timeout
    lport, rport = sock.getsockname()[1], sock.getpeername()[1]
    table = "/proc/net/tcp6" if ":" in sock.getsockname()[0] else "/proc/net/tcp"
    while time.monotonic() < deadline:
        try:
            queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), 0x5411, b"\0" * 4))[0]
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            break
        unread = None
        for line in lines:
            f_ = line.split()
            if (int(f_[1].rsplit(":", 1)[1], 16) == rport
                    and int(f_[2].rsplit(":", 1)[1], 16) == lport):
                unread = int(f_[4].split(":")[1], 16)
        if unread is None:
            break  # the server is not on this machine
        if not queued and not unread:
            return
        time.sleep(0.01)
    time.sleep(0.5)


def kill_inside_next_write(store: KVStore, at: float) -> None:
    """SIGKILL this process inside ``store``'s next write, before the backend commits it.

    Call it in a child process, inside a ``store.batch()`` block (the next write is then the
    batch). The process dies once the backend has been handed ``at`` (0 < at <= 1) of the
    batch's operations, ``at=1`` meaning all of them but not the commit:

    - LMDB: in the write transaction, after ``LMDBStore._apply`` put that many ops;
    - RocksDB, LevelDB: after that many puts into the backend's write batch, before it is
      written (puts straight into the database count too);
    - Redis: after that share of the batch's bytes was sent (``at=1``: all but the last
      byte of the transaction) and the server has read them.

    Raises
    ------
    NotImplementedError
        For other backends (no known seam inside their commit).
    """
    from tensorkv.stores.leveldb import LevelDBStore
    from tensorkv.stores.lmdb import LMDBStore
    from tensorkv.stores.redis import RedisStore
    from tensorkv.stores.rocksdb import RocksDBStore

    counter = _Counter(at)
    cls: Any = type(store)
    write = cls._write

    def counted_write(self: Any, ops: Any, *, atomic: bool) -> None:
        counter.start(len(ops))
        write(self, ops, atomic=atomic)

    if isinstance(store, LMDBStore):
        apply = cls._apply

        def counted_apply(txn: Any, ops: Any) -> None:
            n, die = counter.take(len(ops))
            apply(txn, ops[:n])
            if die:
                _die()

        cls._apply = staticmethod(counted_apply)
    elif isinstance(store, RocksDBStore):
        import tensorkv.stores.rocksdb as module

        cast("Any", module).rocksdict = _CountingModule(module.rocksdict, counter)
        cast("Any", store)._db = _CountingDB(store._db, counter)
    elif isinstance(store, LevelDBStore):
        cast("Any", store)._db = _CountingDB(store._db, counter)
    elif isinstance(store, RedisStore):
        from redis.connection import AbstractConnection

        send = AbstractConnection.send_packed_command
        total: list[int] = []
        sent = [0]

        def counted_redis_write(self: Any, ops: Any, *, atomic: bool) -> None:
            total.append(sum(len(k) + (0 if v is None else memoryview(v).nbytes)
                             for k, v in ops))
            write(self, ops, atomic=atomic)

        def counted_send(self: Any, command: Any, check_health: bool = True) -> None:
            if not total:
                return send(self, command, check_health)
            items = [command] if isinstance(command, (str, bytes, memoryview)) else command
            data = b"".join(c.encode() if isinstance(c, str) else bytes(c) for c in items)
            goal = total[0] * at
            if sent[0] + len(data) < goal:
                sent[0] += len(data)
                return send(self, [data], check_health)
            cut = len(data) - 1 if at >= 1 else max(0, int(goal) - sent[0])
            send(self, [data[:cut]], check_health)
            _wait_until_read(self._sock)
            _die()

        AbstractConnection.send_packed_command = counted_send  # type: ignore[method-assign]
        cls._write = counted_redis_write
        return
    else:
        raise NotImplementedError(
            f"no known seam to kill a {cls.__name__} inside its commit; its conformance run "
            "skips the killed-mid-batch check"
        )
    cls._write = counted_write
