"""Zero-copy reads of an LMDB store that outlive the call: views pinned to a read snapshot.

:meth:`LMDBStore.get_many_views <tensorkv.stores.lmdb.LMDBStore.get_many_views>` finds each
value inside LMDB's memory map, then hands out a read-only numpy array over the same bytes of
``data.mdb`` in a second, read-only map of the file that this module owns (a :class:`FileMap`).
LMDB's own map may move when it is resized; the second map does not. The read transaction
the values came from stays open (a :class:`Pin`) for as long as any array lives, so LMDB does
not reuse the pages under them: tie-in is by reference, each array's base holding its pin.

A resize of the map in this process ends every open transaction (py-lmdb aborts them).
Before it, views whose value was deleted or rewritten since they were lent are copied out in
place (:func:`freeze_moved`); after it, each live pin holds the newest snapshot
(:func:`renew`), which still holds every other view's value where it was.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from typing import Any

import lmdb
import numpy as np

from tensorkv import pages

PROT_READ, PROT_WRITE, MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANON = 1, 2, 1, 2, 0x10, 0x20


def _libc_fn(name: str, argtypes: list[Any], restype: Any) -> Any:
    import ctypes

    fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_FNS: dict[str, Any] = {}


def _mmap_fns() -> tuple[Any, Any]:
    if not _FNS:
        import ctypes

        _FNS["mmap"] = _libc_fn("mmap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                         ctypes.c_int, ctypes.c_int, ctypes.c_int64],
                                ctypes.c_void_p)
        _FNS["munmap"] = _libc_fn("munmap", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int)
        _FNS["mprotect"] = _libc_fn("mprotect", [ctypes.c_void_p, ctypes.c_size_t,
                                                 ctypes.c_int], ctypes.c_int)
    return _FNS["mmap"], _FNS["munmap"]


#: Whether views can be lent here (libc ``mmap`` and ``/proc/self/maps``: Linux).
SUPPORTED = sys.platform.startswith("linux")


class FileMap:
    """A read-only shared map of ``data.mdb`` of ``length`` bytes (may exceed the file).

    Only bytes inside the file are ever read through it (committed values), so the part
    past the end of the file is never touched. Unmapped when the last array using it dies.
    """

    def __init__(self, path: str, length: int) -> None:
        mmap_fn, _ = _mmap_fns()
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            addr = mmap_fn(None, length, PROT_READ, MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr is None or addr == 2**64 - 1:  # MAP_FAILED
            import ctypes

            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {path!r} ({length} bytes) failed: {os.strerror(err)}")
        self.addr = int(addr)
        self.length = length
        self.inode = (st.st_dev, st.st_ino)
        weakref.finalize(self, _mmap_fns()[1], self.addr, length)


class Pin:
    """An open read transaction kept for the arrays made from it (see the module docstring)."""

    def __init__(self, txn: lmdb.Transaction, state: ViewState) -> None:
        self.txnid = -1
        self.lent: list[tuple[bytes, int, int, int]] = []  # key, file offset, size, address
        self._fin: Any = None
        self.hold(txn, state)
        state.pins.add(self)

    def hold(self, txn: lmdb.Transaction, state: ViewState) -> None:
        """Keep ``txn`` open until this pin dies.

        The transaction is then ended by whoever next enters the store, never by the
        finalizer itself: the last array may die in any thread, even one holding the
        store's resize gate.
        """
        if self._fin is not None:
            self._fin.detach()
        self.txnid = txn.id()
        self._fin = weakref.finalize(self, state.dead_txns.append, txn)


class _View:
    """Exposes a pinned byte range to numpy; the arrays made from it keep it (and its pin)."""

    __slots__ = ("__array_interface__", "fmap", "pin")

    def __init__(self, addr: int, n: int, fmap: FileMap, pin: Pin) -> None:
        self.__array_interface__ = {"data": (addr, True), "shape": (n,), "typestr": "|u1",
                                    "version": 3}
        self.fmap, self.pin = fmap, pin


def abort_quietly(txn: lmdb.Transaction) -> None:
    """End a read transaction (one a resize or a close already ended is left alone)."""
    with contextlib.suppress(lmdb.Error):
        txn.abort()


def drain(shared: Any) -> None:
    """End the transactions of pins no array uses any more (thread-safe, never blocks)."""
    dead = shared.dead_txns
    while dead:
        try:
            txn = dead.pop()
        except IndexError:  # pragma: no cover - another thread took the last one
            break
        abort_quietly(txn)


def freeze_moved(state: ViewState, path: str, env: lmdb.Environment) -> int:
    """Before a resize ends the pins' transactions: copy out views whose value moved.

    A view whose key still holds the same bytes at the same place in the newest snapshot
    stays pinned by that snapshot once :func:`renew` runs. The others (their value was
    deleted or rewritten since) get their pages replaced, at the same address, by a private
    copy of their bytes, since LMDB may now reuse those pages. Runs with the gate held
    exclusively, before LMDB's map moves. Returns how many views were copied.
    """
    pins = [p for p in list(state.pins) if p.lent]
    if not pins:
        return 0
    data = os.path.join(path, "data.mdb")
    txn = env.begin(buffers=True)
    frozen = 0
    try:
        newest = txn.id()
        for pin in pins:
            if pin.txnid == newest:
                continue
            for key, off, n, addr in pin.lent:
                v = txn.get(key)
                if v is not None and len(v) == n:
                    at = np.frombuffer(v, np.uint8).ctypes.data
                    base = state.base
                    if base is None or not base[0] <= at < base[1]:
                        base = state.base = map_base(data, at)
                    if base is not None and at - base[0] == off:
                        continue
                _freeze(addr, n)
                frozen += 1
    finally:
        abort_quietly(txn)
    return frozen


def _freeze(addr: int, n: int) -> None:
    """Replace the pages under ``addr..addr+n`` by private read-only copies of their bytes."""
    import ctypes

    mmap_fn, _ = _mmap_fns()
    page = os.sysconf("SC_PAGE_SIZE")
    lo, hi = addr // page * page, -(-(addr + n) // page) * page
    saved = ctypes.string_at(lo, hi - lo)
    got = mmap_fn(lo, hi - lo, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED | MAP_ANON, -1,
                  0)
    if got != lo:  # pragma: no cover - MAP_FIXED over our own mapping does not fail
        raise OSError(ctypes.get_errno(), "mmap(MAP_FIXED) failed while copying out a view")
    ctypes.memmove(lo, saved, hi - lo)
    _FNS["mprotect"](lo, hi - lo, PROT_READ)


def renew(state: ViewState, env: lmdb.Environment) -> None:
    """After a resize ended every transaction: open a new one for each live pin.

    Runs while the store's gate is held exclusively (no transaction of this process runs).
    """
    state.dead_txns.clear()  # the resize ended them all
    state.forget_map()
    for pin in list(state.pins):
        pin.hold(env.begin(buffers=True), state)


def map_base(path: str, addr: int) -> tuple[int, int] | None:
    """(start, end) of the mapping of ``path`` holding address ``addr``, from file offset 0.

    Read from ``/proc/self/maps``; None where that is missing or no mapping holds it.
    """
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].rstrip("\n") == real:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    if lo <= addr < hi:
                        start = lo - int(parts[2], 16)
                        return start, hi
    except OSError:  # pragma: no cover - no /proc
        return None
    return None


class ViewState:
    """Per-environment state of the views: pins, the second map, LMDB's map base (cached)."""

    def __init__(self) -> None:
        self.pins: weakref.WeakSet[Pin] = weakref.WeakSet()
        self.dead_txns: list[lmdb.Transaction] = []
        self.current_pin: Pin | None = None
        self.fmap: FileMap | None = None
        self.fmaps: weakref.WeakSet[FileMap] = weakref.WeakSet()  # every live second map
        self.base: tuple[int, int] | None = None  # LMDB's map: (start, end) of the mapping
        self.ranges: list[tuple[int, int]] | None = None  # LMDB's map, for madvise
        self.lock = threading.Lock()

    def forget_map(self) -> None:
        """LMDB's map moved (a resize or a reopen): look its address up again."""
        self.base = None
        self.ranges = None
        self.current_pin = None

    def lmdb_ranges(self, data: str) -> list[tuple[int, int]]:
        """Address ranges of LMDB's own map of ``data`` (not the second maps); cached."""
        if self.ranges is None:
            ours = [(f.addr, f.addr + f.length) for f in list(self.fmaps)]
            self.ranges = [(lo, hi) for lo, hi in pages.file_mappings(data)
                           if not any(a < hi and lo < b for a, b in ours)]
        return self.ranges


