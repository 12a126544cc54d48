"""Redis faults during a save: a restart, a Sentinel failover, a server paused past the timeout.

Each fault is injected at a chosen write of the save (deterministically) by a store that
forwards every call to a real RedisStore and acts on the real server at that point. The
rule: the save either fails with a clear error (StoreRestartedError, StoreUnavailableError)
and no tag appears, or it succeeded and loads bit-identical; earlier tags that the server
kept stay loadable; ``check`` agrees; a retry succeeds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import tensorkv
from servers import RedisSentinel, RedisServer, _client, _wait, available
from tensorkv.errors import ReplicationError, StoreRestartedError, StoreUnavailableError
from tensorkv.stores.base import KVStore

from .saver_worker import assert_model_equal, model

pytestmark = pytest.mark.skipif(not available(), reason="redis-server is not installed")

# Servers die with the thread that started them (PR_SET_PDEATHSIG), and faults fire on the
# save's writer thread, which ends with the save: (re)start servers on this long-lived one.
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="test-redis-spawner")


def _on_spawner(fn: Any) -> Any:
    return lambda: _SPAWNER.submit(fn).result()


class FaultAt(KVStore):
    """Forwards to a real store; runs ``fault()`` before the ``at``-th write (or flush).

    With ``after_key`` the fault is chosen by key instead: ``fault(key)`` runs right after the
    first write that stores a key starting with ``after_key`` has landed, whichever of the
    save's writer threads sends it and whatever it sent before.
    """

    def __init__(self, inner: KVStore, at: int, fault: Any, on_flush: bool = False,
                 after_key: bytes | None = None) -> None:
        super().__init__(inner.url)
        self.inner, self.at, self.fault, self.on_flush = inner, at, fault, on_flush
        self.after_key = after_key
        self.capabilities = inner.capabilities
        self.max_value_size = inner.max_value_size
        self.writes = 0
        self.fired = False
        self._lock = threading.Lock()

    def _fire(self, *args: Any) -> None:
        with self._lock:
            if self.fired:
                return
            self.fired = True
        self.fault(*args)

    def _get_many(self, keys):
        return self.inner._get_many(keys)

    def _write(self, ops, *, atomic):
        with self._lock:
            self.writes += 1
            now = self.after_key is None and not self.on_flush and self.writes == self.at
        if now:
            self._fire()
        out = self.inner._write(ops, atomic=atomic)
        if self.after_key is not None:
            hit = next((bytes(k) for k, v in ops
                        if v is not None and bytes(k).startswith(self.after_key)), None)
            if hit is not None:
                self._fire(hit)
        return out

    def _flush(self):
        if self.on_flush:
            self._fire()
        return self.inner._flush()

    def _scan(self, start, stop, keys_only, limit):
        return self.inner._scan(start, stop, keys_only, limit)

    def _compare_and_set(self, key, expected, value):
        return self.inner._compare_and_set(key, expected, value)

    def _value_sizes(self, keys):
        return self.inner._value_sizes(keys)

    def identity(self):
        return self.inner.identity()

    def delete_prefix(self, prefix, *, chunk=4096):
        return self.inner.delete_prefix(prefix, chunk=chunk)

    def _close(self):
        self.inner.close()

    def _stats(self):
        return self.inner.stats()


@pytest.fixture(autouse=True)
def small_batches(monkeypatch):
    """Many write batches per save, so faults can hit its start, middle and end."""
    from tensorkv.checkpoint import writer

    monkeypatch.setattr(writer, "WRITE_BATCH_BYTES", 16384)


@pytest.fixture(scope="module")
def own_redis():
    """A server of this module only (it is restarted), persisting with appendfsync always."""
    server = RedisServer(extra_conf="appendonly yes\nappendfsync always\n")
    server.start()
    yield server
    server.stop()


def _writes_of_a_save(url: str) -> int:
    with tensorkv.open_store(url) as real:
        probe = FaultAt(real, 0, lambda: None)
        tensorkv.save(model(2), probe, "probe", block_rows=256, bucket_bits=2)
        n = probe.writes
        tensorkv.delete_tag(probe, "probe")
        return n


@pytest.mark.parametrize("point", ["first", "middle", "last", "flush"])
def test_restart_mid_save_fails_the_save_and_keeps_earlier_tags(own_redis, point):
    own_redis.flushall()
    url = own_redis.url + "?retries=6&retry_backoff=0.05"
    tensorkv.save(model(1), url, "before", block_rows=256)
    n = _writes_of_a_save(url)
    assert n >= 3
    with tensorkv.open_store(url) as real:
        at = {"first": 1, "middle": n // 2, "last": n, "flush": 0}[point]
        store = FaultAt(real, at, _on_spawner(own_redis.restart), on_flush=point == "flush")
        with pytest.raises(StoreRestartedError, match="restarted, failed over or lost"):
            tensorkv.save(model(2), store, "during", block_rows=256, bucket_bits=2)
        assert store.fired
    assert tensorkv.list_tags(url) == ["before"]  # the AOF kept it; "during" never appeared
    assert_model_equal(tensorkv.load(None, url, "before"), model(1))
    rep = tensorkv.checkpoint.gc(url, grace=0)
    rep = tensorkv.checkpoint.check(url, verify=True)
    assert rep.ok and rep.tags == ["before"], rep.as_dict()
    tensorkv.save(model(2), url, "during", block_rows=256)  # the retry succeeds
    assert_model_equal(tensorkv.load(None, url, "during"), model(2))


def test_records_lost_without_a_restart_are_detected(own_redis):
    """Records vanish while the server keeps running (an operator's FLUSHDB, eviction)."""
    own_redis.flushall()
    url = own_redis.url
    with tensorkv.open_store(url) as real:
        store = FaultAt(real, 2, own_redis.flushall)
        with pytest.raises(StoreRestartedError, match="pending marker .* is gone"):
            tensorkv.save(model(2), store, "lost", block_rows=256, bucket_bits=2)
        c = own_redis.client()
        try:  # a record of the tag vanishes once written, the marker stays: still refused
            dropped: list[bytes] = []

            def drop(key: bytes) -> None:
                assert c.delete(key) == 1
                dropped.append(key)

            store = FaultAt(real, 0, drop, after_key=b"ckpt/c/")  # a dense chunk, by key
            with pytest.raises(StoreRestartedError, match="records it wrote are missing") as e:
                tensorkv.save(model(3), store, "lost2", block_rows=256, bucket_bits=2)
            assert len(dropped) == 1 and repr(dropped[0]) in str(e.value)
        finally:
            c.close()
    assert tensorkv.list_tags(url) == []


def test_restart_without_persistence_never_publishes_a_tag_without_data(own_redis):
    """The server comes back empty (shutdown nosave): the save fails, no tag points nowhere."""
    own_redis.flushall()
    c = own_redis.client()
    try:
        c.config_set("appendonly", "no")
        with tensorkv.open_store(own_redis.url + "?retries=6&retry_backoff=0.05") as real:
            def restart_empty() -> None:
                # shutdown nosave, as an operator would; the config file still says appendonly,
                # so remove the AOF first (the point is an empty server)
                for p in own_redis.tmp.rglob("appendonly*"):
                    if p.is_dir():
                        for f in p.iterdir():
                            f.unlink()
                    else:
                        p.unlink()
                own_redis.restart()

            store = FaultAt(real, 4, _on_spawner(restart_empty))
            with pytest.raises(StoreRestartedError):
                tensorkv.save(model(3), store, "lost", block_rows=256)
        assert tensorkv.list_tags(own_redis.url) == []
    finally:
        c.close()
        c = own_redis.client()
        c.config_set("appendonly", "yes")
        c.close()


def test_paused_server_past_the_socket_timeout(own_redis):
    """SIGSTOP for longer than socket_timeout: the save fails; after SIGCONT all is clean."""
    own_redis.flushall()
    url = own_redis.url + "?socket_timeout=0.5&retries=0"
    tensorkv.save(model(1), url, "before", block_rows=256)
    pid = own_redis.procs[-1].proc.pid

    def pause() -> None:
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(1.5, os.kill, (pid, signal.SIGCONT)).start()

    with tensorkv.open_store(url) as real:
        store = FaultAt(real, 3, pause)
        with pytest.raises(StoreUnavailableError, match="socket_timeout=0.5"):
            tensorkv.save(model(2), store, "paused", block_rows=256)
    time.sleep(1.6)
    assert tensorkv.list_tags(url) == ["before"]
    assert_model_equal(tensorkv.load(None, url, "before"), model(1))
    tensorkv.checkpoint.gc(url)  # the failed save's own leftovers: its claim is dead
    rep = tensorkv.checkpoint.check(url)
    assert rep.ok and not rep.pending, rep.as_dict()
    tensorkv.save(model(2), url, "paused", block_rows=256)
    assert_model_equal(tensorkv.load(None, url, "paused"), model(2))


@pytest.fixture(scope="module")
def own_sentinel():
    setup = RedisSentinel()
    setup.start()
    yield setup
    setup.stop()


def test_wait_replicas_acknowledged(own_sentinel):
    """wait_replicas=1: the save returns once the replica has every record."""
    own_sentinel.flushall()
    url = own_sentinel.url + "?wait_replicas=1&wait_timeout=10"
    tensorkv.save(model(4), url, "acked", block_rows=256)
    replica = [p for p in own_sentinel.data_ports if p != own_sentinel.master_port()][0]
    c = _client(replica)
    try:  # no wait_replication() here: WAIT already covered every write
        assert c.exists(b"ckpt/m/acked")
    finally:
        c.close()


def test_wait_replicas_not_acknowledged_publishes_nothing(own_sentinel):
    own_sentinel.flushall()
    url = own_sentinel.url + "?wait_replicas=2&wait_timeout=0.3"  # there is one replica
    with pytest.raises(ReplicationError, match="only 1 of wait_replicas=2"):
        tensorkv.save(model(4), url, "unacked", block_rows=256)
    assert tensorkv.list_tags(url) == []
    plain = own_sentinel.url  # gc writes too: with wait_replicas=2 its flush would fail
    assert tensorkv.checkpoint.gc(plain).removed_keys > 0  # the refused save's records
    assert tensorkv.checkpoint.check(plain).ok


def test_sentinel_failover_mid_save(own_sentinel):
    """The master dies mid-save; a replica is promoted: the save fails, no tag appears."""
    url = own_sentinel.url + "?retries=12&retry_backoff=0.05"
    own_sentinel.flushall()
    tensorkv.save(model(1), url, "before", block_rows=256)
    own_sentinel.wait_replication()
    killed: list[int] = []

    def failover() -> None:
        old = own_sentinel.kill_master()
        killed.append(old)

        def promoted() -> bool:
            seen = set()
            for port in own_sentinel.sentinel_ports:
                sc = _client(port)
                try:
                    seen.add(int(sc.execute_command(
                        "SENTINEL", "GET-MASTER-ADDR-BY-NAME", own_sentinel.master_name)[1]))
                finally:
                    sc.close()
            return len(seen) == 1 and old not in seen

        _wait(promoted, 30, "the sentinels to promote the replica")

    try:
        with tensorkv.open_store(url) as real:
            store = FaultAt(real, 3, failover)
            with pytest.raises((StoreRestartedError, StoreUnavailableError)):
                tensorkv.save(model(2), store, "during", block_rows=256)
            assert store.fired
        assert tensorkv.list_tags(url) == ["before"]
        assert_model_equal(tensorkv.load(None, url, "before"), model(1))
        tensorkv.checkpoint.gc(url)
        assert tensorkv.checkpoint.check(url).ok
        tensorkv.save(model(2), url, "during", block_rows=256)
        assert_model_equal(tensorkv.load(None, url, "during"), model(2))
    finally:
        if killed:
            own_sentinel.restart_as_replica(killed[0])
