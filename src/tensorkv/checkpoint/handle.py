"""Saves in flight: :class:`SaveHandle`, one pending save per table, what an exit does.

A save takes its snapshot on the calling thread, then writes it (on a background thread with
``blocking=False``). The handle reports the write's outcome and the memory the snapshot
holds; at most one save per table is in flight (the next one waits, or raises
:class:`~tensorkv.errors.SaveInProgressError`); a process that exits waits for its saves or
abandons them (``TENSORKV_SAVE_AT_EXIT``), and an abandoned save publishes no tag. See
docs/reliability.md ("Saves while training").
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must run after ours (see below)
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from tensorkv import config
from tensorkv.embedding.protocol import Table
from tensorkv.errors import SaveCancelledError, SaveInProgressError

_WRITING, _PUBLISHING, _CANCELLED, _DONE = "writing", "publishing", "cancelled", "done"


class SaveHandle:
    """A save whose snapshot is taken and whose data is being written.

    Returned by ``tensorkv.save(..., blocking=False)`` (and ``tensorkv.torch.save``). The
    training loop may go on at once: the tag holds the state of the moment the call was made.

    Attributes
    ----------
    tag
        The tag being saved.
    """

    def __init__(self, tag: str, tables: Iterable[Table]) -> None:
        self.tag = tag
        self.tables = list(tables)
        self._snaps: list[Any] = []
        self._dense_bytes = 0
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._state = _WRITING
        self._result: str | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.snapshot_seconds = 0.0
        self.write_seconds = 0.0
        self._peak = 0
        self._nice = 0

    # --- set up by the save ---------------------------------------------------------------------
    def attach(self, snaps: list[Any], dense_bytes: int, seconds: float) -> None:
        """Record the snapshots taken (released when the save ends) and the dense copies."""
        self._snaps = list(snaps)
        self._dense_bytes = int(dense_bytes)
        self.snapshot_seconds = float(seconds)
        self._peak = self._held()

    def _held(self) -> int:
        return self._dense_bytes + sum(int(s.stats()["bytes"]) for s in self._snaps)

    def run(self, work: Callable[[], str], background: bool, nice: int = 0) -> None:
        """Run the write ``work()`` here, or on a new thread (the handle's outcome either way).

        The new thread runs at niceness ``nice`` (:func:`lower_priority`). Should the thread
        not start, the save ends with that error.
        """
        if not background:
            self._run(work)
            return
        self._nice = nice
        self._thread = threading.Thread(target=self._background, args=(work,), daemon=True,
                                        name=f"tensorkv-save-{self.tag}")
        try:
            self._thread.start()
        except BaseException as e:
            self._error = e
            self._finish(0.0)
            raise

    def _background(self, work: Callable[[], str]) -> None:
        lower_priority(self._nice)
        self._run(work)

    def _run(self, work: Callable[[], str]) -> None:
        t0 = time.perf_counter()
        try:
            self._result = work()
            with self._lock:
                self._state = _DONE
        except BaseException as e:  # kept for result(); the thread ends cleanly
            self._error = e
        finally:
            self._finish(time.perf_counter() - t0)

    def _finish(self, seconds: float) -> None:
        self.write_seconds = seconds
        for s in self._snaps:
            self._peak = max(self._peak, self._dense_bytes + int(s.stats()["peak_bytes"]))
            s.release()
        self._dense_bytes = 0
        _finished(self)
        self._done.set()

    def check(self) -> None:
        """Raise :class:`SaveCancelledError` if the save was cancelled (the writer's check)."""
        if self._state == _CANCELLED:
            raise SaveCancelledError(f"the save of tag {self.tag!r} was cancelled; no tag was "
                                     "published and its data is removed")

    def publishing(self) -> None:
        """The writer is about to publish the tag: from now on :meth:`cancel` returns False."""
        with self._lock:
            self.check()
            self._state = _PUBLISHING

    # --- the user's side ------------------------------------------------------------------------
    def done(self) -> bool:
        """Whether the save has ended (published, failed or cancelled)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the save to end; returns :meth:`done`."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> str:
        """The tag once the save has published it; raises the save's error.

        Raises
        ------
        TimeoutError
            ``timeout`` seconds passed first.
        SaveCancelledError
            The save was cancelled (no tag).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the save of tag {self.tag!r} is still writing after "
                               f"{timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (None if it published its tag); waits like :meth:`result`."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the save of tag {self.tag!r} is still writing after "
                               f"{timeout} s")
        return self._error

    def cancel(self) -> bool:
        """Stop the save before it publishes: no tag, its data is removed.

        Returns True if the tag will not be published (the writer stops at its next chunk),
        False if it is being published or done already.
        """
        with self._lock:
            if self._state == _WRITING:
                self._state = _CANCELLED
            return self._state == _CANCELLED

    def cancelled(self) -> bool:
        """Whether :meth:`cancel` stopped the save."""
        return self._state == _CANCELLED

    def stats(self) -> dict[str, Any]:
        """Where the save is and what it holds.

        Returns
        -------
        dict
            ``state`` (``"writing"``, ``"publishing"``, ``"done"``, ``"failed"``,
            ``"cancelled"``), ``snapshot_seconds`` (the barrier: the training threads'
            pause), ``write_seconds`` (once done), ``snapshot_bytes`` (memory the snapshot
            holds now: dense copies, tier-0 key copies, rows copied before writes, the settled
            keys of lower tiers) and ``peak_snapshot_bytes``.
        """
        state = self._state
        if self.done() and self._error is not None and state != _CANCELLED:
            state = "failed"
        held = 0 if self.done() else self._held()
        self._peak = max(self._peak, held)
        return {"tag": self.tag, "state": state, "snapshot_seconds": self.snapshot_seconds,
                "write_seconds": self.write_seconds, "snapshot_bytes": held,
                "peak_snapshot_bytes": self._peak}

    def __repr__(self) -> str:
        return f"SaveHandle(tag={self.tag!r}, state={self.stats()['state']!r})"


def lower_priority(nice: int) -> None:
    """Lower this thread's CPU priority (and that of the threads it starts) to ``nice``.

    A background save then takes mostly the CPU time training leaves idle (Linux; a thread
    id names one thread there, and raising the niceness needs no privilege). Elsewhere, or
    where it is refused, nothing changes.
    """
    setpriority = getattr(os, "setpriority", None)
    if setpriority is None or not hasattr(threading, "get_native_id"):
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))