def read(state: ViewState, path: str, env: lmdb.Environment, keys: list[bytes],
         max_key: int) -> list[np.ndarray | None]:
    """Read ``keys`` in a new transaction and :func:`lend` them (keys LMDB cannot hold: None).

    The caller holds the store's gate.
    """
    txn = env.begin(buffers=True)
    try:
        got = [txn.get(k) if len(k) <= max_key else None for k in keys]
        return lend(state, path, env, txn, keys, got)
    except BaseException:
        abort_quietly(txn)
        raise


def lend(state: ViewState, path: str, env: lmdb.Environment, txn: lmdb.Transaction,
         keys: list[bytes], values: list[memoryview | None]) -> list[np.ndarray | None]:
    """Turn values read in ``txn`` into pinned arrays; keeps ``txn`` (or ends it, see below).

    The caller holds the store's gate (no resize can run). When a live pin already holds the
    same snapshot, ``txn`` is ended and that pin serves: one reader slot per snapshot in use.
    """
    data = os.path.join(path, "data.mdb")
    with state.lock:
        pin = state.current_pin
        keep = pin is None or pin.txnid != txn.id()
        if pin is None or keep:
            pin = state.current_pin = Pin(txn, state)
        fmap = state.fmap
        if fmap is not None and not _same_file(fmap, data):  # compacted: a new file
            fmap = None
        out: list[np.ndarray | None] = []
        for v in values:
            if v is None:
                out.append(None)
                continue
            n = len(v)
            if not n:
                out.append(_EMPTY)
                continue
            addr = np.frombuffer(v, np.uint8).ctypes.data
            base = state.base
            if base is None or not base[0] <= addr < base[1]:
                base = state.base = map_base(data, addr)
                if base is None:  # pragma: no cover - no /proc: the caller copies instead
                    raise OSError(f"cannot find the map of {data!r} in /proc/self/maps")
            off = addr - base[0]
            if fmap is None or off + n > fmap.length:
                fmap = FileMap(data, max(int(env.info()["map_size"]), off + n))
                state.fmaps.add(fmap)
            out.append(np.asarray(_View(fmap.addr + off, n, fmap, pin)))
            pin.lent.append((keys[len(out) - 1], off, n, fmap.addr + off))
        state.fmap = fmap
    if not keep:
        abort_quietly(txn)  # a live pin holds the same snapshot
    return out


_EMPTY = np.empty(0, np.uint8)
_EMPTY.flags.writeable = False


def _same_file(fmap: FileMap, data: str) -> bool:
    st = os.stat(data)
    return fmap.inode == (st.st_dev, st.st_ino)
