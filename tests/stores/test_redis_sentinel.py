"""Redis backend behind Redis Sentinel: a master, a replica and three sentinels."""

from __future__ import annotations

import pytest

from servers import free_port, with_options
from tensorkv.errors import StoreUnavailableError
from tensorkv.stores import open_store
from tensorkv.testing import StoreTests


class TestRedisSentinel(StoreTests):
    @pytest.fixture
    def store_url(self, redis_sentinel, key_prefix):
        redis_sentinel.flushall()
        return with_options(redis_sentinel.url, prefix=key_prefix)


def test_stats_name_master_and_replica(redis_sentinel, key_prefix):
    with open_store(redis_sentinel.url, prefix=key_prefix) as s:
        st = s.stats()
        assert st["mode"] == "sentinel" and st["capabilities"]["atomic_batches"]
        assert st["nodes"][0] == f"127.0.0.1:{redis_sentinel.master_port()}"
        assert len(st["nodes"]) == 2


def test_read_from_replicas(redis_sentinel, key_prefix):
    redis_sentinel.flushall()
    items = {b"r%d" % i: b"value-%d" % i for i in range(300)}
    with open_store(redis_sentinel.url, prefix=key_prefix) as w:
        w.put_many(items)
    redis_sentinel.wait_replication()
    with open_store(redis_sentinel.url, prefix=key_prefix, read_from_replicas=True) as r:
        assert r.get_many(list(items)) == list(items.values())
        assert r.count() == 300
        r.put(b"written", b"to master")  # writes still go to the master
    redis_sentinel.wait_replication()
    with open_store(redis_sentinel.url, prefix=key_prefix) as w:
        assert w.get(b"written") == b"to master"


def test_unknown_master_name(redis_sentinel):
    url = redis_sentinel.url.replace("/mymaster/", "/nosuchmaster/")
    with pytest.raises(StoreUnavailableError, match="nosuchmaster"):
        open_store(url, connect_timeout=1)


def test_unreachable_sentinels():
    ports = [free_port(), free_port()]
    url = f"redis+sentinel://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/mymaster"
    with pytest.raises(StoreUnavailableError, match=str(ports[0])):
        open_store(url, connect_timeout=0.5)


def test_db_in_path(redis_sentinel, key_prefix):
    url = with_options(redis_sentinel.url.replace("/mymaster/0", "/mymaster/3"),
                       prefix=key_prefix)
    with open_store(url) as s:
        s.put(b"k", b"v")
        assert s._db == 3 and s.get(b"k") == b"v"


def test_failover_keeps_data_and_follows_the_new_master(redis_sentinel, key_prefix):
    """The master crashes; sentinels promote the replica; an open store follows it.

    Runs last in this module: it moves the master role (the crashed node comes back as a
    replica).
    """
    from servers import _client, _wait

    redis_sentinel.flushall()
    with open_store(redis_sentinel.url, prefix=key_prefix, retries=10,
                    retry_backoff=0.05) as s:
        s.put_many({b"k%d" % i: b"v%d" % i for i in range(100)})
        redis_sentinel.wait_replication()
        old = redis_sentinel.kill_master()

        def promoted() -> bool:
            seen = set()
            for port in redis_sentinel.sentinel_ports:  # every sentinel agrees
                sc = _client(port)
                try:
                    seen.add(int(sc.execute_command(
                        "SENTINEL", "GET-MASTER-ADDR-BY-NAME", redis_sentinel.master_name)[1]))
                finally:
                    sc.close()
            if len(seen) != 1 or old in seen:
                return False
            nc = _client(seen.pop())
            try:
                return nc.info("replication")["role"] == "master"
            finally:
                nc.close()

        try:
            _wait(promoted, 30, "the sentinels to promote the replica")
            assert s.get(b"k42") == b"v42"  # the broken connection is retried via sentinels
            s.put(b"after", b"failover")
            assert s.count() == 101
        finally:
            redis_sentinel.restart_as_replica(old)
    with open_store(redis_sentinel.url, prefix=key_prefix) as again:
        assert again.get(b"after") == b"failover"
