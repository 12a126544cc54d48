"""Rows lost under a live Redis-resident table are detected, never re-created from initial values.

Real servers: a standalone server restarted without persistence, restarted from an older
snapshot (as a failover to a replica that missed writes), buckets evicted (deleted) on a
standalone server and on a Cluster. Every process that has the table open fails its next
operation that touches a lost bucket with ``TableLostError`` (its step unchanged, nothing
written); a new process refuses to open the tag unless ``on_lost="start_empty"``, after which
a checkpoint restores the rows bit for bit.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from tests.redis_table.helpers import redis_table

import servers
import tensorkv
from tensorkv.embedding.redis import commit as redis_commit
from tensorkv.embedding.redis import lua as redis_lua
from tensorkv.errors import ConfigError, StoreUnavailableError, TableLostError

ADAGRAD = {"optimizer": "adagrad", "seed": 7}
KEYS = np.arange(58)


def train(tables, steps: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        k = rng.choice(KEYS, 24, replace=False)
        g = rng.normal(size=(24, 4)).astype(np.float32)
        for t in tables:
            t.lookup(k)
            t.apply_gradients(k, g)


def state(t) -> dict[str, np.ndarray]:
    k = np.sort(t.keys())
    return {"keys": k, "values": t.lookup(k, insert=False), "freq": t.frequency(k),
            "version": t.version(k)}


def assert_same(a, b) -> None:
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def every_call(t, keys):
    """Every kind of call of a table touching ``keys`` (reads and writes)."""
    return {
        "lookup": lambda: t.lookup(keys),
        "lookup(insert=False)": lambda: t.lookup(keys, insert=False),
        "apply_gradients": lambda: t.apply_gradients(keys, np.ones((keys.size, 4))),
        "upsert": lambda: t.upsert(keys, np.ones((keys.size, 4))),
        "contains": lambda: t.contains(keys),
        "len": lambda: len(t),
        "keys": lambda: t.keys(),
        "export": lambda: list(t.export()),
    }


def test_restart_without_persistence(own_server, tag):
    """The issue's case: the server comes back empty under a trainer and a serving table."""
    url = f"redis://127.0.0.1:{own_server.port}/0"
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=4, table_kwargs=ADAGRAD)
    serving = redis_table(url, 4, model_tag_runtime=tag, storage_slice=4, read_only=True,
                          table_kwargs=ADAGRAD)
    train([t], 4)
    step = t.step
    own_server.kill()
    own_server.restart()  # no persistence: empty
    for name, call in every_call(t, KEYS[:10]).items():
        with pytest.raises(TableLostError, match="lost their rows"):
            call()
        assert t.step == step, name
    with pytest.raises(TableLostError, match="lost their rows"):
        serving.lookup(KEYS, insert=False)
    c = own_server.client()
    try:  # nothing was re-created (the locks taken were released)
        assert c.dbsize() == 0
    finally:
        c.close()
    # a server that lost everything leaves no trace: servers refuse, resuming trainers can
    with pytest.raises(TableLostError, match="holds no table"):
        redis_table(url, 4, model_tag_runtime=tag, storage_slice=4, read_only=True,
                    table_kwargs=ADAGRAD)
    with pytest.raises(TableLostError, match="must_exist"):
        redis_table(url, 4, model_tag_runtime=tag, storage_slice=4, must_exist=True,
                    table_kwargs=ADAGRAD)
    t.close(), serving.close()


def test_restart_from_an_older_snapshot(own_server, tag):
    """Buckets going back to older versions (a stale replica, an old dump) are refused."""
    url = f"redis://127.0.0.1:{own_server.port}/0"
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=2, table_kwargs=ADAGRAD)
    train([t], 3)
    c = own_server.client()
    try:
        c.save()  # dump.rdb: the server will restart from this older state
    finally:
        c.close()
    train([t], 2, seed=1)
    step = t.step
    own_server.kill()
    own_server.restart()
    with pytest.raises(TableLostError, match=r"went back from version \d+ to \d+"):
        t.apply_gradients(KEYS, np.ones((KEYS.size, 4)))
    assert t.step == step
    t.close()


@pytest.fixture(params=["standalone", "cluster"])
def where(request):
    """``(url, admin client factory)`` of the session's standalone server or Cluster."""
    if request.param == "standalone":
        srv = request.getfixturevalue("redis_server")
        return f"redis://127.0.0.1:{srv.port}/0", srv.client
    cl = request.getfixturevalue("redis_cluster")
    from redis.cluster import RedisCluster

    return cl.url, lambda: RedisCluster(host="127.0.0.1", port=cl.ports[0])


