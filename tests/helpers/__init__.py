"""Helpers shared by the test packages (servers: ``tests/servers.py``; fixtures: conftests).

- :func:`store_url`: a fresh, empty store URL of a backend (real files, the shared
  redis-server).
- :func:`run_python`: run Python code in a child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

import servers

#: The Python module each backend needs (the test skips without it).
BACKEND_MODULES = {"lmdb": "lmdb", "rocksdb": "rocksdict", "leveldb": "plyvel", "redis": "redis"}


def store_url(backend: str, tmp_path: Path, request: Any, name: str = "store") -> str:
    """A URL of a fresh, empty store of ``backend``, unique across tests and workers.

    ``memory``: a named memory store; ``lmdb``, ``rocksdb``, ``leveldb``: a directory under
    ``tmp_path``; ``redis``: a fresh key prefix on the session's ``redis_server`` fixture.
    Skips the test when the backend's client module is not installed.
    """
    unique = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    if backend == "memory":
        return f"memory://{unique}"
    if backend not in BACKEND_MODULES:
        raise ValueError(f"unknown backend {backend!r}: use memory or one of {BACKEND_MODULES}")
    pytest.importorskip(BACKEND_MODULES[backend])
    if backend == "redis":
        server = request.getfixturevalue("redis_server")
        return f"redis://127.0.0.1:{server.port}/0?prefix={servers.prefix(name)}"
    return f"{backend}://{tmp_path}/{unique}"


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a child Python; return its exit code and captured text."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=timeout,
    )
