"""Faults of a Redis-resident table: corrupted rows, a killed server, a Sentinel failover.

A row that fails its checksum is never read as valid; a server that dies mid-training gives
a clear error and nothing half-applied, and the retried step gives the DRAM table's result;
a Sentinel failover is survived by retrying; a lost bucket lock fails the commit.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from tests.redis_table.helpers import redis_table

import servers
import tensorkv
from tensorkv.embedding.redis import commit as redis_commit
from tensorkv.embedding.redis import engine as redis_engine
from tensorkv.errors import CorruptRecordError, RowLockError, StoreUnavailableError

ADAGRAD = {"optimizer": "adagrad", "seed": 2}


def step(tables, rng, high: int = 50) -> None:
    keys = rng.integers(0, high, 16)
    grads = rng.normal(size=(16, 4)).astype(np.float32)
    outs = [t.lookup(keys) for t in tables]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    for t in tables:
        t.apply_gradients(keys, grads)


def assert_same(t, ref) -> None:
    keys = np.sort(ref.keys())
    np.testing.assert_array_equal(np.sort(t.keys()), keys)
    np.testing.assert_array_equal(t.lookup(keys, insert=False), ref.lookup(keys, insert=False))
    np.testing.assert_array_equal(t.frequency(keys), ref.frequency(keys))
    np.testing.assert_array_equal(t.version(keys), ref.version(keys))


def test_checksum_catches_corrupted_rows(redis_server, tag):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=1, table_kwargs=ADAGRAD)
    t.lookup(np.arange(10))
    bucket = f"{tag}:default{{{redis_engine.generated_tags(1)[0]}}}"
    field = redis_engine.encode_fields(np.array([3]))[0]
    c = redis_server.client()
    try:
        raw = bytearray(c.hget(bucket, field))
        raw[40] ^= 0x10  # one bit of the values
        c.hset(bucket, field, bytes(raw))
        with pytest.raises(CorruptRecordError, match=r"fail their checksum.*keys \[3\]"):
            t.lookup(np.array([1, 3]))
        with pytest.raises(CorruptRecordError, match="checksum"):
            t.lookup(np.array([3]), insert=False)
        c.hset(bucket, redis_engine.encode_fields(np.array([4]))[0], b"half")
        with pytest.raises(CorruptRecordError, match=r"values of \[4\] bytes"):
            t.apply_gradients(np.array([4]), np.ones((1, 4)))
        assert t.remove(np.array([4])) == 0  # a bad row is replaced or removed, never read
        t.upsert(np.array([3]), np.full((1, 4), 2.0))
        np.testing.assert_array_equal(t.lookup(np.array([3, 4]), insert=False)[0], 2.0)
        assert not c.hexists(bucket, redis_engine.encode_fields(np.array([4]))[0])
    finally:
        c.close()
    t.close()


def test_killed_server_fails_clearly_then_a_retry_matches_dram(tag):
    srv = servers.RedisServer(extra_conf="appendonly yes\nappendfsync always\n")
    srv.start()
    try:
        url = f"redis://127.0.0.1:{srv.port}/0"
        t = redis_table(url, 4, model_tag_runtime=tag, retries=1, retry_backoff=0.01,
                        connect_timeout=1, table_kwargs=ADAGRAD)
        ref = tensorkv.EmbeddingTable(4, **ADAGRAD)
        rng = np.random.default_rng(0)
        for _ in range(3):
            step([t, ref], rng)
        srv.kill()
        state = rng.bit_generator.state
        with pytest.raises(StoreUnavailableError, match="cannot reach"):
            step([t], rng)
        assert t.step == ref.step  # nothing of the failed step happened
        srv.restart()
        rng.bit_generator.state = state
        for _ in range(3):  # the failed step again, then more
            step([t, ref], rng)
        assert_same(t, ref)
        t.close()
    finally:
        srv.stop()


def test_lost_lock_fails_the_commit(redis_server, tag, monkeypatch):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=2, table_kwargs=ADAGRAD)
    t.lookup(np.arange(6))
    real = redis_commit.commit

    def expire_locks_first(engine, *args):
        c = redis_server.client()
        try:  # as if the locks expired (lock_ttl_seconds) while the step ran
            c.delete(*engine.runtime.locks)
        finally:
            c.close()
        return real(engine, *args)

    monkeypatch.setattr(redis_commit, "commit", expire_locks_first)
    step_before = t.step
    with pytest.raises(RowLockError, match="expired"):
        t.apply_gradients(np.arange(6), np.ones((6, 4)))
    assert t.step == step_before  # the step moves only with an applied commit
    monkeypatch.setattr(redis_commit, "commit", real)
    before = t.lookup(np.arange(6), insert=False)
    assert t.apply_gradients(np.arange(6), np.ones((6, 4))) == 6  # locks free again
    assert not np.array_equal(before, t.lookup(np.arange(6), insert=False))
    t.close()


def test_busy_lock_times_out(redis_server, tag):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=1, lock_wait_seconds=0.2,
                    table_kwargs=ADAGRAD)
    c = redis_server.client()
    try:
        c.set(t._rows.engine.runtime.locks[0], b"someone-else", px=60000)
        with pytest.raises(RowLockError, match="stayed locked"):
            t.lookup(np.arange(3))
        assert len(t) == 0
    finally:
        c.close()
    t.close()


@pytest.fixture(scope="module")
def sentinel():
    setup = servers.RedisSentinel()
    setup.start()
    yield setup
    setup.stop()


def test_sentinel_failover_is_survived_by_retrying(sentinel, tag):
    url = sentinel.url
    t = redis_table(url, 4, model_tag_runtime=tag, retries=2, retry_backoff=0.05,
                    table_kwargs=ADAGRAD)
    ref = tensorkv.EmbeddingTable(4, **ADAGRAD)
    rng = np.random.default_rng(1)
    for _ in range(3):
        step([t, ref], rng)
    sentinel.wait_replication()
    serving = redis_table(url, 4, model_tag_runtime=tag, read_only=True,
                          redis_read_access_slave=True, table_kwargs=ADAGRAD)
    keys = np.sort(ref.keys())
    np.testing.assert_array_equal(serving.lookup(keys, insert=False),
                                  ref.lookup(keys, insert=False))
    replica = [p for p in sentinel.data_ports if p != sentinel.master_port()][0]
    c = servers._client(replica)
    try:  # the serving table read from the replica
        assert int(c.info("commandstats")["cmdstat_hmget"]["calls"]) > 0
    finally:
        c.close()
    serving.close()
    sentinel.kill_master()
    deadline = time.monotonic() + 60

    def retried(fn, *args):
        while True:  # a failed operation changed nothing: run it again
            try:
                return fn(*args)
            except StoreUnavailableError:
                assert time.monotonic() < deadline, "no master after 60 s"
                time.sleep(0.2)

    for _ in range(3):
        keys = rng.integers(0, 50, 16)
        grads = rng.normal(size=(16, 4)).astype(np.float32)
        np.testing.assert_array_equal(retried(t.lookup, keys), ref.lookup(keys))
        retried(t.apply_gradients, keys, grads)
        ref.apply_gradients(keys, grads)
    assert_same(t, ref)
    t.close()


@pytest.mark.parametrize("server", ["redis_acl_server", "redis_tls_server"])
def test_acl_and_tls(server, request, tag):
    srv = request.getfixturevalue(server)
    t = redis_table(srv.url, 4, model_tag_runtime=tag, table_kwargs=ADAGRAD)
    ref = tensorkv.EmbeddingTable(4, **ADAGRAD)
    rng = np.random.default_rng(3)
    for _ in range(3):
        step([t, ref], rng)
    assert_same(t, ref)
    t.close()
