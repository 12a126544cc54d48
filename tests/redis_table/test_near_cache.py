"""The near-cache of a Redis-resident table never serves a row older than Redis holds.

Real servers and processes: two writer processes (``near_writer.py``, one of them reading
through its own near-cache) train one table while this process reads it through a
near-cache; every cached read is bracketed by two reads without a cache, and since every
update only grows a row's values, a read that returned an older row than Redis held when it
began would fall below the first bracket. Then other processes' ``clear``, ``remove``,
``upsert``, rehash and tag import, and server restarts, each followed by reads compared with
Redis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tests.redis_table.helpers import redis_table

from tensorkv.embedding.redis import commit as redis_commit
from tensorkv.errors import ConfigError, TableLostError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import near_writer  # noqa: E402

STEPS = 40


def start_writer(url: str, tag: str, consistency: str, seed: int, near: bool):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p])
    return subprocess.Popen([sys.executable, os.path.join(HERE, "near_writer.py"), url, tag,
                             consistency, str(seed), str(STEPS), "1" if near else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


@pytest.fixture(params=["standalone", "sentinel", "cluster"])
def url(request) -> str:
    if request.param == "standalone":
        return f"redis://127.0.0.1:{request.getfixturevalue('redis_server').port}/0"
    return request.getfixturevalue(f"redis_{request.param}").url


def near(table) -> dict:
    """The near-cache's statistics (read directly: ``stats()`` raises on a lost table)."""
    return table._rows._near.stats()


@pytest.mark.slow  # three processes training and reading: 10-40 s each on the shared VM
@pytest.mark.parametrize("consistency", ["exact", "last_writer_wins"])
def test_never_stale_under_two_writer_processes(url, tag, consistency):
    """Each cached read lies between what Redis held before it and after it."""
    setup = near_writer.open_table(url, tag, consistency, False)
    setup.lookup(np.arange(near_writer.KEYS))  # every row exists (zeros)
    reader = near_writer.open_table(url, tag, consistency, True, read_only=True)
    plain = near_writer.open_table(url, tag, consistency, False, read_only=True)
    procs = [start_writer(url, tag, consistency, seed, near=seed == 0) for seed in (0, 1)]
    rng = np.random.default_rng(11)
    reads = after_done = 0
    try:
        while after_done < 5:
            if all(p.poll() is not None for p in procs):
                after_done += 1
            keys = np.minimum(rng.zipf(1.3, 16) - 1, near_writer.KEYS - 1)
            before = plain.lookup(keys, insert=False)
            got = reader.lookup(keys, insert=False)
            after = plain.lookup(keys, insert=False)
            stale = np.flatnonzero((got < before).any(axis=1))
            assert stale.size == 0, (f"read {reads}: keys {keys[stale].tolist()} read "
                                     f"{got[stale, 0].tolist()}, Redis held "
                                     f"{before[stale, 0].tolist()} when the read began")
            assert (got <= after).all(), f"read {reads}: a row from the future"
            reads += 1
        counts = np.zeros(near_writer.KEYS, np.int64)
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0 and b"done" in out, (out + err).decode()[-3000:]
            counts += np.asarray(json.loads(out.split(b"done", 1)[1]))
        keys = np.arange(near_writer.KEYS)
        final = reader.lookup(keys, insert=False)
        # no update lost (the writer reading through its near-cache included), none stale
        np.testing.assert_array_equal(final[:, 0], counts.astype(np.float32))
        np.testing.assert_array_equal(final, plain.lookup(keys, insert=False))
        s = near(reader)
        assert s["hits"] > 0 and s["invalidations"] > 0, s
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        setup.close(), reader.close(), plain.close()


@pytest.fixture(params=["standalone", "cluster"])
def where(request) -> str:
    if request.param == "standalone":
        return f"redis://127.0.0.1:{request.getfixturevalue('redis_server').port}/0"
    return request.getfixturevalue("redis_cluster").url


