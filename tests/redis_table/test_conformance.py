"""The Redis-resident table passes TableTests: bit for bit the DRAM table's results.

Standalone runs the whole suite (small buckets and commands, so batches span several
buckets and pipelined commands); the Cluster and last-writer-wins runs a core subset.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

import tensorkv
from tensorkv.testing import TableTests

CORE = frozenset({"reads", "training", "mutations", "export", "eviction", "randomized"})


class TestRedisTable(TableTests):
    """Standalone server, exact mode."""

    options: dict[str, Any] = {"storage_slice": 3, "keys_sending_size": 4}
    random_seeds = (0,)

    @pytest.fixture
    def url(self, redis_server) -> str:
        return f"redis://127.0.0.1:{redis_server.port}/0"

    @pytest.fixture
    def make_table(self, url, tag):
        n = itertools.count()

        def make(dim: int, **kwargs: Any) -> tensorkv.EmbeddingTable:
            opt = tensorkv.StorageOption("REDIS", storage_path=url, redis_options={
                "model_tag_runtime": f"{tag}t{next(n)}", **self.options})
            return tensorkv.EmbeddingTable(dim, storage=opt, **kwargs)

        return make


class TestRedisTableLastWriterWins(TestRedisTable):
    options = {"storage_slice": 2, "using_hash_storage_slice": True,
               "consistency": "last_writer_wins"}
    checks = CORE
    optimizers = ("adagrad",)
    random_seeds = (0,)


class TestRedisTableCluster(TestRedisTable):
    options = {"storage_slice": 5, "keys_sending_size": 3}
    checks = CORE
    optimizers = ("adam",)
    random_seeds = (1,)

    @pytest.fixture
    def url(self, redis_cluster) -> str:
        return redis_cluster.url


class TestRedisTableNearCache(TestRedisTable):
    """Exact mode through a near-cache small enough to evict: the DRAM table's results."""

    options = {"storage_slice": 3, "keys_sending_size": 4, "near_cache_rows": 24}
    checks = CORE
    optimizers = ("adagrad",)
    random_seeds = (2,)


class TestRedisTableNearCacheClusterLastWriterWins(TestRedisTable):
    options = {"storage_slice": 4, "consistency": "last_writer_wins",
               "near_cache_rows": 1000, "near_cache_min_freq": 1}
    checks = CORE
    optimizers = ("sgd",)
    random_seeds = (3,)

    @pytest.fixture
    def url(self, redis_cluster) -> str:
        return redis_cluster.url
