"""Comparing a table with the reference :class:`tensorkv.EmbeddingTable`, bit for bit.

The helpers behind :class:`~tensorkv.testing.tables.TableTests`, for other tests too:
:func:`table_rows` dumps a table's rows sorted by key, :func:`assert_same_table` compares a
table with the reference (sizes, keys, every exported field, reads), :func:`bits` and
:func:`assert_bits_equal` compare float bit patterns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ROW_FIELDS = ("keys", "values", "slots", "freq", "version", "seq")
"""The fields of an export chunk, in order."""

STAT_COUNTERS = ("rows", "step", "mutation_seq", "hits", "misses", "inserts", "evictions",
                 "admissions_rejected", "gradients_dropped", "nonfinite_skipped", "removed")
"""The ``stats()`` entries :func:`assert_same_table` compares with ``stats=True``."""

PROBE_KEYS = np.array([-1, 10**12, -(2**50)], np.int64)
"""Keys the suite never inserts (read to check the values of keys without a row)."""


def bits(a: Any) -> np.ndarray:
    """The bit patterns of ``a``'s elements as unsigned integers of the same width.

    Two float arrays are bit-identical when their ``bits`` are equal: ``-0.0`` differs from
    ``0.0`` and every NaN payload counts.
    """
    a = np.ascontiguousarray(np.asarray(a))
    if a.dtype.itemsize in (1, 2, 4, 8) and a.ndim:
        return a.view(f"u{a.dtype.itemsize}")
    return a.reshape(-1).view(np.uint8)


def assert_bits_equal(got: Any, want: Any, what: str, keys: Any = None) -> None:
    """Assert that two arrays have the same shape, dtype and element bits.

    Parameters
    ----------
    got, want
        The table under test's array and the reference's.
    what
        Names the compared quantity in the failure message.
    keys
        Keys of the rows (first axis), named in the failure message.
    """
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != reference {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != reference {want.dtype}"
    gb, wb = bits(got), bits(want)
    if np.array_equal(gb, wb):
        return
    diff = gb != wb
    rows = np.flatnonzero(diff.reshape(diff.shape[0], -1).any(axis=1)) if diff.ndim else [0]
    first = int(rows[0])
    where = f"row {first}" + ("" if keys is None else f" (key {np.asarray(keys)[first]})")
    raise AssertionError(
        f"{what} differs from the reference in {len(rows)} of {got.shape[0] if got.ndim else 1}"
        f" rows; first at {where}: {got[first]!r} != reference {want[first]!r}"
    )


def table_rows(table: Any, chunk_rows: int = 7, since: int | None = None) -> dict[str, Any]:
    """Every row ``table.export`` yields, as arrays sorted by key.

    Returns
    -------
    dict
        ``keys``, ``values``, ``slots``, ``freq``, ``version``, ``seq`` (those the chunks
        hold); just ``keys`` (empty) when nothing was exported. Each key appears once.
    """
    chunks = [tuple(c) for c in table.export(chunk_rows=chunk_rows, since=since)]
    chunks = [c for c in chunks if len(c[0])]
    for c in chunks:
        assert 0 < len(c[0]) <= chunk_rows, f"an export chunk has {len(c[0])} rows"
    if not chunks:
        return {"keys": np.empty(0, np.int64)}
    n_fields = min(len(c) for c in chunks)
    out = {f: np.concatenate([np.asarray(c[i]) for c in chunks])
           for i, f in enumerate(ROW_FIELDS[:n_fields])}  # fmt: skip
    order = np.argsort(out["keys"], kind="stable")
    out = {f: v[order] for f, v in out.items()}
    k = out["keys"]
    assert k.size == np.unique(k).size, "export yielded a key twice"
    return out


def assert_same_rows(got: dict[str, Any], want: dict[str, Any], what: str = "export",
                     seq: bool = True) -> None:
    """Compare two :func:`table_rows` dumps field by field, bit for bit.

    ``seq=False`` leaves out the change sequence numbers (tables filled by ``import_`` or a
    checkpoint load number their changes differently).
    """
    assert_bits_equal(got["keys"], want["keys"], f"{what}: keys")
    for f in ROW_FIELDS[1:]:
        if f == "seq" and not seq:
            continue
        if f in got or f in want:
            assert f in got and f in want, f"{what}: field {f} missing on one side"
            assert_bits_equal(got[f], want[f], f"{what}: {f}", got["keys"])


def assert_same_table(table: Any, ref: Any, *, seq: bool = True, export: bool = True,
                      stats: bool = False, probe: Any = None) -> None:
    """Assert that ``table`` holds what the reference ``ref`` holds.

    Compares ``len``, ``keys()`` (as sets), ``step``, ``mutation_seq`` (with ``seq``), every
    exported row field bit for bit (with ``export``; ``seq`` includes the change sequence
    numbers), and ``contains``, ``frequency``, ``version`` and ``table[keys]`` of the keys
    of rows plus :data:`PROBE_KEYS` and ``probe`` (keys without a row read as their initial
    value).
    """
    assert len(table) == len(ref), f"len {len(table)} != reference {len(ref)}"
    keys = np.asarray(table.keys())
    ref_keys = np.asarray(ref.keys())
    assert keys.size == len(table), f"keys() returned {keys.size} keys for {len(table)} rows"
    assert set(keys.tolist()) == set(ref_keys.tolist()), (
        f"keys differ: only in table {sorted(set(keys.tolist()) - set(ref_keys.tolist()))[:8]},"
        f" only in reference {sorted(set(ref_keys.tolist()) - set(keys.tolist()))[:8]}"
    )
    assert table.step == ref.step, f"step {table.step} != reference {ref.step}"
    if seq:
        assert table.mutation_seq == ref.mutation_seq, (
            f"mutation_seq {table.mutation_seq} != reference {ref.mutation_seq}"
        )
    if export:
        assert_same_rows(table_rows(table), table_rows(ref), seq=seq)
    if stats:
        st, sr = table.stats(), ref.stats()
        for name in STAT_COUNTERS:
            assert st[name] == sr[name], f"stats()[{name!r}] {st[name]} != reference {sr[name]}"
    extra = PROBE_KEYS if probe is None else np.concatenate([PROBE_KEYS, np.asarray(probe,
                                                                                     np.int64)])
    ks = np.concatenate([np.sort(ref_keys), extra])
    assert_reads_equal(table, ref, ks)


def assert_reads_equal(table: Any, ref: Any, keys: Any) -> None:
    """Compare ``contains``, ``frequency``, ``version`` and ``table[keys]`` of ``keys``.

    None of them inserts a row or counts a sighting (``table[keys]`` counts ``stats()``
    hits and misses, alike in both tables).
    """
    assert_bits_equal(table.contains(keys), ref.contains(keys), "contains", keys)
    assert_bits_equal(table.frequency(keys), ref.frequency(keys), "frequency", keys)
    assert_bits_equal(table.version(keys), ref.version(keys), "version", keys)
    assert_bits_equal(table[keys], ref[keys], "table[keys]", keys)


def snapshot(table: Any, export: bool) -> tuple[Any, ...]:
    """``(len, step, mutation_seq, rows)`` of a table (rows: :func:`table_rows` or None)."""
    rows = table_rows(table) if export else None
    return len(table), table.step, table.mutation_seq, rows


def close_table(table: Any) -> None:
    """Call ``table.close()`` if the table has one."""
    close = getattr(table, "close", None)
    if callable(close):
        close()


def rng_keys(rng: np.random.Generator, n: int, high: int, dups: int = 2) -> np.ndarray:
    """``n`` keys in ``[0, high)`` (with replacement) plus ``dups`` repeats of the first ones."""
    k = rng.integers(0, high, n).astype(np.int64)
    return np.concatenate([k, k[:dups]])


def grads_like(rng: np.random.Generator, n: int, dim: int, scale: float = 1.0) -> np.ndarray:
    """Random float32 gradients ``[n, dim]`` times ``scale``."""
    return (rng.standard_normal((n, dim)) * scale).astype(np.float32)


__all__ = ["PROBE_KEYS", "ROW_FIELDS", "STAT_COUNTERS", "assert_bits_equal",
           "assert_reads_equal", "assert_same_rows", "assert_same_table", "bits", "close_table",
           "grads_like", "rng_keys", "snapshot", "table_rows"]
