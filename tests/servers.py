"""Real redis-server processes for tests: standalone (TLS, ACL), cluster and sentinel.

Every server runs from a private temp dir, bound to 127.0.0.1 on a free port, without
persistence (``save ""``, ``appendonly no``). Processes run in their own process group, get
SIGTERM if the test process dies (Linux ``PR_SET_PDEATHSIG``), and are stopped with their
temp dirs by :meth:`stop`, by the pytest fixtures' finalizers, or at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
_LIVE: set[Any] = set()

BASE_CONF = """
bind 127.0.0.1
protected-mode no
daemonize no
save ""
appendonly no
dir {dir}
logfile {dir}/redis.log
pidfile {dir}/redis.pid
repl-diskless-sync-delay 0
"""


def with_options(url: str, **options: Any) -> str:
    """Append query options to a URL."""
    sep = "&" if "?" in url else "?"
    return url + sep + "&".join(f"{k}={v}" for k, v in options.items())


def prefix(name: str) -> str:
    """A key prefix ``name-PID-RANDOM/`` that no other test of any worker uses."""
    return f"{name}-{os.getpid()}-{uuid.uuid4().hex[:12]}/"


def available() -> bool:
    """Whether redis-server and redis-cli are installed."""
    return os.path.exists(REDIS_SERVER) and os.path.exists(REDIS_CLI)


def session_server(request, kind, **options):
    """Start ``kind(**options)`` for the test session (stopped at its end); skip without redis."""
    import pytest

    if not available():
        pytest.skip("redis-server / redis-cli are not installed")
    server = kind(**options)
    request.addfinalizer(server.stop)
    return server.start()


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, bus: bool = False, exclude: set[int] | None = None) -> int:
    """A free loopback port (and port + 10000 free too when ``bus``)."""
    exclude = exclude or set()
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port in exclude:
            continue
        if bus and (port + 10000 > 65535 or not _port_free(port + 10000)):
            continue
        return port
    raise RuntimeError("no free port found on 127.0.0.1")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop_all() -> None:
    for obj in list(_LIVE):
        with contextlib.suppress(Exception):
            obj.stop()


atexit.register(_stop_all)


class _Process:
    """One redis-server process from a config file."""

    def __init__(self, workdir: Path, conf: str, *, sentinel: bool = False) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.conf_path = self.dir / ("sentinel.conf" if sentinel else "redis.conf")
        self.conf_path.write_text(conf)
        args = [REDIS_SERVER, str(self.conf_path)] + (["--sentinel"] if sentinel else [])
        self.out = open(self.dir / "stdout.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.dir,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - tests only, no threads yet
        )

    def log(self) -> str:
        text = ""
        for name in ("stdout.log", "redis.log"):
            p = self.dir / name
            if p.exists():
                text += p.read_text(errors="replace")[-3000:]
        return text

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        if not self.out.closed:
            self.out.close()


def _client(port: int, **kw: Any) -> Any:
    import redis

    return redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1,
                       socket_timeout=5, **kw)


def _wait(predicate: Any, timeout: float, what: str, proc: _Process | None = None) -> None:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"redis-server exited while waiting for {what}:\n{proc.log()}")
        try:
            if predicate():
                return
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last = exc
        time.sleep(0.05)
    log = proc.log() if proc is not None else ""
    raise RuntimeError(
        f"timed out after {timeout} s waiting for {what} (last error: {last})\n{log}"
    )


def _remove_stale_dirs() -> None:
    """Remove temp dirs left by test processes that were killed before they could clean up."""
    for d in Path(tempfile.gettempdir()).glob("tensorkv-redis*-pid*-*"):
        try:
            pid = int(d.name.split("-pid", 1)[1].split("-", 1)[0])
        except (IndexError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            pass


class _Base:
    """Temp dir and process bookkeeping shared by the server kinds."""

    def __init__(self, name: str) -> None:
        _remove_stale_dirs()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"tensorkv-{name}-pid{os.getpid()}-"))
        self.procs: list[_Process] = []
        _LIVE.add(self)

    def stop(self) -> None:
        """Stop every process and remove the temp dir."""
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.stop()
        self.procs = []
        shutil.rmtree(self.tmp, ignore_errors=True)
        _LIVE.discard(self)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start_node(self, name: str, make_conf: Any, *, bus: bool = False,
                    sentinel: bool = False, ready: Any = None) -> tuple[_Process, int]:
        """Start one process on a fresh port, retrying if another process took the port."""
        taken = {getattr(p, "port", 0) for p in self.procs}
        for attempt in range(5):
            port = free_port(bus=bus, exclude=taken)
            workdir = self.tmp / f"{name}-{attempt}"
            proc = _Process(workdir, make_conf(port, workdir), sentinel=sentinel)
            proc.port = port  # type: ignore[attr-defined]
            try:
                _wait(lambda port=port: (ready or _ping)(port), 15, f"{name} on port {port}",
                      proc)
            except RuntimeError:
                log = proc.log()
                proc.stop()
                if "Address already in use" in log and attempt < 4:
                    continue
                raise
            self.procs.append(proc)
            return proc, port
        raise RuntimeError(f"could not start {name}")


def _ping(port: int) -> bool:
    c = _client(port)
    try:
        return bool(c.ping())
    finally:
        c.close()


# ---------------------------------------------------------------------------- standalone
def make_certs(directory: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (openssl)."""
    directory.mkdir(parents=True, exist_ok=True)
    d = str(directory)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3",
        "-subj", "/CN=tensorkv test CA")
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who in ("server", "client"):
        run("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr",
            "-subj", f"/CN=tensorkv test {who}")
        extra = ["-extfile", "server.ext"] if who == "server" else []
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{who}.crt", "-days", "3", *extra)
    return {k: str(directory / k) for k in
            ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


class RedisServer(_Base):
    """A standalone redis-server.

    Parameters
    ----------
    tls
        Serve TLS only (mutual TLS: clients must present a certificate signed by the CA).
    username, password
        Create this ACL user (all keys and commands) and disable the default user.
    extra_conf
        More config lines.
    """

    def __init__(self, *, tls: bool = False, username: str | None = None,
                 password: str | None = None, extra_conf: str = "") -> None:
        super().__init__("redis-tls" if tls else "redis")
        self.tls = tls
        self.username = username
        self.password = password
        self.certs = make_certs(self.tmp / "certs") if tls else {}
        self.extra_conf = extra_conf
        self.port = 0

    def _conf(self, port: int, workdir: Path) -> str:
        conf = BASE_CONF.format(dir=workdir)
        if self.tls:
            c = self.certs
            conf += (f"port 0\ntls-port {port}\ntls-cert-file {c['server.crt']}\n"
                     f"tls-key-file {c['server.key']}\ntls-ca-cert-file {c['ca.crt']}\n"
                     "tls-auth-clients yes\n")
        else:
            conf += f"port {port}\n"
        if self.username:
            conf += f"user default off\nuser {self.username} on >{self.password} ~* &* +@all\n"
        elif self.password:
            conf += f"requirepass {self.password}\n"
        return conf + self.extra_conf

    def client_kwargs(self) -> dict[str, Any]:
        """redis.Redis keyword arguments for an admin connection."""
        kw: dict[str, Any] = {}
        if self.username or self.password:
            kw.update(username=self.username, password=self.password)
        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=self.certs["ca.crt"],
                      ssl_certfile=self.certs["client.crt"], ssl_keyfile=self.certs["client.key"])
        return kw

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING."""
        kw = self.client_kwargs()

        def ready(port: int) -> bool:
            c = _client(port, **kw)
            try:
                return bool(c.ping())
            finally:
                c.close()

        _, self.port = self._start_node("node", self._conf, ready=ready)
        return self

    def kill(self) -> None:
        """SIGKILL the server (its port stays reserved for :meth:`restart`)."""
        self.procs[-1].stop(sig=signal.SIGKILL)

    def restart(self) -> None:
        """Start the server again on the same port and config (empty: no persistence)."""
        old = self.procs[-1]
        old.stop()
        new = _Process(old.dir, old.conf_path.read_text())
        new.port = self.port  # type: ignore[attr-defined]
        self.procs[-1] = new
        kw = self.client_kwargs()

        def ready() -> bool:
            c = _client(self.port, **kw)
            try:
                return bool(c.ping())
            finally:
                c.close()

        _wait(ready, 15, f"restarted redis-server on port {self.port}", new)

    @property
    def url(self) -> str:
        """``redis://`` / ``rediss://`` URL with credentials and, for TLS, the cert options."""
        scheme = "rediss" if self.tls else "redis"
        cred = ""
        if self.username:
            cred = f"{self.username}:{self.password}@"
        elif self.password:
            cred = f":{self.password}@"
        url = f"{scheme}://{cred}127.0.0.1:{self.port}/0"
        if self.tls:
            c = self.certs
            url += (f"?ssl_ca_certs={c['ca.crt']}&ssl_certfile={c['client.crt']}"
                    f"&ssl_keyfile={c['client.key']}")
        return url

    def client(self) -> Any:
        """An admin redis.Redis connection (close it after use)."""
        return _client(self.port, **self.client_kwargs())

    def flushall(self) -> None:
        """Remove every key."""
        c = self.client()
        try:
            c.flushall()
        finally:
            c.close()