def test_evicted_bucket_then_start_empty_and_restore(where, tag, tmp_path):
    """One bucket evicted (on a Cluster: a master's buckets lost): refused by every process;
    ``on_lost='start_empty'`` then a checkpoint restore the rows; old processes must reopen."""
    url, client = where
    opts = {"model_tag_runtime": tag, "storage_slice": 6, "table_kwargs": ADAGRAD}
    t = redis_table(url, 4, **opts)
    ref = tensorkv.EmbeddingTable(4, **ADAGRAD)
    train([t, ref], 5)
    store = f"lmdb://{tmp_path}/ck"
    tensorkv.save({"emb": t}, store, tag="v1")
    saved = state(t)
    engine = t._rows.engine
    lost = engine.runtime.names[2]
    c = client()
    try:
        c.delete(lost)  # maxmemory eviction, or the master serving it restarted empty
    finally:
        c.close()
    in_lost = KEYS[engine.runtime.of(KEYS) == 2]
    step = t.step
    for name, call in every_call(t, in_lost).items():
        with pytest.raises(TableLostError, match="1 of its 6 buckets lost"):
            call()
        assert t.step == step, name
    np.testing.assert_array_equal(  # the other buckets still answer
        t.lookup(KEYS[:2], insert=False), ref.lookup(KEYS[:2], insert=False))
    with pytest.raises(TableLostError, match=r"holds no epoch.*on_lost='start_empty'"):
        redis_table(url, 4, **opts)  # a new process
    fresh = redis_table(url, 4, on_lost="start_empty", **opts)
    assert len(fresh) == 0 and fresh.stats()["redis"]["epoch"] != engine.runtime.epoch
    tensorkv.load({"emb": fresh}, store, tag="v1")
    assert_same(state(fresh), saved)
    with pytest.raises(TableLostError, match="emptied .*start_empty.*Open the table again"):
        t.lookup(KEYS)  # a process that had it open
    again = redis_table(url, 4, **opts)
    assert_same(state(again), saved)
    t.close(), fresh.close(), again.close()


def test_layout_record_lost(where, tag):
    """Buckets without their layout record (the master serving it lost it) are refused."""
    url, client = where
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=3, table_kwargs=ADAGRAD)
    train([t], 2)
    c = client()
    try:
        c.delete(t._rows.engine.runtime.meta_key)
    finally:
        c.close()
    with pytest.raises(TableLostError, match="layout record is gone"):
        redis_table(url, 4, model_tag_runtime=tag, storage_slice=3, table_kwargs=ADAGRAD)
    t.close()


def test_rows_of_an_older_tensorkv_are_adopted(redis_server, tag):
    """A table whose buckets carry no identity (written before it was recorded) is adopted
    by the first writable process, rows kept; a read-only one asks for that first."""
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=3, table_kwargs=ADAGRAD)
    train([t], 3)
    before = state(t)
    engine = t._rows.engine
    c = redis_server.client()
    try:  # as an older tensorkv left it
        for name in engine.runtime.names:
            c.hdel(name, *redis_lua.META_FIELDS)
        meta = json.loads(c.get(engine.runtime.meta_key))
        for k in ("epoch", "state"):
            meta.pop(k)
        c.set(engine.runtime.meta_key, json.dumps({**meta, "version": 1}))
    finally:
        c.close()
    with pytest.raises(ConfigError, match="open it once from a writable process"):
        redis_table(url, 4, model_tag_runtime=tag, storage_slice=3, read_only=True,
                    table_kwargs=ADAGRAD)
    adopted = redis_table(url, 4, model_tag_runtime=tag, storage_slice=3, table_kwargs=ADAGRAD)
    assert_same(state(adopted), before)
    serving = redis_table(url, 4, model_tag_runtime=tag, storage_slice=3, read_only=True,
                          table_kwargs=ADAGRAD)
    assert_same(state(serving), before)
    t.close(), adopted.close(), serving.close()


def test_bad_on_lost_option(redis_server):
    with pytest.raises(ConfigError, match="on_lost='ignore' must be one of raise, start_empty"):
        tensorkv.StorageOption("REDIS", storage_path=f"redis://127.0.0.1:{redis_server.port}/0",
                               redis_options={"on_lost": "ignore"})
    with pytest.raises(ConfigError, match="must_exist=1 must be true or false"):
        tensorkv.StorageOption("REDIS", storage_path=f"redis://127.0.0.1:{redis_server.port}/0",
                               redis_options={"must_exist": 1})


