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
out). With ``pytest -n N --dist loadgroup`` (``make test``), one worker runs every test listed
in ``GROUPS["ray"]`` on one local Ray, started first since it is the longest unit; every other
test goes to whichever worker is free.
"""

from __future__ import annotations

import os

import pytest

import servers

os.environ.setdefault("TENSORKV_PROGRESS", "0")

#: Node-id prefixes of the ``slow`` tests (still run by ``make test``), with the reason.
#: A prefix is a file, a test, or one parametrized case.
SLOW: dict[str, str] = {}

#: Groups of tests that one xdist worker runs, by node-id prefix: the tests that start or use
#: a local Ray (one Ray per worker would start several at once on a small machine).
GROUPS: dict[str, tuple[str, ...]] = {
    "ray": ("tests/distributed/",
            "tests/test_docs.py::test_doc_block_runs[docs/distributed.md"),
}


def _matches(nodeid: str, prefix: str) -> bool:
    return nodeid == prefix or (nodeid.startswith(prefix) and (
        prefix.endswith(("/", ".py", "[")) or nodeid[len(prefix)] in ":["))


def group_of(nodeid: str) -> str | None:
    """The name of the ``GROUPS`` entry that holds test ``nodeid``, or None."""
    return next((name for name, prefixes in GROUPS.items()
                 if any(nodeid.startswith(p) for p in prefixes)), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the ``SLOW`` tests slow."""
    for item in items:
        if any(_matches(item.nodeid, p) for p in SLOW):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config: pytest.Config) -> None:
    """With pytest-xdist installed, schedule ``--dist loadgroup`` by ``GROUPS``."""
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_GroupScheduling(), "tensorkv-test-groups")


class _GroupScheduling:
    """``--dist loadgroup`` by ``GROUPS``: one work unit per group, one per other test.

    pytest-xdist's own ``loadgroup`` reads ``xdist_group`` marks by renaming test ids, which
    pytest 9 no longer allows; this scheduler reads the groups from the ids instead.
    """

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log):
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class Scheduling(LoadScopeScheduling):
            # xdist sorts units by size (--loadscope-reorder), so a group starts first
            def _split_scope(self, nodeid: str) -> str:
                return group_of(nodeid) or nodeid

        return Scheduling(config, log)


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
