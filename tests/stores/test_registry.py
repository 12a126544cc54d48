import subprocess
import sys
import textwrap

import pytest

import tensorkv
from tensorkv.errors import (
    ConfigError,
    InvalidURLError,
    MissingDependencyError,
    ReadOnlyError,
    UnknownSchemeError,
)
from tensorkv.stores import open_store, parse_url, register_backend, schemes
from tensorkv.stores import registry as registry_module
from tensorkv.stores.memory import MemoryStore


# ----------------------------------------------------------------------------- schemes
def test_known_schemes():
    assert {"memory", "lmdb", "rocksdb", "leveldb", "redis", "rediss"} <= set(schemes())
    assert schemes() == sorted(schemes())


def test_unknown_scheme_lists_the_known_ones():
    with pytest.raises(UnknownSchemeError, match="'sqlite'") as info:
        open_store("sqlite:///tmp/x.db")
    for name in ("lmdb", "rocksdb", "leveldb", "memory", "redis"):
        assert name in str(info.value)
    assert isinstance(info.value, InvalidURLError) and isinstance(info.value, ValueError)


def test_scheme_is_case_insensitive(tmp_path):
    with open_store(f"LMDB://{tmp_path}/db") as s:
        assert s.scheme == "lmdb"


# ----------------------------------------------------------------------------- malformed URLs
@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("/abs/path", "no scheme; write e.g. 'lmdb:///abs/path'"),
        ("relative/path", "no scheme"),
        ("", "no scheme"),
        ("redis://localhost:abc/0", "port 'abc' of host 'localhost' is not a number"),
        ("redis://localhost:70000/0", "port 70000 is out of range"),
        ("redis://localhost:0/0", "port 0 is out of range"),
        ("redis+cluster://h1:7000,,h2:7001", "empty host"),
    ],
)
def test_malformed_urls(url, match):
    with pytest.raises(InvalidURLError, match=match):
        parse_url(url)
    with pytest.raises(InvalidURLError):
        open_store(url)


@pytest.mark.parametrize("url", [None, 42, b"lmdb:///x"])
def test_url_must_be_a_string(url):
    with pytest.raises(InvalidURLError, match="must be a str"):
        open_store(url)


@pytest.mark.parametrize("scheme", ["lmdb", "rocksdb", "leveldb"])
@pytest.mark.parametrize("rest", ["relative", "relative/db", "host:1/db", "user@host/db"])
def test_embedded_stores_need_an_absolute_path(scheme, rest, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidURLError, match=f"use {scheme}:///abs/path") as info:
        open_store(f"{scheme}://{rest}")
    assert "three slashes" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing was created anywhere


@pytest.mark.parametrize("scheme", ["lmdb", "rocksdb", "leveldb"])
def test_embedded_stores_need_a_path(scheme):
    for url in (f"{scheme}://", f"{scheme}:///"):
        with pytest.raises(InvalidURLError, match="has no path"):
            open_store(url)


# ----------------------------------------------------------------------------- parsing
def test_parse_network_urls():
    u = parse_url("redis://alice:s%40cret@cache.local:6380/2?socket_timeout=1.5&ssl=true")
    assert u.scheme == "redis" and u.hosts == [("cache.local", 6380)] and u.path == "/2"
    assert (u.username, u.password) == ("alice", "s@cret")
    assert u.options == {"socket_timeout": 1.5, "ssl": True}
    c = parse_url("redis+cluster://h1:7000,h2:7001,[::1]:7002")
    assert c.hosts == [("h1", 7000), ("h2", 7001), ("::1", 7002)]
    s = parse_url("redis+sentinel://:pw@s1:26379,s2/mymaster")
    assert s.hosts == [("s1", 26379), ("s2", None)] and s.path == "/mymaster"
    assert s.username is None and s.password == "pw"


def test_parse_embedded_urls():
    u = parse_url("lmdb:///data/my%20db?readonly=true&map_size=1GiB&max_readers=16&x=0.5&s=on")
    assert u.scheme == "lmdb" and u.hosts == [] and u.path == "/data/my db"
    assert u.options == {
        "readonly": True, "map_size": "1GiB", "max_readers": 16, "x": 0.5, "s": True,
    }
    assert parse_url("memory://").hosts == []
    assert parse_url("memory://named").hosts == [("named", None)]


