"""Progress bars for long saves and loads (tqdm, shown only after a delay, on terminals).

Saves and loads count the bytes of the records they write or read (``docs/format.md`` says
which records) into a bar from :func:`bar`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tensorkv import config

#: What checkpoint code calls with each count of bytes done (a progress bar's ``update``).
OnBytes = Callable[[int], object]


class ProgressBar(Protocol):
    """What :func:`bar` returns: a tqdm bar, or an object that draws nothing."""

    def update(self, n: int) -> object:
        """Count ``n`` more bytes done."""

    def close(self) -> None:
        """Remove the bar."""


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total: int, desc: str, progress: bool | None) -> ProgressBar:
    """A byte-counting progress bar.

    Drawn only when :func:`tensorkv.config.progress_enabled` says so (explicit ``progress``,
    then ``TENSORKV_PROGRESS``, then whether stderr is a terminal), and only once the work has
    taken ``config.PROGRESS_MIN_SECONDS`` (tqdm's ``delay``), so short operations print nothing.
    """
    if not config.progress_enabled(progress):
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        delay=config.PROGRESS_MIN_SECONDS,
        leave=False,
    )
