"""Fixtures of the fault-injection suite: store URLs per backend, the seed of random choices.

Random choices (kill points, ...) come from ``random.Random(f"{SEED}:{case}")``. ``SEED`` is
fixed (``TENSORKV_FAULT_SEED`` overrides it) and shown in the test ids, so a failure is
reproduced by running the same test id again.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest

SEED = int(os.environ.get("TENSORKV_FAULT_SEED", "20240611"))
EMBEDDED = ("lmdb", "rocksdb", "leveldb")
BACKENDS = (*EMBEDDED, "redis")
_MODULES = {"lmdb": "lmdb", "rocksdb": "rocksdict", "leveldb": "plyvel", "redis": "redis"}
_counter = itertools.count()


def rng_for(case: str) -> random.Random:
    """The random generator of one test case (``case`` names it, e.g. ``"kill:lmdb"``)."""
    return random.Random(f"{SEED}:{case}")


def make_url(backend: str, tmp_path, request) -> str:
    """A URL of a fresh, empty store of ``backend`` (skips when its client is missing)."""
    pytest.importorskip(_MODULES[backend])
    n = next(_counter)
    if backend == "redis":
        server = request.getfixturevalue("redis_server")
        return f"redis://127.0.0.1:{server.port}/0?prefix=faults-{os.getpid()}-{n}/"
    return f"{backend}://{tmp_path}/store-{n}"


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Each backend the suite covers (redis: the session's standalone server)."""
    return request.param


@pytest.fixture
def url(backend, tmp_path, request) -> str:
    """A fresh, empty store URL of ``backend``."""
    return make_url(backend, tmp_path, request)
