"""Redis backend on a real Redis Cluster: 3 masters with one replica each."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from servers import _client, with_options
from tensorkv.stores import open_store
from tensorkv.stores.redis import key_slots
from tensorkv.testing import StoreTests


class TestRedisCluster(StoreTests):
    @pytest.fixture
    def store_url(self, redis_cluster, key_prefix):
        redis_cluster.flushall()
        return with_options(redis_cluster.url, prefix=key_prefix)


def _node_calls(ports: list[int], command: str) -> int:
    total = 0
    for p in ports:
        c = _client(p)
        try:
            total += int(c.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))
        finally:
            c.close()
    return total


def _reset_stats(ports: list[int]) -> None:
    for p in ports:
        c = _client(p)
        try:
            c.config_resetstat()
        finally:
            c.close()


def test_capabilities_and_stats(redis_cluster, key_prefix):
    redis_cluster.flushall()
    with open_store(redis_cluster.url, prefix=key_prefix) as s:
        caps = s.capabilities
        assert caps.distributed and not caps.atomic_batches and not caps.ordered_scans
        s.put_many({b"a": b"1", b"b": b"2", b"c": b"3"})
        st = s.stats()
        assert st["mode"] == "cluster" and st["keys"] == 3 and len(st["nodes"]) >= 3


def test_hash_tags_share_a_slot(redis_cluster, key_prefix):
    redis_cluster.flushall()
    keys = [b"{t}a", b"{t}b", b"{t}c/long/key"]
    full = [key_prefix.encode() + k for k in keys]
    slots = key_slots(full)
    assert len(set(slots.tolist())) == 1
    c = _client(redis_cluster.ports[0])
    try:
        assert int(c.execute_command("CLUSTER", "KEYSLOT", full[0])) == slots[0]
    finally:
        c.close()
    masters = redis_cluster.nodes("master")
    with open_store(redis_cluster.url, prefix=key_prefix) as s:
        _reset_stats(masters)
        s.put_many({k: k for k in keys})
        # one slot: a single MSET for all three keys
        assert _node_calls(masters, "mset") == 1
        assert s.get_many(keys[::-1]) == keys[::-1]
        assert _node_calls(masters, "mget") == 1
        assert _node_calls(masters, "exec") == 0  # put_many is not a transaction
        with s.batch() as b:  # one slot: a MULTI/EXEC transaction on its master
            b.put(b"{t}a", b"new")
            b.delete(b"{t}b")
        assert _node_calls(masters, "exec") == 1
        assert s.get_many(keys[:2]) == [b"new", None]


def test_keys_sending_size_7_with_1000_keys(redis_cluster, key_prefix):
    redis_cluster.flushall()
    # ten hash tags, so per-slot commands really carry several keys
    items = {b"{g%d}k%04d" % (i % 10, i): b"v%d" % i for i in range(1000)}
    masters = redis_cluster.nodes("master")
    with open_store(redis_cluster.url, prefix=key_prefix, keys_sending_size=7) as s:
        _reset_stats(masters)
        s.put_many(items)
        assert _node_calls(masters, "mset") == 10 * -(-100 // 7)
        keys = list(items)[::-1] + [b"{g1}absent", b"untagged"]
        assert s.get_many(keys) == [items[k] for k in keys[:-2]] + [None, None]
        assert s.count() == 1000 and dict(s.scan()) == items
        s.delete_many(list(items)[:500])
        assert s.count() == 500
        assert s.delete_prefix(b"{g") == 500 and s.count() == 0


def test_untagged_keys_spread_over_masters(redis_cluster, key_prefix):
    redis_cluster.flushall()
    items = {b"key%d" % i: b"%d" % i for i in range(300)}
    with open_store(redis_cluster.url, prefix=key_prefix) as s:
        with s.batch() as b:  # spans many slots: applied, though not atomically
            b.put_many(items)
        assert s.get_many(list(items)) == list(items.values())
    for p in redis_cluster.nodes("master"):
        c = _client(p)
        try:
            assert c.dbsize() > 0
        finally:
            c.close()


def test_count_without_namespace_uses_dbsize(redis_cluster):
    redis_cluster.flushall()
    with open_store(redis_cluster.url) as s:
        s.put_many({b"n%d" % i: b"x" for i in range(100)})
        assert s.count() == 100 and s.count(b"n1") == 11


def test_read_from_replicas(redis_cluster, key_prefix):
    redis_cluster.flushall()
    items = {b"r%d" % i: b"value-%d" % i for i in range(500)}
    with open_store(redis_cluster.url, prefix=key_prefix) as w:
        w.put_many(items)
    redis_cluster.wait_replication()
    redis_cluster.wait_replicas_advertised()
    replicas = redis_cluster.nodes("slave")
    _reset_stats(replicas)
    with open_store(redis_cluster.url, prefix=key_prefix, read_from_replicas=True) as r:
        assert r.get_many(list(items)) == list(items.values())
        assert dict(r.scan(b"r1")) == {k: v for k, v in items.items() if k.startswith(b"r1")}
    assert _node_calls(replicas, "mget") > 0


def test_hash_tag_batch_is_atomic_when_killed(redis_cluster, key_prefix):
    redis_cluster.flushall()
    url = with_options(redis_cluster.url, prefix=key_prefix)
    n = 20000
    code = f"""
        import os, time
        import tensorkv
        s = tensorkv.open_store({url!r})
        payload = os.urandom(512)
        with s.batch() as b:
            for i in range({n}):
                b.put(b"{{t}}batch/%06d" % i, payload)
            b.put(b"{{t}}marker", b"after")
            print("committing", flush=True)
        print("committed", flush=True)
        time.sleep(60)
    """
    for delay in (0.0, 0.05, 0.3):
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        with open_store(url) as check:
            count = check.count(b"{t}batch/")
            marker = check.get(b"{t}marker")
            assert count in (0, n), f"partial batch: {count} of {n}"
            assert (count == n) == (marker == b"after")
            check.delete_prefix(b"{t}")


def test_resharded_slot_is_followed(redis_cluster, key_prefix):
    """A store whose slot map is stale gets MOVED replies and retries on the new owner."""
    from redis.crc import key_slot

    redis_cluster.flushall()
    keys = [b"{moving}k%d" % i for i in range(50)]
    other = [b"stay%d" % i for i in range(50)]
    slot = key_slot(b"moving")
    with open_store(redis_cluster.url, prefix=key_prefix, keys_sending_size=8) as s:
        s.put_many({k: k for k in keys + other})
        owner = redis_cluster.slot_owner(slot)
        target = next(p for p in redis_cluster.nodes("master") if p != owner)
        redis_cluster.move_slot(slot, target)
        assert s.get_many(keys + other) == keys + other
        s.put_many({k: b"new" for k in keys})
        s.delete_many(keys[:10])
        assert s.get_many(keys) == [None] * 10 + [b"new"] * 40
        assert s.count(b"{moving}") == 40
    c = _client(target)
    try:
        assert c.get(key_prefix.encode() + keys[-1]) == b"new"
    finally:
        c.close()


def test_wait_replicas_is_refused_on_a_cluster(redis_cluster):
    from tensorkv.errors import ConfigError

    with pytest.raises(ConfigError, match="wait_replicas=1 is not supported on a Redis Cluster"):
        open_store(with_options(redis_cluster.url, wait_replicas=1))


def test_identity_names_every_primary(redis_cluster):
    with open_store(redis_cluster.url) as s:
        ids = s.identity().split(",")
        assert len(ids) == len(redis_cluster.nodes("master")) and all(len(i) == 40 for i in ids)
