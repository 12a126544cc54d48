"""Open-addressing hash index ``int64 key -> int64 row`` as numba kernels over numpy arrays.

:func:`index_find`, :func:`index_insert` and :func:`index_remove` (and the detach, attach and
hold of rows) work on an ``int64[2**b, 2]`` index with the row allocator built in; scratch
maps (:func:`map_distinct`, :func:`map_find`) and counting maps serve batches and filters.
Layout, probing, deletion and growth: docs/internals.md ("The hash index").
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from tensorkv.errors import ConfigError

# state[] fields
#: How many items ahead the probe and copy kernels prefetch (index slots, rows, records).
PREFETCH_DISTANCE = 16

SIZE = 0
NEXT_ROW = 1
FREE_HEAD = 2
N_FREE = 3


@intrinsic
def prefetch(typingctx, arr, r, c):  # pragma: no cover - compiled
    """Hint the CPU to load the cache line of ``arr[r, c]`` (LLVM ``llvm.prefetch``, read).

    A pure hint: no effect on results, never faults, even for an out-of-range address.
    """
    sig = types.void(arr, r, c)

    def codegen(context, builder, signature, args):
        arr_t = signature.args[0]
        ary = context.make_array(arr_t)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, arr_t, ary, [args[1], args[2]],
                                       wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def prefetch1(typingctx, arr, i):  # pragma: no cover - compiled
    """Hint the CPU to load the cache line of ``arr[i]`` of a 1-D array."""
    sig = types.void(arr, i)

    def codegen(context, builder, signature, args):
        arr_t = signature.args[0]
        ary = context.make_array(arr_t)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, arr_t, ary, [args[1]],
                                       wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True, inline="always")
def mix64(x: np.uint64) -> np.uint64:  # pragma: no cover - compiled
    """splitmix64 finaliser: a 64-bit bijection with full avalanche."""
    z = np.uint64(x)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(nogil=True, cache=True, inline="always")
def home_slot(key: np.int64, mask: np.int64) -> np.int64:  # pragma: no cover - compiled
    """First probe position of ``key`` in a table of ``mask + 1`` slots."""
    return np.int64(mix64(np.uint64(key)) & np.uint64(mask))


def new_index(n_slots: int) -> np.ndarray:
    """Allocate an empty index of ``n_slots`` slots (a power of two): int64 ``[n_slots, 2]``."""
    if n_slots <= 0 or n_slots & (n_slots - 1):
        raise ConfigError(f"n_slots={n_slots} must be a positive power of two")
    index = np.empty((n_slots, 2), np.int64)
    index[:, 0] = 0
    index[:, 1] = -1
    return index


@njit(nogil=True, cache=True, inline="always")
def probe(index, k, mask):  # pragma: no cover - compiled
    """Slot holding key ``k``, or the empty slot that ends its probe run."""
    h = home_slot(k, mask)
    while index[h, 1] >= 0 and index[h, 0] != k:
        h = (h + 1) & mask
    return h


@njit(nogil=True, cache=True, inline="always")
def shift_out(index, h, mask):  # pragma: no cover - compiled
    """Empty slot ``h`` by backward shift (no tombstones, probe runs never grow).

    Later members of its cluster move into the hole when their home slot allows.
    """
    hole = h
    j = h
    while True:
        j = (j + 1) & mask
        if index[j, 1] < 0:
            break
        home = home_slot(index[j, 0], mask)
        # the entry at j may move to `hole` iff its home is not cyclically in (hole, j]
        stays = (hole < home <= j) if hole <= j else (home > hole or home <= j)
        if not stays:
            index[hole, 0] = index[j, 0]
            index[hole, 1] = index[j, 1]
            hole = j
    index[hole, 1] = -1


@njit(nogil=True, cache=True)
def index_find(index, keys, rows_out):  # pragma: no cover - compiled
    """Row of each key into ``rows_out`` (``-1`` when absent); returns the number of misses."""
    mask = np.int64(index.shape[0] - 1)
    misses = 0
    n = keys.shape[0]
    for i in range(n):
        if i + PREFETCH_DISTANCE < n:
            prefetch(index, home_slot(keys[i + PREFETCH_DISTANCE], mask), 0)
        r = index[probe(index, keys[i], mask), 1]
        rows_out[i] = r
        if r < 0:
            misses += 1
    return misses


@njit(nogil=True, cache=True, inline="always")
def _take_row(state, row_key, max_rows):  # pragma: no cover - compiled
    """An unused row: the free list's head, else ``next_row``; ``-1`` at ``max_rows``."""
    if state[N_FREE] > 0:
        row = state[FREE_HEAD]
        state[FREE_HEAD] = row_key[row]
        state[N_FREE] -= 1
        return row
    if state[NEXT_ROW] >= max_rows:
        return -1
    row = state[NEXT_ROW]
    state[NEXT_ROW] += 1
    return row


