"""TFRA's Redis JSON config, as TFRA 0.8.1 documents it, opens a table on real Redis servers.

Standalone, Cluster and Sentinel by ``redis_connection_mode``; TFRA's units (milliseconds,
minutes) and key names become tensorkv's store and table options; the lookup order
``redis_config_abs_dir_env`` > ``TFRA_REDIS_CONFIG_PATH`` > ``redis_config_abs_dir``; keys with
no effect are accepted; unknown keys and bad values are refused with the fix.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import tensorkv
from tensorkv.errors import ConfigError
from tensorkv.stores import tfra_config

# TFRA's documented config file (docs/api_docs/tfra/dynamic_embedding/RedisBackend.md), as
# printed there: Python's True/False and "//" comments included. The test fills in the
# server's address, a model tag of its own and a dump directory.
DOC_CONFIG = """{
      "redis_connection_mode": 2,  // ClusterMode = 0, SentinelMode = 1, StandaloneMode = 2
      "redis_master_name": "master",

      // connection_options
      "redis_host_ip": ["127.0.0.1"],
      "redis_host_port": [PORT],
      "redis_user": "default",
      "redis_password": "",
      "redis_db": 0,
      "redis_read_access_slave": False, // set True in infer or train mode if you like
      "redis_connect_keep_alive": False,  // keep TCP alive
      "redis_connect_timeout": 1000,  // milliseconds
      "redis_socket_timeout": 1000,  // milliseconds

      // connection_pool_options
      "redis_conn_pool_size": 20,
      "redis_wait_timeout": 100000000,  // milliseconds
      "redis_connection_lifetime": 100,  // minutes

      // sentinel_connection_options
      "redis_sentinel_user": "default",
      "redis_sentinel_password": "",
      "redis_sentinel_connect_timeout": 1000,  // milliseconds
      "redis_sentinel_socket_timeout": 1000,  // milliseconds

      // Below there is user-defined parameters in this custom op, not Redis setting parameters
      "storage_slice_import": 2,
      "storage_slice": 2,
      "using_hash_storage_slice":
          False,
      "keys_sending_size": 1024,
      "using_md5_prefix_name": False,  // 1=true, 0=false
      "redis_hash_tags_hypodispersion":
          True,
      "model_tag_import": "TAG",
      "redis_hash_tags_import": ["{6379}","{26379}"],
      "model_tag_runtime": "TAG",
      "redis_hash_tags_runtime": ["{3560}","{120}"],
      "expire_model_tag_in_seconds": 604800,
      "table_store_mode": 1,
      "model_lib_abs_dir": "DIR"
  }
