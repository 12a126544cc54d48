import gc
import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

import tensorkv
from helpers import run_python
from tensorkv.errors import (
    ConfigError,
    InvalidURLError,
    KeyTooLargeError,
    ReadOnlyError,
    StoreError,
    StoreFullError,
    StoreLockedError,
    StoreNotFoundError,
    StorePathError,
    StorePermissionError,
)
from tensorkv.stores.lmdb import LMDBStore
from tensorkv.testing import StoreTests
from tensorkv.testing.stores import unwritable_directory

KiB, MiB = 1024, 1024 * 1024


class TestLMDBStore(StoreTests):
    @pytest.fixture
    def store_url(self, tmp_path):
        return f"lmdb://{tmp_path}/db"


class TestLMDBNoSync(StoreTests):
    """sync=false keeps every guarantee except durability against power loss."""

    open_options = {"sync": False}

    @pytest.fixture
    def store_url(self, tmp_path):
        return f"lmdb://{tmp_path}/db"


# ----------------------------------------------------------------------------- map growth
def test_map_grows_from_64kib_through_many_mb(tmp_path):
    url = f"lmdb://{tmp_path}/db?map_size=64KiB"
    with tensorkv.open_store(url) as s:
        assert s.stats()["map_size"] == 64 * KiB
        value = os.urandom(8 * KiB)
        for batch in range(40):  # 40 x 32 x 8 KiB = 10 MiB
            s.put_many({b"k%03d/%02d" % (batch, i): value for i in range(32)})
        one_big = {b"big/%04d" % i: os.urandom(4 * KiB) for i in range(1024)}  # 4 MiB at once
        with s.batch() as b:
            b.put_many(one_big)
        st = s.stats()
        assert st["map_size"] >= 14 * MiB
        assert st["resizes"] >= 8
        assert s.count() == 40 * 32 + 1024
        assert s.get(b"k000/00") == value and s.get(b"k039/31") == value
        assert s.get_many(list(one_big)[:50]) == list(one_big.values())[:50]
    with tensorkv.open_store(url) as again:  # reopening with the small map_size keeps all
        assert again.count() == 40 * 32 + 1024
        assert again.stats()["map_size"] >= 14 * MiB


def test_full_map_raises_and_keeps_earlier_data(tmp_path):
    url = f"lmdb://{tmp_path}/db?map_size=128KiB&max_map_size=1MiB"
    s = tensorkv.open_store(url)
    written = {}
    with pytest.raises(StoreFullError, match="max_map_size") as info:
        for i in range(100):
            batch = {b"c%03d/%d" % (i, j): os.urandom(10 * KiB) for j in range(4)}
            s.put_many(batch)
            written.update(batch)
    msg = str(info.value)
    assert str(1 * MiB) in msg and str(tmp_path) in msg
    assert isinstance(info.value, OSError)
    assert 0 < len(written) < 400
    assert s.count() == len(written)  # the refused batch wrote nothing
    some = list(written)[:: max(1, len(written) // 10)]
    assert s.get_many(some) == [written[k] for k in some]
    s.put(b"small", b"still fits")  # small writes that fit keep working
    assert s.get(b"small") == b"still fits"
    s.close()
    with tensorkv.open_store(url, max_map_size="8MiB") as bigger:
        bigger.put_many({b"more/%d" % j: os.urandom(10 * KiB) for j in range(100)})
        assert bigger.count(b"c") == len(written)


def test_another_process_grows_the_map(tmp_path):
    url = f"lmdb://{tmp_path}/db?map_size=64KiB"
    s = tensorkv.open_store(url)
    s.put(b"parent", b"1")
    r = run_python(
        f"""
        import os, tensorkv
        with tensorkv.open_store({url!r}) as c:
            c.put_many({{b"child/%04d" % i: os.urandom(4096) for i in range(2000)}})
            print(c.stats()["map_size"])
        """
    )
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) > 64 * KiB
    # this process still maps 64 KiB: reads and writes adopt the larger map
    assert s.count(b"child/") == 2000
    assert len(s.get(b"child/1999")) == 4096
    s.put_many({b"parent/%04d" % i: os.urandom(4096) for i in range(500)})
    assert s.count() == 2501
    s.close()


def test_processes_write_at_once_while_the_map_grows(tmp_path):
    url = f"lmdb://{tmp_path}/db?map_size=64KiB"
    code = f"""
        import os, sys, tensorkv
        p = int(sys.argv[1])
        with tensorkv.open_store({url!r}) as s:
            for r in range(30):
                s.put_many({{b"p%d/%02d/%02d" % (p, r, i): os.urandom(2048) for i in range(10)}})
                assert s.count(b"p%d/" % p) == (r + 1) * 10
    """
    with tensorkv.open_store(url) as parent:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(code), str(p)],
                stderr=subprocess.PIPE,
            )
            for p in range(3)
        ]
        seen = 0
        while any(proc.poll() is None for proc in procs):
            seen = max(seen, parent.count(b"p"))  # reads keep adopting the growing map
        for proc in procs:
            proc.wait()
            assert proc.returncode == 0, proc.stderr.read().decode()
        assert parent.count(b"p") == 3 * 30 * 10
        assert parent.stats()["map_size"] > 64 * KiB


