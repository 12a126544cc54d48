"""Model tags for the Redis-resident table tests (the servers: tests/conftest.py).

Each test names its own model tag (``tag``), so tests share one server without flushing
between them; servers start once per session and stop at its end.
"""

from __future__ import annotations

import itertools
import os

import pytest

import servers

_counter = itertools.count()


@pytest.fixture
def tag() -> str:
    """A model tag no other test in this session uses."""
    return f"m{os.getpid()}x{next(_counter)}"


@pytest.fixture
def own_server():
    """A standalone server of this test alone (it is restarted or flushed)."""
    if not servers.available():
        pytest.skip("redis-server is not installed")
    srv = servers.RedisServer()
    srv.start()
    yield srv
    srv.stop()
