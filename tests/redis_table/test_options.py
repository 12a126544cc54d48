"""Every option of a Redis-resident table on a real server (standalone and Cluster).

Layout (bucket names, remainder/hash bucketing, generated hash tags), model tags and
rehashing (resumable), table_store_mode 0/1/2, expiry, config file priority, read-only
serving with a read cache, and bad inputs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tests.redis_table.helpers import redis_table

import tensorkv
from tensorkv.embedding.redis import engine as redis_engine
from tensorkv.errors import ConfigError, ShapeError

ADAGRAD = {"optimizer": "adagrad", "seed": 5}


def train(table, steps: int = 6, seed: int = 0, high: int = 60) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        k = rng.integers(0, high, 32)
        table.lookup(k)
        table.apply_gradients(k, rng.normal(size=(32, table.dim)).astype(np.float32))


def snapshot(table) -> dict[str, np.ndarray]:
    k = np.sort(table.keys())
    return {"keys": k, "values": table.lookup(k, insert=False),
            "freq": table.frequency(k), "version": table.version(k)}


def assert_same(a: dict, b: dict) -> None:
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(params=["standalone", "cluster"])
def where(request):
    """``(url, admin client factory)`` of a standalone server or a Cluster."""
    if request.param == "standalone":
        srv = request.getfixturevalue("redis_server")
        return f"redis://127.0.0.1:{srv.port}/0", srv.client
    cl = request.getfixturevalue("redis_cluster")
    from redis.cluster import RedisCluster

    return cl.url, lambda: RedisCluster(host="127.0.0.1", port=cl.ports[0])


def test_layout_buckets_and_hash_tags(where, tag):
    url, client = where
    t = redis_table(url, 4, model_tag_runtime=tag, table_name="user", storage_slice=8,
                    table_kwargs=ADAGRAD)
    keys = np.arange(100, dtype=np.int64)
    t.lookup(keys)
    c = client()
    try:
        tags = redis_engine.generated_tags(8)
        names = [f"{tag}:user{{{g}}}".encode() for g in tags]
        for i, name in enumerate(names):  # key mod 8 picks the bucket
            rows = [f for f in c.hkeys(name) if len(f) == 8]  # not the identity fields
            fields = sorted(np.frombuffer(b"".join(rows), "<i8").tolist())
            assert fields == list(range(i, 100, 8))
        slots = servers_slots(names)
        assert slots == [(2 * i + 1) * 16384 // 16 for i in range(8)]  # spread evenly
    finally:
        c.close()
    t.close()


def servers_slots(names):
    from tensorkv.stores.redis_keys import key_slots

    return key_slots(names).tolist()


def test_hash_bucketing_and_given_tags(where, tag):
    url, client = where
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=3, using_hash_storage_slice=True,
                    redis_hash_tags_runtime=["a", "b", "c"], table_kwargs=ADAGRAD)
    ref = tensorkv.EmbeddingTable(4, **ADAGRAD)
    keys = np.arange(0, 3000, 3, dtype=np.int64)  # all one residue mod 3
    np.testing.assert_array_equal(t.lookup(keys), ref.lookup(keys))
    c = client()
    try:
        sizes = [len([f for f in c.hkeys(f"{tag}:default{{{g}}}") if len(f) == 8])
                 for g in "abc"]
    finally:
        c.close()
    assert sum(sizes) == 1000 and min(sizes) > 250, sizes  # by hash: spread anyway
    t.close()


def test_second_process_opens_the_same_rows(where, tag):
    url, _ = where
    a = redis_table(url, 4, model_tag_runtime=tag, table_kwargs=ADAGRAD)
    train(a)
    b = redis_table(url, 4, model_tag_runtime=tag, table_kwargs=ADAGRAD)
    assert_same(snapshot(a), snapshot(b))
    other = redis_table(url, 4, model_tag_runtime=tag, table_name="other", table_kwargs=ADAGRAD)
    assert len(other) == 0
    a.close(), b.close(), other.close()


def test_model_tag_import_copies_then_diverges(where, tag):
    url, client = where
    old = redis_table(url, 4, model_tag_runtime=f"{tag}old", table_kwargs=ADAGRAD)
    train(old)
    before = snapshot(old)
    new = redis_table(url, 4, model_tag_runtime=f"{tag}new", model_tag_import=f"{tag}old",
                      expire_model_tag_in_seconds=3600, table_kwargs=ADAGRAD)
    assert_same(snapshot(new), before)  # starts from the old model's rows
    train(new, seed=1)
    assert_same(snapshot(old), before)  # writes go under the new tag only
    assert not np.array_equal(snapshot(new)["values"], before["values"])
    c = client()
    try:
        name = f"{tag}old:default{{{redis_engine.generated_tags(16)[0]}}}"
        assert 0 < c.ttl(name) <= 3600
    finally:
        c.close()
    with pytest.raises(ConfigError, match="holds no table"):
        redis_table(url, 4, model_tag_runtime=f"{tag}new2", model_tag_import=f"{tag}typo",
                    table_kwargs=ADAGRAD)
    again = redis_table(url, 4, model_tag_runtime=f"{tag}new", model_tag_import=f"{tag}old",
                        table_kwargs=ADAGRAD)  # imported once: not copied again
    assert_same(snapshot(again), snapshot(new))
    old.close(), new.close(), again.close()


def test_rehash_resumes_after_an_interruption(where, tag, monkeypatch):
    url, _ = where
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=3, table_kwargs=ADAGRAD)
    train(t)
    before = snapshot(t)
    t.close()
    with pytest.raises(ConfigError, match="storage_slice_import"):
        redis_table(url, 4, model_tag_runtime=tag, storage_slice=5, table_kwargs=ADAGRAD)
    real = redis_engine.RedisRowEngine.read_bucket
    calls = {"n": 0}

    def crash_on_second_bucket(self, b, i):
        if i == 1:
            calls["n"] += 1
            raise KeyboardInterrupt("interrupted mid-migration")
        return real(self, b, i)

    monkeypatch.setattr(redis_engine.RedisRowEngine, "read_bucket", crash_on_second_bucket)
    with pytest.raises(KeyboardInterrupt):
        redis_table(url, 4, model_tag_runtime=tag, storage_slice=5, storage_slice_import=3,
                    table_kwargs=ADAGRAD)
    monkeypatch.setattr(redis_engine.RedisRowEngine, "read_bucket", real)
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=5, storage_slice_import=3,
                    table_kwargs=ADAGRAD)
    assert_same(snapshot(t), before)
    assert sum(t._rows.engine.bucket_lengths()) == len(before["keys"])
    assert t.stats()["redis"]["storage_slice"] == 5
    t.close()
    t = redis_table(url, 4, model_tag_runtime=tag, storage_slice=5, table_kwargs=ADAGRAD)
    assert_same(snapshot(t), before)  # the new layout is recorded: no import needed
    t.close()


def test_table_store_modes(redis_server, tag, tmp_path):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    rows = {}
    for mode in (0, 1, 2):
        t = redis_table(url, 4, model_tag_runtime=f"{tag}m{mode}", table_store_mode=mode,
                        model_lib_abs_dir=str(tmp_path) if mode == 1 else None,
                        table_kwargs=ADAGRAD)
        train(t)
        rows[mode] = sum(len(c.keys) for c in t.export())
        if mode == 1:
            before = snapshot(t)
            t.clear()
            assert len(t) == 0
            t.close()
            t = redis_table(url, 4, model_tag_runtime=f"{tag}m{mode}", table_store_mode=1,
                            model_lib_abs_dir=str(tmp_path), table_kwargs=ADAGRAD)
            assert_same(snapshot(t), before)  # restored from the dump files
        t.close()
    assert rows[0] > 0 and rows[1] == 0 and rows[2] == 0


def test_checkpoint_of_store_mode_2_keeps_rows_in_redis(redis_server, tag, tmp_path):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    t = redis_table(url, 4, model_tag_runtime=tag, table_store_mode=2, table_kwargs=ADAGRAD)
    train(t)
    store = f"lmdb://{tmp_path}/ck"
    tensorkv.save({"emb": t}, store, tag="v1")
    loaded = tensorkv.load(None, store, tag="v1")
    assert len(loaded["emb"]) == 0  # the checkpoint holds the table's settings only
    before = snapshot(t)
    t2 = redis_table(url, 4, model_tag_runtime=tag, table_store_mode=2, table_kwargs=ADAGRAD)
    tensorkv.load({"emb": t2}, store, tag="v1")  # the step; the rows stay as Redis has them
    assert t2.step == t.step
    assert_same(snapshot(t2), before)
    t.close(), t2.close()


def test_read_only_serving_with_cache(where, tag):
    url, _ = where
    t = redis_table(url, 4, model_tag_runtime=tag, table_kwargs=ADAGRAD)
    train(t)
    before = snapshot(t)
    srv = redis_table(url, 4, model_tag_runtime=tag, read_only=True, read_cache_rows=1000,
                      table_kwargs=ADAGRAD)
    keys = np.arange(80)
    ref = tensorkv.EmbeddingTable(4, **ADAGRAD)
    first = srv.lookup(keys, insert=False)
    np.testing.assert_array_equal(srv.lookup(keys, insert=False), first)
    assert srv.stats()["redis"]["cache_hits"] >= len(before["keys"])
    absent = keys[~np.isin(keys, before["keys"])]
    np.testing.assert_array_equal(first[absent], ref.lookup(absent, insert=False))
    assert_same(snapshot(t), before)  # no insertion, no frequency count
    t.close(), srv.close()


def test_config_file_priority(redis_server, tag, tmp_path, monkeypatch):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    files = {}
    for name in ("given", "default_env", "named_env"):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"url": url, "table_name": name, "model_tag_runtime": tag,
                                 "storage_slice": 2}))
        files[name] = str(p)

    def opened() -> str:
        opt = tensorkv.StorageOption("REDIS", storage_path=files["given"],
                                     redis_options={"config_env": "MY_TABLE_CONFIG"})
        return opt.redis.table_name

    assert opened() == "given"
    monkeypatch.setenv("TENSORKV_REDIS_CONFIG_PATH", files["default_env"])
    assert opened() == "default_env"
    monkeypatch.setenv("MY_TABLE_CONFIG", files["named_env"])
    assert opened() == "named_env"
    # the store ignores the table's keys in a shared file
    t = tensorkv.EmbeddingTable(4, storage=tensorkv.StorageOption(
        "REDIS", storage_path=files["given"], redis_options={"config_env": "MY_TABLE_CONFIG"}))
    t.lookup(np.arange(5))
    assert t.stats()["redis"]["table_name"] == "named_env"
    t.close()


@pytest.mark.parametrize("options, match", [
    ({"storage_slice": 0}, "storage_slice=0"),
    ({"storage_slice": 2, "redis_hash_tags_runtime": ["a"]}, "give 2 distinct tags"),
    ({"redis_hash_tags_runtime": "abc"}, "list of"),
    ({"table_store_mode": 1}, "model_lib_abs_dir"),
    ({"table_store_mode": 3}, "table_store_mode=3"),
    ({"read_cache_rows": 10}, "read_only=True"),
    ({"consistency": "eventual"}, "consistency='eventual'"),
    ({"model_tag_runtime": "a:b"}, "model_tag_runtime='a:b'"),
    ({"no_such_option": 1}, "unknown Redis table option no_such_option"),
    ({"lock_ttl_seconds": 0}, "lock_ttl_seconds=0"),
    ({"lock_ttl_seconds": float("inf")}, "lock_ttl_seconds=inf must be a finite number"),
    ({"lock_wait_seconds": float("nan")}, "lock_wait_seconds=nan must be a finite number"),
    ({"read_cache_seconds": float("inf")}, "read_cache_seconds=inf must be a finite"),
    ({"lock_ttl_seconds": 0.0004}, "under the 1 ms"),
])
def test_bad_options(options, match, redis_server):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    with pytest.raises(ConfigError, match=match):
        tensorkv.StorageOption("REDIS", storage_path=url, redis_options=options)


def test_bad_storage_arguments(redis_server, tag):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    with pytest.raises(ConfigError, match="needs its URL"):
        tensorkv.StorageOption("REDIS")
    with pytest.raises(ConfigError, match="drop storage_size"):
        tensorkv.StorageOption("REDIS", storage_path=url, storage_size=["1GiB"])
    with pytest.raises(ConfigError, match="redis_options is for storage_type='REDIS'"):
        tensorkv.StorageOption("DRAM_REDIS", storage_path=url, redis_options={})
    with pytest.raises(ConfigError, match="Redis table config file .* does not exist"):
        tensorkv.StorageOption("REDIS", storage_path="/no/such/config.json")
    t = redis_table(url, 4, model_tag_runtime=tag, table_kwargs=ADAGRAD)
    t.lookup(np.arange(3))
    with pytest.raises(ShapeError, match="dim, dtype and optimizer slots must match"):
        redis_table(url, 8, model_tag_runtime=tag, table_kwargs=ADAGRAD)
    with pytest.raises(ShapeError, match="dim, dtype and optimizer slots must match"):
        redis_table(url, 4, model_tag_runtime=tag, table_kwargs={"optimizer": "adam"})
    assert len(t) == 3  # nothing lost
    t.close()


def test_storage_option_round_trip(redis_server, tag):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    opt = tensorkv.StorageOption("REDIS", storage_path=url, redis_options={
        "model_tag_runtime": tag, "storage_slice": 3})
    again = tensorkv.StorageOption.from_dict(json.loads(json.dumps(opt.to_dict())))
    assert again == opt and again.redis.storage_slice == 3
    assert "REDIS" in repr(opt) and tag in repr(opt)


def test_bad_table_config_files(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    broken = tmp_path / "broken.json"
    broken.write_text("{\"url\": ")
    with pytest.raises(ConfigError, match="must hold a JSON object of options, not list"):
        tensorkv.StorageOption("REDIS", storage_path=str(listed))
    with pytest.raises(ConfigError, match="Redis table config file .*broken.json.* unreadable"):
        tensorkv.StorageOption("REDIS", storage_path=str(broken))
