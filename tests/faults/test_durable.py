"""``durable_on_return`` checked by what the process does, not by the flag.

A child process writes (``put_many``, then a ``batch``) under ``strace``, marking the start
and end of each call with a write to fd -1 (a syscall that fails harmlessly and shows in the
trace). For every store configuration claiming ``durable_on_return``, each data file written
between the marks must be synced (``fsync``, ``fdatasync``, ``sync_file_range``, ``msync``)
after its last write and before the call returned, unless the file was opened ``O_DSYNC`` or
``O_SYNC`` (each write to it is then synchronous). ``flush()`` of the other configurations
is checked the same way: saves rely on it before and after the manifest. Redis never claims
durability on return; with ``appendfsync always`` the server syncs its append-only file
before it answers, which a trace of the server shows.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

import tensorkv

from .conftest import make_url

DATA_FILES = {"lmdb": r"data\.mdb$", "rocksdb": r"\d+\.log$", "leveldb": r"\d+\.log$"}
"""Files that hold a backend's data or write-ahead log."""
CONFIGS = [("lmdb", {}), ("lmdb", {"sync": False}), ("rocksdb", {}), ("rocksdb", {"sync": True}),
           ("leveldb", {}), ("leveldb", {"sync": True})]
IDS = [f"{k}-{'-'.join(f'{a}={b}' for a, b in o.items()) or 'default'}" for k, o in CONFIGS]
WRITES = "write,pwrite64,writev,pwritev,pwritev2"
SYNCS = "fsync,fdatasync,msync,sync_file_range"
_CALL = re.compile(r"^(\d+)\s+(\w+)\((-?\d+)(?:<([^>]*)>)?")
_OPEN = re.compile(r'^(\d+)\s+openat\([^"]*"([^"]+)", ([A-Z_|]+).*= (\d+)')
_CLOSE = re.compile(r"^(\d+)\s+close\((\d+)")
_RESUMED = re.compile(r"^(\d+)\s+<\.\.\. (\w+) resumed>.*= (-?\d+)")

CHILD = """
    import os, sys
    import tensorkv

    def mark(what):
        try:
            os.write(-1, what)
        except OSError:
            pass

    s = tensorkv.open_store(sys.argv[1], **eval(sys.argv[2]))
    s.put(b"warm-up", b"x")  # files are created by the first write
    mark(b"tensorkv-begin put_many")
    s.put_many({b"k%03d" % i: os.urandom(100) for i in range(100)})
    mark(b"tensorkv-end put_many")
    mark(b"tensorkv-begin batch")
    with s.batch() as b:
        b.put_many({b"b%03d" % i: os.urandom(100) for i in range(100)})
        b.delete(b"k000")
    mark(b"tensorkv-end batch")
    mark(b"tensorkv-begin flush")
    s.put_many({b"f%03d" % i: os.urandom(100) for i in range(100)})
    s.flush()
    mark(b"tensorkv-end flush")
    s.close()
"""


def _strace_works() -> str | None:
    """None when strace can trace a child here, else why not."""
    if shutil.which("strace") is None:
        return "strace is not installed"
    r = subprocess.run(["strace", "-f", "-o", os.devnull, "true"], capture_output=True)
    return None if r.returncode == 0 else f"strace cannot trace here: {r.stderr[-200:]!r}"


@pytest.fixture(scope="module")
def strace() -> None:
    why = _strace_works()
    if why:
        pytest.skip(why)


def unsynced_writes(trace: list[str], what: str, data_file: str) -> tuple[int, list[str]]:
    """Data-file writes of the call ``what`` not followed by a sync before the call returned.

    Returns the number of data-file writes between the call's marks and the files whose
    last write was not synced.
    """
    sync_fds: set[tuple[str, int]] = set()  # (pid, fd) opened O_DSYNC / O_SYNC
    inside, writes = False, 0
    pending: dict[str, bool] = {}  # data file -> written since its last completed sync
    started: dict[tuple[str, str], str] = {}  # (pid, syscall) -> path of an unfinished sync
    for line in trace:
        if f'"tensorkv-begin {what}"' in line:
            inside = True
            continue
        if f'"tensorkv-end {what}"' in line:
            break
        if m := _OPEN.match(line):
            if "O_DSYNC" in m[3] or "O_SYNC" in m[3]:
                sync_fds.add((m[1], int(m[4])))
            continue
        if m := _CLOSE.match(line):
            sync_fds.discard((m[1], int(m[2])))
            continue
        if not inside:
            continue
        if m := _RESUMED.match(line):
            path = started.pop((m[1], m[2]), None)
            if path is not None and m[3] == "0":
                pending[path] = False
            continue
        m = _CALL.match(line)
        if m is None or not re.search(data_file, m[4] or ""):
            if m is not None and m[2] == "msync" and line.rstrip().endswith("= 0"):
                pending = dict.fromkeys(pending, False)  # a synced map: LMDB's writemap mode
            continue
        name, path = m[2], m[4]
        if name in WRITES.split(","):
            writes += 1
            if (m[1], int(m[3])) not in sync_fds:
                pending[path] = True
        elif name in SYNCS.split(","):
            if "<unfinished ...>" in line:
                started[(m[1], name)] = path
            elif line.rstrip().endswith("= 0"):
                pending[path] = False
    return writes, sorted(p for p, dirty in pending.items() if dirty)


