"""An unfinished migration (rehash, tag copy) cannot be rolled back by reopening the old layout.

The issue's case: a rehash interrupted midway, then the table reopened with the old
``storage_slice``, saw part of its rows, re-created the others and lost updates when the
rehash resumed. Now the old layout is refused with an error that says how to finish the
migration (or, for a copy into a new tag, abandon it); processes that had the old layout
open fail their next operation; finishing gives every row exactly as before.
"""

from __future__ import annotations

import numpy as np
import pytest
from tests.redis_table.helpers import redis_table

from tensorkv.embedding.redis import engine as redis_engine
from tensorkv.errors import MigrationUnfinishedError, TableLostError

ADAGRAD = {"optimizer": "adagrad", "seed": 11}
KEYS = np.arange(3000)


def state(t) -> dict[str, np.ndarray]:
    k = np.sort(t.keys())
    return {"keys": k, "values": t.lookup(k, insert=False), "freq": t.frequency(k)}


def assert_same(a, b) -> None:
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(params=["standalone", "cluster"])
def url(request):
    if request.param == "standalone":
        return f"redis://127.0.0.1:{request.getfixturevalue('redis_server').port}/0"
    return request.getfixturevalue("redis_cluster").url


def interrupt(monkeypatch, at_bucket: int, fn):
    """Run ``fn`` with the migration crashing when it reaches ``at_bucket``."""
    real = redis_engine.RedisRowEngine.read_bucket

    def crash(self, b, i):
        if i == at_bucket and b is self.source:
            raise KeyboardInterrupt("the migrating process died")
        return real(self, b, i)

    monkeypatch.setattr(redis_engine.RedisRowEngine, "read_bucket", crash)
    with pytest.raises(KeyboardInterrupt):
        fn()
    monkeypatch.setattr(redis_engine.RedisRowEngine, "read_bucket", real)


def test_rollback_of_an_unfinished_rehash_is_refused(url, tag, monkeypatch):
    old = redis_table(url, 4, model_tag_runtime=tag, storage_slice=3, table_kwargs=ADAGRAD)
    old.upsert(KEYS, np.random.default_rng(0).normal(size=(KEYS.size, 4)))
    before = state(old)
    interrupt(monkeypatch, 1, lambda: redis_table(
        url, 4, model_tag_runtime=tag, storage_slice=5, storage_slice_import=3,
        table_kwargs=ADAGRAD))
    # a process that had the old layout open: its next operation fails, nothing written
    with pytest.raises(TableLostError, match="rehashed"):
        old.apply_gradients(KEYS[:100], np.ones((100, 4)))
    for options in ({"storage_slice": 3}, {"storage_slice": 5}, {"storage_slice": 3,
                                                                  "read_only": True}):
        with pytest.raises(MigrationUnfinishedError,
                           match="storage_slice=5, storage_slice_import=3 .*rehash back"):
            redis_table(url, 4, model_tag_runtime=tag, table_kwargs=ADAGRAD, **options)
    done = redis_table(url, 4, model_tag_runtime=tag, storage_slice=5, storage_slice_import=3,
                       table_kwargs=ADAGRAD)  # finish it: it resumes
    assert_same(state(done), before)
    done.apply_gradients(KEYS[:100], np.ones((100, 4)))
    after = state(done)
    back = redis_table(url, 4, model_tag_runtime=tag, storage_slice=3, storage_slice_import=5,
                       table_kwargs=ADAGRAD)  # then back to the old layout: nothing lost
    assert_same(state(back), after)
    old.close(), done.close(), back.close()


def test_unfinished_copy_into_a_new_tag(url, tag, monkeypatch):
    src = redis_table(url, 4, model_tag_runtime=f"{tag}a", storage_slice=4, table_kwargs=ADAGRAD)
    src.upsert(KEYS, np.ones((KEYS.size, 4)))
    before = state(src)

    def copy(**extra):
        return redis_table(url, 4, model_tag_runtime=f"{tag}b", model_tag_import=f"{tag}a",
                           storage_slice=4, table_kwargs=ADAGRAD, **extra)

    interrupt(monkeypatch, 2, copy)
    with pytest.raises(MigrationUnfinishedError, match=f"model_tag_import='{tag}a'.*abandon"):
        redis_table(url, 4, model_tag_runtime=f"{tag}b", storage_slice=4, table_kwargs=ADAGRAD)
    dropped = redis_table(url, 4, model_tag_runtime=f"{tag}b", storage_slice=4,
                          on_lost="start_empty", table_kwargs=ADAGRAD)  # abandon the copy
    assert len(dropped) == 0
    assert_same(state(src), before)  # the source is unchanged
    interrupt(monkeypatch, 1, copy)
    assert_same(state(copy()), before)  # or finish it
    src.close(), dropped.close()
