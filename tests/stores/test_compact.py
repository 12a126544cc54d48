"""KVStore.compact(): deleted space goes back to the file system and nothing else changes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import tensorkv
from servers import with_options
from tensorkv.errors import ReadOnlyError, StoreLockedError, UnsupportedOperationError
from tensorkv.stores import lmdb_file

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src")
ENV = {**os.environ, "PYTHONPATH": SRC}


def _fill(store, n_batches: int = 20, per_batch: int = 250, size: int = 4000) -> list[bytes]:
    rng = np.random.default_rng(3)
    keys = []
    for b in range(n_batches):
        batch = {f"k{b:03d}-{i:04d}".encode(): rng.bytes(size) for i in range(per_batch)}
        store.put_many(batch)
        keys += sorted(batch)
    return keys


def _txnid(data) -> int:
    with open(data, "rb") as f:
        return lmdb_file.committed_meta(str(data.parent), f.fileno()).txnid


def _child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=ENV, timeout=120)


def test_lmdb_file_shrinks_and_every_key_reads_back(tmp_path):
    url = f"lmdb://{tmp_path / 'db'}"
    data = tmp_path / "db" / "data.mdb"
    with tensorkv.open_store(url) as s:
        keys = _fill(s)
        s.delete_many([k for i, k in enumerate(keys) if i % 10])  # 90 % deleted
        kept = sorted(s.keys())
        want = s.get_many(kept)
        size = os.path.getsize(data)
        before, after = s.compact()
        assert before == size and after == os.path.getsize(data)
        assert after < before / 4, (before, after)
        # the same store object reads and writes on the new file
        assert sorted(s.keys()) == kept and s.get_many(kept) == want
        s.put(b"later", b"write")
        # another process attaches to this process's lock file: it must see the same data
        code = ("import sys, tensorkv\nwith tensorkv.open_store(sys.argv[1]) as t:\n"
                "    print(t.count(), t.get(b'later').decode())\n    t.put(b'child', b'1')")
        child = _child(code, url)
        assert child.returncode == 0, child.stderr
        assert child.stdout.split() == [str(len(kept) + 1), "write"]
        assert s.get(b"child") == b"1"
    with tensorkv.open_store(url, readonly=True) as s:
        assert s.get_many(kept) == want and s.count() == len(kept) + 2
    assert sorted(os.listdir(tmp_path / "db")) == ["data.mdb", "lock.mdb"]  # no temp left


def test_lmdb_compact_is_refused_while_another_process_has_it_open(tmp_path):
    url = f"lmdb://{tmp_path / 'db'}"
    with tensorkv.open_store(url) as s:
        keys = _fill(s, n_batches=4)
        s.delete_many(keys[100:])
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, tensorkv\ns = tensorkv.open_store(sys.argv[1], "
         "readonly=True)\nprint('open', flush=True)\nsys.stdin.read()", url],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "open"
        with tensorkv.open_store(url) as s:
            size = os.path.getsize(tmp_path / "db" / "data.mdb")
            with pytest.raises(StoreLockedError, match="another process has it open"):
                s.compact()
            assert os.path.getsize(tmp_path / "db" / "data.mdb") == size
            assert sorted(s.keys()) == keys[:100]  # still usable
            s.put(b"after", b"refusal")
    finally:
        holder.communicate("", timeout=60)
    with tensorkv.open_store(url) as s:  # and compacts once the other process has gone
        before, after = s.compact()
        assert after < before and s.count() == 101


def test_lmdb_compact_refuses_a_second_store_object(tmp_path):
    url = f"lmdb://{tmp_path / 'db'}"
    with tensorkv.open_store(url) as a, tensorkv.open_store(url) as b:
        a.put(b"k", b"v")
        with pytest.raises(StoreLockedError, match="open 2 times in this process"):
            b.compact()


@pytest.mark.parametrize("scheme", ["rocksdb", "leveldb"])
def test_lsm_compact_keeps_every_key(tmp_path, scheme):
    url = f"{scheme}://{tmp_path / 'db'}?write_buffer_size=1MiB"
    with tensorkv.open_store(url) as s:
        keys = _fill(s, n_batches=8)
        s.delete_many(keys[200:])
        want = s.get_many(keys[:200])
        before, after = s.compact()
        # 8 MB written, 0.8 MB kept
        assert before > 0 and after < before and after < 4_000_000, (before, after)
        assert sorted(s.keys()) == keys[:200] and s.get_many(keys[:200]) == want


def test_memory_compact_is_a_no_op():
    with tensorkv.open_store("memory://") as s:
        s.put(b"k", b"vv")
        assert s.compact() == (3, 3)


def test_compact_needs_a_writable_store(tmp_path):
    url = f"lmdb://{tmp_path / 'db'}"
    tensorkv.open_store(url).close()
    with tensorkv.open_store(url, readonly=True) as s, pytest.raises(ReadOnlyError):
        s.compact()


def test_redis_cannot_compact(redis_server, key_prefix):
    url = with_options(redis_server.url, prefix=key_prefix)
    with tensorkv.open_store(url) as s, pytest.raises(UnsupportedOperationError, match="reclaims"):
        s.compact()


def test_lmdb_compacted_file_continues_the_transaction_ids(tmp_path):
    """The swapped-in file's committed meta carries the environment's last transaction id."""
    url = f"lmdb://{tmp_path / 'db'}"
    data = tmp_path / "db" / "data.mdb"
    with tensorkv.open_store(url) as s:
        keys = _fill(s, n_batches=4)
        s.delete_many(keys[10:])
        txnid = _txnid(data)
        s.compact()
        assert _txnid(data) == txnid  # a plain env.copy(compact=True) restarts at 1
        with open(data, "rb") as f:
            m0, m1 = lmdb_file.read_metas(f.fileno())
        assert isinstance(m0, lmdb_file.Meta) and isinstance(m1, lmdb_file.Meta)
        assert (m0.main_root, m0.last_pg) == (m1.main_root, m1.last_pg)  # one tree in both
        assert [m0, m1][txnid & 1].txnid == txnid


def test_lmdb_restamped_copy_reads_right_through_a_live_lock_file(tmp_path):
    """A process attaching to a lock file that outlived the swap reads meta page id & 1."""
    import lmdb

    env = lmdb.open(str(tmp_path / "db"), map_size=1 << 26)
    for i in range(4):  # four transactions: an even id, so meta page 0 is read
        with env.begin(write=True) as t:
            t.put(b"k%d" % i, b"v" * 3000)
    txnid = env.info()["last_txnid"]
    assert txnid == 4
    (tmp_path / "copy").mkdir()
    env.copy(str(tmp_path / "copy"), compact=True)
    lmdb_file.restamp_metas(str(tmp_path / "copy" / "data.mdb"), txnid)
    os.replace(tmp_path / "copy" / "data.mdb", tmp_path / "db" / "data.mdb")
    # env stays open: the child attaches to its lock file (last txnid = txnid) and the new file
    code = ("import sys, lmdb\ne = lmdb.open(sys.argv[1], readonly=True)\n"
            "print(e.stat()['entries'], e.begin().get(b'k0') == b'v' * 3000)")
    child = _child(code, str(tmp_path / "db"))
    env.close()
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["4", "True"]
