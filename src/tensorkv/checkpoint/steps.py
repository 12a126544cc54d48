"""Training steps and saves: :class:`StepScope`, so a snapshot lands between two steps.

A training step is several table operations (a lookup that inserts, then an update) and a
dense optimizer step. A save's snapshot is taken between two *operations*; to have it taken
between two *steps*, the training loop holds a step scope shared for each step and the save
takes it exclusively while it takes its snapshot (writer-preferring: a waiting save holds new
steps off, so it never starves). ``tensorkv.torch.Optimizer`` opens the default scope at a
module's first forward pass of a step and closes it in ``step()``; other loops write
``with tensorkv.training_step(): ...``. See docs/torch.md ("Saving while training").
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from tensorkv.errors import StepScopeError


class StepScope:
    """A writer-preferring readers-writer lock: training steps shared, snapshots exclusive.

    Shared holds are per thread and reentrant (a thread inside a step may enter it again),
    and the thread holding it exclusively may enter steps too. :meth:`open` / :meth:`close`
    hold a step across calls (``tensorkv.torch.Optimizer`` opens one at a forward pass and
    closes it in ``step()``).
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._depth: dict[int, int] = {}  # thread id -> shared holds
        self._open: set[int] = set()  # threads with a step opened by open()
        self._writer: int | None = None
        self._waiting = 0

    def _acquire(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if me in self._depth:
                self._depth[me] += 1
                return
            if self._writer != me:
                while self._writer is not None or self._waiting:
                    self._cond.wait()
            self._depth[me] = 1

    def _release(self) -> None:
        me = threading.get_ident()
        with self._cond:
            d = self._depth.get(me, 0) - 1
            if d > 0:
                self._depth[me] = d
                return
            self._depth.pop(me, None)
            self._cond.notify_all()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One training step: saves that wait for this scope take their snapshot before or after.

        Examples
        --------
        >>> import tensorkv
        >>> scope = tensorkv.StepScope()
        >>> with scope.step():
        ...     pass  # lookups, backward, optimizer step
        >>> scope.held()
        False
        """
        self._acquire()
        try:
            yield
        finally:
            self._release()

    def open(self) -> None:
        """Open a step on this thread (if none is open); :meth:`close` ends it."""
        me = threading.get_ident()
        if me in self._open:
            return
        self._acquire()
        self._open.add(me)

    def close(self) -> None:
        """End the step :meth:`open` opened on this thread (if any)."""
        me = threading.get_ident()
        if me not in self._open:
            return
        self._open.discard(me)
        self._release()

    def held(self) -> bool:
        """Whether this thread is inside a step of this scope."""
        with self._cond:
            return threading.get_ident() in self._depth

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Wait until no step runs, hold new ones off inside (what a save's snapshot does).

        Raises
        ------
        StepScopeError
            This thread is inside a step of this scope: it would wait for itself.
        """
        me = threading.get_ident()
        with self._cond:
            if me in self._depth:
                raise StepScopeError(
                    "this thread is inside a training step (tensorkv.training_step(), or "
                    "between a dynamic module's forward pass and Optimizer.step()), and a save "
                    "waits for steps to end: save after the step, from another thread, or pass "
                    "step_scope=False to take the snapshot between two table operations")
            self._waiting += 1
            try:
                while self._writer is not None or self._depth:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._writer = me
        try:
            yield
        finally:
            with self._cond:
                self._writer = None
                self._cond.notify_all()


_DEFAULT = StepScope()
if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's steps running
    os.register_at_fork(after_in_child=_DEFAULT._reset)


def default_scope() -> StepScope:
    """The process-wide scope ``training_step()``, saves and ``tensorkv.torch`` use by default."""
    return _DEFAULT


def training_step() -> contextlib.AbstractContextManager[None]:
    """``with tensorkv.training_step(): ...``: one step; saves snapshot before or after it.

    Examples
    --------
    >>> import numpy as np
    >>> import tensorkv
    >>> table = tensorkv.EmbeddingTable(4)
    >>> for step in range(3):
    ...     with tensorkv.training_step():
    ...         keys = np.array([1, 2, 3]) + step
    ...         rows = table.lookup(keys)
    ...         _ = table.apply_gradients(keys, np.ones_like(rows))
    """
    return _DEFAULT.step()


__all__ = ["StepScope", "default_scope", "training_step"]
