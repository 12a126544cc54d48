"""LMDB's data file read without LMDB: meta pages checked before the file is mapped.

LMDB maps ``data.mdb`` and follows page numbers into the map. A page past the end of a
truncated file is a SIGBUS that kills the process, and LMDB itself checks only the meta
pages' magic number and version. :func:`check_data_file` reads both meta pages with
``pread`` (never ``mmap``), picks the committed one as LMDB does (the higher transaction
id), and compares the last page it needs with the size of the file.

Layout (``mdb.c`` of LMDB 0.9, the version py-lmdb bundles; 64-bit builds, native byte
order):

- page header ``MDB_page``, 16 bytes: ``mp_pgno`` u64 @0, ``mp_flags`` u16 @10,
  ``mp_lower`` u16 @12 (end of the ``mp_ptrs`` u16 array of node offsets that starts @16);
  ``P_BRANCH`` 0x01, ``P_LEAF`` 0x02, ``P_META`` 0x08.
- ``MDB_meta`` after the header of pages 0 and 1: ``mm_magic`` u32 @16 (0xBEEFC0DE),
  ``mm_version`` u32 @20 (1), two ``MDB_db`` of 48 bytes (free pages @40, main @88; in each
  ``md_pad`` u32 @+0, which in the free DB holds the page size, and ``md_root`` u64 @+40),
  ``mm_last_pg`` u64 @136, ``mm_txnid`` u64 @144.
- ``MDB_node``: ``mn_lo``, ``mn_hi`` (data size, or in branch pages with ``mn_flags`` the
  child page number), ``mn_flags``, ``mn_ksize`` (u16 each), then key and data. With
  ``F_BIGDATA`` (0x01) the data is the u64 number of an overflow page whose content starts
  after its 16-byte header. Values of the free DB are ID lists: a u64 count, then the pages.

A file may legitimately end before its last page when the pages at its end are free (LMDB
never writes a page that was freed in the transaction that allocated it), so when the file
is short the free DB is read too, and only live pages past the end count as truncation.

Also the file-level steps of ``LMDBStore.compact``: :func:`restamp_metas`,
:func:`lock_descriptor`, :func:`fsync_directory`.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from tensorkv.errors import UnsupportedOperationError
from tensorkv.stores.embedded import corrupt_error

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
PAGE_HEADER = 16
META_END = PAGE_HEADER + 136  # the meta ends with mm_txnid at 144..152
P_BRANCH, P_LEAF, P_META = 0x01, 0x02, 0x08
F_BIGDATA = 0x01
P_INVALID = (1 << 64) - 1
_U16 = struct.Struct("=H")
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_NODE = struct.Struct("=HHHH")

#: Whether this interpreter's layout is the one above (a 64-bit build) and it has pread.
SUPPORTED = struct.calcsize("P") == 8 and hasattr(os, "pread")


@dataclass(frozen=True)
class Meta:
    """The fields of one meta page that the checks need."""

    slot: int
    psize: int
    free_root: int
    main_root: int
    last_pg: int
    txnid: int


def parse_meta(buf: bytes, slot: int) -> Meta | str:
    """The meta in the first :data:`META_END` bytes of page ``slot``, or what is wrong.

    What is wrong is a phrase that follows "meta page N", such as ``"is cut short"``.
    """
    if len(buf) < META_END:
        return "is cut short"
    flags = _U16.unpack_from(buf, 10)[0]
    magic, version = _U32.unpack_from(buf, 16)[0], _U32.unpack_from(buf, 20)[0]
    if not flags & P_META or magic != MAGIC:
        return f"holds no LMDB meta page (magic number {magic:#x}, not {MAGIC:#x})"
    if version != DATA_VERSION:
        return f"has data format version {version}; this LMDB reads version {DATA_VERSION}"
    psize = _U32.unpack_from(buf, 40)[0]
    if not 256 <= psize <= 65536 or psize & (psize - 1):
        return f"has page size {psize}, not a power of two between 256 and 65536"
    return Meta(
        slot=slot,
        psize=psize,
        free_root=_U64.unpack_from(buf, 80)[0],
        main_root=_U64.unpack_from(buf, 128)[0],
        last_pg=_U64.unpack_from(buf, 136)[0],
        txnid=_U64.unpack_from(buf, 144)[0],
    )


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1_000_000 else f"{n} bytes"


def read_metas(fd: int) -> tuple[Meta | str, Meta | str]:
    """Both meta pages of the open data file ``fd`` (page 1 is found with page 0's size).

    When page 0 is damaged, page 1 is looked for at every possible page size.
    """
    m0 = parse_meta(os.pread(fd, META_END, 0), 0)
    if isinstance(m0, Meta):
        return m0, parse_meta(os.pread(fd, META_END, m0.psize), 1)
    for psize in (4096, *(1 << n for n in range(8, 17))):
        m1 = parse_meta(os.pread(fd, META_END, psize), 1)
        if isinstance(m1, Meta) and m1.psize == psize:
            return m0, m1
    return m0, "is not found at any page size"


def committed_meta(store: str, fd: int) -> Meta:
    """The meta LMDB would use, or CorruptStoreError when either meta page is damaged.

    LMDB refuses to open a file with a damaged meta page, whichever one it is.
    """
    m0, m1 = read_metas(fd)
    bad = [f"meta page {i} {m}" for i, m in enumerate((m0, m1)) if isinstance(m, str)]
    if bad:
        head = "data.mdb has no valid meta page: " if len(bad) == 2 else "in data.mdb, "
        raise corrupt_error("lmdb", store, head + "; ".join(bad))
    assert isinstance(m0, Meta) and isinstance(m1, Meta)
    if m0.psize != m1.psize:
        raise corrupt_error(
            "lmdb", store, f"the meta pages disagree on the page size ({m0.psize}, {m1.psize})"
        )
    return m1 if m1.txnid > m0.txnid else m0


def free_pages(fd: int, meta: Meta, size: int) -> set[int] | None:
    """Every page the free DB of ``meta`` lists, or None where it cannot be read in full."""
    psize = meta.psize
    out: set[int] = set()
    stack = [] if meta.free_root == P_INVALID else [meta.free_root]
    budget = size // psize  # no tree has more pages than the file
    while stack:
        pg = stack.pop()
        budget -= 1
        if budget < 0 or (pg + 1) * psize > size:
            return None
        page = os.pread(fd, psize, pg * psize)
        flags, lower = _U16.unpack_from(page, 10)[0], _U16.unpack_from(page, 12)[0]
        n = (lower - PAGE_HEADER) // 2
        if n < 0 or not flags & (P_BRANCH | P_LEAF):
            return None
        for off in struct.unpack_from(f"={n}H", page, PAGE_HEADER):
            if off + _NODE.size > psize:
                return None
            lo, hi, nflags, ksize = _NODE.unpack_from(page, off)
            if flags & P_BRANCH:
                stack.append(lo | hi << 16 | nflags << 32)
                continue
            dsize, at = lo | hi << 16, off + _NODE.size + ksize
            if nflags & F_BIGDATA:
                if at + 8 > psize:
                    return None
                start = _U64.unpack_from(page, at)[0] * psize + PAGE_HEADER
                if start + dsize > size:
                    return None
                data = os.pread(fd, dsize, start)
            else:
                data = page[at : at + dsize]
            if len(data) != dsize or dsize < 8 or dsize % 8:
                return None
            count = _U64.unpack_from(data, 0)[0]
            if count != dsize // 8 - 1:
                return None
            out.update(struct.unpack_from(f"={count}Q", data, 8))
    return out


def _settled_size(store: str) -> int | None:
    """The size of ``data.mdb`` once no process is writing a new environment into it.

    LMDB's first opener holds a write lock on byte 0 of ``lock.mdb`` while it creates
    ``data.mdb`` and writes its meta pages; waiting for a read lock there tells a file being
    created (it has its pages afterwards) from one left empty. Only called for an empty file,
    which no environment of this process can have open, so closing the lock file here drops
    no lock of this process's. None: no ``data.mdb``.
    """
    data = os.path.join(store, "data.mdb")
    try:
        size = os.stat(data).st_size
    except OSError:
        return None
    if size:
        return size
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock to wait for
        return 0
    try:
        fd = os.open(os.path.join(store, "lock.mdb"), os.O_RDONLY)
    except OSError:
        return 0  # no lock file: no environment was ever being created here
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH, 1, 0, os.SEEK_SET)  # waits for a creator to finish
        try:
            return os.stat(data).st_size
        except OSError:
            return None
    finally:
        os.close(fd)  # releases the read lock


def check_data_file(store: str, *, empty_ok: bool = True) -> None:
    """Refuse a ``data.mdb`` that LMDB would map past its end (CorruptStoreError).

    Does nothing when the file is missing (LMDB creates it, or its own open reports it) or on
    a build whose layout this module does not know. An empty file is refused unless
    ``empty_ok``: LMDB would write a new environment into it, so an open that must find an
    existing store (``create=False``, read-only) would read, or make, an empty one.

    Parameters
    ----------
    store
        The environment directory.
    empty_ok
        Whether an empty ``data.mdb`` may be initialised (an open that may create a store).
    """
    if not empty_ok and _settled_size(store) == 0:
        raise corrupt_error(
            "lmdb", store, "data.mdb is empty (0 bytes), so it holds no LMDB environment "
            "(nothing was read or written; if no data was ever saved there, delete the "
            "directory to start a new store)")
    if not SUPPORTED:
        return
    try:
        fd = os.open(os.path.join(store, "data.mdb"), os.O_RDONLY)
    except OSError:
        return  # missing or unreadable: LMDB's own open reports it
    try:
        # the size after the metas: a writer extends the file before it commits a meta
        if not os.fstat(fd).st_size:
            return
        meta = committed_meta(store, fd)
        size = os.fstat(fd).st_size
        need = (meta.last_pg + 1) * meta.psize
        for name, root in (("main", meta.main_root), ("free-page", meta.free_root)):
            if root != P_INVALID and root > meta.last_pg:
                raise corrupt_error(
                    "lmdb", store, f"the committed meta page (meta page {meta.slot}) puts the "
                    f"{name} tree's root at page {root}, past its last page {meta.last_pg}"
                )
        if size >= need:
            return
        free = free_pages(fd, meta, size)
        if free is None or not all(p in free for p in range(size // meta.psize, meta.last_pg + 1)):
            raise corrupt_error(
                "lmdb", store, f"data.mdb is {_size(size)}, its last committed page needs "
                f"{_size(need)}: the file was truncated"
            )
    finally:
        os.close(fd)


def restamp_metas(path: str, txnid: int) -> None:
    """Make a compacted copy continue the transaction ids of the environment it came from.

    ``mdb_env_copy2(MDB_CP_COMPACT)`` writes its tree into meta page 1 with transaction id
    1. Processes that attach to the environment's lock file later take the current id from
    it (not from the data file) and read meta page ``id & 1``; so both meta pages get the
    copy's tree, page ``txnid & 1`` with ``txnid`` and the other with ``txnid - 1``. The file
    is fsynced.
    """
    with open(path, "r+b") as f:
        fd = f.fileno()
        m0, m1 = read_metas(fd)
        if not isinstance(m0, Meta) or not isinstance(m1, Meta):
            raise corrupt_error("lmdb", os.path.dirname(path), f"the compacted copy {path!r} "
                                "has no valid meta page")
        src = m1 if m1.txnid > m0.txnid else m0
        committed = bytearray(os.pread(fd, META_END, src.slot * src.psize))
        if txnid:
            for slot in (0, 1):
                _U64.pack_into(committed, 0, slot)
                _U64.pack_into(committed, 144, txnid if slot == txnid & 1 else txnid - 1)
                os.pwrite(fd, bytes(committed), slot * src.psize)
        os.fsync(fd)


def lock_descriptor(lock_path: str) -> int:
    """LMDB's own descriptor of ``lock_path`` in this process (Linux: ``/proc/self/fd``).

    POSIX record locks belong to the process: closing any descriptor of the file drops all
    of them, LMDB's included, so the lock is changed through LMDB's descriptor, never
    through one opened (and later closed) here.
    """
    st = os.stat(lock_path)
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        names = []
    for name in names:
        try:
            fst = os.fstat(int(name))
        except (OSError, ValueError):
            continue
        if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
            return int(name)
    raise UnsupportedOperationError(
        f"cannot compact the lmdb store {os.path.dirname(lock_path)!r} here: finding LMDB's "
        "lock descriptor needs /proc/self/fd (Linux); copy it with `mdb_copy -c` while no "
        "process has it open instead"
    )
