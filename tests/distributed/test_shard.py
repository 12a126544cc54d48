"""ShardServer on its own (no Ray): exactly-once bookkeeping, checkpoints, recovery, retention."""

import numpy as np

import tensorkv
from tensorkv.distributed.shard import BEHIND, ShardServer, checkpoint_prefix
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
