import gc
import os
import subprocess
import sys

import pytest

import tensorkv
from helpers import run_python
from tensorkv.errors import (
    ConfigError,
    ReadOnlyError,
    StoreError,
    StoreLockedError,
    StoreNotFoundError,
    StorePathError,
    StorePermissionError,
)
from tensorkv.stores.leveldb import LevelDBStore
from tensorkv.testing import StoreTests
from tensorkv.testing.stores import unwritable_directory


class TestLevelDBStore(StoreTests):
    @pytest.fixture
    def store_url(self, tmp_path):
        return f"leveldb://{tmp_path}/db"


class TestLevelDBSyncSnappy(StoreTests):
    """Every write fsynced, snappy compression: the same contract."""

    open_options = {"sync": True, "compression": "snappy"}

    @pytest.fixture
    def store_url(self, tmp_path):
        return f"leveldb://{tmp_path}/db"


_TRY_OPEN = """
    import tensorkv
    try:
        tensorkv.open_store({url!r}{extra})
        print("opened")
    except Exception as exc:
        print(type(exc).__name__, exc)
"""


# ----------------------------------------------------------------------------- locking
def test_second_process_gets_a_clear_lock_error(tmp_path):
    url = f"leveldb://{tmp_path}/db"
    with tensorkv.open_store(url) as s:
        s.put(b"k", b"v")
        for extra in ("", ", readonly=True"):  # LevelDB locks read-only opens too
            r = run_python(_TRY_OPEN.format(url=url, extra=extra))
            assert r.returncode == 0, r.stderr
            assert r.stdout.startswith("StoreLockedError"), r.stdout
            assert os.path.join(str(tmp_path), "db", "LOCK") in r.stdout
            assert "one process at a time" in r.stdout
        s.put(b"k2", b"still mine")
        assert s.get(b"k2") == b"still mine"
    r = run_python(_TRY_OPEN.format(url=url, extra=""))  # released on close
    assert r.stdout.strip() == "opened", r.stdout + r.stderr


def test_second_open_in_same_process_keeps_the_lock(tmp_path):
    """LevelDB drops a process's lock when a second open in it fails; we refuse it first."""
    url = f"leveldb://{tmp_path}/db"
    with tensorkv.open_store(url) as s:
        for kwargs in ({}, {"readonly": True}):
            with pytest.raises(StoreLockedError, match="already open .* in this process"):
                tensorkv.open_store(url, **kwargs)
        r = run_python(_TRY_OPEN.format(url=url, extra=""))
        assert r.stdout.startswith("StoreLockedError"), r.stdout + r.stderr
        s.put(b"k", b"v")
    with tensorkv.open_store(url) as again:
        assert again.get(b"k") == b"v"


def test_failed_open_releases_the_claim(tmp_path):
    url = f"leveldb://{tmp_path}/db"
    with tensorkv.open_store(url):
        r = run_python(_TRY_OPEN.format(url=url, extra=""))
        assert r.stdout.startswith("StoreLockedError")
    # another process holds it now: our open fails, and must not leave a stale claim behind
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import tensorkv,time\ns = tensorkv.open_store({url!r})\n"
         "print('ready', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
        with pytest.raises(StoreLockedError, match="locked by another process"):
            tensorkv.open_store(url)
    finally:
        holder.kill()
        holder.wait()
    with tensorkv.open_store(url) as s:
        s.put(b"k", b"v")


def test_store_dropped_without_close_frees_the_path(tmp_path):
    url = f"leveldb://{tmp_path}/db"
    tensorkv.open_store(url).put(b"k", b"v")  # never closed; collected right away
    gc.collect()
    with tensorkv.open_store(url) as s:
        assert s.get(b"k") == b"v"


# ----------------------------------------------------------------------------- readonly
def test_readonly_refuses_writes_at_our_level(tmp_path):
    url = f"leveldb://{tmp_path}/db"
    with tensorkv.open_store(url) as s:
        s.put(b"k", b"v")
    with tensorkv.open_store(url, readonly=True) as ro:
        with pytest.raises(ReadOnlyError, match="read-only"):
            ro.put(b"k", b"x")
        with pytest.raises(ReadOnlyError):
            ro.delete_prefix(b"")
        ro.flush()  # harmless on a read-only store
        assert ro.get(b"k") == b"v"


def test_readonly_open_of_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(StoreNotFoundError, match=str(missing)):
        tensorkv.open_store(f"leveldb://{missing}", readonly=True)
    assert not missing.exists()  # plyvel would have created the directory


def test_path_under_a_file(tmp_path):
    afile = tmp_path / "afile"
    afile.write_bytes(b"x")
    with pytest.raises(StorePathError, match=str(afile)):
        tensorkv.open_store(f"leveldb://{afile}/db")


def test_unwritable_directory(tmp_path):
    parent = unwritable_directory(tmp_path)
    with pytest.raises(StorePermissionError, match=str(parent)):
        tensorkv.open_store(f"leveldb://{parent}/db")


# ----------------------------------------------------------------------------- options
def test_capabilities_follow_sync(tmp_path):
    with tensorkv.open_store(f"leveldb://{tmp_path}/a") as s:
        assert s.capabilities.durable_on_return is False
        assert not s.capabilities.multi_process
    with tensorkv.open_store(f"leveldb://{tmp_path}/b", sync=True) as s:
        assert s.capabilities.durable_on_return is True
    assert LevelDBStore.capabilities.durable_on_return is False


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"cache": "1GiB"}, "cache; valid options: block_cache_size, bloom_bits, compression"),
        ({"compression": "zstd"}, "use none or snappy"),
        ({"bloom_bits": -1}, "bloom_bits=-1 is below the minimum 0"),
    ],
)
def test_bad_options(tmp_path, options, match):
    with pytest.raises(ConfigError, match=match):
        tensorkv.open_store(f"leveldb://{tmp_path}/db", **options)
    with tensorkv.open_store(f"leveldb://{tmp_path}/db") as s:  # nothing left locked
        s.put(b"k", b"v")


def test_bulk_load_through_compactions(tmp_path):
    url = f"leveldb://{tmp_path}/db?write_buffer_size=256KiB"
    value = os.urandom(1024)
    with tensorkv.open_store(url) as s:
        for r in range(16):
            s.put_many({b"bulk/%02d/%04d" % (r, i): value for i in range(256)})  # 4 MiB
        s.delete_prefix(b"bulk/03/")
    with tensorkv.open_store(url) as s:
        assert s.count(b"bulk/") == 15 * 256
        assert s.get(b"bulk/15/0255") == value and s.get(b"bulk/03/0000") is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_use_after_fork_is_refused(tmp_path):
    s = tensorkv.open_store(f"leveldb://{tmp_path}/db")
    s.put(b"k", b"v")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must neither read, write nor close the parent's database
        os.close(r)
        try:
            try:
                s.put(b"k", b"child")
                answer = b"no error"
            except StoreError as exc:
                answer = b"refused" if "fork" in str(exc) else str(exc).encode()
            s.close()  # closing the inherited store is harmless
            os.write(w, answer)
        except BaseException as exc:  # noqa: BLE001
            os.write(w, repr(exc).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        answer = f.read()
    os.waitpid(pid, 0)
    assert answer == b"refused"
    assert s.get(b"k") == b"v"
    s.put(b"k2", b"parent")
    s.close()
    with tensorkv.open_store(f"leveldb://{tmp_path}/db") as again:
        assert again.get(b"k2") == b"parent"