@pytest.mark.parametrize(("kind", "options"), CONFIGS, ids=IDS)
def test_durable_on_return_syncs_before_returning(strace, kind, options, tmp_path, request):
    url = make_url(kind, tmp_path, request)
    with tensorkv.open_store(url, **options) as store:
        if not store.capabilities.durable_on_return:
            pytest.skip(f"{kind} with {options or 'default options'} does not claim durability")
    log = tmp_path / "strace.log"
    r = subprocess.run(
        ["strace", "-f", "-y", "-qq", "-s", "40", "-o", str(log),
         "-e", f"trace=openat,close,{WRITES},{SYNCS}",
         sys.executable, "-c", textwrap.dedent(CHILD), url, repr(options)],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    trace = log.read_text().splitlines()
    for what in ("put_many", "batch"):
        writes, unsynced = unsynced_writes(trace, what, DATA_FILES[kind])
        assert writes, f"{what}: no write to a data file between the marks"
        assert not unsynced, (
            f"{kind} claims durable_on_return, but {what} returned before {unsynced} was "
            "synced after its last write"
        )


@pytest.mark.parametrize(("kind", "options"), CONFIGS, ids=IDS)
def test_flush_syncs_what_was_written(strace, kind, options, tmp_path, request):
    """``flush()`` makes what was written durable, in every configuration (saves rely on it)."""
    url = make_url(kind, tmp_path, request)
    log = tmp_path / "strace.log"
    r = subprocess.run(
        ["strace", "-f", "-y", "-qq", "-s", "40", "-o", str(log),
         "-e", f"trace=openat,close,{WRITES},{SYNCS}",
         sys.executable, "-c", textwrap.dedent(CHILD), url, repr(options)],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    writes, unsynced = unsynced_writes(log.read_text().splitlines(), "flush", DATA_FILES[kind])
    assert writes, "no write to a data file between the marks"
    assert not unsynced, f"flush() returned before {unsynced} was synced after its last write"


def _server_trace(pid: int, log: str) -> subprocess.Popen:
    """Attach strace to a running process (and its threads); return once attached."""
    proc = subprocess.Popen(
        ["strace", "-f", "-y", "-s", "64", "-o", log, "-p", str(pid),
         "-e", f"trace=write,writev,{SYNCS}"],
        stderr=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert "attached" in line, line
    return proc


def test_redis_appendfsync_always_syncs_before_the_reply(strace, request, tmp_path):
    servers = pytest.importorskip("servers")
    pytest.importorskip("redis")
    if not servers.available():
        pytest.skip("redis-server is not installed")
    server = servers.RedisServer(extra_conf="appendonly yes\nappendfsync always\n").start()
    request.addfinalizer(server.stop)
    url = server.url
    with tensorkv.open_store(url) as store:
        assert not store.capabilities.durable_on_return  # never claimed: a server setting
        admin = server.client()
        try:
            info: dict[str, Any] = admin.info("persistence")
        finally:
            admin.close()
        assert info["aof_enabled"] == 1
        store.put(b"warm-up", b"x")
        tracer = _server_trace(server.procs[-1].proc.pid, str(tmp_path / "redis.log"))
        try:
            store.put(b"durable-probe", b"v" * 10)
            time.sleep(0.2)  # strace writes its log as the server runs
        finally:
            tracer.terminate()
            tracer.wait(timeout=30)
    trace = (tmp_path / "redis.log").read_text().splitlines()
    aof = [i for i, t in enumerate(trace) if "durable-probe" in t and ".aof" in t]
    assert aof, "the server did not write the probe to its append-only file"
    aof_path = re.search(r"\((\d+<[^>]*>)", trace[aof[0]])[1]  # type: ignore[index]
    synced = [i for i, t in enumerate(trace) if i > aof[0] and re.search(
        rf"(fsync|fdatasync)\({re.escape(aof_path)}\)\s+= 0", t)]
    replies = [i for i, t in enumerate(trace) if i > aof[0] and '"+OK' in t]
    assert synced and replies and synced[0] < replies[0], "\n".join(trace[aof[0]:][:20])
