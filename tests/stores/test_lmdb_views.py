"""LMDB zero-copy views that outlive the call: pinned snapshots, resizes, reuse, close."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from tensorkv.stores import lmdb_views, open_store
from tensorkv.stores.lmdb import LMDBStore

KiB = 1024


@pytest.fixture
def store(tmp_path):
    st = LMDBStore(str(tmp_path / "env"), map_size=256 * KiB, sync=False)
    yield st
    st.close()


def test_views_are_read_only_and_equal(store):
    big = np.arange(100_000, dtype=np.uint8).tobytes()
    store.put_many([(b"a", b"abc"), (b"big", big), (b"empty", b"")])
    a, b, e, none, long = store.get_many_views([b"a", b"big", b"empty", b"zz", b"k" * 600])
    assert bytes(a) == b"abc" and bytes(b) == big and e.size == 0
    assert none is None and long is None  # absent, and a key LMDB cannot hold
    assert not a.flags.writeable and not b.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        b[0] = 1
    assert isinstance(b.base, lmdb_views._View)


def test_a_view_keeps_its_pages_through_deletes_writes_and_resizes(store):
    val = np.random.default_rng(0).integers(0, 255, 300 * KiB, dtype=np.uint8).tobytes()
    store.put(b"v", val)
    (v,) = store.get_many_views([b"v"])
    store.delete(b"v")  # its pages are freed, but pinned by the view's snapshot
    for i in range(40):  # writes that would reuse free pages, and grow the map
        store.put_many([(b"w%d" % i, bytes([i]) * (50 * KiB))])
    assert store.stats()["resizes"] >= 1
    assert bytes(v) == val
    assert store.get(b"v") is None


def test_one_pin_per_snapshot_and_dead_pins_are_ended(store):
    store.put_many([(b"a", b"1" * 5000), (b"b", b"2" * 5000)])
    (a,) = store.get_many_views([b"a"])
    (b,) = store.get_many_views([b"b"])
    assert a.base.pin is b.base.pin  # same snapshot: one read transaction
    store.put(b"c", b"3")
    (c,) = store.get_many_views([b"c"])
    assert c.base.pin is not a.base.pin
    state = store._shared.views
    assert len(state.pins) == 2
    del a, b
    gc.collect()
    assert len(state.pins) == 1 and len(state.dead_txns) == 1
    store.get(b"c")  # entering the store ends the dead pin's transaction
    assert not state.dead_txns
    assert bytes(c) == b"3"


def test_views_survive_close_and_compaction(tmp_path):
    st = LMDBStore(str(tmp_path / "c"), sync=False)
    st.put_many([(b"k%d" % i, bytes([i]) * 9000) for i in range(20)])
    st.delete_many([b"k%d" % i for i in range(10)])
    (v,) = st.get_many_views([b"k15"])
    st.compact()  # a new file: the view keeps the old one mapped
    (w,) = st.get_many_views([b"k15"])
    assert bytes(v) == bytes(w) == bytes([15]) * 9000
    st.close()
    assert bytes(w[:3]) == bytes([15]) * 3


def test_other_backends_return_read_only_arrays(tmp_path):
    st = open_store("memory://views-test")
    st.put(b"a", b"xyz")
    a, none = st.get_many_views([b"a", b"b"])
    assert bytes(a) == b"xyz" and none is None and not a.flags.writeable
    st.close()


def test_map_base_finds_only_mapped_files(tmp_path):
    assert lmdb_views.map_base(str(tmp_path / "nothing"), 0) is None


def test_only_views_whose_value_moved_are_copied_out(store):
    store.put_many([(b"keep", b"k" * 20000), (b"gone", b"g" * 20000)])
    keep, gone = store.get_many_views([b"keep", b"gone"])
    store.delete(b"gone")  # a newer snapshot: "keep" is where it was, "gone" is not
    state = store._shared.views
    assert lmdb_views.freeze_moved(state, store.path, store._env) == 1
    assert bytes(keep) == b"k" * 20000 and bytes(gone) == b"g" * 20000
    store.put_many([(b"x%d" % i, b"x" * 20000) for i in range(20)])  # reuses gone's pages
    assert bytes(gone) == b"g" * 20000


def test_a_failed_map_is_reported(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 4096)
    with pytest.raises(OSError, match="mmap of"):
        lmdb_views.FileMap(str(path), 1 << 62)