# ---------------------------------------------------------------------------- cluster
class RedisCluster(_Base):
    """A Redis Cluster of 3 masters, optionally with one replica each.

    Parameters
    ----------
    replicas
        Replicas per master (0 or 1).
    """

    def __init__(self, *, replicas: int = 0, extra_conf: str = "") -> None:
        super().__init__("redis-cluster")
        self.replicas = replicas
        self.extra_conf = extra_conf
        self.ports: list[int] = []

    def _conf(self, port: int, workdir: Path) -> str:
        return BASE_CONF.format(dir=workdir) + (
            f"port {port}\ncluster-enabled yes\ncluster-config-file nodes.conf\n"
            "cluster-node-timeout 3000\ncluster-replica-validity-factor 0\n"
        ) + self.extra_conf

    def _proc(self, port: int) -> _Process:
        for p in self.procs:
            if getattr(p, "port", None) == port:
                return p
        raise RuntimeError(f"no node of this cluster serves port {port}")

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port`` (as a crash would)."""
        self._proc(port).stop(sig=signal.SIGKILL)

    def restart(self, port: int) -> None:
        """Start a stopped node again (same port, config and directory: its cluster config
        and, with persistence in ``extra_conf``, its data); wait until the cluster is ok."""
        old = self._proc(port)
        old.stop()
        new = _Process(old.dir, old.conf_path.read_text())
        new.port = port  # type: ignore[attr-defined]
        self.procs[self.procs.index(old)] = new
        _wait(lambda: _ping(port), 15, f"restarted node on port {port}", new)

        def ok() -> bool:
            for p in self.ports:
                c = _client(p)
                try:
                    if "cluster_state:ok" not in c.execute_command("CLUSTER", "INFO").decode():
                        return False
                finally:
                    c.close()
            return True

        _wait(ok, 60, "cluster_state:ok on every node after a restart")

    def start(self) -> RedisCluster:
        """Start the nodes, create the cluster and wait until every node says it is ok."""
        n = 3 * (1 + self.replicas)
        self.ports = [self._start_node(f"node{i}", self._conf, bus=True)[1] for i in range(n)]
        cmd = [REDIS_CLI, "--cluster", "create",
               *[f"127.0.0.1:{p}" for p in self.ports],
               "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{r.stdout}\n{r.stderr}")

        def ok() -> bool:
            for p in self.ports:
                c = _client(p)
                try:
                    info = c.execute_command("CLUSTER", "INFO").decode()
                    if "cluster_state:ok" not in info or f"cluster_known_nodes:{n}" not in info:
                        return False
                    if self.replicas:
                        rep = c.info("replication")
                        if rep["role"] == "slave" and rep.get("master_link_status") != "up":
                            return False
                finally:
                    c.close()
            return True

        _wait(ok, 60, "cluster_state:ok on every node")
        return self

    @property
    def url(self) -> str:
        """``redis+cluster://`` URL listing two startup nodes."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:2])

    def nodes(self, role: str) -> list[int]:
        """Ports of the nodes with ``role`` ("master" or "slave")."""
        out = []
        for p in self.ports:
            c = _client(p)
            try:
                if c.info("replication")["role"] == role:
                    out.append(p)
            finally:
                c.close()
        return out

    def flushall(self) -> None:
        """Remove every key from every master."""
        for p in self.nodes("master"):
            c = _client(p)
            try:
                c.flushall()
            finally:
                c.close()

    def wait_replicas_advertised(self, timeout: float = 60) -> None:
        """Wait until every node lists each slot range's replica in CLUSTER SLOTS.

        Nodes learn replica roles by gossip, some seconds after the cluster is ok; clients
        that read from replicas discover them through CLUSTER SLOTS.
        """
        def advertised() -> bool:
            for p in self.ports:
                c = _client(p)
                try:
                    ranges = c.execute_command("CLUSTER", "SLOTS")
                finally:
                    c.close()
                if any(len(r) < 3 + self.replicas for r in ranges):
                    return False
            return True

        _wait(advertised, timeout, "every node to advertise the replicas")

    def slot_owner(self, slot: int) -> int:
        """Port of the master serving ``slot``."""
        c = _client(self.ports[0])
        try:
            for lo, hi, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    return int(master[1])
        finally:
            c.close()
        raise RuntimeError(f"slot {slot} is not served")

    def move_slot(self, slot: int, to_port: int) -> None:
        """Migrate ``slot`` and its keys to the master on ``to_port`` (as resharding does)."""
        from_port = self.slot_owner(slot)
        if from_port == to_port:
            return
        src, dst = _client(from_port), _client(to_port)
        try:
            src_id = src.execute_command("CLUSTER", "MYID").decode()
            dst_id = dst.execute_command("CLUSTER", "MYID").decode()
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            while True:
                keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
                if not keys:
                    break
                src.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys)
            for c in (dst, src):
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        finally:
            src.close()
            dst.close()
        masters = self.nodes("master")

        def agreed() -> bool:
            for p in masters:
                c = _client(p)
                try:
                    for lo, hi, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                        if lo <= slot <= hi and int(master[1]) != to_port:
                            return False
                finally:
                    c.close()
            return True

        _wait(agreed, 20, f"every master to agree that slot {slot} moved")

    def wait_replication(self, timeout: float = 20) -> None:
        """Wait until every replica has applied everything its master has written."""
        masters = self.nodes("master")

        def synced() -> bool:
            for p in masters:
                c = _client(p)
                try:
                    rep = c.info("replication")
                finally:
                    c.close()
                offset = int(rep["master_repl_offset"])
                for i in range(int(rep["connected_slaves"])):
                    if int(rep[f"slave{i}"]["offset"]) < offset:
                        return False
            return True

        _wait(synced, timeout, "replicas to catch up")


