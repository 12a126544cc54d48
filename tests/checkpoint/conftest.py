"""Fixtures for checkpoint tests: a store URL per backend (real files, real redis-server)."""

from __future__ import annotations

import itertools
import os

import pytest

_counter = itertools.count()
BACKENDS = ["memory", "lmdb", "rocksdb", "leveldb", "redis"]
SHARED_BACKENDS = ["lmdb", "rocksdb", "leveldb", "redis"]  # usable from several processes


def _importable(mod: str) -> bool:
    try:
        __import__(mod)
    except ImportError:
        return False
    return True


@pytest.fixture(scope="session")
def ckpt_redis(redis_server):
    """The shared standalone redis-server (tests/conftest.py); each URL has its own prefix."""
    return redis_server


def make_url(backend: str, tmp_path, request) -> str:
    """A fresh, empty store URL of ``backend``."""
    n = next(_counter)
    if backend == "memory":
        return f"memory://ckpt-test-{os.getpid()}-{n}"
    if backend == "redis":
        if not _importable("redis"):
            pytest.skip("redis-py is not installed")
        server = request.getfixturevalue("ckpt_redis")
        return f"redis://127.0.0.1:{server.port}/0?prefix=t{os.getpid()}-{n}/"
    mod = {"lmdb": "lmdb", "rocksdb": "rocksdict", "leveldb": "plyvel"}[backend]
    if not _importable(mod):
        pytest.skip(f"{mod} is not installed")
    return f"{backend}://{tmp_path}/store-{n}"


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
