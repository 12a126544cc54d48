"""The shared background write-back pool of tiered embedding tables.

:func:`pool` is one thread pool for the process (``TENSORKV_EVICTION_THREADS`` threads); each
table owns a :class:`WriteQueue`, whose jobs run in order, one at a time, and whose failures
:meth:`WriteQueue.check` / :meth:`WriteQueue.flush` re-raise. See docs/tiers.md ("Write-back
pool").
"""

from __future__ import annotations

import atexit
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tensorkv import config
from tensorkv.errors import WriteBackError

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def pool() -> ThreadPoolExecutor:
    """The process-wide write-back pool (created lazily with ``eviction_threads()`` workers)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=config.eviction_threads(), thread_name_prefix="tensorkv-writeback"
            )
        return _pool


def pool_threads() -> int:
    """Worker threads of the shared pool (0 before it is created)."""
    with _pool_lock:
        return 0 if _pool is None else int(_pool._max_workers)


def shutdown() -> None:
    """Stop the shared pool after its queued jobs (a later submit creates a new one)."""
    global _pool
    with _pool_lock:
        p, _pool = _pool, None
    if p is not None:
        p.shutdown(wait=True)


atexit.register(shutdown)


class WriteQueue:
    """An ordered job queue of one table, run on the shared pool.

    Parameters
    ----------
    name
        Used in error messages.
    """

    def __init__(self, name: str = "table") -> None:
        self.name = name
        self._jobs: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._running = False
        self._error: BaseException | None = None
        self.completed = 0

    def submit(self, job: Callable[[], None], first: bool = False) -> None:
        """Queue ``job``; it runs after every job queued before it.

        ``first``: run it next instead, before the queued jobs (after the running one); for
        jobs whose order against the others does not matter (a prefetch).
        """
        with self._cond:
            if not first:
                self._jobs.append(job)
            elif self._running and self._jobs:
                self._jobs.insert(1, job)  # jobs[0] is running
            else:
                self._jobs.appendleft(job)
            if self._running:
                return
            self._running = True
        try:
            pool().submit(self._drain)
        except RuntimeError:  # interpreter shutting down: run inline
            self._drain()

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._jobs or self._error is not None:
                    self._running = False
                    self._cond.notify_all()
                    return
                job = self._jobs[0]
            try:
                job()
            except BaseException as e:  # kept and re-raised on the caller's thread
                with self._cond:
                    self._error = e
                    self._running = False
                    self._cond.notify_all()
                return
            with self._cond:
                self._jobs.popleft()
                self.completed += 1
                self._cond.notify_all()

    def cancel(self, job: Callable[[], None]) -> bool:
        """Remove ``job`` if it has not started; returns whether it was removed."""
        with self._cond:
            if self._running and self._jobs and self._jobs[0] is job:
                return False  # running (or about to)
            try:
                self._jobs.remove(job)
            except ValueError:
                return False  # done
            self._cond.notify_all()
            return True

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cond:
            return len(self._jobs)

    def wait_below(self, n_jobs: int) -> None:
        """Block until fewer than ``n_jobs`` jobs are queued (or a job failed)."""
        with self._cond:
            while len(self._jobs) >= max(n_jobs, 1) and self._error is None and self._running:
                self._cond.wait()
        self.check()

    def check(self) -> None:
        """Re-raise (once) the error of a failed job as :class:`WriteBackError`.

        The failed job stays first in the queue; :meth:`flush` runs it again.
        """
        with self._cond:
            err, self._error = self._error, None
        if err is not None:
            raise WriteBackError(
                f"a background write of evicted rows of {self.name} failed: {err!r}. The rows "
                "are kept in memory; fix the cause (disk space, store connection) and call "
                "flush() to retry"
            ) from err

    def flush(self) -> None:
        """Run every queued job to completion; re-raise a job's error."""
        self.check()
        with self._cond:
            idle = not self._running and bool(self._jobs)
        if idle:  # jobs left by an earlier failure: restart them
            with self._cond:
                self._running = True
            pool().submit(self._drain)
        with self._cond:
            while (self._jobs or self._running) and self._error is None:
                self._cond.wait()
        self.check()


__all__ = ["WriteQueue", "pool", "pool_threads", "shutdown"]