@njit(nogil=True, cache=True)
def index_insert(
    index, keys, start, rows_out, is_new, state, row_key, live, max_size, max_rows
):  # pragma: no cover - compiled
    """Find-or-insert ``keys[start:]``; new keys get a row from the free list or ``next_row``.

    Stops before a key that would push the index past ``max_size`` keys or need a row
    ``>= max_rows``; returns the position reached (``len(keys)`` when done) so the caller can
    grow and resume. ``is_new[i]`` says whether key ``i`` got a fresh row.
    """
    mask = np.int64(index.shape[0] - 1)
    n = keys.shape[0]
    for i in range(start, n):
        if i + PREFETCH_DISTANCE < n:
            prefetch(index, home_slot(keys[i + PREFETCH_DISTANCE], mask), 0)
        k = keys[i]
        h = home_slot(k, mask)
        while True:
            r = index[h, 1]
            if r < 0:
                if state[SIZE] >= max_size:
                    return i
                # the body of _take_row, written out: calling it here measured 2x slower
                if state[N_FREE] > 0:
                    row = state[FREE_HEAD]
                    state[FREE_HEAD] = row_key[row]
                    state[N_FREE] -= 1
                else:
                    if state[NEXT_ROW] >= max_rows:
                        return i
                    row = state[NEXT_ROW]
                    state[NEXT_ROW] += 1
                index[h, 0] = k
                index[h, 1] = row
                row_key[row] = k
                live[row] = 1
                state[SIZE] += 1
                rows_out[i] = row
                is_new[i] = True
                break
            if index[h, 0] == k:
                rows_out[i] = r
                is_new[i] = False
                break
            h = (h + 1) & mask
    return n


@njit(nogil=True, cache=True, inline="always")
def _remove_keys(index, keys, rows_out, state, row_key, live, free):  # pragma: no cover
    mask = np.int64(index.shape[0] - 1)
    removed = 0
    n = keys.shape[0]
    for i in range(n):
        if i + PREFETCH_DISTANCE < n:
            prefetch(index, home_slot(keys[i + PREFETCH_DISTANCE], mask), 0)
        h = probe(index, keys[i], mask)
        r = index[h, 1]
        rows_out[i] = r
        if r < 0:
            continue
        removed += 1
        live[r] = 0
        if free:  # on the free list, linked through row_key
            row_key[r] = state[FREE_HEAD]
            state[FREE_HEAD] = r
            state[N_FREE] += 1
        state[SIZE] -= 1
        shift_out(index, h, mask)
    return removed


@njit(nogil=True, cache=True)
def index_remove(index, keys, rows_out, state, row_key, live):  # pragma: no cover
    """Remove keys (backward-shift deletion); freed rows go on the free list.

    ``rows_out[i]`` is the freed row of key ``i`` or ``-1`` when it was absent (or a duplicate
    already removed in this call). Returns the number of keys removed.
    """
    return _remove_keys(index, keys, rows_out, state, row_key, live, True)


