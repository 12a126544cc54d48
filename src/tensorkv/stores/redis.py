"""Redis backend: standalone, TLS, ACL users, Redis Cluster and Redis Sentinel.

Keys are stored as plain Redis strings under an optional namespace ``prefix``. Reads and
writes go out as pipelined MGET / MSET / UNLINK commands of at most ``keys_sending_size``
keys each; in cluster mode keys are first grouped by hash slot (honouring ``{hash tags}``)
so that every multi-key command stays within one slot. See ``docs/redis.md``.
"""

from __future__ import annotations

import contextlib
import operator
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

import numpy as np
import redis
from redis import exceptions as rex
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from tensorkv import config
from tensorkv.errors import (
    ConfigError,
    InvalidURLError,
    KeyTypeError,
    ReplicationError,
    StoreAuthError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
    TensorKVError,
)
from tensorkv.stores import redis_raw
from tensorkv.stores.base import Capabilities, KVStore, WriteOp, prefix_upper_bound
from tensorkv.stores.redis_config import RedisOptions, resolve_options
from tensorkv.stores.redis_keys import (
    bounds,
    glob_escape,
    key_slots,
    range_prefix,
    redact_url,
    send_packed,
    take,
    value_sizes,
)
from tensorkv.stores.redis_pack import LargeValuePacker
from tensorkv.stores.redis_scripts import APPEND_SCRIPT, CAS_SCRIPT

if TYPE_CHECKING:
    from tensorkv.stores.url import StoreURL

__all__ = ["RedisStore", "glob_escape", "key_slots", "redact_url"]

_STANDALONE_CAPS = Capabilities(
    ordered_scans=False, atomic_batches=True, durable_on_return=False, multi_process=True
)
_CLUSTER_CAPS = Capabilities(
    ordered_scans=False,
    atomic_batches=False,
    durable_on_return=False,
    multi_process=True,
    distributed=True,
)
_MODES = {"redis": "standalone", "redis+cluster": "cluster", "redis+sentinel": "sentinel"}


