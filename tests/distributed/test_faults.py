"""Shards killed mid-training come back from their checkpoints with no update lost or doubled.

Each test trains a sharded table and a local reference on the same batches, kills a shard
actor on the way (``ray.kill`` with a restart, or SIGKILL of its process), and then compares
the tables bit for bit: values, optimizer slots, frequencies, versions.
"""

import os
import signal
import time

import numpy as np
import pytest

import tensorkv
from tensorkv.distributed import ParameterServer
from tensorkv.errors import ShardUnavailableError
from tensorkv.testing.tablecheck import assert_same_rows, table_rows


def _batches(seed, steps, high=500, n=80, dim=8):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, high, n), rng.standard_normal((n, dim)).astype(np.float32))
            for _ in range(steps)]


def _pid(actor, ray):
    return ray.get(actor.info.remote())["pid"]


def _restarted(actor, ray, pid, timeout=60.0):
    """Wait until the shard answers from a new process (ray.kill returns before it acts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if _pid(actor, ray) != pid:
                return
        except ray.exceptions.RayActorError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"shard {actor} did not restart within {timeout} s")


def _run(ps, ray, mode, kill_at, kill):
    kw = {"optimizer": "adam", "initializer": "normal", "seed": 9}
    t = ps.table("f", 8, mode=mode, staleness=3, **kw)
    ref = tensorkv.EmbeddingTable(8, **kw)
    for i, (k, g) in enumerate(_batches(0, 24)):
        if i in kill_at:
            kill(ps.actors[kill_at[i]])
        if i % 3 == 0:  # lookups too (they insert and count): replayed as well
            np.testing.assert_array_equal(t.lookup(k), ref.lookup(k))
        t.apply_gradients(k, g)
        ref.apply_gradients(k, g)
    t.drain()
    assert_same_rows(table_rows(t), table_rows(ref), seq=False)
    assert t.step == ref.step
    np.testing.assert_array_equal(t.frequency(np.arange(500)), ref.frequency(np.arange(500)))
    return t


def test_ray_kill_of_a_shard_loses_nothing(ray_cluster, tmp_path):
    ray = ray_cluster
    url = f"lmdb://{tmp_path / 'ck'}"
    with ParameterServer(2, name="kill", checkpoint_url=url, checkpoint_every=5) as ps:
        pids = [_pid(a, ray) for a in ps.actors]
        _run(ps, ray, "sync", {7: 0, 15: 1}, lambda a: ray.kill(a, no_restart=False))
        info = [ray.get(a.info.remote()) for a in ps.actors]
        assert [i["pid"] for i in info] != pids  # both were restarted...
        assert all(i["restored_from"] for i in info)  # ...from their checkpoints
        assert ps.channel.recoveries >= 2


def test_sigkill_of_a_shard_process_with_updates_in_flight(ray_cluster, tmp_path):
    ray = ray_cluster
    url = f"lmdb://{tmp_path / 'ck'}"
    with ParameterServer(2, name="sigkill", checkpoint_url=url, checkpoint_every=4) as ps:
        def sigkill(actor):
            os.kill(_pid(actor, ray), signal.SIGKILL)

        _run(ps, ray, "async", {5: 1, 11: 0, 18: 1}, sigkill)
        assert ps.channel.recoveries >= 3


def test_a_dead_worker_loses_nothing_on_the_ps(ray_cluster, tmp_path):
    ray = ray_cluster
    with ParameterServer(2, name="deadworker") as ps:
        t = ps.table("w", 4, optimizer=tensorkv.SGD(lr=1.0), initializer="zeros")

        @ray.remote(num_cpus=0, max_restarts=0)
        class Worker:
            def push(self, n):
                from tensorkv.distributed import ParameterServer

                tw = ParameterServer(name="deadworker").table("w")
                for _ in range(n):
                    tw.apply_gradients(np.arange(10), np.ones((10, 4), np.float32))
                return n

        w = Worker.remote()
        assert ray.get(w.push.remote(3)) == 3
        ray.kill(w)
        time.sleep(0.2)
        np.testing.assert_array_equal(t.lookup(np.arange(10), insert=False), -3.0)
        t.apply_gradients(np.arange(10), np.ones((10, 4), np.float32))  # others go on
        np.testing.assert_array_equal(t[np.arange(10)], -4.0)


def test_a_lost_shard_without_checkpoints_is_an_error(ray_cluster):
    ray = ray_cluster
    with ParameterServer(1, name="nockpt", max_restarts=1, recover_timeout=20) as ps:
        t = ps.table("n", 4)
        t.lookup(np.arange(5))
        pid = _pid(ps.actors[0], ray)
        ray.kill(ps.actors[0], no_restart=False)
        _restarted(ps.actors[0], ray, pid)
        with pytest.raises(ShardUnavailableError, match="lost this client's requests"):
            t.lookup(np.arange(5))


def test_a_shard_killed_amid_large_batches_through_shared_memory(ray_cluster, tmp_path):
    """Batches too large for a frame travel through the shared-memory buffers; a SIGKILL
    of a shard with updates in flight still loses nothing."""
    ray = ray_cluster
    url = f"lmdb://{tmp_path / 'ck'}"
    kw = {"optimizer": "adagrad", "initializer": "normal", "seed": 3}
    with ParameterServer(2, name="sigkill-big", checkpoint_url=url, checkpoint_every=3) as ps:
        t = ps.table("b", 16, mode="async", staleness=2, **kw)
        ref = tensorkv.EmbeddingTable(16, **kw)
        assert ps.channel.link is not None
        for i, (k, g) in enumerate(_batches(1, 9, high=20_000, n=3000, dim=16)):
            if i in (3, 7):
                os.kill(_pid(ps.actors[i % 2], ray), signal.SIGKILL)
            np.testing.assert_array_equal(t.lookup(k), ref.lookup(k))
            t.apply_gradients(k, g)
            ref.apply_gradients(k, g)
        t.drain()
        assert_same_rows(table_rows(t), table_rows(ref), seq=False)
        assert ps.channel.recoveries >= 2