@njit(nogil=True, cache=True)
def index_detach(index, keys, rows_out, state, row_key, live):  # pragma: no cover - compiled
    """Remove keys from the index but keep their rows off the free list (see :func:`free_rows`).

    A detached row is not live and keeps its data and its ``row_key``; it is reused only once
    :func:`free_rows` returns it, or when :func:`index_attach` maps a key to it again.
    ``rows_out`` as in :func:`index_remove`. Returns the number of keys detached.
    """
    return _remove_keys(index, keys, rows_out, state, row_key, live, False)


@njit(nogil=True, cache=True)
def free_rows(rows, state, row_key):  # pragma: no cover - compiled
    """Put detached rows on the free list (``-1`` entries skipped)."""
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        row_key[r] = state[FREE_HEAD]
        state[FREE_HEAD] = r
        state[N_FREE] += 1


@njit(nogil=True, cache=True)
def hold_rows(rows_out, state, row_key, max_rows):  # pragma: no cover - compiled
    """Take unused rows (free list first, then ``next_row``) into ``rows_out``, held.

    A held row is like a detached one: not live, mapped by no key, reused only once
    :func:`free_rows` returns it or :func:`index_attach` maps a key to it. Stops at row
    ``max_rows``; returns the number of rows taken.
    """
    n = rows_out.shape[0]
    for i in range(n):
        r = _take_row(state, row_key, max_rows)
        if r < 0:
            return i
        row_key[r] = -1
        rows_out[i] = r
    return n


@njit(nogil=True, cache=True)
def index_attach(index, keys, rows, state, row_key, live):  # pragma: no cover - compiled
    """Map absent, distinct ``keys[i]`` to detached ``rows[i]`` again (the reverse of a detach).

    The caller guarantees room in the index (``size + len(keys) <= max_size``).
    """
    mask = np.int64(index.shape[0] - 1)
    n = keys.shape[0]
    for i in range(n):
        if i + PREFETCH_DISTANCE < n:
            prefetch(index, home_slot(keys[i + PREFETCH_DISTANCE], mask), 0)
        k = keys[i]
        h = probe(index, k, mask)
        r = rows[i]
        index[h, 0] = k
        index[h, 1] = r
        row_key[r] = k
        live[r] = 1
        state[SIZE] += 1


@njit(nogil=True, cache=True)
def index_set_rows(index, keys, rows):  # pragma: no cover - compiled
    """Point present ``keys[i]`` at ``rows[i]`` (rows moved by the caller)."""
    mask = np.int64(index.shape[0] - 1)
    for i in range(keys.shape[0]):
        h = probe(index, keys[i], mask)
        if index[h, 1] >= 0:
            index[h, 1] = rows[i]


@njit(nogil=True, cache=True)
def index_rehash(old, new):  # pragma: no cover - compiled
    """Insert every occupied slot of the old index into an empty new one."""
    mask = np.int64(new.shape[0] - 1)
    for s in range(old.shape[0]):
        r = old[s, 1]
        if r < 0:
            continue
        k = old[s, 0]
        h = home_slot(k, mask)
        while new[h, 1] >= 0:
            h = (h + 1) & mask
        new[h, 0] = k
        new[h, 1] = r


@njit(nogil=True, cache=True)
def index_probe_stats(index):  # pragma: no cover - compiled
    """Mean and max probe length (1 = found in its home slot) over the stored keys."""
    mask = np.int64(index.shape[0] - 1)
    total = 0
    worst = 0
    count = 0
    for s in range(index.shape[0]):
        if index[s, 1] < 0:
            continue
        d = ((s - home_slot(index[s, 0], mask)) & mask) + 1
        total += d
        count += 1
        if d > worst:
            worst = d
    return (total / count if count else 0.0), worst


# --- a scratch map (key -> position in a batch), for batch-sized lookups ----------------------
def map_slots(n: int) -> int:
    """Slots of a scratch map holding ``n`` keys (a power of two, at least ``2 n``)."""
    size = 16
    while size < 2 * n:
        size *= 2
    return size


