"""Shared-memory buffers between a client and the shards on its own node.

A large pull or push through Ray's object store costs an object created, sealed, mapped and
read in two processes per array each way; between processes of one node the client instead
keeps, per shard, a request buffer (keys, counts, gradients) and a reply buffer (rows) in
files under ``/dev/shm``, mapped once by both sides and reused. The Ray call then carries
only a small descriptor; the shard reads the request in place and writes the rows straight
into the reply buffer. Each buffer serves one request at a time: a request that finds it busy
(updates in flight in ``"async"`` mode) takes Ray's path, as do replays, shards on other
nodes and platforms without ``/dev/shm``.

Files are named ``tkv-<pid>-...``; the client removes them when it is collected or exits, and
removes those of dead processes when it makes new ones.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import uuid
import weakref
from typing import Any, NamedTuple

import numpy as np

SHM_DIR = "/dev/shm"
#: Answer of a shard that cannot map a client's buffer (it runs on another node).
NO_SHM = "noshm"


class Rows(NamedTuple):
    """The rows of an answer are the first ``m`` rows of the client's reply buffer."""

    m: int
    dim: int

_PREFIX = "tkv-"
_count = itertools.count()


def available(directory: str = SHM_DIR) -> bool:
    """Whether shared-memory files can be made in ``directory``."""
    return os.path.isdir(directory) and os.access(directory, os.W_OK)


def sweep(directory: str = SHM_DIR) -> int:
    """Remove the buffer files of processes that no longer run; how many."""
    n = 0
    with contextlib.suppress(OSError):
        for f in os.listdir(directory):
            if not f.startswith(_PREFIX):
                continue
            pid = f[len(_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, f))
                    n += 1
    return n


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            try:  # the memory now, or ENOSPC now: never a SIGBUS when a page is first used
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.unlink(path)
                raise
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class Buffer:
    """One growable shared-memory buffer of the client (a file mapped here).

    ``path`` changes when it grows (a new file; the old one is removed), so a shard that
    mapped the old one notices from the descriptor.
    """

    def __init__(self, directory: str, tag: str) -> None:
        self.directory = directory
        self.tag = tag
        self.path = ""
        self.size = 0
        self.mem: mmap.mmap | None = None
        self.holders: list[Any] = []  #: object refs of the requests using it
        self.address = 0  #: where it is mapped in this process

    def ensure(self, nbytes: int) -> None:
        """Make room for ``nbytes`` (a new, larger file when needed).

        Raises ``OSError`` when ``/dev/shm`` has no room (the buffer is then empty).
        """
        if nbytes <= self.size:
            return
        size = max(1 << 20, 1 << (int(nbytes) - 1).bit_length())
        self.close()
        path = os.path.join(self.directory,
                            f"{_PREFIX}{os.getpid()}-{self.tag}-{next(_count)}")
        mem = _map(path, size, True)
        whole = np.frombuffer(mem, np.uint8)
        whole[::4096] = 0  # map every page now, not in the hot path
        self.path, self.size, self.mem = path, size, mem
        self.address = int(whole.ctypes.data)

    def offset_of(self, a: np.ndarray) -> int:
        """Where array ``a`` starts in the buffer, or -1 if it is not a contiguous view of it."""
        if self.mem is None or not a.flags.c_contiguous:
            return -1
        at = int(a.__array_interface__["data"][0]) - self.address
        return at if at >= 0 and at + a.nbytes <= self.size else -1

    def array(self, offset: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        """A view of the buffer."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape))
        if self.mem is None:
            raise ValueError("the shared-memory buffer is closed")
        return np.frombuffer(self.mem, dt, n, offset).reshape(shape)

    def close(self) -> None:
        """Unmap and remove the file."""
        if self.path:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        if self.mem is not None:
            with contextlib.suppress(BufferError):  # views still alive: the GC unmaps it
                self.mem.close()
        self.path, self.size, self.mem, self.address = "", 0, None, 0


class Link:
    """A client's request and reply buffers, one pair per shard.

    Parameters
    ----------
    num_shards
        Number of shards.
    directory
        Where the files go (``/dev/shm``).
    """

    def __init__(self, num_shards: int, directory: str = SHM_DIR) -> None:
        sweep(directory)
        tag = uuid.uuid4().hex[:8]
        self.request = [Buffer(directory, f"{tag}-{s}q") for s in range(num_shards)]
        self.reply = [Buffer(directory, f"{tag}-{s}r") for s in range(num_shards)]
        self.staging = Buffer(directory, f"{tag}-st")  #: a push's keys and sums, all shards
        self.enabled = [True] * num_shards
        self._finalizer = weakref.finalize(self, _close_all, os.getpid(),
                                           [*self.request, *self.reply, self.staging])

    def close(self) -> None:
        """Remove every buffer file."""
        self._finalizer()


def _close_all(pid: int, buffers: list[Buffer]) -> None:
    if os.getpid() != pid:  # a forked child: the files are its parent's
        return
    for b in buffers:
        b.close()


class Mapped:
    """The shard's side: the buffers of its clients, mapped by path (the newest per buffer)."""

    def __init__(self) -> None:
        self.maps: dict[str, tuple[str, mmap.mmap]] = {}

    def array(self, desc: tuple) -> np.ndarray:
        """The array a descriptor ``(path, size, offset, dtype, shape)`` names.

        Raises ``OSError`` when the file cannot be mapped (a shard on another node).
        """
        path, size, offset, dtype, shape = desc
        key = path.rsplit("-", 1)[0]
        have = self.maps.get(key)
        if have is None or have[0] != path:
            mem = _map(path, size, False)
            if have is not None:
                with contextlib.suppress(BufferError):
                    have[1].close()
            else:
                self._forget_gone()
            self.maps[key] = have = (path, mem)
        dt = np.dtype(dtype)
        return np.frombuffer(have[1], dt, int(np.prod(shape)), offset).reshape(shape)


    def _forget_gone(self) -> None:
        """Unmap the buffers whose files are gone (their clients ended): frees their memory."""
        for key, (path, mem) in list(self.maps.items()):
            if not os.path.exists(path):
                del self.maps[key]
                with contextlib.suppress(BufferError):
                    mem.close()


def descriptor(buf: Buffer, offset: int, dtype: Any, shape: tuple[int, ...]) -> tuple:
    """The descriptor of a view of ``buf`` that :meth:`Mapped.array` opens."""
    return (buf.path, buf.size, int(offset), np.dtype(dtype).str, tuple(int(x) for x in shape))


__all__ = ["NO_SHM", "Buffer", "Link", "Mapped", "Rows", "available", "descriptor", "sweep"]
