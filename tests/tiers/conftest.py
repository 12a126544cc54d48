"""Fixtures for tier tests: a session-scoped real redis-server when one is installed."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import servers  # noqa: E402


@pytest.fixture(scope="session")
def redis_server(request):
    """A plain standalone redis-server for the session."""
    if not servers.available():
        pytest.skip("redis-server / redis-cli are not installed")
    server = servers.RedisServer()
    request.addfinalizer(server.stop)
    return server.start()