def test_threads_write_and_read_while_the_map_grows(tmp_path):
    s = tensorkv.open_store(f"lmdb://{tmp_path}/db", map_size="64KiB")
    errors = []

    def writer(t):
        try:
            for r in range(30):
                s.put_many({b"w%d/%02d/%02d" % (t, r, i): os.urandom(2048) for i in range(20)})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader():
        try:
            for _ in range(200):
                s.get_many([b"w0/00/00", b"w1/05/03", b"absent"])
                for _ in s.scan(b"w2/", limit=50):
                    pass
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(3)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert s.count() == 3 * 30 * 20
    assert s.stats()["resizes"] > 0
    s.close()


# ----------------------------------------------------------------------------- options
def test_options_from_query_and_kwargs(tmp_path):
    url = f"lmdb://{tmp_path}/db?sync=false&map_size=1MiB&readahead=true&max_readers=64"
    with tensorkv.open_store(url) as s:
        st = s.stats()
        assert st["sync"] is False and st["map_size"] == MiB and st["max_readers"] == 64
        assert s.capabilities.durable_on_return is False
        assert LMDBStore.capabilities.durable_on_return is True  # class flags unchanged
        assert s.stats()["capabilities"]["durable_on_return"] is False
        s.put(b"k", b"v")
        s.flush()
    with tensorkv.open_store(url, sync=True) as s:  # kwargs override the query string
        assert s.stats()["sync"] is True and s.capabilities.durable_on_return is True


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"mapsize": "1GiB"}, "mapsize; valid options: create, map_size, max_map_size"),
        ({"map_size": "lots"}, "map_size='lots'"),
        ({"map_size": "1MiB", "max_map_size": "512KiB"}, "smaller than map_size"),
        ({"sync": "maybe"}, "sync='maybe' is not a boolean"),
        ({"max_readers": 0}, "max_readers=0 is below"),
    ],
)
def test_bad_options(tmp_path, options, match):
    with pytest.raises(ConfigError, match=match):
        tensorkv.open_store(f"lmdb://{tmp_path}/db", **options)


def test_bad_urls(tmp_path):
    with pytest.raises(InvalidURLError, match="lmdb:///abs/path"):
        tensorkv.open_store("lmdb://relative/db")
    with pytest.raises(InvalidURLError, match="no path"):
        tensorkv.open_store("lmdb://")


def test_store_dropped_without_close_frees_the_path(tmp_path):
    url = f"lmdb://{tmp_path}/db"
    tensorkv.open_store(url).put(b"k", b"v")  # never closed; collected right away
    gc.collect()
    with tensorkv.open_store(url, readonly=True) as ro:
        assert ro.get(b"k") == b"v"
    with tensorkv.open_store(url) as s:
        s.put(b"k", b"again")


# ----------------------------------------------------------------------------- paths
def test_readonly_open_of_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(StoreNotFoundError, match=str(missing)) as info:
        tensorkv.open_store(f"lmdb://{missing}", readonly=True)
    assert isinstance(info.value, FileNotFoundError)
    assert "readonly=False" in str(info.value)
    assert not missing.exists()  # nothing was created


