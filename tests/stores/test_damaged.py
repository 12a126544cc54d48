"""Damaged store files give a clean error or the data that was written, never a signal.

Each case damages a copy of a store that holds raw records and a checkpoint (truncation,
seeded bit flips, a deleted file), then reads it in a subprocess, so that a SIGBUS kills
only the child and shows in its returncode: ``get_many`` of every key, a scan, ``load`` of
the checkpoint, and ``tensorkv check --verify`` through the CLI. The rule: the child exits
normally, and either reports a CorruptStoreError (a StoreNotFoundError where the file that
marks a store was deleted) whose message says how to recover, or what it reads is what was
written. LMDB has no checksums: a flipped byte inside a value reads back flipped, so there
only the checkpoint (checksummed) must load identical or fail cleanly, and ``check
--verify`` must agree with ``load``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import tensorkv
from tensorkv.errors import CorruptStoreError
from tensorkv.stores import lmdb_file

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src")
ENV = {**os.environ, "PYTHONPATH": SRC, "TENSORKV_PROGRESS": "0"}
ENV.pop("TENSORKV_DEBUG", None)
#: Options that make the LSM stores write several table files for a few MB of data.
OPTIONS = {"lmdb": "", "rocksdb": "?write_buffer_size=1MiB", "leveldb": "?write_buffer_size=1MiB"}

CHILD = r"""
import json, pickle, sys
import numpy as np
import tensorkv
from tensorkv.errors import TensorKVError

url, expected = sys.argv[1], pickle.load(open(sys.argv[2], "rb"))
raw, out = expected["raw"], {"error": None, "opened": False}


def phase(name, read):
    try:
        out[name] = read()
    except TensorKVError as exc:
        out[name] = {"error": type(exc).__name__, "message": str(exc)}


def compare(got):
    return {"missing": sum(got.get(k) is None for k in raw),
            "wrong": sum(k not in raw or (v is not None and v != raw[k]) for k, v in got.items())}


def load():
    loaded = tensorkv.load(None, url, "v1")
    return {"equal": all(np.array_equal(loaded[n], a) for n, a in expected["dense"].items())}


try:
    with tensorkv.open_store(url, readonly=True) as s:
        out["opened"] = True
        keys = sorted(raw)
        phase("get", lambda: compare(dict(zip(keys, s.get_many(keys)))))
        phase("scan", lambda: compare(dict(s.scan(b"raw/"))))
    phase("load", load)
except TensorKVError as exc:
    out["error"], out["message"] = type(exc).__name__, str(exc)
print(json.dumps(out))
"""


def _expected_data() -> dict:
    rng = np.random.default_rng(7)
    raw = {f"raw/{i:05d}".encode(): rng.bytes(int(rng.integers(10, 3000))) for i in range(2000)}
    raw.update({f"raw/big{i}".encode(): rng.bytes(300_000) for i in range(4)})
    dense = {f"w{i}": rng.standard_normal((64, 1024)).astype(np.float32) for i in range(6)}
    return {"raw": raw, "dense": dense}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """scheme -> (directory of an undamaged store, pickle of what it holds)."""
    root = tmp_path_factory.mktemp("pristine")
    data = _expected_data()
    expected = root / "expected.pkl"
    expected.write_bytes(pickle.dumps(data))
    out = {}
    for scheme in ("lmdb", "rocksdb", "leveldb"):
        path = root / scheme
        url = f"{scheme}://{path}{OPTIONS[scheme]}"
        with tensorkv.open_store(url) as s:
            items = sorted(data["raw"].items())
            for i in range(0, len(items), 250):
                s.put_many(items[i : i + 250])
        tensorkv.save(data["dense"], url, tag="v1")
        out[scheme] = (path, expected)
    return out


def _files(path, *suffixes: str) -> list[str]:
    names = sorted(os.listdir(path))
    return [n for n in names if n.endswith(suffixes) or any(n.startswith(s) for s in suffixes)]


def _truncate(path, name: str) -> None:
    f = os.path.join(path, name)
    os.truncate(f, os.path.getsize(f) // 2)


def _flip(path, seed: int, flips: int = 6) -> None:
    """Flip one bit at each of ``flips`` seeded offsets of the store's data files."""
    rng = random.Random(seed)
    names = [n for n in os.listdir(path) if n not in ("LOCK", "LOG", "LOG.old", "lock.mdb")
             and not n.startswith("OPTIONS") and os.path.getsize(os.path.join(path, n))]
    sizes = {n: os.path.getsize(os.path.join(path, n)) for n in sorted(names)}
    total = sum(sizes.values())
    for _ in range(flips):
        at = rng.randrange(total)  # uniform over the bytes of every file together
        for name, size in sizes.items():
            if at < size:
                with open(os.path.join(path, name), "r+b") as f:
                    f.seek(at)
                    b = f.read(1)[0]
                    f.seek(at)
                    f.write(bytes([b ^ (1 << rng.randrange(8))]))
                break
            at -= size


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV,
                          timeout=120)


