"""Fixtures for repository tests: store URLs on real backends, real redis-servers."""

from __future__ import annotations

import itertools
import os

import pytest

import servers
from helpers import store_url

_counter = itertools.count()
BACKENDS = ["memory", "lmdb", "rocksdb", "leveldb", "redis"]


@pytest.fixture(scope="session")
def repo_redis(redis_server):
    """The shared standalone redis-server (tests/conftest.py); each URL has its own prefix."""
    return redis_server


@pytest.fixture(scope="session")
def repo_redis_pool(request):
    """Three more standalone redis-servers: providers of one repository."""
    return [servers.session_server(request, servers.RedisServer) for _ in range(3)]


def ns() -> str:
    """A fresh key namespace."""
    return f"r{os.getpid()}-{next(_counter)}/"


def make_url(backend: str, tmp_path, request) -> str:
    """A fresh, empty store URL of ``backend`` (see ``helpers.store_url``)."""
    return store_url(backend, tmp_path, request, name="repo")


@pytest.fixture(params=BACKENDS)
def any_url(request, tmp_path) -> str:
    """A fresh store URL on each backend in turn."""
    return make_url(request.param, tmp_path, request)


@pytest.fixture
def lmdb_url(tmp_path) -> str:
    """A fresh LMDB store URL."""
    return f"lmdb://{tmp_path}/repo"