def test_path_under_a_file(tmp_path):
    afile = tmp_path / "afile"
    afile.write_bytes(b"not a directory")
    with pytest.raises(StorePathError, match=str(afile)):
        tensorkv.open_store(f"lmdb://{afile}/db")
    with pytest.raises(StorePathError, match="not a directory"):
        tensorkv.open_store(f"lmdb://{afile}")
    assert afile.read_bytes() == b"not a directory"


def test_unwritable_directory(tmp_path):
    parent = unwritable_directory(tmp_path)
    with pytest.raises(StorePermissionError, match=str(parent)) as info:
        tensorkv.open_store(f"lmdb://{parent}/db")
    assert isinstance(info.value, PermissionError)


# ----------------------------------------------------------------------------- sharing
def test_two_stores_on_one_path_share_the_environment(tmp_path):
    url = f"lmdb://{tmp_path}/db"
    a = tensorkv.open_store(url)
    b = tensorkv.open_store(url)
    ro = tensorkv.open_store(url, readonly=True)
    a.put(b"k", b"from a")
    assert b.get(b"k") == b"from a" and ro.get(b"k") == b"from a"
    with pytest.raises(ReadOnlyError):
        ro.put(b"k", b"x")
    a.close()
    b.put(b"k2", b"from b")  # closing one store leaves the others working
    assert ro.get(b"k2") == b"from b"
    b.close()
    ro.close()
    with pytest.raises(ConfigError, match="sync"), tensorkv.open_store(url):
        tensorkv.open_store(url, sync=False)