"""

ADAGRAD = {"optimizer": "adagrad", "seed": 3}


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def doc_config(tmp_path, port: int, tag: str) -> str:
    text = (DOC_CONFIG.replace("PORT", str(port)).replace("TAG", tag)
            .replace("DIR", str(tmp_path / "lib") + "/"))
    return write(tmp_path / "redis_config.json", text)


def train_both(table, steps: int = 4) -> None:
    """Train ``table`` and a DRAM reference the same way; they must stay bit-identical."""
    ref = tensorkv.EmbeddingTable(table.dim, **ADAGRAD)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        k = rng.integers(0, 50, 24)
        np.testing.assert_array_equal(table.lookup(k), ref.lookup(k))
        g = rng.normal(size=(24, table.dim)).astype(np.float32)
        table.apply_gradients(k, g)
        ref.apply_gradients(k, g)
    k = np.arange(50)
    np.testing.assert_array_equal(table.lookup(k, insert=False), ref.lookup(k, insert=False))
    ref.close()


def test_documented_config_opens_a_table_as_written(redis_server, tag, tmp_path):
    path = doc_config(tmp_path, redis_server.port, tag)
    opt = tensorkv.StorageOption("REDIS", redis_options={"redis_config_abs_dir": path,
                                                         "table_name": "user"})
    r = opt.redis
    assert r.url == f"redis://127.0.0.1:{redis_server.port}/0"
    assert r.storage_slice == r.storage_slice_import == 2
    assert r.redis_hash_tags_runtime == ("3560", "120")  # TFRA's braces are the hash tag's
    assert r.redis_hash_tags_import == ("6379", "26379")
    assert r.model_tag_runtime == tag and r.table_store_mode == 1
    store = dict(r.store_options)
    assert store["connect_timeout"] == store["socket_timeout"] == 1.0  # 1000 ms
    assert store["max_connections"] == 20 and store["pool_timeout"] == 100000.0
    assert "password" not in store and "username" not in store  # "" means no AUTH, as TFRA
    t = tensorkv.EmbeddingTable(4, storage=opt, **ADAGRAD)
    train_both(t)
    names = sorted(k.decode() for k in redis_server.client().keys(f"{tag}:user*"))
    assert any("{3560}" in n for n in names) and any("{120}" in n for n in names)
    t.close()


@pytest.mark.parametrize("mode", ["cluster", "sentinel"])
def test_connection_modes(mode, request, tag, tmp_path):
    if mode == "cluster":
        cl = request.getfixturevalue("redis_cluster")
        conf = {"redis_connection_mode": 0, "redis_host_ip": ["127.0.0.1"] * len(cl.ports),
                "redis_host_port": list(cl.ports)}
        want = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in cl.ports)
    else:
        s = request.getfixturevalue("redis_sentinel")
        conf = {"redis_connection_mode": 1, "redis_master_name": s.master_name,
                "redis_host_ip": ["127.0.0.1"] * len(s.sentinel_ports),
                "redis_host_port": list(s.sentinel_ports), "redis_db": 0,
                "redis_sentinel_connect_timeout": 2000, "redis_sentinel_socket_timeout": 3000}
        want = s.url
    conf.update(model_tag_runtime=tag, model_tag_import=tag, storage_slice=4,
                redis_hash_tags_runtime=[], table_store_mode=2)
    path = write(tmp_path / "c.json", json.dumps(conf))
    opt = tensorkv.StorageOption("REDIS", storage_path=path)
    assert opt.redis.url == want
    assert opt.redis.redis_hash_tags_runtime is None  # an empty list: generated tags
    if mode == "sentinel":
        store = dict(opt.redis.store_options)
        assert store["sentinel_connect_timeout"] == 2.0
        assert store["sentinel_socket_timeout"] == 3.0
    t = tensorkv.EmbeddingTable(4, storage=opt, **ADAGRAD)
    train_both(t, steps=3)
    t.close()


def test_mode_omitted_asks_the_server(redis_server, redis_sentinel):
    """TFRA's default mode is Sentinel, falling back to the server itself: so is ours."""
    srv = tfra_config.translate({"redis_host_port": [redis_server.port]}, where="t")
    assert srv["url"] == f"redis://127.0.0.1:{redis_server.port}/0"
    sen = tfra_config.translate({"redis_host_port": [redis_sentinel.sentinel_ports[0]],
                                 "redis_master_name": redis_sentinel.master_name}, where="t")
    assert sen["url"] == (f"redis+sentinel://127.0.0.1:{redis_sentinel.sentinel_ports[0]}/"
                          f"{redis_sentinel.master_name}/0")


def test_credentials_and_units_reach_the_connection(redis_acl_server, tag, tmp_path):
    conf = {"redis_connection_mode": 2, "redis_host_ip": "127.0.0.1",  # lone values: TFRA's doc
            "redis_host_port": redis_acl_server.port, "redis_user": "app",
            "redis_password": "s3cret", "redis_connect_keep_alive": True,
            "redis_socket_timeout": 2500, "redis_conn_pool_size": 7,
            "model_tag_runtime": tag, "model_tag_import": tag, "table_store_mode": 2}
    opt = tensorkv.StorageOption("REDIS", storage_path=write(tmp_path / "a.json",
                                                             json.dumps(conf)))
    store = tensorkv.open_store(opt.redis.url, **dict(opt.redis.store_options))
    kw = store._client.connection_pool.connection_kwargs
    assert kw["username"] == "app" and kw["password"] == "s3cret"
    assert kw["socket_keepalive"] is True and kw["socket_timeout"] == 2.5
    assert store.options.max_connections == 7
    store.close()
    t = tensorkv.EmbeddingTable(4, storage=opt, **ADAGRAD)
    train_both(t, steps=2)
    t.close()
    conf["redis_password"] = "wrong"
    bad = tensorkv.StorageOption("REDIS", storage_path=write(tmp_path / "b.json",
                                                             json.dumps(conf)))
    with pytest.raises(tensorkv.errors.StoreAuthError):
        tensorkv.EmbeddingTable(4, storage=bad)


