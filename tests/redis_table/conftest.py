"""A Redis Cluster and model tags for the Redis-resident table tests.

Each test names its own model tag (``tag``), so tests share one server without flushing
between them; servers start once per session and stop at its end.
"""

from __future__ import annotations

import itertools
import os

import pytest

import servers

_counter = itertools.count()


@pytest.fixture(scope="session")
def redis_cluster(request):
    """A Redis Cluster of 3 masters (no replicas)."""
    return servers.session_server(request, servers.RedisCluster)


@pytest.fixture
def tag() -> str:
    """A model tag no other test in this session uses."""
    return f"m{os.getpid()}x{next(_counter)}"


@pytest.fixture(scope="session")
def redis_sentinel(request):
    """A master, a replica and three sentinels (quorum 2) for service ``mymaster``."""
    return servers.session_server(request, servers.RedisSentinel)
