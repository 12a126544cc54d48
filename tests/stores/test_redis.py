"""Redis backend on standalone servers: plain, TLS (mutual), ACL user; options and config."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import tensorkv.config as tk_config
from servers import free_port, with_options
from tensorkv.errors import (
    ConfigError,
    InvalidURLError,
    StoreAuthError,
    StoreError,
    StoreUnavailableError,
)
from tensorkv.stores import open_store
from tensorkv.stores.redis import RedisStore, glob_escape, key_slots
from tensorkv.testing import StoreTests


class TestRedisStandalone(StoreTests):
    @pytest.fixture
    def store_url(self, redis_server, key_prefix):
        redis_server.flushall()
        return with_options(redis_server.url, prefix=key_prefix)


class TestRedisTLS(StoreTests):
    @pytest.fixture
    def store_url(self, redis_tls_server, key_prefix):
        redis_tls_server.flushall()
        return with_options(redis_tls_server.url, prefix=key_prefix)

    def test_killed_mid_batch_is_all_or_nothing(self) -> None:
        pytest.skip("same MULTI/EXEC path as TestRedisStandalone; only the transport differs")


class TestRedisACLUser(StoreTests):
    @pytest.fixture
    def store_url(self, redis_acl_server, key_prefix):
        redis_acl_server.flushall()
        return with_options(redis_acl_server.url, prefix=key_prefix)

    def test_killed_mid_batch_is_all_or_nothing(self) -> None:
        pytest.skip("same MULTI/EXEC path as TestRedisStandalone; only the transport differs")


# ---------------------------------------------------------------------------- helpers
def _cmd_calls(server, command: str) -> int:
    c = server.client()
    try:
        stats = c.info("commandstats")
    finally:
        c.close()
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def _reset_stats(server) -> None:
    c = server.client()
    try:
        c.config_resetstat()
    finally:
        c.close()


# ---------------------------------------------------------------------------- chunking
def test_keys_sending_size_7_with_1000_keys(redis_server, key_prefix):
    redis_server.flushall()
    items = {b"k%04d" % i: b"v%d" % i for i in range(1000)}
    with open_store(redis_server.url, prefix=key_prefix, keys_sending_size=7) as s:
        _reset_stats(redis_server)
        s.put_many(items)
        assert _cmd_calls(redis_server, "mset") == -(-1000 // 7)
        keys = list(items)[::-1]
        assert s.get_many(keys) == [items[k] for k in keys]
        assert _cmd_calls(redis_server, "mget") == -(-1000 // 7)
        assert s.count() == 1000
        assert dict(s.scan()) == items
        s.delete_many(list(items)[:500])
        assert _cmd_calls(redis_server, "unlink") == -(-500 // 7)
        assert sorted(s.keys()) == sorted(list(items)[500:])
        assert s.delete_prefix(b"k") == 500 and s.count() == 0


def test_commands_split_by_bytes(redis_server, key_prefix, monkeypatch):
    redis_server.flushall()
    monkeypatch.setattr(tk_config, "REDIS_MAX_COMMAND_BYTES", 1000)
    items = {b"k%03d" % i: bytes([i % 251]) * 300 for i in range(100)}
    with open_store(redis_server.url, prefix=key_prefix) as s:
        _reset_stats(redis_server)
        s.put_many(items)
        # ~3 values of 300 bytes per MSET before the running total crosses 1000 bytes
        assert _cmd_calls(redis_server, "mset") >= 25
        assert s.get_many(list(items)) == list(items.values())


def test_duplicate_keys_last_wins(redis_server, key_prefix):
    redis_server.flushall()
    with open_store(redis_server.url, prefix=key_prefix, keys_sending_size=2) as s:
        s.put_many([(b"a", b"1"), (b"b", b"x"), (b"a", b"2"), (b"c", b"y"), (b"a", b"3")])
        assert s.get_many([b"a", b"a", b"b"]) == [b"3", b"3", b"x"]


def test_batch_is_a_transaction(redis_server, key_prefix):
    redis_server.flushall()
    with open_store(redis_server.url, prefix=key_prefix, keys_sending_size=10) as s:
        _reset_stats(redis_server)
        s.put_many({b"p%d" % i: b"x" for i in range(50)})
        assert _cmd_calls(redis_server, "exec") == 0
        with s.batch() as b:
            b.put_many({b"q%d" % i: b"y" for i in range(50)})
            b.delete_many([b"p%d" % i for i in range(25)])
        assert _cmd_calls(redis_server, "exec") == 1
        assert _cmd_calls(redis_server, "mset") == 10 and _cmd_calls(redis_server, "unlink") == 3
        assert s.count(b"p") == 25 and s.count(b"q") == 50


# ---------------------------------------------------------------------------- namespaces
def test_prefix_namespace_isolation(redis_server):
    redis_server.flushall()
    a = open_store(redis_server.url, prefix="ns-a/")
    b = open_store(redis_server.url, prefix=b"ns-b/")
    raw = open_store(redis_server.url)
    try:
        a.put_many({b"k1": b"a1", b"k2": b"a2"})
        b.put_many({b"k1": b"b1", b"k3": b"b3"})
        assert a.get_many([b"k1", b"k2", b"k3"]) == [b"a1", b"a2", None]
        assert b.get_many([b"k1", b"k2", b"k3"]) == [b"b1", None, b"b3"]
        assert sorted(a.keys()) == [b"k1", b"k2"] and sorted(b.keys()) == [b"k1", b"k3"]
        assert a.count() == 2 and b.count() == 2
        assert sorted(raw.keys()) == [b"ns-a/k1", b"ns-a/k2", b"ns-b/k1", b"ns-b/k3"]
        assert raw.count() == 4  # DBSIZE path
        assert a.delete_prefix(b"") == 2
        assert a.count() == 0 and b.count() == 2 and raw.count() == 2
        assert a.stats()["keys"] == 0 and b.stats()["keys"] == 2
    finally:
        for s in (a, b, raw):
            s.close()


def test_glob_characters_are_literal(redis_server):
    redis_server.flushall()
    star = open_store(redis_server.url, prefix="x*[")
    other = open_store(redis_server.url, prefix="xy[")
    try:
        star.put_many({b"a?": b"1", b"ab": b"2", b"a\\": b"3", b"a[b]": b"4"})
        other.put(b"a?", b"other")
        assert star.count() == 4 and other.count() == 1
        assert sorted(star.keys(b"a?")) == [b"a?"]
        assert sorted(star.keys(b"a[")) == [b"a[b]"]
        assert sorted(star.keys(b"a\\")) == [b"a\\"]
        assert star.delete_prefix(b"a?") == 1 and star.get(b"ab") == b"2"
    finally:
        star.close()
        other.close()
    assert glob_escape(b"a*b?c[d]e\\") == b"a\\*b\\?c\\[d\\]e\\\\"
    assert glob_escape(b"plain") == b"plain"


def test_prefix_from_query_stays_text(redis_server):
    redis_server.flushall()
    with open_store(with_options(redis_server.url, prefix="007")) as s:
        assert s.options.prefix == b"007"
        s.put(b"k", b"v")
    with open_store(redis_server.url) as raw:
        assert raw.get(b"007k") == b"v"


def test_scan_range_without_common_prefix(redis_server, key_prefix):
    redis_server.flushall()
    items = {bytes([c]) + b"%02d" % i: b"v" for c in b"abc" for i in range(20)}
    with open_store(redis_server.url, prefix=key_prefix, keys_sending_size=5) as s:
        s.put_many(items)
        got = sorted(s.scan(start=b"a10", stop=b"c05", keys_only=True))
        assert got == sorted(k for k in items if b"a10" <= k < b"c05")
        assert len(list(s.scan(start=b"b", limit=13))) == 13


# ---------------------------------------------------------------------------- connections
def test_unreachable_server_fails_fast():
    port = free_port()
    with pytest.raises(StoreUnavailableError, match=rf"127\.0\.0\.1:{port}.*0\.5"):
        open_store(f"redis://127.0.0.1:{port}/0", connect_timeout=0.5)


def test_reconnects_after_server_restart_and_fails_when_down(key_prefix):
    from servers import RedisServer

    with RedisServer() as srv:
        srv.start()
        with open_store(srv.url, prefix=key_prefix, retries=3, retry_backoff=0.05,
                        connect_timeout=0.5) as s:
            s.put(b"k", b"before")
            srv.restart()  # the pooled connection is now dead; a retry reconnects
            assert s.get(b"k") is None  # no persistence: the restarted server is empty
            s.put(b"k", b"after")
            assert s.get(b"k") == b"after"
            srv.kill()
            with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{srv.port}"):
                s.get(b"k")
            with pytest.raises(StoreUnavailableError):
                s.put(b"k", b"v")
            srv.restart()
            assert s.get(b"k") is None  # usable again once the server is back


def test_wrong_password(redis_acl_server):
    good = redis_acl_server.url
    bad = good.replace(":s3cret@", ":wrong@")
    with pytest.raises(StoreAuthError, match="password"):
        open_store(bad, connect_timeout=2)
    with pytest.raises(StoreAuthError):
        open_store(f"redis://127.0.0.1:{redis_acl_server.port}/0", connect_timeout=2)
    # explicit options override the URL's credentials
    with open_store(bad, password="s3cret") as s:
        s.put(b"k", b"v")
        assert s.get(b"k") == b"v"
    # passwords never show in repr, url or stats
    with open_store(good) as s:
        assert "s3cret" not in repr(s) and "s3cret" not in str(s.stats())
        assert s.url.startswith("redis://app:***@")


def test_tls_needs_the_right_ca_and_client_cert(redis_tls_server, tmp_path):
    c = redis_tls_server.certs
    base = f"rediss://127.0.0.1:{redis_tls_server.port}/0"
    with pytest.raises(StoreError):  # no client certificate
        open_store(base, ssl_ca_certs=c["ca.crt"], connect_timeout=2)
    with pytest.raises(StoreError):  # the server's CA is not trusted
        open_store(base, ssl_certfile=c["client.crt"], ssl_keyfile=c["client.key"],
                   connect_timeout=2)
    with pytest.raises(StoreError):  # plain text to a TLS port
        open_store(f"redis://127.0.0.1:{redis_tls_server.port}/0", connect_timeout=2,
                   socket_timeout=2)
    with pytest.raises(ConfigError, match="no such file"):
        open_store(base, ssl_ca_certs=str(tmp_path / "missing.pem"))
    with open_store(redis_tls_server.url, ssl_cert_reqs="none") as s:
        s.put(b"k", b"v")
        assert s.get(b"k") == b"v"


def test_max_connections_with_threads(redis_server, key_prefix):
    redis_server.flushall()
    errors: list[BaseException] = []
    with open_store(redis_server.url, prefix=key_prefix, max_connections=2) as s:
        def work(t: int) -> None:
            try:
                for r in range(10):
                    keys = [b"%d/%d/%d" % (t, r, i) for i in range(20)]
                    s.put_many({k: k for k in keys})
                    assert s.get_many(keys) == keys
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        assert s.count() == 6 * 10 * 20


def test_retry_and_timeouts_reach_the_client(redis_server):
    with open_store(redis_server.url, retries=5, retry_backoff=0.01, connect_timeout=1.5,
                    socket_timeout=4) as s:
        kw = s._client.connection_pool.connection_kwargs
        assert kw["retry"].get_retries() == 5
        assert kw["socket_connect_timeout"] == 1.5 and kw["socket_timeout"] == 4


def test_stats(redis_server, key_prefix):
    redis_server.flushall()
    with open_store(redis_server.url, prefix=key_prefix) as s:
        s.put_many({b"a": b"1", b"b": b"2"})
        st = s.stats()
        assert st["mode"] == "standalone" and st["keys"] == 2
        assert st["server_version"].startswith("7") and st["used_memory_bytes"] > 0
        assert st["nodes"] == [f"127.0.0.1:{redis_server.port}"]
        assert st["capabilities"]["atomic_batches"] is True
        assert st["capabilities"]["durable_on_return"] is False


def test_numpy_values(redis_server, key_prefix):
    redis_server.flushall()
    with open_store(redis_server.url, prefix=key_prefix) as s:
        arr = np.arange(12, dtype=np.float32).reshape(3, 4)
        s.put(b"arr", arr)
        assert np.frombuffer(s.get(b"arr"), np.float32).tolist() == arr.ravel().tolist()


# ---------------------------------------------------------------------------- options
def test_unknown_options_are_listed(redis_server):
    with pytest.raises(ConfigError, match="bogus.*valid options are:.*keys_sending_size"):
        open_store(redis_server.url, bogus=1)
    with pytest.raises(ConfigError, match="bogus"):
        open_store(with_options(redis_server.url, bogus="x"))


@pytest.mark.parametrize(
    ("name", "value"),
    [("keys_sending_size", 0), ("keys_sending_size", "many"), ("connect_timeout", -1),
     ("socket_timeout", 0), ("retries", -1), ("ssl_cert_reqs", "maybe"),
     ("read_from_replicas", "perhaps"), ("max_connections", 0), ("prefix", 3j)],
)
def test_bad_option_values(redis_server, name, value):
    with pytest.raises(ConfigError, match=name):
        open_store(redis_server.url, **{name: value})


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:1/abc", "redis://127.0.0.1:1/0/1", "redis+sentinel://127.0.0.1:1",
     "redis+cluster://127.0.0.1:1/3", "redis://127.0.0.1:1,127.0.0.1:2/0"],
)
def test_bad_urls(url):
    with pytest.raises(InvalidURLError):
        open_store(url)


def _write_config(path, **options):
    path.write_text(json.dumps(options))
    return str(path)


def test_json_config_priority(redis_server, tmp_path, monkeypatch):
    redis_server.flushall()
    explicit = _write_config(tmp_path / "explicit.json", prefix="from-explicit/",
                             keys_sending_size=5)
    global_ = _write_config(tmp_path / "global.json", prefix="from-global/")
    caller = _write_config(tmp_path / "caller.json", prefix="from-caller/", retries=1)
    url = redis_server.url

    with open_store(url, config=explicit) as s:
        assert s.options.prefix == b"from-explicit/" and s.options.keys_sending_size == 5
        assert s.config_file == explicit
        s.put(b"k", b"1")
    monkeypatch.setenv("TENSORKV_REDIS_CONFIG_PATH", global_)
    with open_store(url, config=explicit) as s:
        assert s.options.prefix == b"from-global/" and s.options.keys_sending_size == 1024
    monkeypatch.setenv("MY_REDIS_CONFIG", caller)
    with open_store(url, config=explicit, config_env="MY_REDIS_CONFIG") as s:
        assert s.options.prefix == b"from-caller/" and s.options.retries == 1
    # an unset caller variable falls through to the next source
    with open_store(url, config=explicit, config_env="UNSET_VARIABLE_XYZ") as s:
        assert s.options.prefix == b"from-global/"
    # explicit options (query string and keyword arguments) override the file
    with open_store(with_options(url, prefix="q/", retries=2), config_env="MY_REDIS_CONFIG",
                    retries=4) as s:
        assert s.options.prefix == b"q/" and s.options.retries == 4
    monkeypatch.delenv("TENSORKV_REDIS_CONFIG_PATH")
    with open_store(url, config=explicit) as s:
        assert s.get(b"k") == b"1"
    with open_store(url) as raw:
        assert raw.get(b"from-explicit/k") == b"1"


def test_json_config_errors(redis_server, tmp_path, monkeypatch):
    url = redis_server.url
    bad = _write_config(tmp_path / "bad.json", prefix="p/", colour="blue")
    with pytest.raises(ConfigError, match=r"colour.*bad\.json.*valid options"):
        open_store(url, config=bad)
    with pytest.raises(ConfigError, match="does not exist"):
        open_store(url, config=str(tmp_path / "missing.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        open_store(url, config=str(tmp_path / "list.json"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        open_store(url, config=str(tmp_path / "broken.json"))
    typed = _write_config(tmp_path / "typed.json", keys_sending_size="lots")
    with pytest.raises(ConfigError, match=r"keys_sending_size.*typed\.json"):
        open_store(url, config=typed)
    monkeypatch.setenv("TENSORKV_REDIS_CONFIG_PATH", str(tmp_path / "gone.json"))
    with pytest.raises(ConfigError, match="TENSORKV_REDIS_CONFIG_PATH"):
        open_store(url)
    nested = _write_config(tmp_path / "nested.json", config="other.json")
    monkeypatch.setenv("TENSORKV_REDIS_CONFIG_PATH", nested)
    with pytest.raises(ConfigError, match="config"):
        open_store(url)


def test_json_config_holds_credentials(redis_acl_server, tmp_path):
    path = _write_config(tmp_path / "creds.json", username="app", password="s3cret",
                         prefix="cfg/")
    with open_store(f"redis://127.0.0.1:{redis_acl_server.port}/0", config=path) as s:
        s.put(b"k", b"v")
        assert s.get(b"k") == b"v"
    # URL credentials beat the file's
    with pytest.raises(StoreAuthError):
        open_store(f"redis://app:nope@127.0.0.1:{redis_acl_server.port}/0", config=path)


# ---------------------------------------------------------------------------- slots
def test_key_slots_match_redis_py():
    from redis.crc import key_slot

    rng = np.random.default_rng(7)
    keys = [bytes(rng.integers(0, 256, rng.integers(1, 40), dtype=np.uint8)) for _ in range(500)]
    keys += [b"{t}a", b"{t}b", b"x{t}y", b"{}a", b"{{t}}", b"a{b", b"a}b{c}", b"{t"]
    assert key_slots(keys).tolist() == [key_slot(k) for k in keys]
    assert key_slots([b"{t}a", b"{t}b"]).tolist() == [key_slot(b"t")] * 2


def test_capabilities():
    caps = RedisStore.capabilities
    assert not caps.ordered_scans and caps.atomic_batches and caps.multi_process
    assert not caps.durable_on_return
    assert RedisStore.max_value_size == tk_config.REDIS_MAX_VALUE_BYTES


@pytest.mark.parametrize(("option", "value", "message"), [
    ("wait_replicas", "-1", "wait_replicas=-1 .* must be >= 0"),
    ("wait_replicas", "two", "wait_replicas"),
    ("wait_timeout", "0", "wait_timeout=0.0 .* must be > 0"),
])
def test_bad_wait_options(redis_server, option, value, message):
    from tensorkv.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        open_store(with_options(redis_server.url, **{option: value}))
