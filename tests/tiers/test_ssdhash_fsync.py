"""``flush()`` makes durable what it acknowledges: every write is fsynced before it returns.

:class:`SyncRecorder` wraps the real system calls (``os.write``, ``os.pwrite``,
``os.ftruncate``, ``os.open`` with ``O_CREAT``, ``os.mkdir``, ``os.rename``, ``os.replace``,
``os.unlink``, ``os.fsync``, ``os.fdatasync``): each wrapper calls the real function and notes
which file (device, inode) it changed or synced. A directory counts as a file whose contents
are its entries, so creating, renaming or removing a file dirties its directory, and only an
fsync of the directory makes that durable. When ``flush()`` (or ``close()``) returns, no file
that still exists may hold a change that no later fsync covered.

The PMEM tier writes through a shared mapping, which no system call shows: its mappings are
made by a :class:`RecordingMmap`, whose ``flush`` (``msync``) notes the mapping's bytes, and
when the tier's ``flush()`` returns they must equal the bytes the last whole-mapping ``msync``
saw (every change before it was synced).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import stat
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tensorkv.embedding import EmbeddingTable
from tensorkv.embedding.tiers import pmem as pmem_mod
from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.embedding.tiers.pmem import PMEMTier
from tensorkv.embedding.tiers.ssdhash import SSDHashTier
from tensorkv.testing.tiers import make_records

LAY = RecordLayout(8, num_slots=1)
FileId = tuple[int, int]


def _file_id(st: os.stat_result) -> FileId:
    return st.st_dev, st.st_ino


class SyncRecorder:
    """Record which files the process changed and which it fsynced, through the real calls.

    ``dirty`` maps each file changed since its last fsync to a description of the change.
    Files under ``root`` only (and ``root`` itself, and its parent for ``root``'s own entry);
    directory entries for which ``exempt(path)`` is true are not recorded.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: str,
                 exempt: Callable[[str], bool] = lambda path: False) -> None:
        self.root = os.path.abspath(root)
        self.dirty: dict[FileId, str] = {}
        self.syncs = 0
        self.writes = 0
        real = {name: getattr(os, name) for name in (
            "open", "write", "pwrite", "ftruncate", "fsync", "fdatasync", "mkdir", "rename",
            "replace", "unlink")}
        self.real = real

        def mine(path: Any) -> bool:
            p = os.path.abspath(os.fspath(path))
            return p == self.root or p.startswith(self.root + os.sep)

        def entry_changed(path: Any, what: str) -> None:
            if exempt(os.fspath(path)):
                return
            parent = os.path.dirname(os.path.abspath(os.fspath(path)))
            self.dirty[_file_id(os.stat(parent))] = f"{what} {os.fspath(path)!r}"

        def fd_changed(fd: int, what: str) -> None:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                self.dirty[_file_id(st)] = f"{what} (fd {fd})"
                self.writes += 1

        def open_(path: Any, flags: int, *args: Any, **kw: Any) -> int:
            created = bool(flags & os.O_CREAT) and mine(path) and not os.path.exists(path)
            fd = real["open"](path, flags, *args, **kw)
            if created:
                entry_changed(path, "created")
            if mine(path) and flags & os.O_TRUNC:
                fd_changed(fd, "truncated")
            return fd

        def write(fd: int, data: Any) -> int:
            n = real["write"](fd, data)
            fd_changed(fd, "write")
            return n

        def pwrite(fd: int, data: Any, offset: int) -> int:
            n = real["pwrite"](fd, data, offset)
            fd_changed(fd, f"pwrite at {offset}")
            return n

        def ftruncate(fd: int, length: int) -> None:
            real["ftruncate"](fd, length)
            fd_changed(fd, f"ftruncate to {length}")

        def sync(name: str) -> Callable[[int], None]:
            def fn(fd: int) -> None:
                real[name](fd)
                self.synced(_file_id(os.fstat(fd)))
            return fn

        def mkdir(path: Any, *args: Any, **kw: Any) -> None:
            real["mkdir"](path, *args, **kw)
            if mine(path):
                entry_changed(path, "made directory")

        def rename(name: str) -> Callable[..., None]:
            def fn(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
                real[name](src, dst, *args, **kw)
                if mine(src) or mine(dst):
                    entry_changed(src, f"{name}d away")
                    entry_changed(dst, f"{name}d to")
            return fn

        def unlink(path: Any, *args: Any, **kw: Any) -> None:
            real["unlink"](path, *args, **kw)
            if mine(path):
                entry_changed(path, "unlinked")

        for name, fn in (("open", open_), ("write", write), ("pwrite", pwrite),
                         ("ftruncate", ftruncate), ("fsync", sync("fsync")),
                         ("fdatasync", sync("fdatasync")), ("mkdir", mkdir),
                         ("rename", rename("rename")), ("replace", rename("replace")),
                         ("unlink", unlink)):
            monkeypatch.setattr(os, name, fn)

    def synced(self, fid: FileId) -> None:
        """Note that file ``fid`` was synced: its changes so far are durable."""
        self.dirty.pop(fid, None)
        self.syncs += 1

    def existing(self) -> set[FileId]:
        """Every file and directory under ``root`` now, plus ``root``'s parent."""
        out = {_file_id(os.stat(os.path.dirname(self.root)))}
        for dirpath, _, files in os.walk(self.root):
            out.add(_file_id(os.stat(dirpath)))
            out.update(_file_id(os.stat(os.path.join(dirpath, f))) for f in files)
        return out

    def unsynced(self) -> list[str]:
        """Changes to files that still exist and that no fsync has covered since."""
        live = self.existing()
        return sorted(what for fid, what in self.dirty.items() if fid in live)

    def assert_all_synced(self, when: str) -> None:
        left = self.unsynced()
        assert not left, f"{when} returned with unsynced changes: {left}"


def scratch_file(path: str) -> bool:
    """SSDHASH's ``free-*.dat`` files: scratch space that an open deletes wherever it finds
    them, so their removal (at close) need not be durable."""
    name = os.path.basename(path)
    return name.startswith("free-") and name.endswith(".dat")


@pytest.fixture
def recorder(tmp_path, monkeypatch) -> SyncRecorder:
    return SyncRecorder(monkeypatch, str(tmp_path / "tier"), exempt=scratch_file)


def open_ssdhash(path: Any, **kw: Any) -> SSDHashTier:
    kw.setdefault("segment_bytes", 8192)  # 78 records a segment: rolls and compactions
    kw.setdefault("buffer_bytes", 2048)
    return SSDHashTier(path, LAY, **kw)


def rounds(seed: int = 0) -> Iterator[tuple[str, Callable[[SSDHashTier], None]]]:
    """Named write steps that together roll, compact, snapshot and reuse segment files."""
    rng = np.random.default_rng(seed)
    keys = np.arange(400, dtype=np.int64)
    yield "a put that stays in the write buffer", lambda t: t.put(keys[:3], make_records(
        LAY, keys[:3], 1))
    yield "puts that roll segments", lambda t: t.put(keys, make_records(LAY, keys, 2))
    for i in range(3, 9):  # overwrites: dead records, compaction, reused segment files
        sel = rng.choice(keys, 150, replace=False)
        yield f"overwrite {i}", lambda t, sel=sel, i=i: t.put(sel, make_records(LAY, sel, i))
    yield "tombstones", lambda t: t.delete(keys[::7])
    yield "a put larger than the buffer", lambda t: t.put(keys[:200], make_records(
        LAY, keys[:200], 9))


@pytest.mark.parametrize("snapshot_min_bytes", [1 << 30, 1], ids=["no-snapshot", "snapshots"])
def test_flush_fsyncs_every_write_it_acknowledges(tmp_path, recorder, snapshot_min_bytes):
    """After each step, ``flush()`` returns with every file change fsynced."""
    t = open_ssdhash(tmp_path / "tier", snapshot_min_bytes=snapshot_min_bytes)
    t.flush()
    recorder.assert_all_synced("the first flush()")
    try:
        for name, step in rounds():
            before = recorder.writes
            step(t)
            t.flush()
            recorder.assert_all_synced(f"flush() after {name}")
            assert recorder.writes > before, f"{name} wrote nothing: the recorder saw no write"
        st = t.stats()
        assert st["compactions"] > 0 and st["segments"] > 1, st
        assert st["reused_segments"] > 0 or snapshot_min_bytes > 1, st
        if snapshot_min_bytes == 1:
            assert st["snapshots"] > 0, st
        for _, step in rounds(1):  # no flush in between: close() syncs everything
            step(t)
    finally:
        t.close()
    recorder.assert_all_synced("close()")
    assert recorder.syncs > 0


def test_flush_after_unflushed_writes_syncs_them_all(tmp_path, recorder):
    """Many steps, one flush: everything written since the previous flush is synced."""
    t = open_ssdhash(tmp_path / "tier")
    try:
        for _, step in rounds(2):
            step(t)
        pending, writes = recorder.unsynced(), recorder.writes
        t.flush()
        recorder.assert_all_synced("flush()")
        assert pending or recorder.writes > writes, "flush() had nothing to make durable"
    finally:
        t.close()


@pytest.mark.parametrize("storage", ["DRAM_SSDHASH", "DRAM_PMEM_SSDHASH"])
def test_table_flush_syncs_its_tiers(tmp_path, recorder, pmem_recording, storage):
    """A tiered table's ``flush()``: the rows moved down are durable when it returns."""
    rb = LAY.record_bytes
    sizes = [16 * rb] + ([64 * rb] if "PMEM" in storage else [])
    with EmbeddingTable(LAY.dim, optimizer="adagrad", storage=storage,
                        storage_path=str(tmp_path / "tier"), storage_size=sizes) as t:
        rng = np.random.default_rng(3)
        for step in range(30):
            keys = rng.choice(500, 40, replace=False).astype(np.int64)
            t.lookup(keys)
            t.apply_gradients(keys, rng.standard_normal((40, LAY.dim)).astype(np.float32))
            if step % 10 == 9:
                t.flush()
                recorder.assert_all_synced(f"table.flush() at step {step}")
                for tier in t._rows.chain.lowers:
                    if isinstance(tier[0], PMEMTier):
                        assert_mapping_synced(tier[0])
        assert t.stats()["tiers"][-1]["rows"] > 0


# --------------------------------------------------------------------------- PMEM
class RecordingMmap(mmap.mmap):
    """A real mapping whose ``flush()`` (msync) notes a digest of the bytes it synced.

    A whole-mapping ``msync(MS_SYNC)`` is, on Linux, ``fdatasync`` of the mapped file (it runs
    ``vfs_fsync_range(file, ..., datasync=1)``, which writes a changed file size too), so it
    also counts as a sync of the file for :attr:`listener` (``SyncRecorder.synced``).
    """

    synced: bytes | None = None
    listener: Callable[[FileId], None] | None = None

    def __new__(cls, fileno: int, length: int, *args: Any, **kw: Any) -> RecordingMmap:
        obj = super().__new__(cls, fileno, length, *args, **kw)
        obj.file_id = _file_id(os.fstat(fileno))
        return obj

    def flush(self, *args: Any) -> None:  # type: ignore[override]
        super().flush(*args)
        if not args:  # the whole mapping
            self.synced = hashlib.sha256(memoryview(self)).digest()
            if self.listener is not None:
                self.listener(self.file_id)


def assert_mapping_synced(tier: PMEMTier) -> None:
    mm = tier._mm
    assert isinstance(mm, RecordingMmap), "the tier's mapping was not made by RecordingMmap"
    assert mm.synced is not None, "flush() did not msync the mapping"
    assert hashlib.sha256(memoryview(mm)).digest() == mm.synced, (
        "the mapping changed after its last msync: flush() returned with unsynced rows"
    )


@pytest.fixture
def pmem_recording(monkeypatch, recorder) -> None:
    """PMEM tiers map their files with :class:`RecordingMmap`, reporting to ``recorder``."""
    monkeypatch.setattr(pmem_mod, "mmap", types.SimpleNamespace(mmap=RecordingMmap))
    monkeypatch.setattr(RecordingMmap, "listener", recorder.synced)


def test_pmem_flush_syncs_the_mapping_and_the_file(tmp_path, recorder, pmem_recording):
    """PMEM ``flush()`` msyncs every change made through the mapping, growth included.

    The new file's directory entry and its header are fsynced too (the recorder).
    """
    recorder.real["mkdir"](tmp_path / "tier")  # the caller's directory, made before
    t = PMEMTier(tmp_path / "tier" / "rows.pmem", LAY, capacity=16)
    try:
        rng = np.random.default_rng(4)
        keys = np.arange(300, dtype=np.int64)
        for i, n in enumerate((5, 40, 120, 300)):  # 16 slots at first: the file grows
            sel = rng.choice(keys, n, replace=False)
            t.put(sel, make_records(LAY, sel, i))
            t.delete(sel[: n // 4])
            before = t._mm.synced
            t.flush()
            assert t._mm.synced != before or n == 0
            assert_mapping_synced(t)
            recorder.assert_all_synced(f"flush() after put {i}")
        assert t.stats()["grows"] > 0
    finally:
        t.close()
    recorder.assert_all_synced("close()")
