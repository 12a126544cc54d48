"""The parameter server against the single-process table: training, modules, checkpoints.

Every test shares the module's 2-shard server (``ps`` in conftest.py) on the session's Ray.
"""

import ipaddress
import os
from pathlib import Path

import numpy as np
import pytest

import tensorkv
from tensorkv.distributed import ParameterServer
from tensorkv.errors import (
    ConfigError,
    MissingDependencyError,
    ReshardedError,
    ShapeError,
    ShardUnavailableError,
)
from tensorkv.testing.tablecheck import assert_same_rows, table_rows


def _train(tables, steps, *, seed=0, prefetch=False, high=400, batch=64, dim=8):
    """Lookup + apply_gradients of the same random batches on every table."""
    rng = np.random.default_rng(seed)
    batches = [rng.integers(0, high, batch) for _ in range(steps + 1)]
    for i in range(steps):
        k = batches[i]
        outs = [t.lookup(k) for t in tables]
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])
        if prefetch:
            for t in tables:
                t.prefetch(batches[i + 1])
        g = rng.standard_normal((k.size, dim)).astype(np.float32)
        for t in tables:
            t.apply_gradients(k, g)


def test_sync_training_and_prefetch_match_the_local_table(ps):
    kw = {"optimizer": "adagrad", "initializer": "normal", "seed": 4}
    t = ps.table("sync", 8, **kw)
    ref = tensorkv.EmbeddingTable(8, **kw)
    _train([ref, t], 12, prefetch=True)
    assert_same_rows(table_rows(t), table_rows(ref), seq=False)
    assert t.mutation_seq == ref.mutation_seq
    st = t.stats()
    assert st["hits"] == ref.stats()["hits"] and len(st["shards"]) == 2
    assert all(s["rows"] > 0 for s in st["shards"])  # the rows really are spread


def test_prefetch_reads_behind_the_update_and_changes_nothing(ps):
    kw = {"optimizer": "adam", "seed": 8}
    t = ps.table("pre", 8, **kw)
    ref = tensorkv.EmbeddingTable(8, **kw)
    k0, k1 = np.arange(0, 40), np.arange(20, 70)
    g = np.ones((40, 8), np.float32)
    for tab in (t, ref):
        tab.lookup(k0)
    t.prefetch(k1)
    for tab in (t, ref):
        tab.apply_gradients(k0, g)
    assert t._prefetch[2] is not None  # the read went out right behind the update
    np.testing.assert_array_equal(t.lookup(k1), ref.lookup(k1))  # new keys' rows came after
    t.prefetch(np.arange(500, 510))  # a prefetch whose lookup never comes leaves no trace
    t.apply_gradients(k0, g)
    ref.apply_gradients(k0, g)
    t.upsert([1], np.zeros((1, 8), np.float32))
    ref.upsert([1], np.zeros((1, 8), np.float32))
    assert_same_rows(table_rows(t), table_rows(ref), seq=False)
    assert t.stats()["hits"] == ref.stats()["hits"]
    assert t.stats()["misses"] == ref.stats()["misses"]


def test_async_mode_applies_one_clients_updates_in_order(ps):
    kw = {"optimizer": "adam", "seed": 5}
    t = ps.table("async", 8, mode="async", staleness=3, **kw)
    ref = tensorkv.EmbeddingTable(8, **kw)
    rng = np.random.default_rng(1)
    for _ in range(10):  # no lookups between the updates: they pile up in flight
        k = rng.integers(0, 300, 50)
        g = rng.standard_normal((50, 8)).astype(np.float32)
        t.apply_gradients(k, g)
        ref.apply_gradients(k, g)
    t.drain()
    assert_same_rows(table_rows(t), table_rows(ref), seq=False)


