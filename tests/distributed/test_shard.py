"""ShardServer on its own (no Ray): exactly-once bookkeeping, checkpoints, recovery, retention."""

import numpy as np
import pytest

import tensorkv
from tensorkv.distributed.shard import BEHIND, ShardServer, checkpoint_prefix
from tensorkv.errors import ConfigError
from tensorkv.testing.tablecheck import assert_same_rows, table_rows


def _push(s, seq, keys, worker="w"):
    return s.push("t", worker, seq, keys, np.ones((keys.size, 4), np.float32), None)


def test_requests_apply_once_and_a_gap_is_noticed():
    s = ShardServer("u", 0, 1)
    s.create("t", {"dim": 4, "optimizer": "sgd"})
    k = np.arange(5)
    assert _push(s, 1, k)[0] == (5, 1)
    assert _push(s, 1, k)[0] == (0, 1)  # a retry: not applied again
    assert _push(s, 3, k) == BEHIND  # request 2 never came
    assert s.pull("t", "w", 2, np.stack([k, np.ones(5, np.int64)]), False) == BEHIND
    assert s.applied_seq("w") == (1, 0)
    assert s.tables["t"].step == 1


def test_checkpoints_recover_and_keep_few_tags(tmp_path):
    url = f"lmdb://{tmp_path / 'ck'}"
    s = ShardServer("u", 0, 1, checkpoint_url=url, checkpoint_every=1, full_every=3)
    s.create("t", {"dim": 4, "optimizer": "adagrad", "seed": 3})
    ref = tensorkv.EmbeddingTable(4, optimizer="adagrad", seed=3)
    rng = np.random.default_rng(0)
    for seq in range(1, 11):
        k = np.unique(rng.integers(0, 50, 10))
        g = rng.standard_normal((k.size, 4)).astype(np.float32)
        s.push("t", "w", seq, k, g, None)
        ref.apply_gradients(k, g)
    tags = [t for t in tensorkv.list_tags(url) if t.startswith(checkpoint_prefix("u", 0, 0))]
    assert 1 <= len(tags) <= 3  # full saves drop the older tags
    again = ShardServer("u", 0, 1, checkpoint_url=url, checkpoint_every=1, full_every=3)
    assert again.restored_from == max(tags) and again.applied_seq("w") == (10, 10)
    assert_same_rows(table_rows(again.tables["t"]), table_rows(ref), seq=False)


def _kc(keys, counts=None):
    counts = np.ones(keys.size, np.int64) if counts is None else np.asarray(counts, np.int64)
    return np.stack([np.asarray(keys, np.int64), counts])


