"""Commits of a Redis-resident table are all-or-nothing and never applied twice.

Faults on real servers at seeded points (``tests/faults/conftest.py``'s seed): a Cluster master
SIGKILLed (and restarted from its append-only file) before or after the n-th store call of a
training step; a standalone server killed while the commit script's reply is on its way; the
training process itself SIGKILLed mid-operation (standalone and Cluster). After each fault a
second reader sees every row of the interrupted operation or none, a retried call is applied
once, and the table ends bit-identical to a DRAM table that applied every step once. A commit
that falls back from the raw path to redis-py still releases its bucket locks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import redis.exceptions as rex
from tests.faults.conftest import rng_for
from tests.redis_table.helpers import redis_table

import servers
import tensorkv
from tensorkv.embedding.redis import commit as redis_commit
from tensorkv.errors import RowLockError, StoreUnavailableError
from tensorkv.stores import redis_raw
from tensorkv.stores.redis_keys import key_slots

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import crash_writer  # noqa: E402

PERSISTED = "appendonly yes\nappendfsync always\n"
FAST_FAIL = {"retries": 1, "retry_backoff": 0.01, "connect_timeout": 1, "socket_timeout": 3}


def snapshot(t, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return t.lookup(keys, insert=False), t.frequency(keys)


def full_state(t) -> dict[str, np.ndarray]:
    k = np.sort(t.keys())
    return {"keys": k, "values": t.lookup(k, insert=False), "freq": t.frequency(k),
            "version": t.version(k)}


def assert_same(a, b) -> None:
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def matches(got, want) -> bool:
    return all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def persisted_cluster(request):
    """A Cluster of 3 masters with append-only files (a killed master comes back whole)."""
    return servers.session_server(request, servers.RedisCluster, extra_conf=PERSISTED)


def _owner_port(cluster, name: bytes) -> int:
    return cluster.slot_owner(int(key_slots([name])[0]))


@pytest.mark.parametrize("case", range(4))
def test_cluster_master_killed_mid_commit(persisted_cluster, tag, case):
    """The issue's case: a master killed during a step on a Cluster (two-phase commits)."""
    rng = rng_for(f"redis-table:cluster-kill:{case}")
    cl = persisted_cluster
    opts = {"model_tag_runtime": tag, **crash_writer.OPTIONS, "lock_ttl_seconds": 2,
            "lock_wait_seconds": 30, **FAST_FAIL}
    t = redis_table(cl.url, 4, table_kwargs=crash_writer.TABLE, **opts)
    checker = redis_table(cl.url, 4, table_kwargs=crash_writer.TABLE, read_only=True, **opts)
    ref = tensorkv.EmbeddingTable(4, **crash_writer.TABLE)
    engine = t._rows.engine
    killed: list[int] = []
    fired: list[int] = []
    faults = 0
    for i, (keys, grads) in enumerate(crash_writer.batches()):
        if i == 2:
            bucket = rng.choice(np.unique(engine.runtime.of(keys)).tolist())
            port = _owner_port(cl, engine.runtime.names[bucket])
            crash_writer.arm(engine.store, rng.randint(1, 10), rng.choice(["before", "after"]),
                             lambda port=port: (cl.kill(port), killed.append(port),
                                                fired.append(port)))
        for call, args, ref_call in (
                (t.lookup, (keys,), lambda k=keys: ref.lookup(k)),
                (t.apply_gradients, (keys, grads), lambda k=keys, g=grads:
                 ref.apply_gradients(k, g))):
            before = snapshot(ref, keys)
            ref_call()
            after = snapshot(ref, keys)
            for _ in range(10):
                try:
                    call(*args)
                    break
                except StoreUnavailableError:  # RowLockError included
                    faults += 1
                    while killed:
                        cl.restart(killed.pop())
                    seen = snapshot(checker, keys)  # every row of the step, or none
                    assert matches(seen, before) or matches(seen, after)
            else:
                pytest.fail("the step kept failing after the master came back")
            assert t.step == ref.step
        while killed:  # the fault hit after the step's commit point: the step succeeded
            cl.restart(killed.pop())
    assert fired
    assert_same(full_state(t), full_state(ref))
    assert_same(full_state(checker), full_state(ref))
    t.close(), checker.close()