@njit(nogil=True, cache=True)
def map_distinct(keys, tab, uniq_out, inv_out):  # pragma: no cover - compiled
    """Distinct keys in order of first occurrence, and each key's position among them.

    ``tab`` is ``int32[map_slots(len(keys))]`` scratch (overwritten): each slot holds the
    position in ``uniq_out`` of the key it maps (``-1``: empty), so a slot is 4 bytes and the
    keys are compared in ``uniq_out`` (batches under 2**31 keys). Afterwards ``(tab,
    uniq_out)`` maps each distinct key to its position (see :func:`map_find`). Returns the
    number of distinct keys written to ``uniq_out``; ``inv_out[i]`` is the position of
    ``keys[i]``.
    """
    mask = np.int64(tab.shape[0] - 1)
    tab[:] = -1
    u = 0
    n = keys.shape[0]
    for i in range(n):
        if i + PREFETCH_DISTANCE < n:
            prefetch1(tab, home_slot(keys[i + PREFETCH_DISTANCE], mask))
        k = keys[i]
        h = home_slot(k, mask)
        while True:
            p = tab[h]
            if p < 0:
                tab[h] = u
                uniq_out[u] = k
                inv_out[i] = u
                u += 1
                break
            if uniq_out[p] == k:
                inv_out[i] = p
                break
            h = (h + 1) & mask
    return u


@njit(nogil=True, cache=True)
def map_find(tab, uniq, q, out):  # pragma: no cover - compiled
    """Position of each query key in a map built by :func:`map_distinct` (``-1``: absent).

    ``tab`` and ``uniq``: the scratch table and the distinct keys :func:`map_distinct` wrote.
    """
    mask = np.int64(tab.shape[0] - 1)
    n = q.shape[0]
    for i in range(n):
        if i + PREFETCH_DISTANCE < n:
            prefetch1(tab, home_slot(q[i + PREFETCH_DISTANCE], mask))
        k = q[i]
        h = home_slot(k, mask)
        while True:
            p = tab[h]
            if p < 0 or uniq[p] == k:
                out[i] = p
                break
            h = (h + 1) & mask


# --- a small counting map (key -> count), used by the admission counter filter ----------------
@njit(nogil=True, cache=True)
def count_map_add(index, keys, counts_out, state, max_size):  # pragma: no cover
    """Add one sighting per key occurrence; ``counts_out[i]`` = count after occurrence ``i``.

    Empty slots hold a count ``< 0``. Returns the position reached (stops before a new key
    would exceed ``max_size``) so the caller can grow and resume.
    """
    mask = np.int64(index.shape[0] - 1)
    n = keys.shape[0]
    for i in range(n):
        if counts_out[i] > 0:  # already counted in an earlier partial pass
            continue
        k = keys[i]
        h = home_slot(k, mask)
        while True:
            c = index[h, 1]
            if c < 0:
                if state[SIZE] >= max_size:
                    return i
                index[h, 0] = k
                index[h, 1] = 1
                state[SIZE] += 1
                counts_out[i] = 1
                break
            if index[h, 0] == k:
                index[h, 1] = c + 1
                counts_out[i] = c + 1
                break
            h = (h + 1) & mask
    return n


@njit(nogil=True, cache=True)
def count_map_remove(index, keys, state):  # pragma: no cover - compiled
    """Remove keys from a counting map (backward shift); returns how many were present."""
    mask = np.int64(index.shape[0] - 1)
    removed = 0
    for i in range(keys.shape[0]):
        h = probe(index, keys[i], mask)
        if index[h, 1] < 0:
            continue
        removed += 1
        state[SIZE] -= 1
        shift_out(index, h, mask)
    return removed


@njit(nogil=True, cache=True)
def count_map_get(index, keys, out):  # pragma: no cover - compiled
    """Current count of each key (0 when absent)."""
    mask = np.int64(index.shape[0] - 1)
    for i in range(keys.shape[0]):
        c = index[probe(index, keys[i], mask), 1]
        out[i] = c if c > 0 else 0
