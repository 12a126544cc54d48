"""Every table kind passes tensorkv.testing.TableTests: bit parity with the DRAM table.

The DRAM-only table and DRAM_SSDHASH (LRU) run the whole suite; the other chains run a core
subset (``checks = CORE``, two optimizers; HBM chains add the initializers) to keep this file
fast. Tier 0 holds a handful of rows (``TIER0`` bytes: 6-13 rows of dim 5, depending on the
dtype and the optimizer's slots), so nearly every batch moves rows down and back up;
``check_exercised`` asserts that it did.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

import tensorkv
from tensorkv.testing import TableTests
from tensorkv.testing.tables import CHECKS

TIER0 = 640  # bytes of tier 0: 6 rows of dim 5 with Adam, 11 with SGD
TIER1 = 1600  # a middle tier (PMEM below DRAM, DRAM below HBM): 16-28 rows
# what the other chains run: everything that goes through the tiers (str-key hashing,
# optimizer objects and initializers happen above them, and admission runs in the
# randomized test of seed 1)
CORE = frozenset({"reads", "training", "nan", "mutations", "eviction", "export", "dtypes",
                  "checkpoint", "randomized", "snapshot"})
CORE_OPTIMIZERS = ("sgd", "ftrl")  # no slots, two slots; adam/adagrad run in the other tests


class TestDRAMTable(TableTests):
    """The reference against itself: the suite's own consistency."""

    @pytest.fixture
    def make_table(self):
        return tensorkv.EmbeddingTable


class TieredTableTests(TableTests):
    """A tier chain built by name (``storage_type``) with small sizes, in a fresh path."""

    storage_type: str = "DRAM_SSDHASH"
    sizes: list[int | None] = [TIER0]
    cache_strategy: str = "lru"
    table_options: dict[str, Any] = {}
    checks = CORE
    optimizers = CORE_OPTIMIZERS

    def storage(self, path: str) -> tensorkv.StorageOption:
        return tensorkv.StorageOption(self.storage_type, storage_path=path,
                                      storage_size=self.sizes, cache_strategy=self.cache_strategy)

    @pytest.fixture
    def make_table(self, tmp_path):
        n = itertools.count()

        def make(dim: int, **kwargs: Any) -> tensorkv.EmbeddingTable:
            opt = self.storage(str(tmp_path / f"tier{next(n)}"))
            return tensorkv.EmbeddingTable(dim, storage=opt, **self.table_options, **kwargs)

        return make

    def check_exercised(self, table: Any) -> None:
        tiers = table.stats()["tiers"]
        if len(tiers) < 2:
            return
        assert tiers[0]["evictions"] > 0, f"no row left tier 0: {tiers}"
        assert sum(t["promotions"] for t in tiers[1:]) > 0, f"no row came back up: {tiers}"


class TestDRAMSSDHashLRU(TieredTableTests):
    """The whole suite."""

    checks = CHECKS
    optimizers = TableTests.optimizers


class TestDRAMSSDHashLFU(TieredTableTests):
    cache_strategy = "lfu"


class TestDRAMPMEM(TieredTableTests):
    storage_type = "DRAM_PMEM"
    cache_strategy = "lfu"


class TestDRAMPMEMSSDHash(TieredTableTests):
    """Three tiers: PMEM overflows into SSDHASH (cascades)."""

    storage_type = "DRAM_PMEM_SSDHASH"
    sizes = [TIER0, TIER1]


class TestDRAMLevelDB(TieredTableTests):
    storage_type = "DRAM_LEVELDB"


class TestDRAMRocksDB(TieredTableTests):
    storage_type = "DRAM_ROCKSDB"
    cache_strategy = "lfu"


class TestDRAMLMDB(TieredTableTests):
    storage_type = "DRAM_LMDB"


class TestDRAMRedis(TieredTableTests):
    storage_type = "DRAM_REDIS"
    cache_strategy = "lfu"

    @pytest.fixture
    def make_table(self, redis_server):
        redis_server.flushall()
        dbs = iter(range(16))  # one database per table of a test: each starts empty

        def make(dim: int, **kwargs: Any) -> tensorkv.EmbeddingTable:
            url = f"redis://127.0.0.1:{redis_server.port}/{next(dbs)}"
            return tensorkv.EmbeddingTable(dim, storage=self.storage(url), **kwargs)

        return make


class TestHBM(TieredTableTests):
    """An HBM tier 0 alone (torch tensors, on the CPU here)."""

    storage_type = "HBM"
    sizes = []
    table_options = {"device": "cpu"}
    dtypes = ("float32",)  # an HBM tier 0 holds float32 rows
    checks = CORE | {"initializers"}  # rows are initialised on the device

    def storage(self, path: str) -> tensorkv.StorageOption:
        return tensorkv.StorageOption("HBM")


class TestHBMDRAM(TestHBM):
    storage_type = "HBM_DRAM"
    sizes = [TIER0, None]

    def storage(self, path: str) -> tensorkv.StorageOption:
        return tensorkv.StorageOption("HBM_DRAM", storage_size=self.sizes,
                                      cache_strategy=self.cache_strategy)


class TestHBMSSDHash(TestHBM):
    storage_type = "HBM_SSDHASH"
    sizes = [TIER0]
    cache_strategy = "lfu"

    storage = TieredTableTests.storage


class TestExplicitChain(TieredTableTests):
    """``StorageOption(tiers=[DRAM(size), SSDHash(path)])`` with the root-level spec classes."""

    def storage(self, path: str) -> tensorkv.StorageOption:
        return tensorkv.StorageOption(
            # tiny segments and buffers: segments roll and compact under the tests
            tiers=[tensorkv.DRAM(TIER0), tensorkv.SSDHash(path, segment_bytes=2048,
                                                          buffer_bytes=512)],
            cache_strategy="lfu",
        )
