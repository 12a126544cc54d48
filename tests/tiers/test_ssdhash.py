import os

import numpy as np
import pytest

from tensorkv.embedding.arena import RowArena
from tensorkv.embedding.tiers import ssdhash_files as sf
from tensorkv.embedding.tiers.base import RecordLayout, RowSink
from tensorkv.embedding.tiers.ssdhash import SSDHashTier
from tensorkv.errors import ConfigError, CorruptRecordError, StoreLockedError
from tensorkv.testing.tiers import TierTests, make_records


class TestSSDHashTier(TierTests):
    @pytest.fixture
    def make_tier(self, tmp_path):
        # Small segments and buffer so rolls, buffered reads and compaction all happen.
        return lambda layout: SSDHashTier(
            tmp_path / "t", layout, segment_bytes=4096, buffer_bytes=1024
        )


class TestSSDHashTierAsync(TierTests):
    @pytest.fixture
    def make_tier(self, tmp_path):
        return lambda layout: SSDHashTier(
            tmp_path / "t", layout, segment_bytes=8192, async_compaction=True
        )


LAY = RecordLayout(8, num_slots=1)


def open_tier(path, **kw):
    kw.setdefault("segment_bytes", 8192)
    kw.setdefault("buffer_bytes", 2048)
    return SSDHashTier(path, LAY, **kw)


def segfiles(path):
    return sf.list_segments(str(path))


def test_segments_roll_and_compaction_reclaims(tmp_path):
    t = open_tier(tmp_path)
    keys = np.arange(200, dtype=np.int64)
    for i in range(10):
        t.put(keys, make_records(LAY, keys, i))
    s = t.stats()
    assert s["compactions"] > 0
    # garbage stays bounded: under the threshold's share of all records, plus the head
    assert s["dead_records"] <= 0.5 * (s["rows"] + s["dead_records"]) + t.segment_rows
    assert t.check() == []
    _, got = t.get(keys)
    np.testing.assert_array_equal(got, make_records(LAY, keys, 9))
    t.close()