@pytest.mark.parametrize("consistency", ["exact", "last_writer_wins"])
def test_other_processes_clear_remove_upsert(where, tag, consistency):
    """Rows another table object (its own connections: another process) changes are never
    served from the cache; this process's own writes update it."""
    kw = {"model_tag_runtime": tag, "storage_slice": 4, "consistency": consistency,
          "table_kwargs": {"optimizer": "adagrad", "seed": 5}}
    mine = redis_table(where, 4, near_cache_rows=1000, **kw)
    other = redis_table(where, 4, **kw)
    keys = np.arange(40)

    def check():
        np.testing.assert_array_equal(mine.lookup(keys, insert=False),
                                      other.lookup(keys, insert=False))

    mine.apply_gradients(keys, np.ones((40, 4)))  # own writes: cached as committed
    assert near(mine)["updated_by_own_commits"] + near(mine)["admitted"] >= 40
    hits = near(mine)["hits"]
    check()
    assert near(mine)["hits"] > hits  # served from the cache
    other.apply_gradients(keys[:3], np.ones((3, 4)))
    check()
    other.upsert(keys[5:9], np.full((4, 4), 7.0))
    check()
    other.remove(keys[10:20])
    check()
    assert not mine.contains(keys[10:20]).any()
    other.clear()
    check()
    assert len(mine) == 0
    mine.close(), other.close()


def test_rehash_and_tag_import_by_another_process(redis_server, tag):
    """A rehash in place fails this process's next operation and empties its cache; a tag
    imported into the table's tag moves its buckets: cached rows are read again."""
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    kw = {"table_kwargs": {"optimizer": "adagrad", "seed": 5}}
    keys = np.arange(50)
    mine = redis_table(url, 4, model_tag_runtime=tag, storage_slice=4, near_cache_rows=100,
                       **kw)
    mine.apply_gradients(keys, np.ones((50, 4)))
    mine.lookup(keys, insert=False)
    assert near(mine)["rows"] == 50
    other = redis_table(url, 4, model_tag_runtime=tag, storage_slice=8, storage_slice_import=4,
                        **kw)
    with pytest.raises(TableLostError, match="rehashed"):
        mine.lookup(keys, insert=False)
    assert near(mine)["rows"] == 0
    mine.close()

    # another tag imported into the tag of a cache (rows it lacks are copied in): the
    # buckets that received rows moved, so the cache reads them again
    src, dst = tag + "src", tag + "dst"
    seed = redis_table(url, 4, model_tag_runtime=src, storage_slice=8, **kw)
    seed.apply_gradients(keys, np.full((50, 4), 2.0))
    reader = redis_table(url, 4, model_tag_runtime=dst, storage_slice=8, near_cache_rows=100,
                         **kw)
    reader.apply_gradients(keys[:10], np.ones((10, 4)))
    reader.lookup(keys[:10], insert=False)
    assert near(reader)["rows"] == 10
    importer = redis_table(url, 4, model_tag_runtime=dst, model_tag_import=src,
                           storage_slice=8, **kw)
    for _ in range(2):
        np.testing.assert_array_equal(reader.lookup(keys, insert=False),
                                      importer.lookup(keys, insert=False))
    for t in (other, seed, reader, importer):
        t.close()


def test_restart_from_an_older_snapshot_that_caught_up(own_server, tag):
    """The server restarts from a snapshot older than the cached rows, and a new writer
    brings the buckets back to the versions the cache saw, with other rows: the cache was
    filled on connections of the old server process, so it is emptied, never served."""
    url = f"redis://127.0.0.1:{own_server.port}/0"
    kw = {"model_tag_runtime": tag, "storage_slice": 1,
          "table_kwargs": {"optimizer": "adagrad", "seed": 5}}
    keys = np.arange(20)
    t = redis_table(url, 4, **kw)
    t.lookup(keys)
    c = own_server.client()
    try:
        c.save()  # the server restarts from this state
    finally:
        c.close()
    reader = redis_table(url, 4, near_cache_rows=100, read_only=True, **kw)
    t.apply_gradients(keys, np.ones((20, 4)))  # one commit: version +1
    reader.lookup(keys, insert=False)  # cached at that version
    assert near(reader)["rows"] == 20
    t.close()
    own_server.kill()
    own_server.restart()
    fresh = redis_table(url, 4, **kw)
    fresh.apply_gradients(keys, np.full((20, 4), -3.0))  # the same version, other rows
    np.testing.assert_array_equal(reader.lookup(keys, insert=False),
                                  fresh.lookup(keys, insert=False))
    assert near(reader)["emptied"] == 1
    reader.close(), fresh.close()


