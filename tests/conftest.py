"""Fixtures shared by every test package: no progress bars, real redis-servers (plain, TLS, ACL)."""

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


@pytest.fixture(autouse=True)
def _no_redis_config_env(monkeypatch):
    """Keep a TENSORKV_REDIS_CONFIG_PATH from the caller's shell out of the tests."""
    monkeypatch.delenv("TENSORKV_REDIS_CONFIG_PATH", raising=False)
