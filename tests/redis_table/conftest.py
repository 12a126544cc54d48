"""Model tags for the Redis-resident table tests (the servers: tests/conftest.py).

Each test names its own model tag (``tag``), so tests share one server without flushing
between them; servers start once per session and stop at its end.
"""

from __future__ import annotations

import itertools
import os

import pytest

_counter = itertools.count()


@pytest.fixture
def tag() -> str:
    """A model tag no other test in this session uses."""
    return f"m{os.getpid()}x{next(_counter)}"

