"""DeepRec's names and environment: its 13 storage types, storage_size defaults, TF_* variables.

Every name of DeepRec's multi-tier document makes its chain (DRAM_PMEM_LEVELDB and
HBM_DRAM_PMEM_LEVELDB train bit-identically to the DRAM-only table); a tier without a size
holds DeepRec's 1 GiB, the last tier none; ``TF_SSDHASH_ASYNC_COMPACTION`` and
``TF_MULTI_TIER_EV_EVICTION_THREADS`` work, their ``TENSORKV_*`` twins win with a warning.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from tests.tiers.test_exactness import assert_same, train

from tensorkv import config
from tensorkv.embedding import EmbeddingTable, StorageOption
from tensorkv.embedding.chain import writeback
from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.errors import ConfigError

GIB = 1 << 30

#: DeepRec's 13 storage types (docs: Embedding multi-tier storage) and the tiers they make.
DEEPREC_TYPES = {
    "HBM": ["HBM"],
    "DRAM": ["DRAM"],
    "HBM_DRAM": ["HBM", "DRAM"],
    "HBM_DRAM_PMEM": ["HBM", "DRAM", "PMEM"],
    "HBM_DRAM_LEVELDB": ["HBM", "DRAM", "KV"],
    "HBM_DRAM_SSDHASH": ["HBM", "DRAM", "SSDHASH"],
    "HBM_DRAM_PMEM_LEVELDB": ["HBM", "DRAM", "PMEM", "KV"],
    "HBM_DRAM_PMEM_SSDHASH": ["HBM", "DRAM", "PMEM", "SSDHASH"],
    "DRAM_PMEM": ["DRAM", "PMEM"],
    "DRAM_LEVELDB": ["DRAM", "KV"],
    "DRAM_SSDHASH": ["DRAM", "SSDHASH"],
    "DRAM_PMEM_LEVELDB": ["DRAM", "PMEM", "KV"],
    "DRAM_PMEM_SSDHASH": ["DRAM", "PMEM", "SSDHASH"],
}


@pytest.mark.parametrize("name", sorted(DEEPREC_TYPES))
def test_every_deeprec_name(name):
    specs = StorageOption(name, storage_path="/data/emb").tier_specs()
    assert [s.kind for s in specs] == DEEPREC_TYPES[name]
    # DeepRec's storage_size default: 1 GiB a tier; the last tier has nowhere to evict to
    assert [s.size for s in specs] == [GIB] * (len(specs) - 1) + [None]


def test_pmem_and_leveldb_share_the_path():
    _, pm, kv = StorageOption("DRAM_PMEM_LEVELDB", storage_path="/data/emb").tier_specs()
    assert pm.path == "/data/emb/pmem.tier" and kv.url == "leveldb:///data/emb/leveldb"
    with pytest.raises(ConfigError, match="takes a directory as storage_path, not the URL"):
        StorageOption("DRAM_PMEM_ROCKSDB", storage_path="rocksdb:///x")


def test_storage_size_in_bytes_per_tier():
    specs = StorageOption("HBM_DRAM_PMEM_SSDHASH", storage_path="/d",
                          storage_size=[512, "2GiB"]).tier_specs()
    assert [s.size for s in specs] == [512, 2 * GIB, GIB, None]
    specs = StorageOption("DRAM_SSDHASH", storage_size=[GIB, 5 * GIB]).tier_specs()
    assert [s.size for s in specs] == [GIB, 5 * GIB]  # given: kept, even for the last tier
    assert StorageOption("DRAM").tier_specs()[0].size is None


@pytest.mark.parametrize("name", ["DRAM_PMEM_LEVELDB", "HBM_DRAM_PMEM_LEVELDB"])
def test_new_chains_train_bit_identically(tmp_path, name):
    dim = 8
    ref = EmbeddingTable(dim, optimizer="adagrad", seed=3)
    rb = RecordLayout(dim, num_slots=ref.num_slots).record_bytes
    sizes = [64 * rb, 200 * rb] if name.startswith("DRAM") else [64 * rb, 150 * rb, 250 * rb]
    device = {} if name.startswith("DRAM") else {"device": "cpu"}  # HBM: torch tensors
    with EmbeddingTable(dim, optimizer="adagrad", seed=3, storage=name, **device,
                        storage_path=str(tmp_path / "t"), storage_size=sizes) as t:
        train([ref, t], string_keys=False, steps=60)
        st = t.stats()
        assert st["tiers"][-1]["rows"] > 0  # rows went all the way down to LevelDB
        assert_same(ref, t)


@pytest.fixture
def fresh_pool():
    writeback.shutdown()
    yield
    writeback.shutdown()


def test_tf_eviction_threads(monkeypatch, fresh_pool):
    monkeypatch.setenv("TF_MULTI_TIER_EV_EVICTION_THREADS", "3")
    assert config.eviction_threads() == 3
    writeback.pool()
    assert writeback.pool_threads() == 3
    writeback.shutdown()
    monkeypatch.setenv("TENSORKV_EVICTION_THREADS", "2")
    with pytest.warns(UserWarning, match="TENSORKV_EVICTION_THREADS='2' and "
                                         "TF_MULTI_TIER_EV_EVICTION_THREADS='3' differ; "
                                         "using TENSORKV_EVICTION_THREADS"):
        assert config.eviction_threads() == 2
    monkeypatch.setenv("TF_MULTI_TIER_EV_EVICTION_THREADS", "2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same value twice: no warning
        assert config.eviction_threads() == 2
    monkeypatch.delenv("TENSORKV_EVICTION_THREADS")
    monkeypatch.setenv("TF_MULTI_TIER_EV_EVICTION_THREADS", "many")
    with pytest.raises(ConfigError, match="TF_MULTI_TIER_EV_EVICTION_THREADS='many'"):
        config.eviction_threads()
    monkeypatch.setenv("TF_MULTI_TIER_EV_EVICTION_THREADS", "0")
    with pytest.raises(ConfigError, match="TF_MULTI_TIER_EV_EVICTION_THREADS=0 is below"):
        config.eviction_threads()


def test_tf_ssdhash_async_compaction(monkeypatch, tmp_path):
    def opened() -> bool:
        with EmbeddingTable(4, storage="DRAM_SSDHASH",
                            storage_path=str(tmp_path / f"s{np.random.randint(1 << 30)}")) as t:
            t.lookup(np.arange(10))
            return t.stats()["tiers"][1]["async_compaction"]

    assert opened() is False
    monkeypatch.setenv("TF_SSDHASH_ASYNC_COMPACTION", "1")
    assert opened() is True
    monkeypatch.setenv("TENSORKV_SSDHASH_ASYNC_COMPACTION", "0")
    with pytest.warns(UserWarning, match="TENSORKV_SSDHASH_ASYNC_COMPACTION='0' and "
                                         "TF_SSDHASH_ASYNC_COMPACTION='1' differ"):
        assert opened() is False
    monkeypatch.setenv("TENSORKV_SSDHASH_ASYNC_COMPACTION", "true")  # same value, other spelling
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opened() is True
