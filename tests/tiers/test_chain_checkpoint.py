"""Checkpoints of tiered tables: save sees every tier, load places rows across tiers."""

from __future__ import annotations

import uuid

import numpy as np

import tensorkv
from tensorkv.embedding import EmbeddingTable

from .test_chain import DIM, pair, rb, steps


def test_save_tiered_load_dram_and_back(tmp_path):
    url = f"memory://ckpt-{uuid.uuid4().hex}"
    ref, t = pair(tmp_path, rows0=16)
    with t:
        steps([ref, t], n_steps=30)
        tensorkv.save(t, url, "a", block_rows=64)
        got = tensorkv.load(None, url, "a")["table"]
        for a, b in zip(_rows(ref), _rows(got), strict=True):
            assert a.tobytes() == b.tobytes()
        target = EmbeddingTable(DIM, optimizer="adagrad", seed=1, storage="DRAM_LMDB",
                                      storage_path=str(tmp_path / "lmdb"),
                                      storage_size=[10 * rb()])
        with target:
            target.lookup(np.arange(10**6, 10**6 + 40))  # stale rows must disappear
            tensorkv.load(target, url, "a")
            assert target.stats()["tiers"][0]["rows"] <= 10 < len(target)
            np.testing.assert_array_equal(np.sort(target.keys()), np.sort(ref.keys()))
            for f_ref, f_t in zip(_rows(ref), _rows(target), strict=True):
                assert f_ref.tobytes() == f_t.tobytes()


def _rows(table):
    from .test_exactness import full_export

    e = full_export(table)
    return [e[f] for f in ("keys", "values", "slots", "freq", "version")]


def test_incremental_save_of_tiered_table(tmp_path):
    url = f"memory://ckpt-{uuid.uuid4().hex}"
    ref, t = pair(tmp_path, rows0=16)
    with t:
        steps([ref, t], n_steps=10)
        tensorkv.save(t, url, "base", incremental=True)
        steps([ref, t], n_steps=10, seed=5)
        t.remove(ref.keys()[:7])
        ref.remove(ref.keys()[:7])
        tensorkv.save(t, url, "inc", incremental=True)
        got = tensorkv.load(EmbeddingTable(DIM, optimizer="adagrad", seed=1), url, "inc")
        for a, b in zip(_rows(ref), _rows(got), strict=True):
            assert a.tobytes() == b.tobytes()
