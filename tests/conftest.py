"""Fixtures shared by every test package: no progress bars, real redis-servers (plain, TLS, ACL,
Sentinel)."""

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


@pytest.fixture(scope="session")
def redis_tls_server(request):
    """A TLS-only redis-server that requires client certificates."""
    return servers.session_server(request, servers.RedisServer, tls=True)


@pytest.fixture(scope="session")
def redis_acl_server(request):
    """A redis-server whose default user is disabled; user ``app`` / password ``s3cret``."""
    return servers.session_server(request, servers.RedisServer, username="app", password="s3cret")


@pytest.fixture(scope="session")
def redis_sentinel(request):
    """A master, a replica and three sentinels (quorum 2) for service ``mymaster``."""
    return servers.session_server(request, servers.RedisSentinel)


@pytest.fixture(autouse=True)
def _no_redis_config_env(monkeypatch):
    """Keep the Redis config variables of the caller's shell (ours, TFRA's) out of the tests."""
    for name in ("TENSORKV_REDIS_CONFIG_PATH", "TFRA_REDIS_CONFIG_PATH"):
        monkeypatch.delenv(name, raising=False)