# --------------------------------------------------------------------------- one save per table
_lock = threading.Lock()
_by_table: dict[int, SaveHandle] = {}
_all: set[SaveHandle] = set()


def reserve(handle: SaveHandle, policy: str | None = None) -> None:
    """Make ``handle`` the one save in flight of each of its tables (waiting, or raising).

    Raises
    ------
    SaveInProgressError
        A table of the save is still being saved and the policy is ``"error"``.
    """
    pol = config.save_pending(policy)
    while True:
        with _lock:
            busy = [h for t in handle.tables
                    if (h := _by_table.get(id(t))) is not None and not h.done()]
            if not busy:
                for t in handle.tables:
                    _by_table[id(t)] = handle
                _all.add(handle)
                return
        if pol == "error":
            raise SaveInProgressError(
                f"tag {handle.tag!r}: a save of the same table (tag {busy[0].tag!r}) is still "
                "being written; wait for it (handle.result()), or let saves wait for it "
                "(on_pending='wait', TENSORKV_SAVE_PENDING=wait)")
        for h in busy:
            h.wait()


def release(handle: SaveHandle) -> None:
    """Forget ``handle`` as its tables' save in flight (a save that failed before writing)."""
    _finished(handle)


def _finished(handle: SaveHandle) -> None:
    with _lock:
        for t in handle.tables:
            if _by_table.get(id(t)) is handle:
                del _by_table[id(t)]
        _all.discard(handle)


def pending() -> list[SaveHandle]:
    """The saves of this process still writing."""
    with _lock:
        return [h for h in _all if not h.done()]


def _at_exit() -> None:
    """Wait for (or abandon) the saves still writing when the interpreter exits."""
    handles = pending()
    if not handles:
        return
    try:
        policy = config.save_at_exit()
    except Exception:  # a bad setting must not lose the checkpoint: wait
        policy = "wait"
    if policy == "abandon":
        for h in handles:
            h.cancel()
    for h in handles:
        if h._thread is not None and h._thread.is_alive():  # no thread: it cannot finish
            h.wait()


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's save threads: drop their snapshots."""
    global _lock
    _lock = threading.Lock()
    for h in list(_all):
        for s in h._snaps:
            reset = getattr(s, "reset_after_fork", None)
            if reset is not None:
                reset()  # its locks may be held by threads that do not exist here
            s.release()
        h._error = SaveCancelledError(f"the save of tag {h.tag!r} belongs to the parent process")
        h._done.set()
    _by_table.clear()
    _all.clear()


# Run before concurrent.futures' own exit hook (threading's exit hooks run newest first), which
# stops its executors from taking work: a save still writing at exit needs its writer threads.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_at_exit)
else:  # pragma: no cover - older Pythons
    atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["SaveHandle", "lower_priority", "pending", "release", "reserve"]