def _errors(rep: dict) -> list[str]:
    """Messages of the errors the child met: opening, or in a read."""
    if rep["error"]:
        return [f"{rep['error']}: {rep['message']}"]
    return [f"{rep[n]['error']}: {rep[n]['message']}" for n in ("get", "scan", "load")
            if "error" in rep[n]]


def _clean(err: dict) -> None:
    """A CorruptStoreError that says what to do."""
    assert err["error"] == "CorruptStoreError", err
    assert "is damaged" in err["message"] and "Restore the directory" in err["message"], err


def _in_process(url: str, expected) -> dict:
    """The child's reads, run in this process (where they cannot end in a signal)."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = ["-c", url, str(expected)]
    try:
        with contextlib.redirect_stdout(out):
            exec(CHILD, {"__name__": "damaged_reads"})  # noqa: S102 - the test's own code
    finally:
        sys.argv = argv
    return json.loads(out.getvalue())


def _read_and_check(scheme: str, path, expected, *, deleted_marker: bool = False) -> dict:
    """Read the damaged store in subprocesses; assert the rule; return the child's report.

    Where the reads cannot end in a signal (RocksDB and LevelDB report damage as exceptions;
    LMDB damage found before the file is mapped), they run in this process too and must
    report the same.
    """
    url = f"{scheme}://{path}"
    child = _run("-c", CHILD, url, str(expected))
    assert child.returncode >= 0, f"child killed by signal {-child.returncode}: {child.stderr}"
    assert child.returncode == 0 and "Traceback" not in child.stderr, child.stderr
    rep = json.loads(child.stdout)
    if scheme != "lmdb" or (rep["error"] and not rep["opened"]):
        assert _in_process(url, expected) == rep
    cli = _run("-m", "tensorkv.cli.main", "check", "--verify", url)
    assert cli.returncode >= 0, f"CLI killed by signal {-cli.returncode}: {cli.stderr}"
    # 0 clean, 1 check found damage, 3 no store, 4 the store failed (the CLI's exit statuses)
    assert cli.returncode in (0, 1, 3, 4) and "Traceback" not in cli.stderr, cli.stderr
    one_line = cli.stderr.startswith("tensorkv: error: ") and len(
        cli.stderr.strip().splitlines()) == 1
    if rep["error"]:  # the store could not be opened: nor can the CLI open it
        if not (deleted_marker and rep["error"] == "StoreNotFoundError"):
            _clean(rep)
        want = 3 if rep["error"] == "StoreNotFoundError" else 4
        assert cli.returncode == want and one_line, cli.stderr
        return rep
    for name in ("get", "scan"):  # each read: a clean error, or (checksummed) exact data
        if "error" in rep[name]:
            _clean(rep[name])
        elif scheme != "lmdb":
            assert rep[name] == {"missing": 0, "wrong": 0}, (name, rep)
    # the checkpoint is checksummed everywhere: identical, or a clean error check also sees
    if "error" in rep["load"]:
        assert cli.returncode in (1, 4), (rep, cli.stdout)
    else:
        assert rep["load"]["equal"], rep
    if cli.returncode:
        assert "CORRUPT" in cli.stdout or one_line, (cli.stdout, cli.stderr)
    return rep


@pytest.fixture
def damaged(pristine, tmp_path):
    """A fresh copy of the pristine store of a scheme: damaged(scheme) -> (path, expected)."""

    def copy(scheme: str):
        src, expected = pristine[scheme]
        dst = tmp_path / scheme
        shutil.copytree(src, dst)
        return dst, expected

    return copy


# ------------------------------------------------------------------ (a) truncated to half

def test_lmdb_truncated_data_file(damaged):
    path, expected = damaged("lmdb")
    _truncate(path, "data.mdb")
    rep = _read_and_check("lmdb", path, expected)
    assert rep["error"] == "CorruptStoreError" and "the file was truncated" in rep["message"]
    assert "data.mdb is" in rep["message"]


@pytest.mark.parametrize("scheme", ["rocksdb", "leveldb"])
@pytest.mark.parametrize("which", ["table", "MANIFEST"])
def test_lsm_truncated_file(damaged, scheme, which):
    path, expected = damaged(scheme)
    tables = _files(path, ".sst", ".ldb")
    name = (max(tables, key=lambda n: os.path.getsize(path / n)) if which == "table"
            else _files(path, "MANIFEST-")[-1])
    _truncate(path, name)
    rep = _read_and_check(scheme, path, expected)
    assert _errors(rep) and _errors(rep)[0].startswith("CorruptStoreError"), rep
    assert set(tables) <= set(os.listdir(path))  # no table was deleted by the failed open


# ------------------------------------------------------------------ (b) seeded bit flips

@pytest.mark.parametrize("scheme", ["lmdb", "rocksdb", "leveldb"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_bit_flips(damaged, scheme, seed):
    path, expected = damaged(scheme)
    _flip(path, seed)
    _read_and_check(scheme, path, expected)


# ------------------------------------------------------------------ (c) a deleted file

@pytest.mark.parametrize(
    ("scheme", "name"),
    [("lmdb", "data.mdb"), ("rocksdb", ".sst"), ("rocksdb", "MANIFEST-"), ("rocksdb", "CURRENT"),
     ("leveldb", ".ldb"), ("leveldb", "MANIFEST-"), ("leveldb", "CURRENT")],
)
def test_deleted_file(damaged, scheme, name):
    path, expected = damaged(scheme)
    os.remove(path / _files(path, name)[0])
    rep = _read_and_check(scheme, path, expected, deleted_marker=name == "data.mdb")
    assert _errors(rep), rep
    if name == "CURRENT":
        assert "CURRENT is missing but the directory holds" in rep["message"]


# ------------------------------------------------------------------ LMDB meta pages

def _meta_offsets(path) -> tuple[int, int]:
    with open(path / "data.mdb", "rb") as f:
        head = f.read(lmdb_file.META_END)
    psize = struct.unpack_from("=I", head, 40)[0]
    return 0, psize


@pytest.mark.parametrize("pages", [(0,), (1,), (0, 1)])
def test_lmdb_damaged_meta_page(damaged, pages):
    path, expected = damaged("lmdb")
    offsets = _meta_offsets(path)
    with open(path / "data.mdb", "r+b") as f:
        for p in pages:
            f.seek(offsets[p] + 16)  # mm_magic
            f.write(b"\0\0\0\0")
    rep = _read_and_check("lmdb", path, expected)
    assert rep["error"] == "CorruptStoreError", rep
    want = "no valid meta page" if len(pages) == 2 else f"meta page {pages[0]} holds no LMDB"
    assert want in rep["message"]


def test_lmdb_page_pointer_past_the_end_is_an_error(damaged):
    """A branch page pointing past the last page: LMDB's PageNotFoundError, wrapped."""
    path, expected = damaged("lmdb")
    with open(path / "data.mdb", "r+b") as f:
        fd = f.fileno()
        meta = lmdb_file.committed_meta(str(path), fd)
        root = os.pread(fd, meta.psize, meta.main_root * meta.psize)
        assert struct.unpack_from("=H", root, 10)[0] & lmdb_file.P_BRANCH
        node = struct.unpack_from("=H", root, lmdb_file.PAGE_HEADER)[0]
        bad = meta.last_pg + 1000
        os.pwrite(fd, struct.pack("=HHH", bad & 0xFFFF, bad >> 16 & 0xFFFF, bad >> 32),
                  meta.main_root * meta.psize + node)
    rep = _read_and_check("lmdb", path, expected)
    assert any(e.startswith("CorruptStoreError") and "PageNotFoundError" in e
               for e in _errors(rep)), rep


