"""``EmbeddingTable(..., storage=...)`` is the entry point of tiered tables."""

from __future__ import annotations

import numpy as np
import pytest

from tensorkv.embedding import EmbeddingTable
from tensorkv.embedding.chain.specs import DRAM, SSDHash, StorageOption
from tensorkv.errors import ConfigError

from .test_chain import DIM, rb, steps
from .test_exactness import assert_same


def test_storage_argument_builds_a_tiered_table(tmp_path):
    ref = EmbeddingTable(DIM, optimizer="adagrad", seed=1)
    t = EmbeddingTable(DIM, optimizer="adagrad", seed=1, storage="DRAM_SSDHASH",
                       storage_path=str(tmp_path / "s"), storage_size=[24 * rb()],
                       cache_strategy="lru")
    assert type(t) is EmbeddingTable and t.storage is not None  # one class, its rows tiered
    with t:
        steps([ref, t], n_steps=20)
        assert t.stats()["tiers"][0]["rows"] <= 24 < len(t)
        assert_same(ref, t)
        assert t.state_dict_meta()["storage"]["storage_type"] == "DRAM_SSDHASH"


def test_storage_option_object(tmp_path):
    opt = StorageOption(tiers=[DRAM(8 * rb()), SSDHash(str(tmp_path / "s"))],
                        cache_strategy="lfu")
    with EmbeddingTable(DIM, optimizer="adagrad", storage=opt) as t:
        t.lookup(np.arange(50))
        assert len(t) == 50 and t.stats()["tiers"][0]["rows"] <= 50


def test_plain_table_has_no_storage():
    assert EmbeddingTable(DIM).storage is None
    assert EmbeddingTable(DIM, storage=None).storage is None


def test_deprecated_names_warn_and_still_work(tmp_path):
    import tensorkv

    with pytest.warns(DeprecationWarning, match="tensorkv.KV"):
        spec = tensorkv.KVTier(f"lmdb://{tmp_path}/kv")
    assert isinstance(spec, tensorkv.KV)
    with pytest.warns(DeprecationWarning, match="EmbeddingTable"):
        assert tensorkv.TieredEmbeddingTable is EmbeddingTable


@pytest.mark.parametrize("kwargs", [{"storage_path": "/x"}, {"storage_size": [100]},
                                    {"cache_strategy": "lru"}])
def test_storage_options_without_storage(kwargs):
    with pytest.raises(ConfigError, match="storage"):
        EmbeddingTable(DIM, **kwargs)