def test_torch_modules_train_a_sharded_table_as_a_local_one(ps):
    torch = pytest.importorskip("torch")
    from tensorkv.bench.dlrm import DLRM, SyntheticCTR
    from tensorkv.torch import DynamicEmbeddingBag, Optimizer

    data = SyntheticCTR(3, vocab=500)
    kw = {"optimizer": tensorkv.Adagrad(lr=0.05), "seed": 2}
    runs = []
    for table in (tensorkv.EmbeddingTable(8, **kw), ps.table("dlrm", 8, **kw)):
        model = DLRM(DynamicEmbeddingBag(8, mode="sum", table=table), dim=8, bottom=16, top=16)
        opt = Optimizer(model, dense=torch.optim.Adam(model.parameters(), lr=1e-3))
        losses = []
        for step in range(4):
            b = data.batch(step, 64)
            out = model(torch.from_numpy(b.dense), torch.from_numpy(b.keys))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                out, torch.from_numpy(b.labels))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs.append((np.array(losses), table, model))
    (l0, t0, m0), (l1, t1, m1) = runs
    np.testing.assert_array_equal(l0, l1)
    assert_same_rows(table_rows(t1), table_rows(t0), seq=False)  # values, slots, freq, version
    for a, b in zip(m0.parameters(), m1.parameters(), strict=True):
        np.testing.assert_array_equal(a.detach().numpy(), b.detach().numpy())
    # state_dict() of a module on a sharded table, into a local table and back
    local = DLRM(DynamicEmbeddingBag(8, mode="sum", table=tensorkv.EmbeddingTable(8, **kw)),
                 dim=8, bottom=16, top=16)
    local.load_state_dict(m1.state_dict())
    assert_same_rows(table_rows(local.embedding.table), table_rows(t0), seq=False)
    assert local.embedding.table.step == t1.step == 4
    t1.upsert(np.array([10**6]), np.ones((1, 8), np.float32))  # replaced by the load below
    m1.load_state_dict(m0.state_dict())
    assert_same_rows(table_rows(t1), table_rows(t0), seq=False)


def test_sharded_save_restores_onto_any_number_of_shards(ps, tmp_path):
    url = f"lmdb://{tmp_path / 'ck'}"
    kw = {"optimizer": "adagrad", "seed": 6}
    t = ps.table("saved", 8, **kw)
    ref = tensorkv.EmbeddingTable(8, **kw)
    _train([ref, t], 5)
    ps.save(url, "two", tables=["saved"])
    assert tensorkv.tag_manifest(url, "two")["num_shards"] == 2
    local = tensorkv.load(None, url, "two")["saved"]  # a plain table from the 2-shard save
    assert_same_rows(table_rows(local), table_rows(ref), seq=False)
    with ParameterServer(3, name=f"{ps.name}-three") as ps3:
        ps3.load(url, "two")
        t3 = ps3.table("saved")
        assert_same_rows(table_rows(t3), table_rows(ref), seq=False)
        assert [s["tables"]["saved"]["rows"] > 0 for s in ps3.status()] == [True] * 3
        _train([ref, t3], 3, seed=1)  # and trains on alike (optimizer state came along)
        assert_same_rows(table_rows(t3), table_rows(ref), seq=False)
    # tensorkv.save / load of the table alone: each shard saves / loads its own rows
    tensorkv.save(t, url, "alone", step=5)
    info = tensorkv.tag_manifest(url, "alone")
    assert info["num_shards"] == 2 and info["step"] == 5 and list(info["tables"]) == ["saved"]
    local = tensorkv.EmbeddingTable(8, **kw)
    tensorkv.load(local, url, "alone")
    assert_same_rows(table_rows(local), table_rows(t), seq=False)  # (ref trained on since)
    tensorkv.save(local, url, "from-local")  # a single-process save, onto the shards
    other = ps.table("other", 8, **kw)
    assert tensorkv.load(other, url, "from-local") is other
    assert_same_rows(table_rows(other), table_rows(t), seq=False)
    # the generic path (a dict holding the table): rows pass through this process
    tensorkv.save({"saved": t}, url, "generic")
    back = ps.table("back", 8, **kw)
    tensorkv.load({"saved": back}, url, "generic")
    assert_same_rows(table_rows(back), table_rows(t), seq=False)


def test_reshard_is_exact(ray_cluster, tmp_path):
    url = f"lmdb://{tmp_path / 'ck'}"
    kw = {"optimizer": "ftrl", "seed": 7}
    ref = tensorkv.EmbeddingTable(8, **kw)
    with ParameterServer(2, name="reshard", checkpoint_url=url) as ps2:
        t = ps2.table("r", 8, **kw)
        _train([ref, t], 4)
        before = ParameterServer(name="reshard", recover_timeout=5)  # another client
        stale = before.table("r")
        stale.lookup(np.arange(5), insert=False)
        ps2.reshard(3)
        assert ps2.num_shards == 3 and t.num_shards == 3
        assert_same_rows(table_rows(t), table_rows(ref), seq=False)
        # the client attached before gets an error that says so, for reads and changes
        for call in (lambda: stale.lookup(np.arange(5), insert=False),
                     lambda: stale.apply_gradients([1, 2], np.ones((2, 8), np.float32))):
            with pytest.raises(ReshardedError, match=r"resharded to 3 shards \(generation 1\)"
                               r".*ParameterServer\(name='reshard'\)"):
                call()
        again = ParameterServer(name="reshard").table("r")  # attached again: the rows
        np.testing.assert_array_equal(again.lookup(np.arange(50), insert=False),
                                      ref.lookup(np.arange(50), insert=False))
        _train([ref, t], 3, seed=2)
        ps2.reshard(1)
        _train([ref, t], 2, seed=3)
        assert_same_rows(table_rows(t), table_rows(ref), seq=False)