def test_percent_encoded_path(tmp_path):
    with open_store(f"lmdb://{tmp_path}/with%20space") as s:
        s.put(b"k", b"v")
    assert (tmp_path / "with space" / "data.mdb").exists()


# ----------------------------------------------------------------------------- options
@pytest.mark.parametrize("scheme", ["lmdb", "rocksdb", "leveldb"])
def test_query_string_options(scheme, tmp_path):
    url = f"{scheme}://{tmp_path}/db"
    with open_store(url) as s:
        s.put(b"k", b"v")
    with open_store(url + "?readonly=true") as ro:
        assert ro.readonly and ro.get(b"k") == b"v"
        with pytest.raises(ReadOnlyError):
            ro.put(b"k", b"x")
    # keyword arguments override the query string
    with open_store(url + "?readonly=true", readonly=False) as rw:
        assert not rw.readonly
        rw.put(b"k", b"new")
    with open_store(url, readonly="yes") as ro:
        assert ro.readonly and ro.get(b"k") == b"new"


@pytest.mark.parametrize("scheme", ["lmdb", "rocksdb", "leveldb"])
def test_unknown_options_are_refused_with_the_valid_ones(scheme, tmp_path):
    with pytest.raises(ConfigError, match="read_only") as info:
        open_store(f"{scheme}://{tmp_path}/db?read_only=true")
    assert "valid options:" in str(info.value) and "readonly" in str(info.value)
    with pytest.raises(ConfigError, match="bogus"):
        open_store(f"{scheme}://{tmp_path}/db", bogus=1)
    with pytest.raises(ConfigError, match="not a boolean"):
        open_store(f"{scheme}://{tmp_path}/db?readonly=perhaps")


def test_memory_store_refuses_options():
    with pytest.raises(InvalidURLError, match="nope"):
        open_store("memory://?nope=1")


# ----------------------------------------------------------------------------- registration
def test_register_backend():
    register_backend("Mem2", "tensorkv.stores.memory:MemoryStore")
    try:
        assert "mem2" in schemes()
        with open_store("mem2://") as s:
            assert isinstance(s, MemoryStore)
    finally:
        registry_module._REGISTRY.pop("mem2", None)
    assert "mem2" not in schemes()


def test_registered_backend_with_a_missing_dependency():
    missing = "tensorkv_no_such_module"
    register_backend("fancy", f"{missing}:Store", extra="fancy", requires=(missing,))
    try:
        with pytest.raises(MissingDependencyError, match=r'pip install "tensorkv\[fancy\]"'):
            open_store("fancy:///x")
    finally:
        registry_module._REGISTRY.pop("fancy", None)


# ----------------------------------------------------------------------------- missing packages
@pytest.mark.parametrize(
    ("scheme", "module", "extra"),
    [
        ("lmdb", "lmdb", "lmdb"),
        ("rocksdb", "rocksdict", "rocksdb"),
        ("leveldb", "plyvel", "leveldb"),
    ],
)
def test_missing_optional_dependency(scheme, module, extra, tmp_path):
    """A really missing package (sys.modules[name] = None makes import fail) names the extra."""
    code = f"""
        import sys
        sys.modules[{module!r}] = None  # the import system now raises ImportError for it
        import tensorkv
        from tensorkv.errors import MissingDependencyError
        try:
            tensorkv.open_store({f"{scheme}://{tmp_path}/db"!r})
        except MissingDependencyError as exc:
            assert isinstance(exc, ImportError)
            print("MISSING:", exc)
        else:
            print("opened")
        # the other backends keep working
        with tensorkv.open_store("memory://") as s:
            s.put(b"k", b"v")
    """
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("MISSING:"), r.stdout
    assert f'pip install "tensorkv[{extra}]"' in r.stdout
    assert repr(module) in r.stdout
    assert not (tmp_path / "db").exists()


def test_package_imports_without_optional_backends():
    code = """
        import sys
        for name in ("lmdb", "rocksdict", "plyvel", "redis"):
            sys.modules[name] = None
        import tensorkv, tensorkv.stores, tensorkv.testing
        print(tensorkv.__version__ != "")
    """
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def test_open_store_is_exported():
    assert tensorkv.open_store is open_store
