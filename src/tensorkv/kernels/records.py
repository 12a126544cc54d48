"""Numba kernels that move embedding rows between a DRAM arena and fixed-size records.

:func:`rows_to_records` packs arena rows into records and :func:`records_to_rows` copies
records (straight out of a mapped SSDHASH segment, too) into rows, word by word in the type
:func:`word_dtype` picks. See docs/internals.md ("Kernels").
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tensorkv.kernels.hashindex import prefetch, prefetch1

#: Records ahead whose cache lines :func:`records_to_rows` prefetches.
PREFETCH_RECORDS = 6


def word_dtype(*sizes: int) -> np.dtype:
    """The widest of uint64/32/16/8 that divides every byte size/offset in ``sizes``."""
    for w in (8, 4, 2):
        if all(s % w == 0 for s in sizes):
            return np.dtype(f"uint{8 * w}")
    return np.dtype(np.uint8)


@njit(nogil=True, cache=True)
def rows_to_records(vals, slots, freq, version, seq, keys, rows,
                    out, out64, vo, so):  # pragma: no cover - compiled
    """Pack arena ``rows`` into records ``out[i]`` under ``keys[i]`` (``out64``: int64 words).

    ``vo``/``so``: offsets of the values and slots in a record, in words of ``out``'s
    dtype (the arena arrays are viewed with the same dtype). Padding is left as it is (the
    caller zeroes it once).
    """
    vw = vals.shape[1]
    sw = slots.shape[1]
    n = rows.shape[0]
    for i in range(n):
        if i + PREFETCH_RECORDS < n:
            ra = rows[i + PREFETCH_RECORDS]
            prefetch1(freq, ra)
            prefetch1(version, ra)
            prefetch1(seq, ra)
        r = rows[i]
        out64[i, 0] = keys[i]
        out64[i, 1] = freq[r]
        out64[i, 2] = version[r]
        out64[i, 3] = seq[r]
        for c in range(vw):
            out[i, vo + c] = vals[r, c]
        for c in range(sw):
            out[i, so + c] = slots[r, c]


@njit(nogil=True, cache=True)
def records_to_rows(src, src64, src_rows, rows, vo, so,
                    vals, slots, freq, version, seq):  # pragma: no cover - compiled
    """Copy record ``src_rows[i]`` of ``src`` into arena row ``rows[i]`` (all fields but key).

    ``src`` may be a memory-mapped file (an SSDHASH segment): the rows go from the page
    cache straight into the arena, with no intermediate buffer.
    """
    vw = vals.shape[1]
    sw = slots.shape[1]
    width = src.shape[1]
    line = max(1, 64 // src.itemsize)  # words per cache line
    n = rows.shape[0]
    for i in range(n):
        if i + PREFETCH_RECORDS < n:  # the record (random pages of a mapped file) ahead
            sa = src_rows[i + PREFETCH_RECORDS]
            for c in range(0, width, line):
                prefetch(src, sa, c)
            ra = rows[i + PREFETCH_RECORDS]
            prefetch1(freq, ra)
            prefetch1(version, ra)
            prefetch1(seq, ra)
        s = src_rows[i]
        r = rows[i]
        freq[r] = src64[s, 1]
        version[r] = src64[s, 2]
        seq[r] = src64[s, 3]
        for c in range(vw):
            vals[r, c] = src[s, vo + c]
        for c in range(sw):
            slots[r, c] = src[s, so + c]


__all__ = ["records_to_rows", "rows_to_records", "word_dtype"]