# ---------------------------------------------------------------------------- the store
class RedisStore(KVStore):
    """A key-value store in Redis (standalone, cluster or sentinel-managed).

    Open it with :func:`tensorkv.open_store`::

        open_store("redis://localhost:6379/0?prefix=exp1/")
        open_store("rediss://user:pw@host:6380/0", ssl_ca_certs="ca.pem")
        open_store("redis+cluster://h1:7000,h2:7001", read_from_replicas=True)
        open_store("redis+sentinel://s1:26379,s2:26379/mymaster/0")

    Parameters
    ----------
    url
        The URL, for messages.
    mode
        ``"standalone"``, ``"cluster"`` or ``"sentinel"``.
    hosts
        Servers (standalone), startup nodes (cluster) or sentinels.
    db
        Database number (standalone and sentinel; cluster has only 0).
    master_name
        Sentinel service name.
    tls
        Connect with TLS.
    options
        Validated :class:`~tensorkv.stores.redis_config.RedisOptions`.
    scheme
        The URL scheme (reported by :meth:`stats`).
    config_file
        The JSON config file the options came from, if any (reported by :meth:`stats`).

    Notes
    -----
    Scans are unordered (Redis SCAN). Batches are MULTI/EXEC transactions except in cluster
    mode, where only a batch whose keys all hash to one slot is a transaction. Writes are
    not durable on return: that depends on the server's ``appendfsync`` setting.
    """

    scheme = "redis"
    capabilities = _STANDALONE_CAPS
    max_value_size = config.REDIS_MAX_VALUE_BYTES

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        mode: str = "standalone",
        hosts: Sequence[tuple[str, int]] = (("127.0.0.1", 6379),),
        db: int = 0,
        master_name: str | None = None,
        tls: bool = False,
        options: RedisOptions | None = None,
        scheme: str = "redis",
        config_file: str | None = None,
    ) -> None:
        opts = options or RedisOptions()
        super().__init__(url, readonly=opts.readonly)
        if mode not in ("standalone", "cluster", "sentinel"):
            raise ConfigError(f"mode={mode!r}; use standalone, cluster or sentinel")
        if mode == "cluster" and opts.wait_replicas:
            raise ConfigError(
                f"wait_replicas={opts.wait_replicas} is not supported on a Redis Cluster "
                "(WAIT covers one primary); drop it, or use a standalone or sentinel URL"
            )
        self.scheme = scheme
        self.mode = mode
        self.options = opts
        self.config_file = config_file
        self.capabilities = _CLUSTER_CAPS if mode == "cluster" else _STANDALONE_CAPS
        self._hosts = [(h, int(p)) for h, p in hosts]
        self._db = db
        self._master_name = master_name
        self._tls = tls
        self._ns = opts.prefix
        self._nsl = len(opts.prefix)
        self._ks = opts.keys_sending_size
        self._gate = (
            threading.BoundedSemaphore(opts.max_connections)
            if opts.max_connections and mode != "standalone"
            else None
        )
        self._sentinel: Any = None
        self._unwaited = False  # writes since the last WAIT
        self._client: Any = None
        self._reader: Any = None
        try:
            self._connect()
        except BaseException:
            self._close_clients()
            raise

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_url(cls, parsed: StoreURL, **options: Any) -> RedisStore:
        """Open from a parsed URL (see :func:`tensorkv.stores.registry.parse_url`)."""
        scheme = parsed.scheme
        url = redact_url(parsed.url)
        tls = scheme.startswith("rediss")
        base = scheme.replace("rediss", "redis", 1)
        if base not in _MODES:
            raise InvalidURLError(
                f"{url!r}: scheme {scheme!r} is not a Redis scheme; use redis://, "
                "rediss://, redis+cluster:// or redis+sentinel://"
            )
        mode = _MODES[base]
        default_port = 26379 if mode == "sentinel" else 6379
        hosts = [(h or "127.0.0.1", p or default_port) for h, p in parsed.hosts] or [
            ("127.0.0.1", default_port)
        ]
        parts = [p for p in parsed.path.split("/") if p]
        db, master = 0, None
        if mode == "sentinel":
            if not parts or len(parts) > 2:
                raise InvalidURLError(
                    f"{url!r}: a sentinel URL names the master after the hosts, "
                    "e.g. redis+sentinel://s1:26379,s2:26379/mymaster or .../mymaster/0"
                )
            master = parts[0]
            parts = parts[1:]
        if len(parts) > 1 or (parts and not parts[0].isdigit()):
            raise InvalidURLError(
                f"{url!r}: the path must be a database number such as /0, not "
                f"{parsed.path!r}"
            )
        db = int(parts[0]) if parts else 0
        if mode == "cluster" and db != 0:
            raise InvalidURLError(
                f"{url!r}: Redis Cluster has only database 0; drop /{db} from the URL"
            )
        if mode == "standalone" and len(hosts) > 1:
            raise InvalidURLError(
                f"{url!r} lists {len(hosts)} hosts; a standalone server takes one "
                "(use redis+cluster:// or redis+sentinel:// for several)"
            )
        # Query values were converted to int/float/bool; string options keep their raw text.
        raw = dict(parse_qsl(urlsplit("x://" + parsed.url.split("://", 1)[1]).query,
                             keep_blank_values=True))
        for name in ("prefix", "password", "username", "ssl_ca_certs", "ssl_certfile",
                     "ssl_keyfile", "config", "config_env"):
            if name in raw and name in options and options[name] is parsed.options.get(name):
                options[name] = raw[name]
        opts, config_file = resolve_options(
            options,
            url_username=parsed.username,
            url_password=parsed.password,
            where=f"options of {url!r}",
        )
        return cls(url, mode=mode, hosts=hosts, db=db, master_name=master, tls=tls,
                   options=opts, scheme=scheme, config_file=config_file)

    def _conn_kwargs(self) -> dict[str, Any]:
        o = self.options
        kw: dict[str, Any] = {
            "username": o.username,
            "password": o.password,
            "socket_connect_timeout": o.connect_timeout,
            "socket_timeout": o.socket_timeout,
        }
        if o.socket_keepalive:
            kw["socket_keepalive"] = True
        if self._tls:
            kw.update(
                ssl=True,
                ssl_ca_certs=o.ssl_ca_certs,
                ssl_certfile=o.ssl_certfile,
                ssl_keyfile=o.ssl_keyfile,
                ssl_cert_reqs=o.ssl_cert_reqs,
                ssl_check_hostname=o.ssl_check_hostname and o.ssl_cert_reqs != "none",
            )
        return kw

    def _retry(self) -> Retry:
        o = self.options
        cap = max(o.retry_backoff * 2 ** (o.retries + 1), o.retry_backoff)
        return Retry(
            ExponentialBackoff(cap=cap, base=o.retry_backoff),
            o.retries,
            supported_errors=(rex.ConnectionError, rex.TimeoutError, TimeoutError),
        )

    def _where(self) -> str:
        nodes = ",".join(f"{h}:{p}" for h, p in self._hosts)
        what = {"standalone": "Redis server", "cluster": "Redis Cluster nodes",
                "sentinel": "Redis sentinels"}[self.mode]
        return f"{what} {nodes}" + (f" (master {self._master_name!r})" if self._master_name else "")

    def _probe(self, host: str, port: int) -> None:
        """One PING without retries, so an unreachable server fails within connect_timeout."""
        kw = self._conn_kwargs()
        probe = redis.Redis(host=host, port=port, db=self._db, retry=Retry(NoBackoff(), 0),
                            single_connection_client=True, **kw)
        try:
            probe.ping()
        finally:
            probe.close()

    def _connect(self) -> None:
        o = self.options
        kw = self._conn_kwargs()
        with self._errors(opening=True):
            if self.mode == "standalone":
                host, port = self._hosts[0]
                self._probe(host, port)
                pool_kw = dict(kw, host=host, port=port, db=self._db, retry=self._retry(),
                               command_packer=LargeValuePacker())
                if pool_kw.pop("ssl", False):
                    pool_kw["connection_class"] = redis.SSLConnection
                if o.max_connections:
                    pool: Any = redis.BlockingConnectionPool(
                        max_connections=o.max_connections,
                        timeout=o.pool_timeout or o.socket_timeout, **pool_kw
                    )
                else:
                    pool = redis.ConnectionPool(**pool_kw)
                self._client = redis.Redis(connection_pool=pool)
                self._reader = self._client
            elif self.mode == "sentinel":
                from redis.sentinel import Sentinel

                skw = o.sentinel_kwargs(kw)
                skw["retry"] = Retry(NoBackoff(), 0)
                ckw = dict(kw, retry=self._retry())
                if o.max_connections:
                    ckw["max_connections"] = o.max_connections
                self._sentinel = Sentinel(self._hosts, sentinel_kwargs=skw, **ckw)
                host, port = self._sentinel.discover_master(self._master_name)
                self._probe(host, port)
                self._client = self._sentinel.master_for(self._master_name, db=self._db)
                self._reader = (
                    self._sentinel.slave_for(self._master_name, db=self._db)
                    if o.read_from_replicas
                    else self._client
                )
            else:
                from redis.cluster import ClusterNode, LoadBalancingStrategy, RedisCluster

                ckw = dict(kw)
                if o.max_connections:
                    ckw["max_connections"] = o.max_connections
                strategy = (
                    LoadBalancingStrategy.ROUND_ROBIN_REPLICAS if o.read_from_replicas else None
                )
                self._client = RedisCluster(
                    startup_nodes=[ClusterNode(h, p) for h, p in self._hosts],
                    retry=self._retry(),
                    load_balancing_strategy=strategy,
                    **ckw,
                )
                self._reader = self._client

    # ------------------------------------------------------------------ errors
    @contextmanager
    def _errors(self, *, opening: bool = False) -> Iterator[None]:
        """Translate redis-py exceptions into tensorkv's hierarchy (and gate connections)."""
        gate = None if opening else self._gate
        o, wait = self.options, self.options.pool_timeout or self.options.socket_timeout
        if gate is not None and not gate.acquire(timeout=wait):
            raise StoreUnavailableError(
                f"all max_connections={o.max_connections} connections to {self._where()} "
                f"stayed busy for {'pool' if o.pool_timeout else 'socket'}_timeout={wait} s")
        try:
            yield
        except TensorKVError:
            raise
        except (rex.AuthenticationError, rex.NoPermissionError) as exc:
            raise StoreAuthError(
                f"{self._where()} refused the credentials of user "
                f"{self.options.username or 'default'!r}: {exc}; check the username and password "
                "(URL user:pass@, or the username/password options) and the user's ACL rights"
            ) from exc
        except rex.OutOfMemoryError as exc:
            raise StoreFullError(f"{self._where()} is out of memory (maxmemory): {exc}") from exc
        except (rex.ConnectionError, rex.TimeoutError, rex.ClusterDownError,
                rex.MasterDownError, rex.SlotNotCoveredError, OSError) as exc:
            if _auth_failure(exc):
                raise StoreAuthError(
                    f"{self._where()} refused the credentials: {exc}; check the username and "
                    "password"
                ) from exc
            o = self.options
            raise StoreUnavailableError(
                f"cannot reach {self._where()} within connect_timeout={o.connect_timeout} s / "
                f"socket_timeout={o.socket_timeout} s"
                + ("" if opening else f" after {o.retries} retries")
                + f": {_reason(exc)}; check that the server runs and that host:port is right"
            ) from exc
        except rex.RedisClusterException as exc:
            if _auth_failure(exc):
                raise StoreAuthError(
                    f"{self._where()} refused the credentials: {exc}; check the username and "
                    "password"
                ) from exc
            if opening:
                raise StoreUnavailableError(
                    f"cannot reach {self._where()} within connect_timeout="
                    f"{self.options.connect_timeout} s: {exc}"
                ) from exc
            raise StoreError(f"{self._where()}: {exc}") from exc
        except rex.RedisError as exc:
            if _auth_failure(exc):
                raise StoreAuthError(f"{self._where()} refused the credentials: {exc}") from exc
            raise StoreError(f"{self._where()} failed: {exc}") from exc
        finally:
            if gate is not None:
                gate.release()

    # ------------------------------------------------------------------ keys
    def _full(self, keys: Sequence[bytes]) -> list[bytes]:
        if not self._nsl:
            return list(keys)
        return list(map(self._ns.__add__, keys))

    def _strip(self, keys: Sequence[bytes]) -> list[bytes]:
        if not self._nsl:
            return list(keys)
        return list(map(operator.itemgetter(slice(self._nsl, None)), keys))

    # ------------------------------------------------------------------ reads
    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        with self._errors():
            return self._mget(self._full(keys))

    def _mget(self, full: list[bytes]) -> list[bytes | None]:
        n, ks = len(full), self._ks
        if self.mode == "cluster":
            slots = key_slots(full)
            order = np.argsort(slots, kind="stable")
            sorted_keys = take(full, order)
            sorted_slots = slots[order]
            cuts = bounds(n, ks, groups=sorted_slots).tolist()
            cmds = [
                (slot, ("MGET", *sorted_keys[a:b]))
                for slot, a, b in zip(sorted_slots[cuts[:-1]].tolist(), cuts[:-1], cuts[1:],
                                      strict=True)
            ]
            res = self._cluster_run(cmds, read=True)
            flat = np.fromiter(chain.from_iterable(res), dtype=object, count=n)
            out = np.empty(n, dtype=object)
            out[order] = flat
            return out.tolist()
        if n <= ks:
            return self._reader.execute_command("MGET", *full)
        pipe = self._reader.pipeline(transaction=False)
        for i in range(0, n, ks):
            pipe.execute_command("MGET", *full[i : i + ks])
        return list(chain.from_iterable(pipe.execute()))

    def _cluster_run(self, cmds: list[tuple[int, tuple[Any, ...]]], *, read: bool) -> list[Any]:
        """Run per-slot commands on a cluster; return their replies in order.

        Commands are grouped by the node serving their slot and sent as one plain pipeline
        per node, which costs far less per command than redis-py's cluster pipeline. Any
        command that a node redirects (MOVED/ASK, resharding) or that hits a connection error
        is sent again through the cluster pipeline, which refreshes the slot map and retries.
        """
        client = self._client
        nm = client.nodes_manager
        strategy = client.load_balancing_strategy if read else None
        node_of: dict[int, Any] = {}
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, (slot, _) in enumerate(cmds):
            node = node_of.get(slot)
            if node is None:
                node = node_of[slot] = nm.get_node_from_slot(
                    slot, load_balancing_strategy=strategy
                )
            entry = groups.get(node.name)
            if entry is None:
                entry = groups[node.name] = (node, [])
            entry[1].append(i)
        results: list[Any] = [None] * len(cmds)
        retry: list[int] = []
        for node, idx in groups.values():
            pipe = client.get_redis_connection(node).pipeline(transaction=False)
            for i in idx:
                pipe.execute_command(*cmds[i][1])
            try:
                replies = pipe.execute(raise_on_error=False)
            except (rex.ConnectionError, rex.TimeoutError, OSError):
                retry.extend(idx)
                continue
            for i, r in zip(idx, replies, strict=True):
                if isinstance(r, Exception):
                    if not isinstance(r, (rex.AskError, rex.TryAgainError, rex.ClusterDownError,
                                          rex.ConnectionError, rex.TimeoutError)):
                        raise r
                    retry.append(i)
                else:
                    results[i] = r
        if retry:
            retry.sort()
            pipe = client.pipeline(transaction=False)
            for i in retry:
                pipe.execute_command(*cmds[i][1])
            for i, r in zip(retry, pipe.execute(), strict=True):
                results[i] = r
        return results

    # ------------------------------------------------------------------ writes
    def _write(self, ops: list[WriteOp], *, atomic: bool) -> None:
        keys = list(map(operator.itemgetter(0), ops))
        values = list(map(operator.itemgetter(1), ops))
        full = self._full(keys)
        is_del = np.fromiter(map(operator.is_, values, repeat(None)), dtype=bool, count=len(ops))
        self._unwaited = True  # flush() waits for the replicas (wait_replicas)
        with self._errors():
            self._apply(full, values, is_del, atomic=atomic)

    def _commands(self, full: list[bytes], values: list[Any], is_del: np.ndarray,
                  slots: np.ndarray | None) -> list[tuple[int, tuple[Any, ...]]]:
        """MSET/UNLINK commands, with their slot, for consecutive runs of puts and deletes."""
        n = len(full)
        change = np.flatnonzero(is_del[1:] != is_del[:-1]) + 1
        runs = np.concatenate(([0], change, [n])).tolist()
        cmds: list[tuple[int, tuple[Any, ...]]] = []
        for a, b in zip(runs[:-1], runs[1:], strict=True):
            rkeys = full[a:b]
            deleting = bool(is_del[a])
            rvals = [] if deleting else values[a:b]
            if slots is not None:
                order = np.argsort(slots[a:b], kind="stable")
                rkeys = take(rkeys, order)
                if not deleting:
                    rvals = take(rvals, order)
                groups = slots[a:b][order]
            else:
                groups = None
            sizes = None if deleting else value_sizes(rvals)
            cuts = bounds(b - a, self._ks, sizes, config.REDIS_MAX_COMMAND_BYTES, groups)
            starts = cuts[:-1]
            cslots = [0] * len(starts) if groups is None else groups[starts].tolist()
            for slot, c0, c1 in zip(cslots, starts.tolist(), cuts[1:].tolist(), strict=True):
                if deleting:
                    cmds.append((slot, ("UNLINK", *rkeys[c0:c1])))
                else:
                    args: list[Any] = [None] * (2 * (c1 - c0))
                    args[0::2] = rkeys[c0:c1]
                    args[1::2] = rvals[c0:c1]
                    cmds.append((slot, ("MSET", *args)))
        return cmds

    def _apply(self, full: list[bytes], values: list[Any], is_del: np.ndarray, *,
               atomic: bool) -> list[Any]:
        slots = key_slots(full) if self.mode == "cluster" else None
        cmds = self._commands(full, values, is_del, slots)
        if slots is not None:
            if not (atomic and bool(np.all(slots == slots[0]))):
                return self._cluster_run(cmds, read=False)
        elif len(cmds) == 1:
            return [self._client.execute_command(*cmds[0][1])]  # one command is atomic
        pipe = self._client.pipeline(transaction=atomic)
        for _, args in cmds:
            pipe.execute_command(*args)
        return pipe.execute()

    def _unlink(self, full: list[bytes]) -> int:
        """UNLINK full keys in pipelined chunks; return how many existed."""
        if not full:
            return 0
        self._unwaited = True
        res = self._apply(full, [None] * len(full), np.ones(len(full), dtype=bool), atomic=False)
        return int(sum(res))

    # ------------------------------------------------------------------ atomic updates
    def _compare_and_set(
        self, key: bytes, expected: bytes | None, value: bytes | memoryview | None
    ) -> bool:
        args = (
            b"1" if expected is None else b"0", expected or b"",
            b"0" if value is None else b"1", b"" if value is None else bytes(value),
        )
        self._unwaited = True
        with self._errors():
            return bool(self._client.eval(CAS_SCRIPT, 1, self._ns + key, *args))

    def _put_first_absent(self, prefix: bytes, start: int, value: bytes | memoryview,
                          before: list[tuple[bytes, bytes | memoryview]]) -> int:
        if self.mode == "cluster":  # the keys live in several slots: one call each
            return super()._put_first_absent(prefix, start, value, before)
        keys = [self._ns + prefix] + [self._ns + k for k, _ in before]
        vals = [bytes(value), str(start).encode()] + [bytes(v) for _, v in before]
        self._unwaited = True
        with self._errors():
            return int(self._client.eval(APPEND_SCRIPT, len(keys), *keys, *vals))

    def _value_sizes(self, keys: list[bytes]) -> np.ndarray:
        # read on the primaries: a replica may not have the latest writes yet
        full = self._full(keys)
        with self._errors():
            if self.mode == "cluster":
                slots = key_slots(full).tolist()
                cmds = [(sl, (c, k)) for sl, k in zip(slots, full, strict=True)
                        for c in ("EXISTS", "STRLEN")]
                res = self._cluster_run(cmds, read=False)
            else:
                res = []
                for i in range(0, len(full), self._ks):
                    pipe = self._client.pipeline(transaction=False)
                    for k in full[i : i + self._ks]:
                        pipe.execute_command("EXISTS", k)
                        pipe.execute_command("STRLEN", k)
                    res += pipe.execute()
        r = np.asarray(res, dtype=np.int64).reshape(-1, 2)
        return np.where(r[:, 0] > 0, r[:, 1], -1)

    def execute(self, commands: Sequence[tuple[bytes, tuple[Any, ...]]], *,
                read: bool = False) -> list[Any]:
        """Run raw Redis commands, each routed by one key it touches, pipelined; replies in order.

        On a cluster the commands are grouped by the node serving each routing key's slot
        (one pipeline per node); otherwise they go out at once on one connection
        (:func:`~tensorkv.stores.redis_keys.send_packed`, raw replies). ``read``: reads may
        go to replicas (``read_from_replicas``). Keys are used as given (the namespace
        ``prefix`` is not added). Errors are raised as tensorkv errors.
        """
        self._check_open()
        if not read:
            self._check_writable()
            self._unwaited = True
        if not commands:
            return []
        with self._errors():
            if self.mode == "cluster":
                slots = key_slots([k for k, _ in commands]).tolist()
                return self._cluster_run(
                    [(s, c) for s, (_, c) in zip(slots, commands, strict=True)], read=read)
            client = self._reader if read else self._client
            return send_packed(client.connection_pool, [c for _, c in commands],
                               retries=self.options.retries, backoff=self.options.retry_backoff)

    def execute_raw(self, keys: list[bytes], chunks: list[list[Any]], elems: list[int],
                    reply_bytes: list[int], *, read: bool = False,
                    row_width: int = 0) -> list[Any]:
        """Run commands framed as RESP bytes on the raw path (:mod:`.redis_raw`).

        Routed like :meth:`execute` (``keys``: one routing key per command); returns the
        parsed replies per connection (``row_width``: array elements of that size are
        copied into their ``rows`` as they arrive). Raises :class:`~.redis_raw.RawFallback` when the
        batch must run on :meth:`execute` instead (redirects, dropped connections).
        """
        self._check_open()
        if not read:
            self._check_writable()
            self._unwaited = True
        with self._errors():
            return redis_raw.run(self, keys, chunks, elems, reply_bytes, read=read,
                                 row_width=row_width)

    def identity(self) -> str | None:
        """The run ids of the primaries serving the data (they change on restart or failover)."""
        self._check_open()
        with self._errors():
            clients = self._scan_clients() if self.mode == "cluster" else [self._client]
            return ",".join(sorted(str(c.info("server")["run_id"]) for c in clients))

    def _flush(self) -> None:
        n, timeout = self.options.wait_replicas, self.options.wait_timeout
        if not n or not self._unwaited:
            return
        with self._errors():
            # WAIT covers the writes of its own connection: a write on that connection first
            # takes its replication offset past every earlier write of every connection
            pipe = self._client.pipeline(transaction=False)
            pipe.execute_command("SET", self._ns + b"tensorkv:wait", b"1", "PX", 60000)
            pipe.execute_command("WAIT", n, int(timeout * 1000))
            acked = int(pipe.execute()[1])
        if acked >= n:
            self._unwaited = False
        else:
            raise ReplicationError(
                f"only {acked} of wait_replicas={n} replicas of {self._where()} acknowledged "
                f"the writes within wait_timeout={timeout} s; nothing was published: check the "
                "replicas (INFO replication) and retry, or lower wait_replicas"
            )

    # ------------------------------------------------------------------ scans
    def _scan_clients(self) -> list[Any]:
        if self.mode == "cluster":
            return [self._client.get_redis_connection(n) for n in self._client.get_primaries()]
        return [self._reader]

    def _scan_full(self, prefix: bytes) -> Iterator[list[bytes]]:
        """Yield batches of full keys starting with namespace + ``prefix`` (deduplicated)."""
        pattern = glob_escape(self._ns + prefix) + b"*"
        count = max(self._ks, 10)
        for client in self._scan_clients():
            seen: set[bytes] = set()
            cursor = 0
            while True:
                with self._errors():
                    cursor, batch = client.scan(cursor, match=pattern, count=count)
                if batch:
                    fresh = set(batch) - seen
                    if fresh:
                        seen |= fresh
                        yield list(fresh)
                if cursor == 0:
                    break

    def _scan(
        self, start: bytes | None, stop: bytes | None, keys_only: bool, limit: int | None
    ) -> Iterator[tuple[bytes, bytes | None]]:
        p = range_prefix(start, stop)
        exact = (start is None or start == p) and stop == prefix_upper_bound(p)
        left = limit
        for full in self._scan_full(p):
            keys = self._strip(full)
            if not exact:
                keep = [i for i, k in enumerate(keys)
                        if (start is None or k >= start) and (stop is None or k < stop)]
                if not keep:
                    continue
                keys = [keys[i] for i in keep]
                full = [full[i] for i in keep]
            if left is not None:
                keys, full = keys[:left], full[:left]
            if keys_only:
                yield from zip(keys, repeat(None))
                got = len(keys)
            else:
                with self._errors():
                    vals = self._mget(full)
                pairs = [(k, v) for k, v in zip(keys, vals, strict=True) if v is not None]
                yield from pairs
                got = len(pairs)
            if left is not None:
                left -= got
                if left <= 0:
                    return

    def count(self, prefix: bytes = b"") -> int:
        """Number of keys starting with ``prefix`` under the namespace.

        Uses DBSIZE when there is neither a namespace nor a prefix, otherwise one SCAN pass
        (per primary in cluster mode) with server-side MATCH.
        """
        self._check_open()
        if not isinstance(prefix, (bytes, bytearray)):
            raise KeyTypeError(f"prefix {prefix!r} must be bytes")
        if not prefix and not self._nsl:
            with self._errors():
                return sum(int(c.dbsize()) for c in self._scan_clients())
        return sum(len(b) for b in self._scan_full(bytes(prefix)))

    def delete_prefix(self, prefix: bytes, *, chunk: int = 4096) -> int:
        """Delete every key starting with ``prefix`` (SCAN + pipelined UNLINK); return count."""
        self._check_writable()
        if not isinstance(prefix, (bytes, bytearray)):
            raise KeyTypeError(f"prefix {prefix!r} must be bytes")
        total = 0
        pending: list[bytes] = []
        for batch in self._scan_full(bytes(prefix)):
            pending.extend(batch)
            if len(pending) >= chunk:
                with self._errors():
                    total += self._unlink(pending)
                pending = []
        with self._errors():
            total += self._unlink(pending)
        return total

    # ------------------------------------------------------------------ lifecycle
    def _close_clients(self) -> None:
        clients = {id(c): c for c in (self._reader, self._client) if c is not None}
        if self._sentinel is not None:
            clients.update((id(s), s) for s in self._sentinel.sentinels)
        for c in clients.values():
            with contextlib.suppress(Exception):  # closing is best effort
                c.close()

    def _close(self) -> None:
        self._close_clients()

    def _stats(self) -> dict[str, Any]:
        with self._errors():
            clients = self._scan_clients()
            infos = [c.info() for c in clients]
            if self.mode == "cluster":
                nodes = [n.name for n in self._client.get_nodes()]
            elif self.mode == "sentinel":
                h, p = self._sentinel.discover_master(self._master_name)
                nodes = [f"{h}:{p}"] + [f"{h2}:{p2}" for h2, p2 in
                                        self._sentinel.discover_slaves(self._master_name)]
            else:
                nodes = [f"{h}:{p}" for h, p in self._hosts]
            db_keys = sum(int(c.dbsize()) for c in clients)
        if not self._nsl:
            keys: int | None = db_keys
        elif db_keys <= config.REDIS_STATS_COUNT_LIMIT:
            keys = self.count()
        else:
            keys = None  # counting would scan the whole keyspace
        return {
            "mode": self.mode,
            "nodes": nodes,
            "server_version": infos[0].get("redis_version") if infos else None,
            "used_memory_bytes": sum(int(i.get("used_memory", 0)) for i in infos),
            "db_keys": db_keys,
            "keys": keys,
            "prefix": self._ns,
            "keys_sending_size": self._ks,
            "config_file": self.config_file,
        }


def _reason(exc: BaseException) -> str:
    """An error's text without the object reprs redis-py puts in some (a sentinel's pool)."""
    return re.sub(r"\s*:?\s*<redis\.[\w.]+\(.*\)>", "", str(exc))


def _auth_failure(exc: BaseException) -> bool:
    """Whether an exception (or its cause) is Redis refusing the credentials."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 5:
        if isinstance(e, (rex.AuthenticationError, rex.NoPermissionError)):
            return True
        msg = str(e)
        if any(m in msg for m in ("WRONGPASS", "NOAUTH", "invalid username-password",
                                  "Authentication required", "NOPERM")):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False