def test_pull_peek_and_calls_match_a_local_table():
    """Each request kind against a local table given the same operations."""
    s = ShardServer("u", 0, 1)
    s.create("t", {"dim": 4, "optimizer": "adagrad", "seed": 5})
    ref = tensorkv.EmbeddingTable(4, optimizer="adagrad", seed=5)
    k = np.array([3, 8, 11])
    # a peek reads rows as a lookup would, and leaves no trace
    rows, *_ = s.peek("t", "w", 0, _kc(k))
    np.testing.assert_array_equal(rows, ref.lookup(k, insert=False))
    assert len(s.tables["t"]) == 0
    # a pull of keys seen several times counts every sighting
    rows, ck, delta, _ = s.pull("t", "w", 1, _kc(k, [2, 1, 3]), True)
    np.testing.assert_array_equal(rows, ref.lookup(np.repeat(k, [2, 1, 3]))[[0, 2, 3]])
    assert ck == 0 and delta > 0
    np.testing.assert_array_equal(s.tables["t"].frequency(k), ref.frequency(k))
    # touch: only the rows of keys that had none come back
    (absent, new), *_ = s.pull("t", "w", 2, _kc(np.array([3, 20])), True, touch=True)
    assert absent.tolist() == [False, True]
    np.testing.assert_array_equal(new, ref.lookup(np.array([3, 20]))[1:])
    assert s.push("t", "w", 3, k, np.ones((3, 4), np.float32), None)[0] == (3, 1)
    ref.apply_gradients(k, np.ones((3, 4), np.float32))
    out, *_ = s.call("t", "w", 4, "upsert", (np.array([50]), np.full((1, 4), 2, np.float32)))
    ref.upsert(np.array([50]), np.full((1, 4), 2, np.float32))
    assert s.call("t", "w", 4, "upsert", (np.array([50]), np.zeros((1, 4), np.float32)))[0] \
        is None  # a retried call is not applied again
    assert s.call("t", "w", 4, "len", ())[0] == len(ref) == 5
    assert s.call("t", "w", 4, "step", ())[0] == ref.step
    assert s.call("t", "w", 9, "remove", (np.array([50]),)) == BEHIND
    keys, freq, ver = s.call("t", "w", 4, "eviction_candidates", (2, "lfu"))[0]
    assert keys.size == 2 and (np.diff(freq) >= 0).all()
    st = s.call("t", "w", 4, "stats", ())[0]
    assert st["rows"] == 5 and st["hits"] >= 0
    s.call("t", "w", 5, "optimizer_tick", ())
    s.call("t", "w", 6, "set_step", (7,))
    assert s.tables["t"].step == 7 and s.tables["t"].optimizer.state()["step"] == 2
    assert s.call("t", "w", 7, "evict_keys", (np.array([20]),))[0] == 1
    assert s.call("t", "w", 7, "stats", ())[0]["evictions"] >= 1
    ref.remove(np.array([20]))
    assert_same_rows(table_rows(s.tables["t"]), table_rows(ref), seq=False)
    with pytest.raises(ConfigError, match="not a table method"):
        s.call("t", "w", 8, "close", ())
    with pytest.raises(ConfigError, match="no table 'x'"):
        s.pull("x", "w", 8, _kc(k), True)
    status = s.status()
    assert status["tables"]["t"]["rows"] == 4 and status["requests"] > 0
    assert s.drop("t") and not s.drop("t")


def test_save_shard_and_load_shard_round_trip(tmp_path):
    url = f"lmdb://{tmp_path / 'ck'}"
    shards = [ShardServer("u", i, 2) for i in range(2)]
    for s in shards:
        s.create("t", {"dim": 4, "optimizer": "sgd", "seed": 1})
    keys = np.arange(40, dtype=np.int64)
    from tensorkv.checkpoint.layout import shard_of_keys

    owner = shard_of_keys(keys, 2)
    for i, s in enumerate(shards):
        s.pull("t", "w", 1, _kc(keys[owner == i]), True)
        s.save_shard(url, "v1", None, {"who": "test"})
    one = ShardServer("u", 0, 1)  # onto one shard: created from the tag's specs
    assert one.load_shard(url, "v1", None) == 40
    ref = tensorkv.EmbeddingTable(4, optimizer="sgd", seed=1)
    ref.lookup(keys)
    assert_same_rows(table_rows(one.tables["t"]), table_rows(ref), seq=False)
    other = ShardServer("u", 0, 1)
    other.create("u2", {"dim": 4, "optimizer": "sgd", "seed": 1})
    assert other.load_shard(url, "v1", ["u2"], saved_as="t") == 40
    with pytest.raises(ConfigError, match="holds no table"):
        other.load_shard(url, "v1", ["u2"], saved_as="nope")
    assert other.forget_checkpoints() == 0


