"""A throwaway ``redis-server`` on a free loopback port, for benchmarks.

The server keeps everything in memory (no RDB snapshots, no append-only file), runs in a
temporary directory and is stopped (and the directory removed) by :meth:`RedisServer.stop`
or on leaving the ``with`` block::

    with RedisServer() as server:
        store = open_store(server.url)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time

from tensorkv.errors import StoreUnavailableError


def redis_server_path() -> str | None:
    """Return the path of ``redis-server`` on ``PATH``, or None when it is not installed."""
    return shutil.which("redis-server")


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RedisServer:
    """Start a private ``redis-server`` process; stop it with :meth:`stop`.

    Parameters
    ----------
    maxmemory
        Redis ``maxmemory`` setting, e.g. ``"2gb"`` (``"0"``: no limit).
    startup_timeout
        Seconds to wait for the server to answer ``PING``.
    """

    def __init__(self, *, maxmemory: str = "0", startup_timeout: float = 10.0) -> None:
        exe = redis_server_path()
        if exe is None:
            raise FileNotFoundError(
                "redis-server is not on PATH; install it (Debian/Ubuntu: "
                "apt-get install redis-server, or `make redis-server`)"
            )
        self.host = "127.0.0.1"
        self.port = free_port(self.host)
        self._dir = tempfile.mkdtemp(prefix="tensorkv-redis-")
        args = [
            exe,
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", self._dir,
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", maxmemory,
            "--protected-mode", "yes",
            "--loglevel", "warning",
            "--logfile", os.path.join(self._dir, "redis.log"),
        ]
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """The ``redis://host:port/0`` URL of the server."""
        return f"redis://{self.host}:{self.port}/0"

    def _ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise StoreUnavailableError(
                    f"redis-server exited with code {self._proc.returncode} on port "
                    f"{self.port}: {err.strip() or 'see ' + self._dir}"
                )
            if self._ping():
                return
            time.sleep(0.05)
        raise StoreUnavailableError(
            f"redis-server on port {self.port} did not answer PING within {timeout} s"
        )

    def flushall(self) -> None:
        """Delete every key on the server (between benchmark rounds)."""
        with socket.create_connection((self.host, self.port), timeout=30) as s:
            s.sendall(b"FLUSHALL\r\n")
            reply = s.recv(64)
        if not reply.startswith(b"+OK"):
            raise StoreUnavailableError(f"FLUSHALL on port {self.port} answered {reply!r}")

    def used_memory(self) -> int:
        """Bytes of memory the server reports in use (``INFO memory``)."""
        with socket.create_connection((self.host, self.port), timeout=5) as s:
            s.sendall(b"INFO memory\r\n")
            data = b""
            while b"used_memory:" not in data or not data.endswith(b"\r\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        for line in data.split(b"\r\n"):
            if line.startswith(b"used_memory:"):
                return int(line.split(b":", 1)[1])
        return 0

    def stop(self) -> None:
        """Stop the server and remove its directory (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort: never leave a server behind
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.stop()
