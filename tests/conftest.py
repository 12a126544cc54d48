"""Fixtures and lanes shared by every test package.

Shared servers (one of each per test process; with ``pytest -n`` each worker has its own):

- ``redis_server``: a plain standalone redis-server; ``redis_tls_server`` (mutual TLS) and
  ``redis_acl_server`` (user ``app`` / password ``s3cret``).
- ``redis_cluster``: a Redis Cluster of 3 masters, no replicas.
- ``redis_sentinel``: a master, a replica and three sentinels for service ``mymaster``.

They start on first use and stop when the session ends. Tests share them by key prefix (a
fresh one per test: ``servers.prefix()``); a test that kills, restarts or reconfigures a server
starts its own (``servers.RedisServer(...)``), never a shared one.

Lanes: tests listed in ``SLOW`` below are marked ``slow`` (``make test-fast`` leaves them
out); the Ray tests share one xdist group, so one worker runs them all on one local Ray.
"""

from __future__ import annotations

import os

import pytest

import servers

os.environ.setdefault("TENSORKV_PROGRESS", "0")

#: Node-id prefixes of the ``slow`` tests (still run by ``make test``), with the reason.
#: A prefix is a file, a test, or one parametrized case.
SLOW: dict[str, str] = {}

#: Node-id prefixes of the tests that start or use a local Ray: one xdist group.
RAY = ("tests/distributed/", "tests/test_docs.py::test_doc_block_runs[docs/distributed.md")


def _matches(nodeid: str, prefix: str) -> bool:
    return nodeid == prefix or (nodeid.startswith(prefix) and (
        prefix.endswith(("/", ".py", "[")) or nodeid[len(prefix)] in ":["))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the ``SLOW`` tests slow; put the Ray tests in one xdist group."""
    xdist = config.pluginmanager.hasplugin("xdist")
    for item in items:
        nodeid = item.nodeid
        if any(_matches(nodeid, p) for p in SLOW):
            item.add_marker(pytest.mark.slow)
        if xdist and any(nodeid.startswith(p) for p in RAY):
            item.add_marker(pytest.mark.xdist_group("ray"))


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
def redis_cluster(request):
    """A Redis Cluster of 3 masters (no replicas), shared by key prefix."""
    return servers.session_server(request, servers.RedisCluster)


@pytest.fixture(scope="session")
def redis_sentinel(request):
    """A master, a replica and three sentinels (quorum 2) for service ``mymaster``."""
    return servers.session_server(request, servers.RedisSentinel)


@pytest.fixture(autouse=True)
def _no_redis_config_env(monkeypatch):
    """Keep a TENSORKV_REDIS_CONFIG_PATH from the caller's shell out of the tests."""
    monkeypatch.delenv("TENSORKV_REDIS_CONFIG_PATH", raising=False)
