"""Page hints (tensorkv.pages): they change speed only, never contents."""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np
import pytest

from tensorkv import pages
from tensorkv.stores import open_store

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux only")


@linux
def test_madvise_accepts_arrays_and_refuses_bad_advice():
    a = np.zeros(4 * mmap.PAGESIZE + 100, np.uint8)
    assert pages.madvise([a], pages.MADV_NOHUGEPAGE)
    assert pages.madvise_ranges([(a.ctypes.data, a.ctypes.data + a.nbytes)], pages.MADV_NORMAL)
    assert not pages.madvise([a], 9999)  # EINVAL: reported, not raised
    assert pages.madvise([a[:10]], 9999)  # no whole page inside: nothing to advise


@linux
def test_start_writeback_queues_dirty_pages_and_ignores_errors(tmp_path):
    import os

    path = tmp_path / "f"
    data = np.random.default_rng(1).integers(0, 255, 3 * mmap.PAGESIZE, np.uint8)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, data.tobytes(), 0)
        assert pages.start_writeback(fd, 0, data.nbytes)
        assert pages.start_writeback(fd)  # to the end of the file
        os.fsync(fd)
        assert os.pread(fd, data.nbytes, 0) == data.tobytes()  # contents untouched
        assert not pages.start_writeback(fd, -1, 10)  # EINVAL: reported, not raised
    finally:
        os.close(fd)
    assert not pages.start_writeback(fd)  # EBADF on the closed descriptor


def test_fresh_pages_prepared_copies_are_exact():
    src = np.random.default_rng(0).random((1 << 16, 8), dtype=np.float32)
    dst = np.empty_like(src)
    fp = pages.FreshPages()
    fp.track(dst)
    for lo in range(0, src.shape[0], 10_000):
        d, s = dst[lo : lo + 10_000], src[lo : lo + 10_000]
        fp.prepare(d)
        d[:] = s
    fp.release()
    np.testing.assert_array_equal(dst, src)


@linux
def test_file_mappings_finds_the_lmdb_map_and_bulk_reads_restore_the_advice(tmp_path):
    st = open_store(f"lmdb://{tmp_path}/db")
    try:
        st.put_many([(b"k%d" % i, bytes([i]) * 300_000) for i in range(8)])
        maps = pages.file_mappings(str(tmp_path / "db" / "data.mdb"))
        assert maps and all(hi > lo for lo, hi in maps)
        assert pages.file_mappings(str(tmp_path / "nothing")) == []
        with st.get_many_buffers([b"k%d" % i for i in range(8)] + [b"absent"]) as vals:
            assert st._shared.bulk_readers == 1  # large values: readahead on while lent
            assert [bytes(v[:1]) for v in vals[:8]] == [bytes([i]) for i in range(8)]
            assert vals[8] is None
        assert st._shared.bulk_readers == 0
        with st.iter_buffers([b"absent", b"k3", b"k5"]) as it:
            assert next(it) is None
            assert st._shared.bulk_readers == 0  # nothing large lent yet
            assert bytes(next(it)[:1]) == b"\x03"
            assert st._shared.bulk_readers == 1
        assert st._shared.bulk_readers == 0
        assert st.get_many([b"k1", b"k2"])[1][:2] == b"\x02\x02"
        assert st._shared.bulk_readers == 0
    finally:
        st.close()


_MALLOC_PROBE = """
import ctypes, sys
from tensorkv import open_store, pages

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
store = open_store(sys.argv[1])
store.put_many([(b"small", b"x" * 100)])
before = pages.freed_memory_decided()
store.put_many([(b"large", b"x" * (1 << 20))])  # LMDB mallocs a block for this value
mapped = libc.mallinfo2().hblks
block = libc.malloc(16 << 20)
print(before, pages.freed_memory_decided(), libc.mallinfo2().hblks - mapped)
libc.free(block)
"""


@pytest.mark.skipif(not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"),
                    reason="mallopt thresholds are glibc's")
@pytest.mark.parametrize("retain", ["", "0"])
def test_large_lmdb_writes_let_glibc_keep_freed_blocks(tmp_path, retain):
    """After LMDB's first large write a 16 MiB block comes from the heap, not its own map."""
    import subprocess

    env = {**os.environ, "TENSORKV_MALLOC_RETAIN": retain}
    for k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
              "GLIBC_TUNABLES"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", _MALLOC_PROBE, f"lmdb://{tmp_path}/s"],
                         capture_output=True, text=True, env=env, timeout=120, check=True)
    small_first, decided, new_maps = out.stdout.split()
    assert (small_first, decided) == ("False", "True")  # small values decide nothing
    assert new_maps == ("1" if retain == "0" else "0")