def test_async_compaction_thread(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORKV_SSDHASH_ASYNC_COMPACTION", "1")
    t = open_tier(tmp_path)
    assert t.async_compaction
    keys = np.arange(200, dtype=np.int64)
    for i in range(10):
        t.put(keys, make_records(LAY, keys, i))
    import time

    deadline = time.monotonic() + 60  # wait for the thread (the test does not assert on time)
    while not t.stats()["compactions"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert t.stats()["compactions"] > 0
    assert t.check() == []
    t.close()
    t = open_tier(tmp_path)
    _, got = t.get(keys)
    np.testing.assert_array_equal(got, make_records(LAY, keys, 9))
    t.close()


def test_reopen_replays_only_after_snapshot(tmp_path):
    t = open_tier(tmp_path, segment_bytes="1MiB")
    keys = np.arange(1000, dtype=np.int64)
    t.put(keys, make_records(LAY, keys))
    t.close()  # close writes a snapshot
    t = open_tier(tmp_path, segment_bytes="1MiB")
    assert t.stats()["replayed_records"] == 0
    more = np.arange(1000, 1100, dtype=np.int64)
    t.put(more, make_records(LAY, more))
    t.delete(keys[:10])
    t.flush()  # durable, but below the snapshot threshold
    # Reopen without close (as after a crash): only the 110 newer records are replayed.
    t._release_files()
    t._closed = True
    t = open_tier(tmp_path, segment_bytes="1MiB")
    assert t.stats()["replayed_records"] == 110
    assert len(t) == 1090
    assert t.check() == []
    t.close()


def test_torn_tail_truncated_on_reopen(tmp_path):
    t = open_tier(tmp_path)
    keys = np.arange(20, dtype=np.int64)
    t.put(keys, make_records(LAY, keys))
    t.flush()
    last = os.path.join(str(tmp_path), sf.seg_name(segfiles(tmp_path)[-1]))
    t._release_files()
    t._closed = True
    end = sf.SEG_HEADER + 20 * t.stored_bytes
    with open(last, "r+b") as f:  # half a record of garbage, as after a kill mid-write
        f.seek(end)
        f.write(b"\x07" * (t.stored_bytes // 2))
    t = open_tier(tmp_path)
    assert len(t) == 20 and t.check() == []
    # a complete record with a wrong checksum is cut too
    t._release_files()
    t._closed = True
    with open(last, "r+b") as f:
        f.seek(end)
        f.write(b"\x01" * t.stored_bytes)
    t = open_tier(tmp_path)
    assert t.stats()["truncated_records"] == 1
    assert len(t) == 20 and t.check() == []
    t.close()


def test_corrupt_sealed_segment_refused_then_repaired(tmp_path):
    t = open_tier(tmp_path, segment_bytes=2048)
    keys = np.arange(60, dtype=np.int64)
    t.put(keys, make_records(LAY, keys))
    t.flush()
    t._release_files()
    t._closed = True  # no snapshot: replay covers every segment
    first = os.path.join(str(tmp_path), sf.seg_name(segfiles(tmp_path)[0]))
    with open(first, "r+b") as f:
        f.seek(sf.SEG_HEADER + 40)
        f.write(b"\xff")
    with pytest.raises(CorruptRecordError, match="repair=True"):
        open_tier(tmp_path, segment_bytes=2048)
    t = open_tier(tmp_path, segment_bytes=2048, repair=True)
    assert 0 < len(t) < 60 and t.check() == []
    t.close()


def test_check_detects_damage(tmp_path):
    t = open_tier(tmp_path)
    keys = np.arange(30, dtype=np.int64)
    t.put(keys, make_records(LAY, keys))
    t.flush()
    seg = t._segs[segfiles(tmp_path)[0]]
    with open(seg.path, "r+b") as f:
        f.seek(sf.SEG_HEADER + 3 * t.stored_bytes + 50)
        f.write(b"\xaa\xbb")
    seg.unmap()
    problems = t.check()
    assert problems and "bad checksum" in problems[0]
    t.close()


def test_snapshot_damage_refused_repair_rebuilds(tmp_path):
    t = open_tier(tmp_path)
    keys = np.arange(30, dtype=np.int64)
    t.put(keys, make_records(LAY, keys))
    t.close()
    snap = os.path.join(str(tmp_path), sf.SNAP_NAME)
    with open(snap, "r+b") as f:
        f.seek(40)
        f.write(b"\x00\x01")
    with pytest.raises(CorruptRecordError, match="repair"):
        open_tier(tmp_path)
    t = open_tier(tmp_path, repair=True)
    assert len(t) == 30 and t.check() == []
    t.close()


def test_lock_and_bad_options(tmp_path):
    t = open_tier(tmp_path)
    with pytest.raises(StoreLockedError):
        open_tier(tmp_path)
    t.close()
    with pytest.raises(ConfigError, match="segment_bytes"):
        open_tier(tmp_path / "x", segment_bytes=100)
    with pytest.raises(ConfigError, match="compaction_threshold"):
        open_tier(tmp_path / "y", compaction_threshold=0)
    with pytest.raises(ConfigError, match="size"):
        open_tier(tmp_path / "z", segment_bytes="lots")


def test_compaction_survives_reopen_and_deletes_stay_deleted(tmp_path):
    t = open_tier(tmp_path, segment_bytes=4096)
    keys = np.arange(100, dtype=np.int64)
    t.put(keys, make_records(LAY, keys))
    t.delete(keys[:50])
    for i in range(6):
        t.put(keys[50:], make_records(LAY, keys[50:], i))
    assert t.stats()["compactions"] > 0
    t.flush()
    t._release_files()
    t._closed = True
    t = open_tier(tmp_path, segment_bytes=4096)
    assert len(t) == 50 and not t.contains(keys[:50]).any()
    _, got = t.get(keys[50:])
    np.testing.assert_array_equal(got, make_records(LAY, keys[50:], 5))
    assert t.check() == []
    t.close()


@pytest.mark.parametrize("async_c,buffer_bytes", [(False, 2048), (True, 2048), (False, 1 << 20)])
def test_concurrent_readers_and_writer(tmp_path, async_c, buffer_bytes):
    # writers let go of the state lock during file I/O: readers must still see whole records
    # (a small buffer sends puts through the direct-write path, a large one through the buffer)
    import threading

    t = open_tier(tmp_path, segment_bytes=4096, async_compaction=async_c,
                  buffer_bytes=buffer_bytes)
    keys = np.arange(300, dtype=np.int64)
    t.put(keys, make_records(LAY, keys, 0))
    stop = threading.Event()
    errors: list[BaseException] = []
    versions = {v: make_records(LAY, keys, v) for v in range(12)}

    def reader():
        try:
            while not stop.is_set():
                found, got = t.get(keys)
                assert found.all()
                v = LAY.unpack(got).version
                for i in (0, 150, 299):  # each row is exactly one written version
                    match = [x for x, r in versions.items() if (r[i] == got[i]).all()]
                    assert match, (i, v[i])
                arena = RowArena(LAY.dim, LAY.slot_width)
                found = t.read_into(keys, lambda f, a=arena: a.insert(keys[f])[0],
                                    RowSink(arena, LAY))
                assert found.all()
                rows = arena.find(keys)
                for i in (0, 150, 299):
                    r = rows[i]
                    match = [x for x, rec in versions.items()
                             if LAY.unpack(rec[i:i + 1]).version[0] == arena.version[r]]
                    assert match, i
                    want = LAY.unpack(versions[match[0]][i:i + 1])
                    assert arena.freq[r] == want.freq[0]
                    assert arena.seq[r] == want.change_seq[0]
                    assert np.array_equal(arena.values[r], want.values[0])
                    assert np.array_equal(arena.slots[r], want.slots[0])
                list(t.scan(100))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        for v in range(1, 12):
            t.put(keys, versions[v])
            t.compact()
            t.flush()
    finally:
        stop.set()
        for r in readers:
            r.join()
    assert not errors, errors
    assert t.check() == []
    _, got = t.get(keys)
    np.testing.assert_array_equal(got, versions[11])
    t.close()


def test_compacted_files_wait_for_the_next_snapshot(tmp_path):
    # compaction retires segments; their files stay until a snapshot that does not reference
    # them is durable, and a crash before that reopens consistent from the older snapshot
    import shutil

    src = tmp_path / "a"
    t = open_tier(src, segment_bytes=4096, snapshot_min_bytes=1 << 30)
    keys = np.arange(200, dtype=np.int64)
    t.put(keys, make_records(LAY, keys, 0))
    want = make_records(LAY, keys, 0)
    v = 0
    while t.stats()["retired_segments"] == 0:  # small overwrites: a segment or two at a time
        v += 1
        assert v < 500, "no compaction happened"
        part = keys[(v * 20) % 200:(v * 20) % 200 + 20]
        recs = make_records(LAY, part, v)
        t.put(part, recs)
        want[part] = recs
    t.flush()  # durable, but no snapshot (snapshot_min_bytes): retired files are still there
    st = t.stats()
    on_disk = {p.name for p in src.iterdir() if p.name.startswith("seg-")}
    assert st["compactions"] > 0 and len(on_disk) == st["segments"] + st["retired_segments"]
    shutil.copytree(src, tmp_path / "crash")  # what a crash now would leave
    c = SSDHashTier(tmp_path / "crash", LAY)
    found, got = c.get(keys)
    assert found.all()
    np.testing.assert_array_equal(got, want)
    assert c.check() == []
    c.close()
    assert t.compact() >= 0 and t.stats()["retired_segments"] == 0  # compact() reclaims now
    on_disk = {p.name for p in src.iterdir() if p.name.startswith("seg-")}
    assert len(on_disk) == t.stats()["segments"]
    t.close()


def test_compacted_segment_files_are_reused(tmp_path):
    """Retired files become free files after the next snapshot, then new segments."""
    t = open_tier(tmp_path, segment_bytes=4096, max_free_segments=2)
    keys = np.arange(100, dtype=np.int64)
    for i in range(40):
        t.put(keys, make_records(LAY, keys, i))
        if i % 5 == 4:
            t.compact()  # snapshot: retired files are free for reuse
    st = t.stats()
    assert st["reused_segments"] > 0 and st["free_segments"] <= 2
    assert t.check() == []
    _, got = t.get(keys)
    np.testing.assert_array_equal(got, make_records(LAY, keys, 39))
    free = [p.name for p in tmp_path.iterdir() if p.name.startswith("free-")]
    assert len(free) == st["free_segments"]
    t.close()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("free-")]  # gone on close
    t = open_tier(tmp_path, segment_bytes=4096)
    found, got = t.get(keys)
    assert found.all()
    np.testing.assert_array_equal(got, make_records(LAY, keys, 39))
    t.close()


def test_reused_head_with_old_records_reopens_at_its_real_end(tmp_path):
    """A reused file still holds its earlier life's records past the end of the new ones;
    their checksums carry the old segment id, so a reopen stops where the new ones end."""
    import shutil

    t = open_tier(tmp_path / "a", segment_bytes=4096, snapshot_min_bytes=1 << 30,
                  max_free_segments=4)
    keys = np.arange(60, dtype=np.int64)
    v = 0
    while t.stats()["reused_segments"] == 0:
        v += 1
        assert v < 500, "no segment file was reused"
        t.put(keys, make_records(LAY, keys, v))
        if v % 3 == 0:
            t.compact()
    t.put(keys[:3], make_records(LAY, keys[:3], 1000))  # a few records at the reused head
    t.flush()
    shutil.copytree(tmp_path / "a", tmp_path / "crash")  # a crash now: no snapshot since
    t.close()
    c = open_tier(tmp_path / "crash", segment_bytes=4096)
    want = make_records(LAY, keys, v)
    want[:3] = make_records(LAY, keys[:3], 1000)
    found, got = c.get(keys)
    assert found.all() and len(c) == 60
    np.testing.assert_array_equal(got, want)
    assert c.check() == []
    c.close()


def test_old_format_and_bad_free_segments_refused(tmp_path):
    import json

    t = open_tier(tmp_path / "v")
    t.close()
    meta = tmp_path / "v" / sf.META_NAME
    doc = json.loads(meta.read_text())
    doc["version"] = 1
    meta.write_text(json.dumps(doc))
    from tensorkv.errors import StorePathError

    with pytest.raises(StorePathError, match="format version 1.*delete the directory"):
        open_tier(tmp_path / "v")
    with pytest.raises(ConfigError, match="max_free_segments"):
        open_tier(tmp_path / "w", max_free_segments=-1)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "free-00000007.dat").write_bytes(b"junk")  # left by a crash
    t = open_tier(tmp_path / "x")
    assert not (tmp_path / "x" / "free-00000007.dat").exists()
    t.close()


def test_seeded_checksums_and_reseed():
    from tensorkv.kernels import ssdhash as K

    recs = np.random.default_rng(0).integers(0, 2**63, (5, 9), dtype=np.int64).view(np.uint64)
    out = np.empty((5, 10), np.uint64)
    K.seal(recs, K.FLAG_PUT, out, 7)
    assert K.first_invalid(out, 0, 5, 7) == 5
    assert K.first_invalid(out, 0, 5, 8) == 0  # another segment's seed: not valid here
    K.reseed(out, 7, 8)
    assert K.first_invalid(out, 0, 5, 8) == 5 and K.first_invalid(out, 0, 5, 7) == 0
    inplace = np.zeros((5, 10), np.uint64)
    inplace[:, :9] = recs
    K.seal_inplace(inplace, K.FLAG_PUT, 8)
    np.testing.assert_array_equal(inplace, out)


def test_compaction_frees_the_deadest_segments_first(tmp_path):
    """Past the threshold, segments go deadest first, their live records copied."""
    t = open_tier(tmp_path, segment_bytes=4096, compaction_threshold=0.5)
    rows = t.segment_rows
    keys = np.arange(6 * rows, dtype=np.int64)
    first = make_records(LAY, keys, 0)
    t.put(keys, first)  # six full segments, all live
    assert t.stats()["compactions"] == 0
    hot = keys[: 3 * rows]  # overwrite most of the first three segments, a few at a time
    rng = np.random.default_rng(0)
    for i in range(1, 12):
        part = rng.choice(hot, rows, replace=False)
        t.put(part, make_records(LAY, part, i))
    s = t.stats()
    assert s["compactions"] > 0 and s["compacted_records"] > 0
    assert s["dead_records"] <= 0.5 * (s["rows"] + s["dead_records"]) + rows
    _, got = t.get(keys[3 * rows:])  # the cold segments were never rewritten
    np.testing.assert_array_equal(got, first[3 * rows:])
    assert t.check() == []
    t.close()


def test_synchronous_compaction_runs_in_steps(tmp_path, monkeypatch):
    """A write compacts a bounded number of records; a segment half copied stays readable."""
    from tensorkv.embedding.tiers import ssdhash as sh

    monkeypatch.setattr(sh, "COMPACTION_CHUNK_ROWS", 8)
    t = open_tier(tmp_path, segment_bytes=16384, compaction_threshold=0.3)
    rows = t.segment_rows
    keys = np.arange(3 * rows, dtype=np.int64)
    want = make_records(LAY, keys, 0)
    t.put(keys, want)
    rng = np.random.default_rng(1)
    seen_partial = False
    for i in range(1, 120):
        part = np.sort(rng.choice(keys[: 2 * rows], 10, replace=False))
        recs = make_records(LAY, part, i)
        t.put(part, recs)
        want[part] = recs
        seen_partial |= t._compacting is not None
        found, got = t.get(keys)
        assert found.all()
        np.testing.assert_array_equal(got, want)
    assert seen_partial and t.stats()["compactions"] > 0
    t.compact()  # finishes the segment in progress
    assert t._compacting is None and t.check() == []
    np.testing.assert_array_equal(t.get(keys)[1], want)
    t.close()


@pytest.mark.parametrize("reuse", [False, True])
def test_readers_do_not_wait_for_a_segment_roll(tmp_path, monkeypatch, reuse):
    """Starting a new head segment syncs files (header, rename, directory); readers go on
    meanwhile, and see every record once the roll is done."""
    import threading

    t = open_tier(tmp_path, segment_bytes=4096, max_free_segments=2)
    keys = np.arange(100, dtype=np.int64)
    for i in range(12 if reuse else 1):
        t.put(keys, make_records(LAY, keys, i))
        if reuse and i % 4 == 3:
            t.compact()
    assert (t.stats()["free_segments"] > 0) == reuse
    syncing, release = threading.Event(), threading.Event()
    real = sf.fsync_dir

    def slow_fsync_dir(path):
        syncing.set()
        assert release.wait(10)
        real(path)

    monkeypatch.setattr(sf, "fsync_dir", slow_fsync_dir)
    more = np.arange(100, 400, dtype=np.int64)  # enough records to roll the head
    writer = threading.Thread(target=t.put, args=(more, make_records(LAY, more, 50)))
    writer.start()
    try:
        assert syncing.wait(10)
        found, got = t.get(keys)  # the writer is inside the roll: this must not wait for it
        assert found.all()
        np.testing.assert_array_equal(got, make_records(LAY, keys, 11 if reuse else 0))
    finally:
        release.set()
        writer.join(10)
    monkeypatch.setattr(sf, "fsync_dir", real)
    found, got = t.get(more)
    assert found.all()
    np.testing.assert_array_equal(got, make_records(LAY, more, 50))
    assert t.check() == []
    t.close()


def test_read_into_take_moves_rows_and_a_failed_copy_keeps_them(tmp_path):
    """``take=True`` removes what it read (one index probe per key); if the copy fails, the
    tier still holds every row, readable and counted live."""
    keys = np.arange(300, dtype=np.int64)
    recs = make_records(LAY, keys, seed=3)
    with open_tier(tmp_path / "t") as t:  # several segments, some rows still buffered
        t.put(keys, recs)
        want = t.get(keys)[1]
        live = sum(s.live for s in t._segs.values())

        def broken_alloc(found):
            raise MemoryError("no rows")

        arena = RowArena(LAY.dim, LAY.slot_width)
        with pytest.raises(MemoryError):
            t.read_into(keys, broken_alloc, RowSink(arena, LAY), take=True)
        found, got = t.get(keys)
        assert found.all() and np.array_equal(got, want)
        assert len(t) == 300 and sum(s.live for s in t._segs.values()) == live
        assert t.check() == []

        q = np.array([5, 299, 1000, 5], np.int64)  # absent key and a repeat
        found = t.read_into(q, lambda f: arena.insert(q[f])[0], RowSink(arena, LAY), take=True)
        assert found.tolist() == [True, True, False, False]  # a key moves once
        assert len(t) == 298 and not t.get(q)[0].any()
        assert sum(s.live for s in t._segs.values()) == live - 2
        rows = arena.find(np.array([5, 299], np.int64))
        f = LAY.unpack(want[[5, 299]])
        assert np.array_equal(arena.values[rows], f.values)
        assert np.array_equal(arena.slots[rows], f.slots)
        assert np.array_equal(arena.version[rows], f.version)
        assert t.check() == []


def _arena_rows(arena, n, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.permutation(10 * n)[:n].astype(np.int64) + 1
    rows, _ = arena.insert(keys)
    arena.scatter(rows, rng.standard_normal((n, arena.dim), dtype=np.float32))
    arena.scatter_slots(rows, rng.random((n, arena.slot_width), dtype=np.float32))
    arena.freq[rows] = rng.integers(0, 99, n)
    arena.version[rows] = rng.integers(0, 99, n)
    return keys, rows


def test_put_rows_across_segment_rolls_reads_back_and_checks(tmp_path):
    from tensorkv.embedding.tiers.base import RowSource

    arena = RowArena(LAY.dim, LAY.slot_width)
    keys, rows = _arena_rows(arena, 500)
    src = RowSource(arena, LAY, keys, rows)
    want = src.pack()
    t = open_tier(tmp_path)  # 8 KiB segments: a put of 500 rows spans several
    t.put_rows(keys[:7], RowSource(arena, LAY, keys[:7], rows[:7]))  # a part-filled head
    t.put_rows(keys, src)
    assert len(segfiles(tmp_path)) > 3
    assert t.check() == []
    _, got = t.get(keys)
    np.testing.assert_array_equal(got, want)
    t.close()
    t = open_tier(tmp_path)  # every record validates on reopen (none cut as torn)
    assert t.stats()["truncated_records"] == 0 and t.check() == []
    _, got = t.get(keys)
    np.testing.assert_array_equal(got, want)
    t.close()


def test_written_records_are_queued_for_writeback(tmp_path, monkeypatch):
    """Every byte written to a segment has its writeback started (so sealing fsyncs wait
    for little); buffered, direct and compaction writes alike."""
    from tensorkv import pages

    calls = []
    real = pages.start_writeback

    def spy(fd, offset=0, nbytes=0):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, nbytes))
        return real(fd, offset, nbytes)

    monkeypatch.setattr(pages, "start_writeback", spy)
    t = open_tier(tmp_path)  # 8 KiB segments, 2 KiB buffer: rolls, buffered and direct writes
    keys = np.arange(300, dtype=np.int64)
    for i in range(6):
        t.put(keys[: 3 + 50 * i], make_records(LAY, keys[: 3 + 50 * i], i))
    t.flush()
    assert t.stats()["compactions"] > 0
    covered: dict[str, list[tuple[int, int]]] = {}
    for path, off, n in calls:
        covered.setdefault(os.path.basename(path), []).append((off, off + n))
    for sid in segfiles(tmp_path):  # the live segments: their records, front to back
        seg = t._segs[sid]
        spans = sorted(covered[sf.seg_name(sid)])
        assert spans[0][0] == sf.SEG_HEADER
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert spans[-1][1] == sf.SEG_HEADER + seg.written * t.stored_bytes
    t.close()
