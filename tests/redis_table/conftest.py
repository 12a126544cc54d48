"""Real Redis servers for the Redis-resident table tests, and a table factory.

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


@pytest.fixture(autouse=True)
def _no_redis_config_env(monkeypatch):
    """Keep a TENSORKV_REDIS_CONFIG_PATH from the caller's shell out of the tests."""
    monkeypatch.delenv("TENSORKV_REDIS_CONFIG_PATH", raising=False)



@pytest.fixture(scope="session")
def redis_acl_server(request):
    """A redis-server whose default user is disabled; user ``app`` / password ``s3cret``."""
    return servers.session_server(request, servers.RedisServer, username="app", password="s3cret")


@pytest.fixture(scope="session")
def redis_tls_server(request):
    """A TLS-only redis-server that requires client certificates."""
    return servers.session_server(request, servers.RedisServer, tls=True)
