"""Fixtures of the fault-injection suite: store URLs per backend, the seed of random choices.

Random choices (kill points, ...) come from ``random.Random(f"{SEED}:{case}")``. ``SEED`` is
fixed (``TENSORKV_FAULT_SEED`` overrides it) and shown in the test ids, so a failure is
reproduced by running the same test id again.
"""

from __future__ import annotations

import os
import random

import pytest

from helpers import store_url

SEED = int(os.environ.get("TENSORKV_FAULT_SEED", "20240611"))
EMBEDDED = ("lmdb", "rocksdb", "leveldb")
BACKENDS = (*EMBEDDED, "redis")


def rng_for(case: str) -> random.Random:
    """The random generator of one test case (``case`` names it, e.g. ``"kill:lmdb"``)."""
    return random.Random(f"{SEED}:{case}")


def make_url(backend: str, tmp_path, request) -> str:
    """A URL of a fresh, empty store of ``backend`` (see ``helpers.store_url``)."""
    return store_url(backend, tmp_path, request, name="faults")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Each backend the suite covers (redis: the session's standalone server)."""
    return request.param


@pytest.fixture
def url(backend, tmp_path, request) -> str:
    """A fresh, empty store URL of ``backend``."""
    return make_url(backend, tmp_path, request)