def test_staged_parts_apply_once_at_commit_and_survive_a_restart(tmp_path):
    """Two-phase changes on one shard: staged parts wait for their commit, a checkpoint
    taken meanwhile makes the client send the stage again, nothing applies twice, a save
    barrier refuses changes, a tombstone refuses a late part, a retired shard says so."""
    from tensorkv.distributed.ops import ABORTED, STAGED, UNKNOWN
    from tensorkv.distributed.wire import REFUSED
    from tensorkv.errors import ReshardedError

    url = f"lmdb://{tmp_path / 'ck'}"
    s = ShardServer("u", 0, 2, checkpoint_url=url, checkpoint_every=1)
    s.create("t", {"dim": 4, "optimizer": "sgd", "initializer": "zeros"})
    k, g = np.arange(3), np.ones((3, 4), np.float32)
    ref = tensorkv.EmbeddingTable(4, optimizer="sgd", initializer="zeros")
    assert s.stage("t", "w", 1, 1, (0, 1), "push", k, g, None, True)[0] == (STAGED, False)
    assert len(s.tables["t"]) == 0 and s.op_status("w", 1) == (STAGED, 0)
    assert s.applied_seq("w") == (1, 0)  # its checkpoint does not hold the staged part
    # the shard restarts from that checkpoint: the client sends the stage again
    s = ShardServer("u", 0, 2, checkpoint_url=url, checkpoint_every=1)
    assert s.applied_seq("w") == (0, 0) and s.op_status("w", 1) == (UNKNOWN, 0)
    assert s.stage("t", "w", 1, 1, (0, 1), "push", k, g, None, True)[0] == (STAGED, False)
    (n, step), _, delta, _ = s.commit("t", "w", 2, 1, False)
    assert (n, step) == (3, 1) and delta == 1
    assert s.commit("t", "w", 2, 1, False)[0] == (3, 1)  # sent again: answered, not applied
    ref.apply_gradients(k, g)
    assert_same_rows(table_rows(s.tables["t"]), table_rows(ref), seq=False)
    s = ShardServer("u", 0, 2, checkpoint_url=url, checkpoint_every=1)  # and once more
    assert s.applied_seq("w") == (2, 2)
    assert s.stage("t", "w", 1, 1, (0, 1), "push", k, g, None, True) == \
        ((STAGED, False), 2, 0, 0)  # an old stage sent again is not staged again
    assert s.ledger.staged == {}
    # a save barrier refuses parts and direct changes, and lets commits through
    assert s.stage("t", "w", 3, 2, (0, 1), "push", k, g, None, True)[0][0] == STAGED
    s.freeze("save", "w")
    assert s.stage("t", "w", 4, 3, (0, 1), "push", k, g, None, True) == REFUSED
    assert s.op_status("w", 3) == (ABORTED, 0)
    assert s.push("t", "w", 5, k, g, None) == REFUSED
    assert s.commit("t", "w", 6, 2, False)[0] == (3, 2)
    assert s.thaw("save") and not s.frozen()
    # an abort drops the part; a tombstone refuses a part that comes late
    assert s.stage("t", "w", 7, 4, (0, 1), "push", k, g, None, True)[0][0] == STAGED
    s.abort("t", "w", 8, 4)
    assert s.op_status("w", 4) == (ABORTED, 0) and s.tables["t"].step == 2
    assert s.op_status("w", 5, tombstone=True) == (ABORTED, 0)
    assert s.stage("t", "w", 9, 5, (0, 1), "push", k, g, None, True) == REFUSED
    # a resolution commits a part; its client's commit is then answered as done
    assert s.stage("t", "w", 10, 6, (0, 1), "push", k, g, None, True)[0][0] == STAGED
    assert s.decide("w", 6, True, False)
    assert s.commit("t", "w", 11, 6, False)[0] == (3, 3)
    ref.apply_gradients(k, g)
    ref.apply_gradients(k, g)
    assert_same_rows(table_rows(s.tables["t"]), table_rows(ref), seq=False)
    with pytest.raises(ConfigError, match="no table 'x'"):
        s.stage("x", "w", 12, 7, (0, 1), "push", k, g, None, True)
    s.retire(1, 3)
    with pytest.raises(ReshardedError, match=r"resharded to 3 shards.*ParameterServer\(name='u'\)"):
        s.pull("t", "w", 12, _kc(k), False)