def test_readonly_first_then_writer_in_same_process(tmp_path):
    url = f"lmdb://{tmp_path}/db"
    tensorkv.open_store(url).close()
    with tensorkv.open_store(url, readonly=True) as ro:
        with pytest.raises(StoreLockedError, match="read-only"):
            tensorkv.open_store(url)
        assert ro.count() == 0
    with tensorkv.open_store(url) as rw:  # once the read-only store is closed it works
        rw.put(b"k", b"v")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_use_after_fork_is_refused(tmp_path):
    s = tensorkv.open_store(f"lmdb://{tmp_path}/db")
    s.put(b"k", b"v")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the inherited environment must not be touched
        os.close(r)
        try:
            s.get(b"k")
            os.write(w, b"no error")
        except StoreError as exc:
            os.write(w, b"refused" if "fork" in str(exc) else str(exc).encode())
        except BaseException as exc:  # noqa: BLE001
            os.write(w, repr(exc).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        answer = f.read()
    os.waitpid(pid, 0)
    assert answer == b"refused"
    assert s.get(b"k") == b"v"  # the parent is unaffected
    s.close()


# ----------------------------------------------------------------------------- keys
def test_key_too_large(tmp_path):
    with tensorkv.open_store(f"lmdb://{tmp_path}/db") as s:
        s.put(b"ok", b"1")
        long_key = b"x" * 600
        with pytest.raises(KeyTooLargeError, match="511"):
            s.put_many({b"a": b"1", long_key: b"2"})
        assert s.get(b"a") is None  # nothing from the refused batch
        assert s.get_many([b"ok", long_key, b"ok"]) == [b"1", None, b"1"]
        assert long_key not in s
        s.put(b"y" * 511, b"max")
        assert s.get(b"y" * 511) == b"max"


# ----------------------------------------------------------------------------- zero-copy reads
def test_get_many_buffers_views_the_map(tmp_path):
    with tensorkv.open_store(f"lmdb://{tmp_path}/db") as s:
        big = os.urandom(3 * MiB)
        s.put_many({b"a": b"1", b"big": big})
        assert LMDBStore.zero_copy_reads
        with s.get_many_buffers([b"big", b"absent", b"a", b"x" * 600, b"big"]) as vals:
            assert [type(v) for v in vals] == [memoryview, type(None), memoryview,
                                                type(None), memoryview]
            assert vals[0].readonly and vals[0].nbytes == len(big)
            assert bytes(vals[0]) == big and bytes(vals[2]) == b"1"
            assert bytes(vals[4]) == big
            s.put(b"a", b"2")  # a write meanwhile: the snapshot still reads the old value
            assert bytes(vals[2]) == b"1"
        with pytest.raises(ValueError, match="released"):
            bytes(vals[0])  # the views die with the block
        assert s.get(b"a") == b"2"
        with s.get_many_buffers([]) as vals:
            assert vals == []


def test_iter_buffers_lends_lazily_from_one_snapshot(tmp_path):
    with tensorkv.open_store(f"lmdb://{tmp_path}/db") as s:
        big = os.urandom(MiB)
        s.put_many({b"a": b"1", b"b": big, b"c": b"3"})
        with s.iter_buffers([b"a", b"b", b"c", b"absent"]) as it:
            first = next(it)
            s.put(b"c", b"changed")  # after the read transaction began: not seen
            rest = list(it)
            assert bytes(first) == b"1" and bytes(rest[0]) == big
            assert bytes(rest[1]) == b"3" and rest[2] is None
        with pytest.raises(ValueError, match="released"):
            bytes(rest[0])
        with s.iter_buffers([b"a", b"b", b"c"]) as it:  # left early: still cleaned up
            part = next(it)
        with pytest.raises(ValueError, match="released"):
            bytes(part)
        assert s.get(b"c") == b"changed"
        s.put(b"d", b"4")  # writes still go through: the transaction ended


def test_get_many_buffers_bad_keys_and_closed_store(tmp_path):
    s = tensorkv.open_store(f"lmdb://{tmp_path}/db")
    with pytest.raises(TypeError), s.get_many_buffers([b"ok", "str"]):
        pass
    with pytest.raises(TypeError), s.get_many_buffers(b"single"):
        pass
    s.close()
    with pytest.raises(StoreError, match="closed"), s.get_many_buffers([b"a"]):
        pass


def test_close_inside_get_many_buffers_is_deferred(tmp_path):
    path = f"{tmp_path}/db"
    s = tensorkv.open_store(f"lmdb://{path}")
    s.put(b"k", b"v" * 5000)
    with s.get_many_buffers([b"k"]) as (v,):
        s.close()  # would wait for this very block: the environment goes when it exits
        assert s.closed
        assert bytes(v[:3]) == b"vvv"
    with tensorkv.open_store(f"lmdb://{path}") as again:  # released: opens afresh
        assert again.get(b"k") == b"v" * 5000


def test_map_growth_waits_for_get_many_buffers(tmp_path):
    s = tensorkv.open_store(f"lmdb://{tmp_path}/db", map_size="64KiB")
    s.put(b"k", b"x" * 1000)
    done = threading.Event()
    errors = []

    def writer():
        try:
            s.put_many({b"w%03d" % i: os.urandom(4096) for i in range(100)})  # grows the map
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        done.set()

    with s.get_many_buffers([b"k"]) as (v,):
        th = threading.Thread(target=writer)
        th.start()
        assert not done.wait(0.3)  # the resize waits: the map under the views stays put
        assert bytes(v) == b"x" * 1000
    th.join(30)
    assert done.is_set() and not errors, errors
    assert s.stats()["resizes"] > 0 and s.count() == 101
    s.close()


def test_get_many_buffers_fallback_copies(tmp_path):
    with tensorkv.open_store("memory://") as s:
        s.put(b"a", b"1")
        assert not s.zero_copy_reads
        with s.get_many_buffers([b"a", b"b"]) as vals:
            assert vals == [b"1", None]


@pytest.mark.parametrize("how", [{"create": False}, {"readonly": True}])
def test_an_empty_data_file_is_refused_by_opens_that_need_a_store(tmp_path, how):
    from tensorkv.errors import CorruptStoreError

    (tmp_path / "data.mdb").touch()
    with pytest.raises(CorruptStoreError, match=r"data.mdb is empty \(0 bytes\)"):
        tensorkv.open_store(f"lmdb://{tmp_path}", **how)
    assert os.path.getsize(tmp_path / "data.mdb") == 0
    with tensorkv.open_store(f"lmdb://{tmp_path}") as s:  # a writer may start a store there
        s.put(b"k", b"v")
    with tensorkv.open_store(f"lmdb://{tmp_path}", **how) as s:
        assert s.get(b"k") == b"v"


def test_a_reader_waits_for_a_store_being_created_instead_of_refusing_it(tmp_path):
    """An empty data.mdb while another process holds LMDB's creation lock is a store being
    made: a create=False open waits for the lock, then reads the finished store."""
    template = tmp_path / "template"
    with tensorkv.open_store(f"lmdb://{template}") as s:
        s.put(b"k", b"v")
    db = tmp_path / "db"
    db.mkdir()
    (db / "data.mdb").touch()
    (db / "lock.mdb").touch()
    creator = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, shutil, sys
        fd = os.open({str(db / "lock.mdb")!r}, os.O_RDWR)
        fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0, os.SEEK_SET)  # as LMDB's first opener does
        print("locked", flush=True)
        sys.stdin.readline()
        shutil.copyfile({str(template / "data.mdb")!r}, {str(db / "data.mdb")!r})
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    result: list = []

    def read() -> None:
        try:
            with tensorkv.open_store(f"lmdb://{db}", create=False) as s:
                result.append(s.get(b"k"))
        except Exception as exc:  # reported below
            result.append(exc)

    try:
        assert creator.stdout.readline().strip() == "locked"
        reader = threading.Thread(target=read)
        reader.start()
        me = f" {os.getpid()} "

        def waiting() -> bool:  # the kernel lists a blocked lock request with "->"
            with open("/proc/locks") as f:
                return any("->" in line and me in line for line in f)

        while reader.is_alive() and not waiting():
            reader.join(0.01)  # until the reader waits for the creator's lock (or has failed)
        creator.stdin.write("go\n")
        creator.stdin.flush()
        assert creator.wait(60) == 0
        reader.join(60)
    finally:
        creator.kill()
    assert result == [b"v"]