def test_lookup_order(redis_server, tag, tmp_path, monkeypatch):
    url_conf = {"redis_connection_mode": 2, "redis_host_port": [redis_server.port],
                "model_tag_runtime": tag, "table_store_mode": 2}
    files = {}
    for name in ("given", "tfra_env", "ours", "named"):
        files[name] = write(tmp_path / f"{name}.json", json.dumps({**url_conf,
                                                                  "model_tag_import": name}))

    def opened(**o) -> str:
        opt = tensorkv.StorageOption("REDIS", redis_options={
            "redis_config_abs_dir": files["given"], **o})
        return opt.redis.model_tag_import

    assert opened() == "given"
    monkeypatch.setenv("TFRA_REDIS_CONFIG_PATH", files["tfra_env"])
    assert opened() == "tfra_env"  # TFRA's default redis_config_abs_dir_env
    assert opened(redis_config_abs_dir_env="MODEL1_PATH") == "tfra_env"  # unset: next
    monkeypatch.setenv("MODEL1_PATH", files["named"])
    assert opened(redis_config_abs_dir_env="MODEL1_PATH") == "named"
    monkeypatch.setenv("TENSORKV_REDIS_CONFIG_PATH", files["ours"])
    with pytest.warns(UserWarning, match="TENSORKV_REDIS_CONFIG_PATH=.* and "
                                         "TFRA_REDIS_CONFIG_PATH=.* differ; using TENSORKV"):
        assert opened() == "ours"
    monkeypatch.setenv("TENSORKV_REDIS_CONFIG_PATH", files["tfra_env"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same file under both names: no warning
        assert opened() == "tfra_env"
    monkeypatch.delenv("TENSORKV_REDIS_CONFIG_PATH")
    monkeypatch.setenv("TFRA_REDIS_CONFIG_PATH", str(tmp_path / "gone.json"))
    with pytest.raises(ConfigError, match="gone.json.*TFRA_REDIS_CONFIG_PATH.* does not exist"):
        opened()


def test_tfra_values_and_defaults(redis_server, tmp_path):
    port = redis_server.port
    path = write(tmp_path / "d.json", json.dumps({"redis_connection_mode": 2,
                                                  "redis_host_port": [port]}))
    r = tensorkv.StorageOption("REDIS", storage_path=path).redis
    # a TFRA file's omitted keys take TFRA's defaults
    assert (r.model_tag_runtime, r.model_tag_import, r.storage_slice) == ("test", "test", 1)
    assert (r.table_store_mode, r.model_lib_abs_dir) == (1, "/tmp/")
    assert r.expire_model_tag_in_seconds == 604800 and r.redis_hash_tags_runtime is None
    r = tensorkv.StorageOption("REDIS", storage_path=path, redis_options={
        "storage_slice": 3, "storage_slice_import": -1, "expire_model_tag_in_seconds": -1,
        "redis_hash_tags_import": [], "redis_read_access_slave": True}).redis
    assert r.storage_slice_import == 3 and r.expire_model_tag_in_seconds == 0
    assert r.redis_hash_tags_import is None
    assert dict(r.store_options)["read_from_replicas"] is True
    # tensorkv's own names keep working beside them, and a file with "url" keeps our defaults
    ours = write(tmp_path / "o.json", json.dumps({"url": f"redis://127.0.0.1:{port}/0",
                                                  "socket_timeout": 4}))
    r = tensorkv.StorageOption("REDIS", storage_path=ours,
                               redis_options={"redis_connect_timeout": 1500}).redis
    assert r.model_tag_runtime == "default" and r.table_store_mode == 0
    assert dict(r.store_options) == {"connect_timeout": 1.5, "socket_timeout": 4}


def test_keys_without_effect_are_accepted_and_say_so(redis_server):
    base = {"redis_connection_mode": 2, "redis_host_port": [redis_server.port]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tfra_config.translate({**base, "redis_connection_lifetime": 5,
                               "redis_hash_tags_hypodispersion": False,
                               "using_md5_prefix_name": False}, where="t")
    with pytest.warns(UserWarning, match="using_md5_prefix_name=True .* has no effect here"):
        tfra_config.translate({**base, "using_md5_prefix_name": True}, where="t")
    with pytest.warns(UserWarning, match="connects to the first host"):
        out = tfra_config.translate({**base, "redis_host_ip": ["127.0.0.1", "10.0.0.9"],
                                     "redis_host_port": [redis_server.port, 6379]}, where="t")
    assert out["url"] == f"redis://127.0.0.1:{redis_server.port}/0"


@pytest.mark.parametrize("conf, match", [
    ({"using_model_lib": False}, "unknown Redis table option using_model_lib; .*TFRA's keys: "
                                 "redis_connection_mode, redis_master_name"),
    ({"redis_connection_mode": 3}, r"redis_connection_mode=3 .* must be one of 0 \(cluster\)"),
    ({"redis_host_ip": ["a", "b"], "redis_host_port": [1]}, "one port per host"),
    ({"redis_host_port": [70000]}, "port 70000"),
    ({"redis_socket_timeout": "1000"}, "redis_socket_timeout='1000' .* must be an integer"),
    ({"redis_socket_timeout": 0}, "redis_socket_timeout=0 .* must be > 0 milliseconds"),
    ({"redis_conn_pool_size": 0}, "redis_conn_pool_size=0 .* must be >= 1"),
    ({"redis_connect_keep_alive": "yes"}, "redis_connect_keep_alive='yes' .* true or false"),
    ({"redis_host_ip": [1]}, "redis_host_ip=.* a list of strings"),
    ({"redis_socket_timeout": 10, "socket_timeout": 2}, "both given"),
    ({"redis_master_name": ""}, "redis_master_name=''"),
])
def test_bad_tfra_configs(conf, match, redis_server, tmp_path):
    base = {"redis_connection_mode": 2, "redis_host_port": [redis_server.port]}
    if "redis_master_name" in conf:
        base["redis_connection_mode"] = 1
    path = write(tmp_path / "bad.json", json.dumps({**base, **conf}))
    with pytest.raises(ConfigError, match=match):
        tensorkv.StorageOption("REDIS", storage_path=path)


def test_bad_option_pairs(redis_server, tmp_path):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    with pytest.raises(ConfigError, match="url=.* and TFRA's redis_host_port both name"):
        tensorkv.StorageOption("REDIS", redis_options={"url": url, "redis_host_port": [1]})
    with pytest.raises(ConfigError, match="config and redis_config_abs_dir .* both given"):
        tensorkv.StorageOption("REDIS", storage_path=url, redis_options={
            "config": "a.json", "redis_config_abs_dir": "b.json"})
    with pytest.raises(ConfigError, match="not JSON"):
        tensorkv.StorageOption("REDIS", storage_path=write(tmp_path / "x.json", "{nope"))


def test_the_store_reads_a_tfra_file(redis_server, tmp_path, monkeypatch):
    """A TFRA file in TENSORKV_REDIS_CONFIG_PATH gives the store its connection options."""
    path = write(tmp_path / "s.json", json.dumps({
        "redis_connection_mode": 2, "redis_host_port": [1], "redis_socket_timeout": 1500,
        "storage_slice": 4, "redis_connection_lifetime": 10}))
    monkeypatch.setenv("TENSORKV_REDIS_CONFIG_PATH", path)
    store = tensorkv.open_store(f"redis://127.0.0.1:{redis_server.port}/0")
    assert store.options.socket_timeout == 1.5
    store.close()


def test_tfra_creator_pair(redis_server, tag, tmp_path, monkeypatch):
    from tensorkv.compat.tfra import RedisTableConfig, RedisTableCreator

    path = doc_config(tmp_path, redis_server.port, tag)
    monkeypatch.setenv("model1_tfra_redis_config_path", path)
    creator = RedisTableCreator(RedisTableConfig(
        redis_config_abs_dir_env="model1_tfra_redis_config_path",
        redis_config_abs_dir=str(tmp_path / "unused.json")), table_store_mode=2)
    t = creator.create(4, name="user_dynamic_embeddings", **ADAGRAD)
    assert t.stats()["redis"]["table_name"] == "user_dynamic_embeddings"
    train_both(t, steps=2)
    t.close()
    assert creator.storage_option("item").redis.table_store_mode == 2
    with pytest.raises(ConfigError, match="must be a RedisTableConfig"):
        RedisTableCreator({"redis_config_abs_dir": path})


def test_sentinel_credentials_go_to_the_sentinels_only():
    out = tfra_config.translate({"redis_sentinel_user": "watch", "redis_sentinel_password": "pw",
                                 "redis_password": "data"}, servers=False, where="t")
    assert out == {"sentinel_username": "watch", "sentinel_password": "pw", "password": "data"}
    from tensorkv.stores.redis_config import RedisOptions

    o = RedisOptions(sentinel_username="watch", sentinel_password="pw", password="data",
                     sentinel_socket_timeout=0.5)
    kw = o.sentinel_kwargs({"username": None, "password": "data", "socket_timeout": 9.0})
    assert kw == {"username": "watch", "password": "pw", "socket_timeout": 0.5}