def test_flushall_then_another_process_creates_the_tag_again(own_server, tag):
    """A serving table never reads rows of a table created again under its tag after a
    FLUSHALL (another epoch), even in buckets whose versions look new enough."""
    url = f"redis://127.0.0.1:{own_server.port}/0"
    opts = {"model_tag_runtime": tag, "storage_slice": 4, "table_kwargs": ADAGRAD}
    trainer = redis_table(url, 4, **opts)
    trainer.upsert(np.array([0, 1, 4, 5]), np.ones((4, 4)))  # buckets 0 and 1 only
    serving = redis_table(url, 4, read_only=True, **opts)
    in_bucket_2 = np.array([2, 6, 10])
    first = serving.lookup(in_bucket_2, insert=False)  # no rows there: initial values
    own_server.flushall()
    other = redis_table(url, 4, **opts)  # sees no trace: a new table, another epoch
    other.upsert(in_bucket_2, np.full((3, 4), 9.0))
    with pytest.raises(TableLostError, match="re-created"):
        serving.lookup(in_bucket_2, insert=False)
    with pytest.raises(TableLostError):
        trainer.lookup(in_bucket_2)
    assert np.array_equal(first, tensorkv.EmbeddingTable(4, **ADAGRAD).lookup(in_bucket_2,
                                                                                insert=False))
    trainer.close(), serving.close(), other.close()


def test_store_mode_2_tag_refused_after_a_flush(own_server, tag, tmp_path):
    """A tag that holds no rows (``table_store_mode=2``) does not load into a table that
    Redis re-created empty after a FLUSHALL: a new process resuming from it is refused,
    nothing changes, and a table with the rows of the save loads it."""
    url = f"redis://127.0.0.1:{own_server.port}/0"
    opts = {"model_tag_runtime": tag, "storage_slice": 4, "table_store_mode": 2,
            "table_kwargs": ADAGRAD}
    t = redis_table(url, 4, **opts)
    train([t], 5)
    ckpt = f"lmdb://{tmp_path}/ck"
    tensorkv.save({"emb": t}, ckpt, tag="v1")
    again = redis_table(url, 4, **opts)  # the same rows: loads
    tensorkv.load({"emb": again}, ckpt, tag="v1")
    assert again.step == t.step
    again.close()
    own_server.flushall()
    fresh = redis_table(url, 4, **opts)  # sees no trace: a new table, another epoch
    with pytest.raises(TableLostError, match="epoch") as info:
        tensorkv.load({"emb": fresh}, ckpt, tag="v1")
    assert "table_store_mode=0" in str(info.value)
    assert fresh.step == 0 and len(fresh) == 0
    t.close(), fresh.close()


@pytest.mark.parametrize("bucket", [0, 1])
def test_bucket_lost_between_the_read_and_the_commit(where, tag, monkeypatch, bucket):
    """A bucket (the commit's first, or another) evicted while an operation computes: its
    commit writes nothing (the bucket is not re-created) and raises ``TableLostError``; the
    step does not move."""
    url, client = where
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=3, table_kwargs=ADAGRAD)
    train([t], 2)
    step = t.step
    name = t._rows.engine.runtime.names[bucket]
    real = redis_commit.commit

    def evict_then_commit(engine, *args):
        c = client()
        try:
            c.delete(name)
        finally:
            c.close()
        return real(engine, *args)

    monkeypatch.setattr(redis_commit, "commit", evict_then_commit)
    with pytest.raises(TableLostError, match="lost their rows"):
        t.apply_gradients(KEYS, np.ones((KEYS.size, 4)))
    monkeypatch.setattr(redis_commit, "commit", real)
    assert t.step == step
    c = client()
    try:
        assert not c.exists(name)
    finally:
        c.close()
    t.close()


@pytest.mark.slow
def test_sentinel_failover_to_a_replica_without_the_rows(tag):
    """Sentinel promotes a replica that lost the table (its dataset diverged): the trainer's
    next operation raises ``TableLostError`` instead of training from initial values."""
    if not servers.available():
        pytest.skip("redis-server is not installed")
    setup = servers.RedisSentinel()
    setup.start()
    try:
        t = redis_table(setup.url, 4, model_tag_runtime=tag, storage_slice=4, retries=2,
                        retry_backoff=0.05, table_kwargs=ADAGRAD)
        train([t], 3)
        step = t.step
        setup.wait_replication()
        replica = [p for p in setup.data_ports if p != setup.master_port()][0]
        c = servers._client(replica)
        try:  # the replica's data is gone (as if it had been resynced from nothing)
            c.config_set("replica-read-only", "no")
            c.flushall()
        finally:
            c.close()
        setup.kill_master()
        deadline = time.monotonic() + 60
        while True:
            try:
                t.lookup(KEYS, insert=False)  # never read as initial values
            except TableLostError as exc:
                assert "lost their rows" in str(exc)
                break
            except StoreUnavailableError:  # the failover is still under way
                assert time.monotonic() < deadline, "no master after 60 s"
                time.sleep(0.2)
            else:
                pytest.fail("the table read rows of a replica that lacks them")
        with pytest.raises(TableLostError):
            t.apply_gradients(KEYS, np.ones((KEYS.size, 4)))
        assert t.step == step
        t.close()
    finally:
        setup.stop()