def test_open_retries_when_another_process_grew_the_map(tmp_path, monkeypatch):
    """``lmdb.open`` raising ``MDB_MAP_RESIZED`` (a map grown by another process between the
    environment's open and its first transaction) opens again and reads what is stored."""
    import lmdb

    from tensorkv.stores import open_store

    url = f"lmdb://{tmp_path}/db"
    with open_store(url) as s:
        s.put(b"k", b"v")
    real, calls = lmdb.open, []

    def grown_meanwhile(*args, **kwargs):
        calls.append(1)
        if len(calls) < 3:
            raise lmdb.MapResizedError("mdb_txn_begin: MDB_MAP_RESIZED")
        return real(*args, **kwargs)

    monkeypatch.setattr(lmdb, "open", grown_meanwhile)
    with open_store(url) as s:
        assert s.get(b"k") == b"v"
    assert len(calls) == 3


def test_an_open_while_the_last_store_of_the_path_is_closing_waits_for_the_close(tmp_path):
    """Closing the last store object of a path closes the environment once running
    transactions end; an open of the same path meanwhile (another thread: a background save)
    waits for that close instead of meeting LMDB's "already open in this process"."""
    from tensorkv.stores import lmdb as lmdb_mod
    from tensorkv.stores import open_store

    url = f"lmdb://{tmp_path}/db"
    first = open_store(url)
    first.put(b"k", b"v")
    gate = first._gate
    gate.enter()  # a transaction still running: the close waits for it
    closer = threading.Thread(target=first.close)
    closer.start()
    key = (os.getpid(), os.path.realpath(str(tmp_path / "db")))
    while key not in lmdb_mod._CLOSING:  # the close has begun (out of the shared table)
        closer.join(0.01)
    got: list[Any] = []
    opener = threading.Thread(target=lambda: got.append(_get_or_error(url)))
    opener.start()
    opener.join(0.2)
    assert opener.is_alive()  # waiting for the close, not failing
    gate.leave()
    closer.join()
    opener.join()
    assert got == [b"v"]


def _get_or_error(url: str) -> Any:
    from tensorkv.stores import open_store

    try:
        with open_store(url) as s:
            return s.get(b"k")
    except Exception as exc:  # the failure is the result the test compares
        return exc
