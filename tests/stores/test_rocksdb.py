import gc
import os

import numpy as np
import pytest

import tensorkv
from helpers import run_python
from tensorkv.errors import (
    ConfigError,
    StoreError,
    StoreLockedError,
    StoreNotFoundError,
    StorePathError,
    StorePermissionError,
)
from tensorkv.stores.rocksdb import RocksDBStore
from tensorkv.testing import StoreTests
from tensorkv.testing.stores import unwritable_directory


class TestRocksDBStore(StoreTests):
    @pytest.fixture
    def store_url(self, tmp_path):
        return f"rocksdb://{tmp_path}/db"


class TestRocksDBSyncLZ4(StoreTests):
    """Every write fsynced, LZ4 compression: the same contract."""

    open_options = {"sync": True, "compression": "lz4"}

    @pytest.fixture
    def store_url(self, tmp_path):
        return f"rocksdb://{tmp_path}/db"


# ----------------------------------------------------------------------------- locking
def test_second_process_gets_a_clear_lock_error(tmp_path):
    url = f"rocksdb://{tmp_path}/db"
    with tensorkv.open_store(url) as s:
        s.put(b"k", b"v")
        r = run_python(
            f"""
            import tensorkv
            from tensorkv.errors import StoreLockedError
            try:
                tensorkv.open_store({url!r})
            except StoreLockedError as exc:
                assert isinstance(exc, OSError)
                print("LOCKED:", exc)
            """
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("LOCKED:"), r.stdout
        assert os.path.join(str(tmp_path), "db", "LOCK") in r.stdout
        assert "one process at a time" in r.stdout
        s.put(b"k2", b"still mine")  # the holder is unaffected
        assert s.get(b"k2") == b"still mine"
    with tensorkv.open_store(url) as again:  # released on close
        assert again.get(b"k") == b"v"


def test_second_open_in_same_process_keeps_the_lock(tmp_path):
    url = f"rocksdb://{tmp_path}/db"
    with tensorkv.open_store(url) as s:
        with pytest.raises(StoreLockedError, match="already open for writing in this process"):
            tensorkv.open_store(url)
        r = run_python(
            f"""
            import tensorkv
            try:
                tensorkv.open_store({url!r})
                print("opened")
            except Exception as exc:
                print(type(exc).__name__)
            """
        )
        assert r.stdout.strip() == "StoreLockedError", r.stdout + r.stderr
        s.put(b"k", b"v")


def test_readonly_readers_beside_a_writer(tmp_path):
    url = f"rocksdb://{tmp_path}/db"
    with tensorkv.open_store(url) as s:
        s.put_many({b"r%d" % i: b"v%d" % i for i in range(10)})
        s.flush()
        with tensorkv.open_store(url, readonly=True) as ro:  # read-only opens take no lock
            assert ro.get(b"r3") == b"v3" and ro.count() == 10
        r = run_python(
            f"""
            import tensorkv
            with tensorkv.open_store({url!r}, readonly=True) as ro:
                print(ro.get(b"r7").decode())
            """
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "v7"


def test_store_dropped_without_close_frees_the_path(tmp_path):
    url = f"rocksdb://{tmp_path}/db"
    tensorkv.open_store(url).put(b"k", b"v")  # never closed; collected right away
    gc.collect()
    with tensorkv.open_store(url, readonly=True) as ro:
        assert ro.get(b"k") == b"v"
    with tensorkv.open_store(url) as s:
        s.put(b"k", b"again")


# ----------------------------------------------------------------------------- paths
def test_readonly_open_of_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(StoreNotFoundError, match=str(missing)):
        tensorkv.open_store(f"rocksdb://{missing}", readonly=True)
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(StoreNotFoundError, match="holds no CURRENT"):
        tensorkv.open_store(f"rocksdb://{empty}?readonly=true")


def test_path_under_a_file(tmp_path):
    afile = tmp_path / "afile"
    afile.write_bytes(b"x")
    with pytest.raises(StorePathError, match=str(afile)):
        tensorkv.open_store(f"rocksdb://{afile}/db")


def test_unwritable_directory(tmp_path):
    parent = unwritable_directory(tmp_path)
    with pytest.raises(StorePermissionError, match=str(parent)):
        tensorkv.open_store(f"rocksdb://{parent}/db")


# ----------------------------------------------------------------------------- options
def test_capabilities_follow_sync(tmp_path):
    with tensorkv.open_store(f"rocksdb://{tmp_path}/a") as s:
        assert s.capabilities.durable_on_return is False
        assert s.capabilities.atomic_batches and s.capabilities.ordered_scans
        assert not s.capabilities.multi_process
    with tensorkv.open_store(f"rocksdb://{tmp_path}/b?sync=true") as s:
        assert s.capabilities.durable_on_return is True
        assert s.stats()["capabilities"]["durable_on_return"] is True
    assert RocksDBStore.capabilities.durable_on_return is False


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"compresion": "lz4"}, "compresion; valid options: background_jobs, block_cache_size"),
        ({"compression": "brotli"}, "use one of none, lz4, zstd, snappy"),
        ({"write_buffer_size": "big"}, "write_buffer_size='big'"),
        ({"background_jobs": 0}, "background_jobs=0 is below"),
    ],
)
def test_bad_options(tmp_path, options, match):
    with pytest.raises(ConfigError, match=match):
        tensorkv.open_store(f"rocksdb://{tmp_path}/db", **options)
    with tensorkv.open_store(f"rocksdb://{tmp_path}/db") as s:  # nothing left locked
        s.put(b"k", b"v")


