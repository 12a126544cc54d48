"""A process racing others to take over one stale claim (see test_concurrent_savers.py).

:func:`race` runs in a child process (``multiprocessing`` spawn context). Every racer first
reads the stale marker, then waits at ``read`` until all racers have read it, so each one
decides to take the claim over from the same dead owner before any of them writes: only the
compare-and-set in :func:`tensorkv.checkpoint.claims.claim` can then let exactly one win.
The racers hold what they got until all have reported (``done``): a winner that exited early
would leave a dead claim for the next one.
"""

from __future__ import annotations

from typing import Any

import tensorkv
from tensorkv.checkpoint import claims
from tensorkv.errors import TagExistsError


def race(url: str, key: bytes, read: Any, done: Any, results: Any) -> None:
    """Try to claim ``key`` after every racer has read the stale marker; report the outcome."""
    store = tensorkv.open_store(url)
    real_get, first = store.get, [True]

    def get(k: bytes, default: bytes | None = None) -> bytes | None:
        value = real_get(k, default)
        if first[0]:
            first[0] = False
            read.wait(60)  # every racer holds the same stale marker now
        return value

    store.get = get  # type: ignore[method-assign]
    c = None
    try:
        c = claims.claim(store, key, "tag 'same'")
        results.put(("won", c.took_over is not None))
    except TagExistsError as e:
        results.put(("exists", str(e)))
    except BaseException as e:  # reported, so the test shows it
        results.put(("error", repr(e)))
    finally:
        done.wait(60)
        if c is not None:
            claims.release(c)
        store.close()