def test_lmdb_free_pages_at_the_end_may_be_missing(tmp_path):
    """LMDB never writes a page freed by the transaction that allocated it, so a file may
    end before its last page when the pages past the end are free: that is no damage."""
    import lmdb

    env = lmdb.open(str(tmp_path / "db"), map_size=1 << 26)
    with env.begin(write=True) as t:
        for i in range(200):
            t.put(b"a%04d" % i, b"x" * 100)
    with env.begin(write=True) as t:
        t.put(b"big", b"y" * 200_000)
    with env.begin(write=True) as t:
        t.delete(b"big")
    for n in range(6):
        with env.begin(write=True) as t:
            t.put(b"a%04d" % n, b"z" * 100)
    env.close()
    with open(tmp_path / "db" / "data.mdb", "rb") as f:
        meta = lmdb_file.committed_meta(str(tmp_path / "db"), f.fileno())
        free = lmdb_file.free_pages(f.fileno(), meta, os.fstat(f.fileno()).st_size)
    assert free is not None
    tail = 0
    while meta.last_pg - tail in free:
        tail += 1
    assert tail, "the setup should leave free pages at the end of the file"
    read = ("import sys, tensorkv\nwith tensorkv.open_store(sys.argv[1], readonly=True) as s:\n"
            "    print(s.count(), len(list(s.scan())))")
    for cut, ok in ((tail, True), (tail + 1, False)):
        copy = tmp_path / f"cut{cut}"
        shutil.copytree(tmp_path / "db", copy)
        os.truncate(copy / "data.mdb", (meta.last_pg + 1 - cut) * meta.psize)
        child = _run("-c", read, f"lmdb://{copy}")
        assert child.returncode >= 0, child.stderr
        if ok:
            assert child.returncode == 0 and child.stdout.split() == ["200", "200"], child.stderr
        else:
            assert "CorruptStoreError" in child.stderr and "truncated" in child.stderr


# ------------------------------------------------------------------ LSM: missing CURRENT

@pytest.mark.parametrize("scheme", ["rocksdb", "leveldb"])
def test_lsm_missing_current_is_not_a_new_store(damaged, scheme):
    """A writer must not start an empty store beside the tables of a lost CURRENT."""
    path, _ = damaged(scheme)
    os.remove(path / "CURRENT")
    before = sorted(os.listdir(path))
    with pytest.raises(CorruptStoreError, match="CURRENT is missing") as info:
        tensorkv.open_store(f"{scheme}://{path}")  # a writer, create=True
    assert "repair" in str(info.value)
    assert sorted(os.listdir(path)) == before
