"""``read_only=True`` means read-only: every mutating call is refused, nothing in Redis changes.

A serving table beside a trainer's table: each mutating entry point of EmbeddingTable and
TableIO (and the checkpoint load, the migration options) raises a clear error before
anything changes; the Redis keyspace is byte-identical afterwards, the serving table's step
never moves, and its store refuses write commands outright.
"""

from __future__ import annotations

import numpy as np
import pytest
from tests.redis_table.helpers import redis_table

import tensorkv
from tensorkv.errors import MigrationUnfinishedError, ReadOnlyError

ADAGRAD = {"optimizer": "adagrad", "seed": 3}
KEYS = np.arange(100)


def dump_keyspace(client, tag: str) -> dict[bytes, object]:
    """Every key of the model tag and its content (hashes field by field)."""
    out: dict[bytes, object] = {}
    for k in client.keys(f"{tag}:*"):
        kind = client.type(k)
        out[k] = client.hgetall(k) if kind == b"hash" else client.get(k)
    return out


def mutations(t, tmp_path):
    """Every call that may write, on the read-only table ``t``."""
    k = KEYS[:10]
    chunk = next(iter(t.export()))
    return {
        "clear": t.clear,
        "evict": t.evict,
        "upsert": lambda: t.upsert(k, np.ones((10, 4))),
        "remove": lambda: t.remove(k),
        "apply_gradients": lambda: t.apply_gradients(k, np.ones((10, 4))),
        "lookup(insert=True)": lambda: t.lookup(k),
        "lookup_torch(insert=True)": lambda: t.lookup_torch(k),
        "import_": lambda: t.import_(chunk),
        "step": lambda: setattr(t, "step", 7),
        "tensorkv.load": lambda: tensorkv.load({"emb": t}, f"lmdb://{tmp_path}/ck", tag="v1"),
    }


def test_every_mutation_is_refused(redis_server, tag, tmp_path):
    pytest.importorskip("torch")
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    trainer = redis_table(url, 4, model_tag_runtime=tag, table_kwargs=ADAGRAD)
    trainer.lookup(KEYS)
    trainer.apply_gradients(KEYS, np.ones((100, 4)))
    tensorkv.save({"emb": trainer}, f"lmdb://{tmp_path}/ck", tag="v1")
    serving = redis_table(url, 4, model_tag_runtime=tag, read_only=True,
                          table_kwargs={**ADAGRAD, "eviction": {"max_rows": 10}})
    c = redis_server.client()
    try:
        before = dump_keyspace(c, tag)
        assert before
        for name, call in mutations(serving, tmp_path).items():
            with pytest.raises(ReadOnlyError, match="read_only=True"):
                call()
            assert serving.step == 0, name
            assert dump_keyspace(c, tag) == before, name
    finally:
        c.close()
    # reads still work, and the store itself refuses writes (no command can leave)
    np.testing.assert_array_equal(serving.lookup(KEYS, insert=False),
                                  trainer.lookup(KEYS, insert=False))
    name = serving._rows.engine.runtime.names[0]
    with pytest.raises(ReadOnlyError, match="read-only"):
        serving._rows.engine.store.execute([(name, ("DEL", name))])
    assert len(trainer) == 100
    trainer.close(), serving.close()


def test_read_only_never_migrates(redis_server, tag):
    """A tag import or a rehash is a write: a read-only table asks for a trainer first."""
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    old = redis_table(url, 4, model_tag_runtime=f"{tag}old", table_kwargs=ADAGRAD)
    old.lookup(KEYS)
    with pytest.raises(MigrationUnfinishedError, match="read_only; open it once writable"):
        redis_table(url, 4, model_tag_runtime=f"{tag}new", model_tag_import=f"{tag}old",
                    read_only=True, table_kwargs=ADAGRAD)
    with pytest.raises(MigrationUnfinishedError, match="read_only"):
        redis_table(url, 4, model_tag_runtime=f"{tag}old", storage_slice=8,
                    storage_slice_import=16, read_only=True, table_kwargs=ADAGRAD)
    assert len(old) == 100
    old.close()
