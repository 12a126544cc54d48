"""A helper thread that shares row-parallel kernels with the training thread.

:func:`run_split` cuts a kernel's rows into chunks that the caller and ONE process-wide helper
thread (:class:`Helper`) claim one at a time; :func:`start` hands the helper a whole
:class:`Task`. Enabled by ``TENSORKV_ASSIST_THREAD``. The rules (GIL-free kernels, disjoint
rows per chunk) and when tiered tables use it: docs/tiers.md ("Helper thread").
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

#: Fewer rows than this run in one call on the calling thread (a hand-off costs ~20-50 us).
MIN_SPLIT_ROWS = 2048
#: Chunks per split: the caller and the helper claim them in turn. Small chunks let a helper
#: that wakes late still take a fair share (16 measured 4 % faster than 4 per step).
CHUNKS = 16

Kernel = Callable[[int, int], None]


class _Split:
    """One kernel cut into chunks; each chunk is claimed once, by the caller or the helper."""

    def __init__(self, fn: Kernel, n: int, chunks: int) -> None:
        self.fn = fn
        self.bounds = [n * i // chunks for i in range(chunks + 1)]
        self.next = 0
        self.running = 0  # chunks claimed by the helper and not finished
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)

    def _claim(self, helper: bool) -> int:
        """The next chunk (-1: none left, or a chunk failed); the helper's count as running."""
        with self.lock:
            i = self.next
            if i >= len(self.bounds) - 1 or self.error is not None:
                return -1
            self.next = i + 1
            self.running += helper
            return i

    def work(self, helper: bool) -> None:
        """Run chunks until none is left; an error stops the others from claiming more."""
        while (i := self._claim(helper)) >= 0:
            try:
                self.fn(self.bounds[i], self.bounds[i + 1])
            except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
                with self.lock:
                    self.error = self.error or e
                if not helper:
                    raise
            finally:
                if helper:
                    with self.lock:
                        self.running -= 1
                        self.idle.notify_all()

    def wait(self) -> BaseException | None:
        """Wait for the helper's running chunks; return the first error of any chunk."""
        with self.lock:
            while self.running:
                self.idle.wait()
            return self.error


class Task:
    """One function run by the helper thread, or by the caller of :meth:`join` if first.

    Returned by :meth:`Helper.start`. Whoever claims it first runs it, once.
    """

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self.claimed = False
        self.result: object = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.done = threading.Event()

    def _claim(self) -> bool:
        with self.lock:
            if self.claimed:
                return False
            self.claimed = True
            return True

    def work(self, helper: bool) -> None:
        """Run the function if no one has claimed it yet (the helper thread's entry)."""
        if not self._claim():
            return
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by join()
            self.error = e
        finally:
            self.done.set()

    def join(self) -> object:
        """The function's result: run it here if the helper has not started it, else wait.

        An exception the function raised is raised here.
        """
        self.work(helper=False)
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class Helper:
    """The process-wide helper thread (started on first use, a daemon)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Split | Task] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tensorkv-assist", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._jobs.get().work(helper=True)

    def run_split(self, fn: Kernel, n: int) -> None:
        """Run ``fn(start, stop)`` over ``[0, n)`` in chunks, shared with the helper.

        Returns once every chunk has run. An exception from a chunk is raised here; chunks
        not yet claimed then do not run (the caller's data may be partly updated, as with a
        kernel that fails midway).
        """
        if n < MIN_SPLIT_ROWS:
            fn(0, n)
            return
        s = _Split(fn, n, CHUNKS)
        self._jobs.put(s)
        try:
            s.work(helper=False)
        finally:
            error = s.wait()
        if error is not None:
            raise error

    def start(self, fn: Callable[[], object]) -> Task:
        """Queue ``fn()`` for the helper thread; :meth:`Task.join` waits for (or runs) it.

        The caller never waits for a task the helper has not started: joining an unclaimed
        task runs it on the joining thread.
        """
        task = Task(fn)
        self._jobs.put(task)
        return task


_helper: Helper | None = None
_helper_lock = threading.Lock()


def _forget_after_fork() -> None:
    """In a forked child: the parent's helper thread does not exist there; start anew."""
    global _helper, _helper_lock
    _helper, _helper_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def helper() -> Helper:
    """The shared :class:`Helper` (created on first call)."""
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = Helper()
        return _helper


def run_split(fn: Kernel, n: int) -> None:
    """:meth:`Helper.run_split` on the shared helper."""
    helper().run_split(fn, n)


def start(fn: Callable[[], object]) -> Task:
    """:meth:`Helper.start` on the shared helper."""
    return helper().start(fn)