@pytest.fixture
def persisted_server():
    if not servers.available():
        pytest.skip("redis-server is not installed")
    srv = servers.RedisServer(extra_conf=PERSISTED)
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("then", ["retry", "other call"])
def test_commit_reply_lost_with_the_server(persisted_server, tag, monkeypatch, when, then):
    """The server dies before or after running the commit (its MULTI/EXEC), so no reply
    comes: the call fails with the step unchanged; once the server is back the next call settles it:
    the same call retried is applied once in all, another call first counts it if it ran."""
    srv = persisted_server
    url = f"redis://127.0.0.1:{srv.port}/0"
    t = redis_table(url, 4, model_tag_runtime=tag, **crash_writer.OPTIONS, **FAST_FAIL,
                    table_kwargs=crash_writer.TABLE)
    ref = tensorkv.EmbeddingTable(4, **crash_writer.TABLE)
    steps = list(crash_writer.batches())
    for keys, grads in steps[:2]:
        for tab in (t, ref):
            tab.lookup(keys)
            tab.apply_gradients(keys, grads)
    keys, grads = steps[2]
    real = redis_commit.commit

    def lose_the_reply(engine, *args):
        read = redis_raw.read_replies
        calls = []

        def reply(*a, **kw):  # the commit's first round trip, then its MULTI/EXEC
            calls.append(1)
            r = read(*a, **kw)
            if when == "before" and len(calls) == 1:
                srv.kill()  # the checks were read; EXEC is never sent
            if when == "after" and len(calls) == 2:
                srv.kill()  # EXEC ran; its reply does not make it back
                raise rex.ConnectionError("connection dropped by the test")
            return r

        monkeypatch.setattr(redis_raw, "read_replies", reply)
        try:
            return real(engine, *args)
        finally:
            monkeypatch.setattr(redis_raw, "read_replies", read)

    monkeypatch.setattr(redis_commit, "commit", lose_the_reply)
    with pytest.raises(StoreUnavailableError, match="whether it was applied is not known"):
        t.apply_gradients(keys, grads)
    monkeypatch.setattr(redis_commit, "commit", real)
    assert t.step == 2
    srv.restart()
    if then == "retry":
        ref.apply_gradients(keys, grads)
        assert t.apply_gradients(keys, grads) == 22
        assert t.stats()["redis"]["replayed"] == (when == "after")
    else:
        other = np.arange(100, 110)
        if when == "after":  # it was applied: it counts
            ref.apply_gradients(keys, grads)
        ref.lookup(other)
        t.lookup(other)
    assert t.step == ref.step
    assert_same(full_state(t), full_state(ref))
    t.close()


#: Seeded kill points, and on a Cluster the point between the commit and its application
#: (the apply's 8th store call: lock+read, prepare, commit).
WRITER_CASES = [("standalone", "seed0"), ("standalone", "seed1"), ("cluster", "seed0"),
                ("cluster", "8:after")]