def test_several_clients_lose_no_update(ps, ray_cluster):
    """Two worker actors push at once; SGD with exact (small integer) sums: nothing lost."""
    ray = ray_cluster
    ps.table("shared", 4, optimizer=tensorkv.SGD(lr=1.0), initializer="zeros")

    @ray.remote(num_cpus=0)
    def work(name, w):
        from tensorkv.distributed import ParameterServer

        t = ParameterServer(name=name).table("shared")
        for i in range(20):
            keys = np.arange(w, 100, 2 if i % 2 else 1)
            t.apply_gradients(keys, np.ones((keys.size, 4), np.float32))
        return True

    assert ray.get([work.remote(ps.name, w) for w in range(2)]) == [True, True]
    t = ps.table("shared")
    got = t.lookup(np.arange(100), insert=False)[:, 0]
    per_key = np.zeros(100)
    for w in range(2):
        for i in range(20):
            per_key[np.arange(w, 100, 2 if i % 2 else 1)] += 1
    np.testing.assert_array_equal(got, -per_key)
    assert t.step == 40


def test_bad_inputs(ps, ray_cluster):
    with pytest.raises(ConfigError, match="num_shards=0"):
        ParameterServer(0)
    with pytest.raises(ConfigError, match="name="):
        ParameterServer(1, name="a/b")
    with pytest.raises(ShardUnavailableError, match="no parameter server named 'nope'"):
        ParameterServer(name="nope")
    with pytest.raises(ConfigError, match="runs 2 shards"):
        ParameterServer(3, name=ps.name)
    with pytest.raises(ConfigError, match="does not exist"):
        ps.table("missing")
    with pytest.raises(ConfigError, match="dim=-1"):
        ps.table("x", -1)
    ps.table("fixed", 4, optimizer="sgd")
    with pytest.raises(ConfigError, match="exists on parameter server"):
        ps.table("fixed", 4, optimizer="adam")
    # the existing table's arguments against those requested, a dim-only call too
    with pytest.raises(ConfigError, match=r"with dim=4, optimizer='sgd'; requested dim=8, "
                                          r"optimizer not given"):
        ps.table("fixed", 8)
    with pytest.raises(ConfigError, match=r"with dim=4; requested dim=8\."):
        ps.table("fixed", 8, optimizer="sgd")
    with pytest.raises(ConfigError, match=r"with optimizer='sgd'; requested optimizer not given"):
        ps.table("fixed", 4)
    assert ps.table("fixed", 4, optimizer="sgd").dim == 4  # the same arguments: attached
    t = ps.table("fixed")
    with pytest.raises(ShapeError, match=r"shape \(3, 4\)"):
        t.apply_gradients([1, 2, 3], np.ones((2, 4)))
    with pytest.raises(ShapeError, match="out must be"):
        t.lookup([1], out=np.empty((1, 3), np.float32))
    with pytest.raises(ConfigError, match="mode='fast'"):
        ps.table("fixed", mode="fast")
    with pytest.raises(ConfigError, match="staleness=65 must be an int from 1 to 64"):
        ps.table("fixed", mode="async", staleness=65)
    with pytest.raises(ConfigError, match="reshard needs a store"):
        ps.reshard(3)
    with pytest.raises(tensorkv.errors.NonFiniteGradientError):
        t.apply_gradients([1], np.full((1, 4), np.nan))
    assert len(t) == 0  # nothing reached a shard


def _listening(pids):
    """``(process name, address, port)`` of the TCP sockets ``pids`` listen on (/proc)."""
    socks = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A":  # LISTEN
                continue
            ip, port = f[1].split(":")
            raw = bytes.fromhex(ip)
            words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]
            addr = b"".join(words)
            if v6 and addr[:12] == bytes(10) + b"\xff\xff":  # an IPv4 address on IPv6
                addr = addr[12:]
            socks[int(f[9])] = (str(ipaddress.ip_address(addr)), int(port, 16))
    out = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in socks:
                out.add((name, *socks[int(target[8:-1])]))
    return out


