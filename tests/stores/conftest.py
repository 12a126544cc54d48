"""A replicated Redis Cluster for the store tests; the other servers are in tests/conftest.py.

Each server starts once per test session (per xdist worker), on demand, and is stopped (with
its temp dir) when the session ends, even after failures. Tests isolate themselves with a
fresh key prefix and a FLUSHALL before they start.
"""

from __future__ import annotations

import itertools
import os

import pytest

import servers

_counter = itertools.count()


@pytest.fixture(scope="session")
def redis_cluster(request):
    """A Redis Cluster of 3 masters with one replica each (here instead of the shared one)."""
    return servers.session_server(request, servers.RedisCluster, replicas=1)


@pytest.fixture
def key_prefix() -> str:
    """A namespace no other test in this session uses."""
    return f"t{os.getpid()}-{next(_counter)}/"