@pytest.mark.parametrize("compression", ["none", "lz4", "zstd", "snappy"])
def test_bulk_load_through_flushes(tmp_path, compression):
    """More data than the write buffer: memtables flush to SST files and read back."""
    # two memtables at most: writing the third waits for the first flush, so SST files exist
    # when the writes return, however slowly the background flush runs
    url = (f"rocksdb://{tmp_path}/db?write_buffer_size=1MiB&max_write_buffers=2"
           f"&compression={compression}")
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((4000, 256), dtype=np.float32)  # 4 MiB
    keys = [b"emb/%08d" % i for i in range(len(rows))]
    with tensorkv.open_store(url) as s:
        for i in range(0, len(rows), 500):
            s.put_many(zip(keys[i : i + 500], rows[i : i + 500], strict=True))
        got = s.get_many(keys[::37])
        assert got == [row.tobytes() for row in rows[::37]]
        assert s.stats()["live_sst_bytes"] > 0
    with tensorkv.open_store(url, readonly=True) as ro:
        assert ro.count(b"emb/") == len(rows)
        assert ro.get(keys[-1]) == rows[-1].tobytes()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_use_after_fork_is_refused(tmp_path):
    s = tensorkv.open_store(f"rocksdb://{tmp_path}/db")
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
    with tensorkv.open_store(f"rocksdb://{tmp_path}/db") as again:
        assert again.get(b"k2") == b"parent"


def test_sst_files_are_ingested_in_key_order(tmp_path):
    from tensorkv.stores.rocksdb import write_sst_files

    items = [(b"k%06d" % i, np.full(100, i % 251, np.uint8).tobytes()) for i in range(1000)]
    (tmp_path / "sst").mkdir()
    files = write_sst_files(iter(items), str(tmp_path / "sst"), file_bytes=30_000)
    assert len(files) == 4  # a new file after each 30 kB of records
    with tensorkv.open_store(f"rocksdb://{tmp_path}/db") as s:
        s.put(b"k000001", b"older")  # ingested keys are newer than every earlier write
        s.ingest_files(files)
        assert s.get_many([k for k, _ in items]) == [v for _, v in items]
        assert not any(os.path.exists(f) for f in files)  # moved into the database
    with pytest.raises(StoreError, match="writing SST files failed.*ascending"):
        write_sst_files(iter([(b"b", b"1"), (b"a", b"2")]), str(tmp_path / "sst"))
