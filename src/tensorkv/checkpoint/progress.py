"""Progress bars for long saves and loads (tqdm, shown only after a delay, on terminals)."""

from __future__ import annotations

from typing import Any

from tensorkv import config


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total: int, desc: str, progress: bool | None) -> Any:
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
