"""Row arrays that grow inside a reserved mapping: contents kept, new rows zero, moves."""

import sys

import numpy as np
import pytest

from tensorkv.embedding import growable
from tensorkv.embedding.arena import RowArena

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux mappings")


@pytest.fixture
def small(monkeypatch):
    """Reservations from 64 KiB up, 4x: the mapping paths at test sizes."""
    monkeypatch.setattr(growable, "MIN_BYTES", 64 << 10)
    monkeypatch.setattr(growable, "RESERVE_FACTOR", 4)


def test_small_arrays_resize_in_place():
    a = np.arange(10, dtype=np.int64)
    b = growable.resized(a, 20)
    assert b is a and b.shape == (20,) and b[:10].tolist() == list(range(10)) and not b[10:].any()


@linux
@pytest.mark.parametrize("width", [None, 3])
def test_grow_shrink_and_move(small, width):
    shape = (4096,) if width is None else (4096, width)
    a = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    ref = a.copy()
    b = growable.resized(a, 20000)  # past 64 KiB: into a reservation (one copy)
    m = growable._mapping(b)
    assert m is not None and np.array_equal(b[:4096], ref) and not b[4096:].any()
    b[4096:] = 7
    c = growable.resized(b, 30000)  # inside the reservation: a view, no copy
    assert growable._mapping(c) is m and np.shares_memory(b, c)
    assert np.array_equal(c[:4096], ref) and (c[4096:20000] == 7).all() and not c[20000:].any()
    d = growable.resized(c, 18000)  # shrink: what is given up reads zero when grown again
    e = growable.resized(d, 30000)
    assert np.array_equal(e[:4096], ref) and (e[4096:18000] == 7).all() and not e[18000:].any()
    big = growable.resized(e, len(m) // e[:1].nbytes + 10)  # past the reservation: moved
    assert growable._mapping(big) is not m
    assert np.array_equal(big[:4096], ref) and (big[4096:18000] == 7).all()
    assert not big[18000:].any()


@linux
def test_arena_rows_survive_growth_into_reservations(small):
    arena = RowArena(4, slot_width=1)
    keys = np.arange(1, 20001, dtype=np.int64)
    for lo in range(0, keys.size, 1000):
        rows, is_new = arena.insert(keys[lo:lo + 1000])
        assert is_new.all()
        arena.scatter(rows, np.repeat(keys[lo:lo + 1000, None], 4, 1).astype(np.float32))
    assert growable._mapping(arena.values) is not None
    rows = arena.find(keys)
    assert (rows >= 0).all()
    np.testing.assert_array_equal(arena.gather(rows)[:, 0], keys.astype(np.float32))
    np.testing.assert_array_equal(np.sort(arena.row_key[rows]), keys)


def test_a_malformed_prefault_setting_is_refused_when_a_table_is_made(monkeypatch):
    from tensorkv.errors import ConfigError

    monkeypatch.setattr(growable, "_enabled", None)
    monkeypatch.setenv("TENSORKV_PREFAULT", "sometimes")
    with pytest.raises(ConfigError, match="TENSORKV_PREFAULT='sometimes'"):
        RowArena(4)
    monkeypatch.setenv("TENSORKV_PREFAULT", "0")
    assert RowArena(4).capacity > 0 and growable.prefault_enabled() is False


def _fail_second_call(monkeypatch, name):
    """Make ``growable.<name>`` raise MemoryError on its second call (an allocator running out)."""
    real, calls = getattr(growable, name), []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("injected: out of memory on the second allocation")
        return real(*args, **kwargs)

    monkeypatch.setattr(growable, name, flaky)
    return calls


@pytest.mark.parametrize("path", [
    "small",
    pytest.param("reservation", marks=linux),
])
def test_an_allocation_failing_mid_resize_leaves_every_row_array_as_it_was(monkeypatch, path):
    if path == "reservation":
        monkeypatch.setattr(growable, "MIN_BYTES", 64 << 10)
        monkeypatch.setattr(growable, "RESERVE_FACTOR", 4)
    arena = RowArena(4, slot_width=2, capacity=1000)
    keys = np.arange(1, 801, dtype=np.int64)
    rows, _ = arena.insert(keys)
    arena.scatter(rows, np.repeat(keys[:, None], 4, 1).astype(np.float32))
    arena.slots[rows] = 3.0
    names = ("values", "slots", "freq", "version", "seq", "row_key", "live")
    before = {n: getattr(arena, n).copy() for n in names}
    # the second allocation fails: between values and slots
    calls = _fail_second_call(monkeypatch, "_prepare" if path == "small" else "_reserve")
    with pytest.raises(MemoryError, match="injected"):
        arena.reserve(40000)
    assert len(calls) == 2
    for n in names:  # same sizes and contents as before: nothing half resized
        np.testing.assert_array_equal(getattr(arena, n), before[n], err_msg=n)
    monkeypatch.undo()
    arena.reserve(40000)  # the arena still works and grows afterwards
    assert {getattr(arena, n).shape[0] for n in names} == {arena.capacity}
    assert arena.capacity >= 40000
    found = arena.find(keys)
    np.testing.assert_array_equal(arena.gather(found)[:, 0], keys.astype(np.float32))
    assert (arena.slots[found] == 3.0).all()