# ---------------------------------------------------------------------------- sentinel
class RedisSentinel(_Base):
    """A master, one replica, and three sentinels (quorum 2) watching ``master_name``."""

    def __init__(self, *, master_name: str = "mymaster") -> None:
        super().__init__("redis-sentinel")
        self.master_name = master_name
        self.data_ports: list[int] = []
        self.sentinel_ports: list[int] = []

    def start(self) -> RedisSentinel:
        """Start master, replica and sentinels; wait until every sentinel knows the replica."""
        def data_conf(port: int, workdir: Path, replicaof: int | None = None) -> str:
            conf = BASE_CONF.format(dir=workdir) + f"port {port}\n"
            if replicaof:
                conf += f"replicaof 127.0.0.1 {replicaof}\n"
            return conf

        _, master = self._start_node("master", data_conf)
        _, replica = self._start_node(
            "replica", lambda p, w: data_conf(p, w, replicaof=master))
        self.data_ports = [master, replica]

        def sentinel_conf(port: int, workdir: Path) -> str:
            return (f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\n"
                    f"dir {workdir}\nlogfile {workdir}/redis.log\n"
                    f"sentinel monitor {self.master_name} 127.0.0.1 {master} 2\n"
                    f"sentinel down-after-milliseconds {self.master_name} 1000\n"
                    f"sentinel failover-timeout {self.master_name} 5000\n"
                    f"sentinel parallel-syncs {self.master_name} 1\n")

        self.sentinel_ports = [self._start_node(f"sentinel{i}", sentinel_conf,
                                                sentinel=True)[1] for i in range(3)]

        def known() -> bool:
            for p in self.sentinel_ports:
                c = _client(p)
                try:
                    if not c.execute_command("SENTINEL", "REPLICAS", self.master_name):
                        return False
                finally:
                    c.close()
            rc = _client(replica)
            try:
                return rc.info("replication").get("master_link_status") == "up"
            finally:
                rc.close()

        _wait(known, 30, "sentinels to discover the replica")
        return self

    @property
    def url(self) -> str:
        """``redis+sentinel://s1,s2,s3/master/0``."""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.master_name}/0"

    def master_port(self) -> int:
        """Port of the current master, as the first reachable sentinel reports it."""
        for p in self.sentinel_ports:
            c = _client(p)
            try:
                addr = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
                return int(addr[1])
            except Exception:  # noqa: BLE001 - try the next sentinel
                continue
            finally:
                c.close()
        raise RuntimeError("no sentinel answered")

    def flushall(self) -> None:
        """Remove every key (on the current master; replicas follow)."""
        c = _client(self.master_port())
        try:
            c.flushall()
        finally:
            c.close()

    def wait_replication(self, timeout: float = 20) -> None:
        """Wait until the replica has applied everything the master has written."""
        def synced() -> bool:
            c = _client(self.master_port())
            try:
                rep = c.info("replication")
            finally:
                c.close()
            offset = int(rep["master_repl_offset"])
            n = int(rep["connected_slaves"])
            return n > 0 and all(int(rep[f"slave{i}"]["offset"]) >= offset for i in range(n))

        _wait(synced, timeout, "the replica to catch up")

    def kill_master(self) -> int:
        """SIGKILL the current master (as a crash would); return its port."""
        port = self.master_port()
        for p in self.procs:
            if getattr(p, "port", None) == port:
                p.stop(sig=signal.SIGKILL)
                return port
        raise RuntimeError(f"no process of this setup serves port {port}")

    def restart_as_replica(self, port: int) -> None:
        """Start a killed data node again on ``port``, replicating the current master."""
        for p in self.procs:
            if getattr(p, "port", None) == port:
                conf = p.conf_path.read_text() + f"replicaof 127.0.0.1 {self.master_port()}\n"
                new = _Process(p.dir, conf)
                new.port = port  # type: ignore[attr-defined]
                self.procs[self.procs.index(p)] = new
                _wait(lambda: _ping(port), 15, f"restarted node on port {port}", new)
                return
        raise RuntimeError(f"no process of this setup served port {port}")
