"""Session fixtures shared by every test package: no progress bars, a real redis-server."""

import os
import sys

import pytest

os.environ.setdefault("TENSORKV_PROGRESS", "0")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import servers  # noqa: E402


@pytest.fixture(scope="session")
def redis_server(request):
    """A plain standalone redis-server for the session (skips if none is installed)."""
    return servers.session_server(request, servers.RedisServer)