@pytest.mark.slow
@pytest.mark.parametrize("kind, case", WRITER_CASES)
def test_writer_sigkilled_mid_operation(kind, case, request, tag):
    """A trainer SIGKILLed at a store call of a step: the next process finds every row of
    each interrupted operation or none (it finishes or rolls back what the dead one left),
    and training on from there ends as the DRAM table."""
    if kind == "standalone":
        url = f"redis://127.0.0.1:{request.getfixturevalue('redis_server').port}/0"
        calls = 4  # lookup: lock+read, commit; apply: the same
    else:
        url = request.getfixturevalue("redis_cluster").url
        calls = 10  # and on a Cluster: prepare, commit, apply, finish
    kill_step = 2
    if case.startswith("seed"):
        rng = rng_for(f"redis-table:writer-kill:{kind}:{case[4:]}")
        at, when = rng.randint(1, calls), rng.choice(["before", "after"])
    else:
        at, when = int(case.split(":")[0]), case.split(":")[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    p = subprocess.run([sys.executable, os.path.join(HERE, "crash_writer.py"), url, tag,
                        str(kill_step), str(at), when], capture_output=True, env=env,
                       timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()[-3000:]
    steps = list(crash_writer.batches())
    ref = tensorkv.EmbeddingTable(4, **crash_writer.TABLE)
    for keys, grads in steps[:kill_step]:
        ref.lookup(keys)
        ref.apply_gradients(keys, grads)
    keys, grads = steps[kill_step]
    states = [full_state(ref)]
    ref.lookup(keys)
    states.append(full_state(ref))
    ref.apply_gradients(keys, grads)
    states.append(full_state(ref))
    def which(got) -> list[int]:
        return [n for n, s in enumerate(states) if s["keys"].shape == got["keys"].shape
                and all(np.array_equal(got[f], s[f]) for f in s)]

    ro = crash_writer.open_table(url, tag, read_only=True)
    seen = which(full_state(ro))  # without locks: committed intents laid over the rows
    ro.close()
    t = crash_writer.open_table(url, tag, lock_wait_seconds=30)
    t.lookup(np.arange(60), insert=False)  # locks every bucket: resolves what was left
    done = which(full_state(t))
    assert done and seen == done, "the interrupted step left part of an operation"
    t.step = kill_step if done[0] < 2 else kill_step + 1
    if done[0] == 0:
        t.lookup(keys)
    if done[0] < 2:
        t.apply_gradients(keys, grads)
    for keys, grads in steps[kill_step + 1:]:
        for tab in (t, ref):
            tab.lookup(keys)
            tab.apply_gradients(keys, grads)
    assert_same(full_state(t), full_state(ref))
    t.close()


def test_fallback_commit_releases_its_locks(redis_cluster, tag, monkeypatch):
    """A commit whose raw path meets a redirect (its slot moved to another master) runs on
    redis-py's path, which releases every bucket lock: a second writer is not blocked for
    the lock TTL."""
    url = redis_cluster.url
    opts = {"model_tag_runtime": tag, "storage_slice": 2, "lock_ttl_seconds": 600}
    t = redis_table(url, 4, table_kwargs=crash_writer.TABLE, **opts)
    engine = t._rows.engine
    b = engine.runtime
    keys = np.arange(40)
    in0, in1 = keys[b.of(keys) == 0], keys[b.of(keys) == 1]
    t.upsert(in0, np.ones((in0.size, 4)))  # bucket 1 holds no row
    slot1 = int(key_slots([b.names[1]])[0])
    other = next(p for p in redis_cluster.nodes("master") if p != redis_cluster.slot_owner(slot1))
    real = redis_commit.commit

    def move_then_commit(engine, *args):
        redis_cluster.move_slot(slot1, other)  # resharding between the read and the commit
        return real(engine, *args)

    monkeypatch.setattr(redis_commit, "commit", move_then_commit)
    fallbacks = engine.counters["raw_fallbacks"]
    assert t.remove(np.concatenate([in0[:3], in1[:3]])) == 3  # locks both, writes bucket 0
    monkeypatch.setattr(redis_commit, "commit", real)
    assert engine.counters["raw_fallbacks"] > fallbacks
    second = redis_table(url, 4, table_kwargs=crash_writer.TABLE, lock_wait_seconds=2, **opts)
    try:
        second.upsert(keys, np.full((40, 4), 2.0))  # both buckets' locks are free
    except RowLockError as exc:
        pytest.fail(f"a lock of the fallback commit was left behind: {exc}")
    assert (t.lookup(keys, insert=False) == 2).all()
    t.close(), second.close()
