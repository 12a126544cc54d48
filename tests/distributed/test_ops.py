"""Changes over several shards land on every shard or on none, whatever happens to the client.

Clients run in processes of their own (``ps_client.py``: drivers attached to the session's
Ray, or a Ray worker actor) and kill or stop themselves with a signal between two messages of
a lookup or a push that spans both shards; the batch of the kill point is seeded
(``TENSORKV_FAULT_SEED``, in the test ids). Afterwards every table must equal the
single-process reference run with the interrupted change applied entirely or not at all (as
the point decides), bit for bit, with the same step on every shard.
"""

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import tensorkv
from tensorkv.checkpoint.layout import shard_of_keys
from tensorkv.distributed import ParameterServer
from tensorkv.testing.tablecheck import assert_same_rows, table_rows

CLIENT = Path(__file__).with_name("ps_client.py")
sys.path.insert(0, str(CLIENT.parent))
from ps_client import DIM, batches  # noqa: E402

SEED = int(os.environ.get("TENSORKV_FAULT_SEED", "20240611"))
KW = {"optimizer": "adam", "initializer": "normal", "seed": 3}

# where the client dies: (operation, message kind, count), and whether the change then lands
POINTS = {
    "push-staged-on-shard-0": ("push", "stage", 1, False),
    "push-staged-everywhere": ("push", "stage", 2, True),
    "push-committed-on-shard-0": ("push", "commit", 1, True),
    "lookup-staged-on-shard-0": ("pull", "stage", 1, False),
    "lookup-committed-on-shard-0": ("pull", "commit", 1, True),
}


def _client(ray, ps_name, table, point, **extra):
    """Start ps_client.py in a process of its own."""
    address = ray.get_runtime_context().gcs_address
    args = [sys.executable, str(CLIENT), address, ps_name, table, "5", point,
            *(f"{k}={v}" for k, v in extra.items())]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _expected(batch, kind, lands):
    """The reference table: batches before ``batch``, then its part up to the kill point."""
    ref = tensorkv.EmbeddingTable(DIM, **KW)
    for i, (k, g) in enumerate(batches(5)):
        if i == batch:
            if kind == "push" or lands:
                ref.lookup(k)
            if kind == "push" and lands:
                ref.apply_gradients(k, g)
            return ref
        ref.lookup(k)
        ref.apply_gradients(k, g)
    raise AssertionError(f"no batch {batch}")


def _steps(ps, table):
    """Each shard's (table step, optimizer step) of ``table``."""
    return [(st["tables"][table]["step"], st["tables"][table]["optimizer_step"])
            for st in ps.status()]


def _wait_stopped(proc, timeout=240.0):
    """Wait until ``proc`` printed its stop line and stopped itself (SIGSTOP)."""
    line = proc.stdout.readline()
    assert line.startswith("at "), (line, proc.stderr.read() if proc.poll() is not None else "")
    deadline = time.monotonic() + timeout
    stat = Path(f"/proc/{proc.pid}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the client did not stop"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [SEED], ids=lambda s: f"seed{s}")
def test_clients_killed_between_the_shards_of_a_change(ray_cluster, seed):
    """SIGKILL of a driver (and of a worker actor's process) at each point of a lookup or
    a push over two shards: the shards' janitors finish or undo the change on every shard."""
    ray = ray_cluster
    cases = {name: (random.Random(f"{seed}:ps-kill:{name}").randrange(4), *spec)
             for name, spec in POINTS.items()}
    with ParameterServer(2, name=f"kill-{uuid.uuid4().hex[:6]}", resolve_after=0.5) as ps:
        tables = {name: f"t{i}" for i, name in enumerate([*cases, "worker"])}
        for t in tables.values():
            ps.table(t, DIM, **KW)
        procs = {name: _client(ray, ps.name, tables[name],
                               f"{b}:{kind}:{phase}:{n}:KILL")
                 for name, (b, kind, phase, n, _) in cases.items()}
        # a worker process (a Ray actor) dies after committing a push on shard 0 only
        wb = random.Random(f"{seed}:ps-kill:worker").randrange(4)
        cases["worker"] = (wb, "push", "commit", 1, True)

        @ray.remote(num_cpus=0, max_restarts=0)
        class Worker:
            def run(self, path, ps_name, table, point):
                ns = {"__name__": "ps_client"}
                exec(compile(Path(path).read_text(), path, "exec"), ns)
                return ns["drive"](ps_name, table, 5, point)

        w = Worker.remote()
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(w.run.remote(str(CLIENT), ps.name, tables["worker"],
                                 f"{wb}:push:commit:1:KILL"))
        for name, p in procs.items():
            out, err = p.communicate(timeout=240)
            assert p.returncode == -signal.SIGKILL and out.startswith("at "), (name, out, err)
        # the janitors resolve what the dead clients left staged
        deadline = time.monotonic() + 120
        while sum(st["staged"] for st in ps.status()):
            assert time.monotonic() < deadline, [st["staged"] for st in ps.status()]
            time.sleep(0.05)
        assert ps.settle() == 0
        for name, (b, kind, _, _, lands) in cases.items():
            t, ref = ps.table(tables[name]), _expected(b, kind, lands)
            assert_same_rows(table_rows(t), table_rows(ref), seq=False)
            assert _steps(ps, tables[name]) == [(ref.step, ref.optimizer.step)] * 2, name
            t.apply_gradients(*batches(5)[0])  # and the table trains on
            ref.apply_gradients(*batches(5)[0])
            assert_same_rows(table_rows(t), table_rows(ref), seq=False)


