"""Fixtures for checkpoint tests: a store URL per backend (real files, real redis-server)."""

from __future__ import annotations

import itertools
import os

import pytest

from helpers import store_url

_counter = itertools.count()
BACKENDS = ["memory", "lmdb", "rocksdb", "leveldb", "redis"]
SHARED_BACKENDS = ["lmdb", "rocksdb", "leveldb", "redis"]  # usable from several processes


@pytest.fixture(scope="session")
def ckpt_redis(redis_server):
    """The shared standalone redis-server (tests/conftest.py); each URL has its own prefix."""
    return redis_server


def make_url(backend: str, tmp_path, request) -> str:
    """A fresh, empty store URL of ``backend`` (see ``helpers.store_url``)."""
    return store_url(backend, tmp_path, request, name="ckpt")


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path) -> str:
    """An empty store URL on each backend."""
    return make_url(request.param, tmp_path, request)


@pytest.fixture(params=SHARED_BACKENDS)
def shared_url(request, tmp_path) -> str:
    """An empty store URL on each backend that several processes can open at once."""
    return make_url(request.param, tmp_path, request)


@pytest.fixture
def mem_url() -> str:
    """A fresh named memory store."""
    return f"memory://ckpt-test-{os.getpid()}-{next(_counter)}"
