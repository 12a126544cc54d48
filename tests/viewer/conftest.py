"""Fixtures of the viewer tests: small checkpoints saved with tensorkv.save into real stores."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from tests.checkpoint.helpers import make_table, rows_of

import helpers
import tensorkv


@dataclass
class Saved:
    """A store holding tags ``a`` (full) and ``b`` (incremental on ``a``), and the truth."""

    url: str
    keys: np.ndarray  # every key of tag a
    changed: np.ndarray  # keys whose rows tag b changed
    removed: np.ndarray  # keys tag b removed
    added: np.ndarray  # keys tag b added
    rows: dict[str, tuple[np.ndarray, ...]]  # tag -> (keys, values, slots, freq, version)
    dense: dict[str, dict[str, np.ndarray]]  # tag -> name -> array


def save_two_tags(url: str, n: int = 3000, dim: int = 8) -> Saved:
    """Save tag ``a`` and an incremental tag ``b`` of a table and two dense arrays."""
    t = make_table(n, dim)
    w = np.arange(60, dtype=np.float32).reshape(12, 5)
    bias = np.linspace(-1, 1, 7).astype(np.float64)
    tensorkv.save({"emb": t, "w": w, "bias": bias}, url, "a", step=10, block_rows=256)
    ra = rows_of(t)
    keys = ra[0]
    rng = np.random.default_rng(1)
    changed = np.sort(rng.choice(keys, 20, replace=False))
    t.apply_gradients(changed, rng.standard_normal((20, dim)).astype(np.float32), step=11)
    removed = np.sort(np.setdiff1d(keys, changed)[:7])
    t.remove(removed)
    added = np.arange(10**12, 10**12 + 5, dtype=np.int64)
    t.lookup(added)
    w2 = w.copy()
    w2[3, 2] = 100.0
    tensorkv.save({"emb": t, "w": w2, "bias": bias}, url, "b", step=11, incremental=True,
                  block_rows=256)
    return Saved(url, keys, changed, removed, added, {"a": ra, "b": rows_of(t)},
                 {"a": {"w": w, "bias": bias}, "b": {"w": w2, "bias": bias}})


def store_url(kind: str, tmp_path, request) -> str:
    """A fresh store URL of a backend (see ``helpers.store_url``)."""
    return helpers.store_url(kind, tmp_path, request, name="viewer")


@pytest.fixture(scope="module")
def saved_lmdb(tmp_path_factory) -> Saved:
    """Two tags in an LMDB store (shared by a module's tests: they only read)."""
    return save_two_tags(f"lmdb://{tmp_path_factory.mktemp('viewer')}/store")


@pytest.fixture(params=["memory", "lmdb", "rocksdb", "leveldb", "redis"])
def saved_any(request, tmp_path) -> Saved:
    """Two tags in each backend: memory, LMDB, RocksDB, LevelDB, a real redis-server."""
    return save_two_tags(store_url(request.param, tmp_path, request), n=600, dim=4)
