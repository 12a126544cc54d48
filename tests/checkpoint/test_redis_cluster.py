"""Checkpoints on a real Redis Cluster: tables pinned to chosen nodes by hash tags."""

from __future__ import annotations

import numpy as np
import pytest
from tests import servers
from tests.checkpoint.helpers import assert_tables_equal, make_table

import tensorkv

pytestmark = pytest.mark.skipif(not servers.available(), reason="redis-server is not installed")


@pytest.fixture(scope="module")
def cluster(redis_cluster):
    """The shared cluster (tests/conftest.py), emptied: these tests count keys per node."""
    pytest.importorskip("redis")
    redis_cluster.flushall()
    return redis_cluster


def _node_keys(cluster) -> dict[int, set[bytes]]:
    import redis

    out = {}
    for port in cluster.nodes("master"):
        with redis.Redis(port=port) as r:
            out[port] = set(r.scan_iter(match=b"*ckpt/t/*", count=1000))
    return out


def _tag_on(port: int, avoid: int) -> str:
    """A literal hash tag whose slot node ``port`` serves (and ``avoid`` does not)."""
    import redis

    with redis.Redis(port=port) as r:
        slots = r.execute_command("CLUSTER", "SLOTS")
        ranges = [(int(s[0]), int(s[1]), int(s[2][1])) for s in slots]
        for i in range(10_000):
            tag = f"model-{i}"
            slot = int(r.execute_command("CLUSTER", "KEYSLOT", tag))
            owner = next(p for lo, hi, p in ranges if lo <= slot <= hi)
            if owner == port and owner != avoid:
                return tag
    raise AssertionError(f"no hash tag found for node {port}")


def test_literal_hash_tag_pins_a_table_to_the_chosen_node(cluster):
    url = cluster.url + "?prefix=pin/"
    masters = cluster.nodes("master")
    target = masters[1]
    tag = _tag_on(target, avoid=masters[0])
    t = make_table(3000, 4)
    dense = np.arange(1000, dtype=np.float32)
    tensorkv.save({"emb": t, "w": dense}, url, "a", hash_tag=tag, block_rows=64)
    keys = _node_keys(cluster)
    pinned = {k for k in keys[target] if b"ckpt/t/" in k}
    assert pinned and all(f"{{{tag}}}".encode() in k for k in pinned)
    assert all(not ks for p, ks in keys.items() if p != target)  # every table key on target
    t.lookup(np.arange(7, dtype=np.int64))
    tensorkv.save({"emb": t, "w": dense}, url, "b", hash_tag=tag, incremental=True)
    assert all(not ks for p, ks in _node_keys(cluster).items() if p != target)
    out = tensorkv.load(None, url, "b")
    assert_tables_equal(out["emb"], t)
    np.testing.assert_array_equal(out["w"], dense)
    assert tensorkv.checkpoint.check(url).ok
    for name in ("b", "a"):
        tensorkv.delete_tag(url, name)
    assert not any(_node_keys(cluster).values())


def test_bucket_hash_tags_spread_a_table_over_the_nodes(cluster):
    url = cluster.url + "?prefix=spread/"
    t = make_table(20_000, 4)
    tensorkv.save({"emb": t}, url, "a", hash_tag="bucket", block_rows=64)
    keys = _node_keys(cluster)
    assert sum(1 for ks in keys.values() if ks) == len(keys)  # every master holds buckets
    assert_tables_equal(tensorkv.load(None, url, "a")["emb"], t)
    tensorkv.delete_tag(url, "a")
    assert not any(_node_keys(cluster).values())