def _descendants(pid):
    children = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                ppid = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def test_local_ray_listens_on_loopback_only(ps, ray_cluster):
    """The session's Ray, started by tensorkv: its GCS, raylet, object manager, workers
    (the shards among them) and this driver accept connections on 127.0.0.1 only."""
    ps.table("net", 4).lookup(np.arange(10))  # the shard workers run
    socks = _listening(_descendants(os.getpid()))
    names = {name for name, _, _ in socks}
    assert {"gcs_server", "raylet"} <= names and len(socks) >= 5, socks
    assert all(ipaddress.ip_address(addr).is_loopback for _, addr, _ in socks), socks
    assert ray_cluster.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert not any(port == 8265 for _, _, port in socks)  # no dashboard


def test_missing_ray_names_the_extra(monkeypatch):
    import sys

    from tensorkv.distributed import channel

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingDependencyError, match=r'pip install "tensorkv\[ray\]"'):
        channel.ray_module()


def test_ps_status_command(ps):
    from click.testing import CliRunner

    from tensorkv.cli.main import main

    ps.table("seen", 4).lookup(np.arange(50))
    res = CliRunner().invoke(main, ["ps", "status", ps.name])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if " seen " in ln]
    assert len(lines) == 2 and sum(int(ln.split()[3].replace(",", "")) for ln in lines) == 50
    res = CliRunner().invoke(main, ["ps", "status", ps.name, "--json"])
    assert res.exit_code == 0 and '"requests_per_s"' in res.output
    res = CliRunner().invoke(main, ["ps", "status", "nope"])
    assert res.exit_code != 0 and "no parameter server named 'nope'" in res.output


def test_large_batches_through_shared_memory_or_the_object_store(ps, ray_cluster, monkeypatch):
    """Batches too large for a frame: shared memory, Ray's object store, and the fallback."""
    from tensorkv.distributed import shm

    kw = {"optimizer": "adagrad", "initializer": "normal", "seed": 6}
    ref = tensorkv.EmbeddingTable(16, **kw)
    big = {"high": 20_000, "batch": 6000, "dim": 16}
    t = ps.table("big-shm", 16, **kw)
    assert ps.channel.link is not None
    _train([ref, t], 3, seed=2, **big)
    assert_same_rows(table_rows(t), table_rows(ref), seq=False)
    assert t.mutation_seq == ref.mutation_seq
    with ParameterServer(2, name=f"{ps.name}-plain", shared_memory=False) as plain:
        assert plain.channel.link is None
        ref2 = tensorkv.EmbeddingTable(16, **kw)
        _train([ref2, plain.table("p", 16, **kw)], 2, seed=3, **big)
        assert_same_rows(table_rows(plain.table("p")), table_rows(ref2), seq=False)
    # a shard that cannot map the client's buffers (another node): the object store
    ensure = shm.Buffer.ensure

    def unmappable(self, nbytes):
        ensure(self, nbytes)
        if os.path.exists(self.path):
            os.unlink(self.path)

    monkeypatch.setattr(shm.Buffer, "ensure", unmappable)
    with ParameterServer(2, name=f"{ps.name}-far") as far:
        ref3 = tensorkv.EmbeddingTable(16, **kw)
        t3 = far.table("f", 16, **kw)
        _train([ref3, t3], 2, seed=4, **big)
        assert far.channel.link.enabled == [False, False]
        assert_same_rows(table_rows(t3), table_rows(ref3), seq=False)
    # /dev/shm full: every request takes the object store

    def full(self, nbytes):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm.Buffer, "ensure", full)
    with ParameterServer(2, name=f"{ps.name}-full") as no_room:
        ref4 = tensorkv.EmbeddingTable(16, **kw)
        t4 = no_room.table("n", 16, **kw)
        _train([ref4, t4], 2, seed=5, **big)
        assert_same_rows(table_rows(t4), table_rows(ref4), seq=False)


def test_async_updates_in_flight_take_the_object_store(ps):
    kw = {"optimizer": "sgd", "seed": 1}
    ref = tensorkv.EmbeddingTable(16, **kw)
    t = ps.table("big-async", 16, mode="async", staleness=3, **kw)
    _train([ref, t], 4, seed=5, high=20_000, batch=6000, dim=16)
    t.drain()
    assert_same_rows(table_rows(t), table_rows(ref), seq=False)