def test_restart_without_persistence_empties_the_cache(own_server, tag):
    url = f"redis://127.0.0.1:{own_server.port}/0"
    keys = np.arange(20)
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=2, near_cache_rows=100)
    t.lookup(keys)
    t.lookup(keys, insert=False)
    assert near(t)["rows"] == 20
    own_server.kill()
    own_server.restart()
    with pytest.raises(TableLostError, match="lost their rows"):
        t.lookup(keys, insert=False)
    assert near(t)["rows"] == 0
    t.close()


def test_bounds_and_admission(redis_server, tag):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=2, near_cache_rows=10,
                    near_cache_min_freq=3)
    cold, hot = np.arange(100, 200), np.arange(8)
    for _ in range(3):
        t.lookup(hot)  # frequency 3
    t.lookup(cold)  # frequency 1: not admitted
    t.lookup(np.concatenate([hot, cold]), insert=False)
    s = near(t)
    assert s["rows"] == 8 and s["capacity_rows"] == 10, s
    t.lookup(np.arange(20, 40))
    t.lookup(np.arange(20, 40))
    t.lookup(np.arange(20, 40))  # 20 more rows of frequency 3: some must go
    assert near(t)["rows"] <= 10 and near(t)["evicted"] > 0
    t.close()
    by_bytes = redis_table(url, 4, model_tag_runtime=tag, storage_slice=2,
                           near_cache_bytes=1000)
    assert near(by_bytes)["capacity_rows"] * (by_bytes.stats()["redis"]["row_bytes"] + 40) \
        <= 1000
    by_bytes.close()


@pytest.mark.parametrize("bad, match", [
    ({"near_cache_rows": -1}, "near_cache_rows=-1"),
    ({"near_cache_bytes": "1GB"}, "near_cache_bytes='1GB'"),
    ({"near_cache_rows": 10, "near_cache_min_freq": -2}, "near_cache_min_freq=-2"),
    ({"near_cache_rows": 10, "read_only": True, "read_cache_rows": 10},
     "two caches of the same rows"),
    ({"near_cache_bytes": 10_000, "read_only": True, "redis_read_access_slave": True},
     "redis_read_access_slave=True"),
])
def test_bad_options(redis_server, tag, bad, match):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    redis_table(url, 4, model_tag_runtime=tag).close()  # the table exists
    with pytest.raises(ConfigError, match=match):
        redis_table(url, 4, model_tag_runtime=tag, **bad)


@pytest.mark.parametrize("where_", ["standalone", "cluster"])
def test_own_commit_after_another_writers_commit(request, tag, monkeypatch, where_):
    """Last-writer-wins: another process writes a bucket between this process's read and its
    commit; the commit moves the bucket two versions past the cached rows, so they go."""
    url = (f"redis://127.0.0.1:{request.getfixturevalue('redis_server').port}/0"
           if where_ == "standalone" else request.getfixturevalue("redis_cluster").url)
    kw = {"model_tag_runtime": tag, "storage_slice": 2, "consistency": "last_writer_wins"}
    mine = redis_table(url, 4, near_cache_rows=100, **kw)
    other = redis_table(url, 4, **kw)
    keys = np.arange(10)
    mine.lookup(keys)
    mine.lookup(keys, insert=False)  # cached
    real, between = redis_commit.commit, []

    def commit(engine, *args):
        if engine is mine._rows.engine and not between:
            between.append(other.upsert(keys[2:8], np.full((6, 4), 9.0)))
        return real(engine, *args)

    monkeypatch.setattr(redis_commit, "commit", commit)
    mine.apply_gradients(keys[:2], np.ones((2, 4)))  # one key of each bucket
    assert between
    np.testing.assert_array_equal(mine.lookup(keys, insert=False),
                                  other.lookup(keys, insert=False))
    mine.close(), other.close()