@pytest.mark.slow
def test_saves_are_consistent_with_concurrent_pushes(ray_cluster, tmp_path):
    """Sharded saves while two workers push (one sync, one async) and two clients stand
    stopped halfway through a push (staged on shard 0; committed on shard 0): every tag holds
    every shard at one agreed step, and afterwards nothing is lost or applied twice."""
    ray = ray_cluster
    url = f"lmdb://{tmp_path / 'ck'}"
    keys = np.arange(64)
    with ParameterServer(2, name=f"save-{uuid.uuid4().hex[:6]}", resolve_after=60) as ps:
        t = ps.table("s", DIM, optimizer=tensorkv.SGD(lr=1.0), initializer="zeros")
        stopped = [_client(ray, ps.name, "s", f"1:push:{phase}:1:STOP", n=3, keys=64,
                           size=64, grads="ones") for phase in ("stage", "commit")]
        for p in stopped:
            _wait_stopped(p)

        @ray.remote(num_cpus=0)
        class Pusher:
            def run(self, ps_name, mode, n):
                from tensorkv.distributed import ParameterServer

                tab = ParameterServer(name=ps_name).table("s", mode=mode)
                for _ in range(n):
                    tab.apply_gradients(np.arange(64), np.ones((64, DIM), np.float32))
                tab.drain()
                return n

        pushers = [Pusher.remote() for _ in range(2)]
        running = [p.run.remote(ps.name, mode, 20)
                   for p, mode in zip(pushers, ("sync", "async"), strict=True)]
        tags = []
        for i in range(3):
            tags.append(ps.save(url, f"mid{i}"))
        tags.append(tensorkv.save(t, url, "table"))
        for p in stopped:
            os.kill(p.pid, signal.SIGCONT)
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0 and "done 3" in out, (out, err)
        assert ray.get(running) == [20, 20]
        for tag in tags:
            local = tensorkv.load(None, url, tag)["s"]
            rows = local.lookup(keys, insert=False)
            assert (rows == -local.step).all(), (tag, local.step, np.unique(rows))
        total = 2 * 3 + 2 * 20
        np.testing.assert_array_equal(t.lookup(keys, insert=False), -float(total))
        assert _steps(ps, "s") == [(total, total)] * 2


def test_resolution_rules_against_real_shards(ray_cluster):
    """The resolution of an operation from what its shards hold (ops.resolve), a janitor's
    pass over its shard's stale parts, and Ray's word on a dead client (ops.owner_dead)."""
    from tensorkv.distributed import ops
    from tensorkv.distributed.wire import REFUSED

    ray = ray_cluster
    with ParameterServer(2, name=f"rules-{uuid.uuid4().hex[:6]}", resolve_after=60) as ps:
        ps.table("r", DIM, optimizer=tensorkv.SGD(lr=1.0), initializer="zeros")
        h = ps.handles
        k = np.arange(16)
        own = {s: k[shard_of_keys(k, 2) == s] for s in (0, 1)}

        def stage(s, seq, op):
            return ray.get(h[s].stage.remote("r", "ghost", seq, op, (0, 1), "push", own[s],
                                             np.ones((own[s].size, DIM), np.float32), None,
                                             True))

        # op 1 staged on shard 0 only: left to its client while it may live; a save barrier's
        # resolution (force) tombstones shard 1, and shard 0 drops it
        stage(0, 1, 1)
        assert not ops.resolve(h, "ghost", 1, (0, 1))
        assert ops.resolve(h, "ghost", 1, (0, 1), force=True)
        assert [ray.get(x.op_status.remote("ghost", 1)) for x in h.values()] == \
            [(ops.ABORTED, 0)] * 2
        assert stage(1, 1, 1) == REFUSED  # its late part is refused
        # op 2 staged on both, committed on shard 0 by a janitor holding that part
        stage(0, 2, 2)
        stage(1, 2, 2)
        ledger = ops.Ledger()
        ledger.staged[("ghost", 2)] = ops.Part("push", "r", (), (0, 1), 2, 0.0, False, False)
        janitor = ops.Janitor(ledger, 1, lambda: [ops.shard_actor_name(ps.name, 0, i)
                                                  for i in h], resolve_after=0.0)
        assert janitor.sweep() == 1
        states = [ray.get(x.op_status.remote("ghost", 2)) for x in h.values()]
        assert states == [(ops.COMMITTED, 2)] * 2
        assert [st["tables"]["r"]["step"] for st in ps.status()] == [1, 1]
        np.testing.assert_array_equal(ps.table("r").lookup(k, insert=False), -1.0)
        assert ps.settle() == 0

        # a client's lease tells whether its process lives
        @ray.remote(num_cpus=0, max_restarts=0)
        class Client:
            def lease(self):
                return [ray.put(b"lease")]

        c = Client.remote()
        (lease,) = ray.get(c.lease.remote())
        assert not ops.owner_dead(lease) and not ops.owner_dead(None)
        ray.kill(c)
        deadline = time.monotonic() + 60
        while not ops.owner_dead(lease, timeout=1.0):  # Ray learns of the death shortly
            assert time.monotonic() < deadline, "Ray never reported the owner dead"
            time.sleep(0.05)
