"""Crash safety of the persistent tiers: child processes killed with SIGKILL at random moments.

Each child reopens the same directory, applies deterministic batches of puts and deletes
(heavy overwrites on a small key space, so segments roll and compaction runs all the time),
and reports every acknowledged ``flush()`` on stdout. SSDHASH runs with synchronous and
asynchronous compaction; the PMEM tier with copy-on-write puts, slot reuse and file growth.
The parent kills the child at a random moment, reopens the tier and checks that every row is
either its state at the last acknowledged flush or a state written after it, that ``check()``
is clean, and carries on from there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.embedding.tiers.pmem import PMEMTier
from tensorkv.embedding.tiers.ssdhash import SSDHashTier

LAY = RecordLayout(8, num_slots=1)
KEYSPACE = 3000
HORIZON = 8  # batches a child can start after its last acknowledged flush
OPTS = {"segment_bytes": 16384, "buffer_bytes": 4096, "snapshot_min_bytes": 32768}


def open_tier(path: str, mode: str):
    """Open the tier under test: ``sync`` / ``async`` SSDHASH or ``pmem``."""
    if mode == "pmem":
        return PMEMTier(path, LAY, capacity=64)
    return SSDHashTier(path, LAY, async_compaction=mode == "async", **OPTS)


def batch_ops(seed: int, b: int) -> tuple[str, np.ndarray]:
    rng = np.random.default_rng([seed, b])
    if rng.random() < 0.8:
        return "put", rng.integers(-KEYSPACE // 2, KEYSPACE // 2, 150).astype(np.int64)
    return "del", rng.integers(-KEYSPACE // 2, KEYSPACE // 2, 40).astype(np.int64)


def records(keys: np.ndarray, b: int) -> np.ndarray:
    vals = keys[:, None].astype(np.float32) * 31 + b + np.arange(LAY.dim, dtype=np.float32)
    slots = np.full((keys.size, LAY.slot_width), b * 0.5, np.float32)
    return LAY.pack(keys, vals, slots, freq=keys * 3, version=b, seq=b + 7)


CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {here!r})
    from test_crash import batch_ops, open_tier, records

    path, seed, start, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    t = open_tier(path, mode)
    print("READY", flush=True)
    b = start
    while True:
        kind, keys = batch_ops(seed, b)
        if kind == "put":
            t.put(keys, records(keys, b))
        else:
            t.delete(keys)
        if b % 2 == 0:
            t.flush()
            st = t.stats()
            print("F", b, st["compactions"] + st.get("grows", 0), st.get("reused_segments", 0),
                  flush=True)
        b += 1
    """
).format(here=os.path.dirname(os.path.abspath(__file__)))


def run_child(path: str, seed: int, start: int, mode: str, rng: np.random.Generator):
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, path, str(seed), str(start), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def reader() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line.strip())
            if line.startswith("READY"):
                ready.set()
        ready.set()

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    early = rng.random() < 0.2
    if early:  # kill while the child may still be opening (and replaying / truncating)
        time.sleep(rng.uniform(0.0, 1.5))
    else:
        assert ready.wait(120), proc.stderr.read()  # type: ignore[union-attr]
        time.sleep(rng.uniform(0.05, 0.8))
    alive = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    th.join(10)
    if not alive:
        raise AssertionError(f"child exited early: {proc.stderr.read()}")  # type: ignore[union-attr]
    # a line cut short by the kill is not an acknowledgement
    acked = [ln.split() for ln in lines if ln.startswith("F ") and len(ln.split()) == 4]
    last = int(acked[-1][1]) if acked else start - 1
    compactions = int(acked[-1][2]) if acked else 0
    reused = int(acked[-1][3]) if acked else 0
    return last, compactions, reused


def expected_after(state: dict[int, int], seed: int, start: int, stop: int) -> dict[int, int]:
    """Model: key -> version (batch) after applying batches [start, stop]."""
    s = dict(state)
    for b in range(start, stop + 1):
        kind, keys = batch_ops(seed, b)
        for k in keys.tolist():
            if kind == "put":
                s[k] = b
            else:
                s.pop(k, None)
    return s


def verify(
    path: str, mode: str, state: dict[int, int], seed: int, start: int, acked: int
) -> dict[int, int]:
    """Reopen, check against the model, and return the recovered key -> version map."""
    model = expected_after(state, seed, start, acked)
    later_puts: dict[int, set[int]] = {}
    later_dels: set[int] = set()
    for b in range(acked + 1, acked + 1 + HORIZON):
        kind, keys = batch_ops(seed, b)
        for k in keys.tolist():
            if kind == "put":
                later_puts.setdefault(k, set()).add(b)
            else:
                later_dels.add(k)
    t = open_tier(path, mode)
    try:
        assert t.check() == []
        space = np.arange(-KEYSPACE // 2, KEYSPACE // 2, dtype=np.int64)
        found, got = t.get(space)
        f = LAY.unpack(got)
        recovered: dict[int, int] = {}
        for i in np.flatnonzero(found).tolist():
            k, v = int(space[i]), int(f.version[i])
            recovered[k] = v
            assert v == model.get(k) or v in later_puts.get(k, ()), (k, v, model.get(k))
        np.testing.assert_array_equal(
            got[found],
            np.concatenate([records(np.array([k]), v) for k, v in recovered.items()])
            if recovered
            else got[found],
        )
        for k in model:
            if k not in recovered:
                assert k in later_dels, f"acknowledged key {k} (v{model[k]}) lost"
        assert len(t) == len(recovered)
    finally:
        t.close()
    return recovered


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async", "pmem"])
def test_sigkill_during_writes_and_compaction(tmp_path, mode):
    """SSDHASH: kills land in puts, deletes, flushes, snapshots, compactions and the reuse of
    compacted segment files; PMEM: in copy-on-write puts, frees and file growth."""
    path = str(tmp_path / "tier")
    rng = np.random.default_rng(1234 + len(mode))
    state: dict[int, int] = {}
    start = 0
    total_events = total_reused = 0
    for it in range(6):
        seed = 100 + it
        acked, events, reused = run_child(path, seed, start, mode, rng)
        total_events += events
        total_reused += reused
        state = verify(path, mode, state, seed, start, acked)
        # Versions keep growing across iterations: start after everything written.
        start = acked + HORIZON + 1 + 1000 * (it + 1)
        start += start % 2
    # compactions (SSDHASH) / file growths (PMEM) happened in the children that were killed
    assert total_events > 0
    if mode != "pmem":  # and new segments were written into reused segment files
        assert total_reused > 0
    t = open_tier(path, mode)
    assert t.check() == []
    t.close()
