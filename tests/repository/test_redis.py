"""Repositories over several Redis providers, a full Redis, a Redis Cluster, rebalancing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import servers
from tensorkv import Repository
from tensorkv.errors import StoreFullError

from .conftest import ns
from .models import CNN, assert_state_equal, mlp


def big(seed: int, mb: float) -> tuple[dict, dict]:
    """A one-layer graph holding a float32 tensor of ``mb`` MiB."""
    rows = int(mb * (1 << 20) / 4 / 256)
    g = {"nodes": [{"name": "x", "op": "input", "type": "input"},
                   {"name": "fc", "type": "D", "inputs": ["x"],
                    "params": {"w": {"shape": [rows, 256], "dtype": "float32"}}}]}
    return g, {"fc.w": np.random.default_rng(seed).random((rows, 256), dtype=np.float32)}


@pytest.fixture
def provider_urls(repo_redis_pool):
    p = ns()
    return [f"redis://127.0.0.1:{s.port}/0?prefix={p}" for s in repo_redis_pool]


def test_tensors_spread_over_providers_and_read_back_exactly(provider_urls):
    with Repository(provider_urls, chunk_bytes=2048) as repo:
        models = [mlp((16, 32, 32, 8), seed=s) for s in range(6)]
        ids = [repo.put(m) for m in models]
        per = [p["chunks"] for p in repo.stats()["providers"]]
        assert all(c > 0 for c in per) and sum(per) >= 6 * 6
        for mid, m in zip(ids, models, strict=True):
            assert_state_equal(repo.get(mid), m.state_dict())
        assert repo.check(verify=True)["ok"]
    with Repository(provider_urls) as other:  # a second client sees the same models
        assert [r["id"] for r in other.list()] == ids


def test_rebalance_after_adding_a_provider(provider_urls):
    with Repository(provider_urls[:1], chunk_bytes=2048) as repo:
        m = CNN()
        mid = repo.put(m)
    with Repository(provider_urls[:2]) as repo:
        assert_state_equal(repo.get(mid), m.state_dict())  # found off home
        moved = repo.rebalance()
        assert moved["moved_tensors"] > 0
        per = [p["chunks"] for p in repo.stats()["providers"]]
        assert all(c > 0 for c in per)
        assert repo.rebalance()["moved_tensors"] == 0
        assert_state_equal(repo.get(mid), m.state_dict())
        assert repo.check(verify=True)["ok"]


@pytest.fixture
def small_redis():
    if not servers.available():
        pytest.skip("redis-server is not installed")
    s = servers.RedisServer(extra_conf="maxmemory 3mb\nmaxmemory-policy noeviction\n").start()
    yield s
    s.stop()


def test_full_redis_refuses_cleanly_and_stays_consistent(small_redis):
    url = small_redis.url
    with Repository(url, chunk_bytes=256 << 10) as repo:
        g, sd = big(0, 0.25)
        keep = repo.put(g, sd, name="small")
        before = repo.stats()
        g2, sd2 = big(1, 8)
        with pytest.raises(StoreFullError) as info:
            repo.put(g2, sd2, name="too-big")
        assert "every provider refused" in str(info.value)
        assert "repository is unchanged" in " ".join(getattr(info.value, "__notes__", []))
        assert [r["name"] for r in repo.list()] == ["small"]
        np.testing.assert_array_equal(repo.read_tensor(keep, "fc.w"), sd["fc.w"])
        repo.gc(grace=0)
        assert repo.check(verify=True)["ok"]
        after = repo.stats()
        assert after["bytes_stored"] == before["bytes_stored"]
        assert after["tensors"] == before["tensors"]


def test_a_full_provider_spills_to_the_next(repo_redis, small_redis):
    urls = [f"redis://127.0.0.1:{repo_redis.port}/0?prefix={ns()}", small_redis.url]
    with Repository(urls, chunk_bytes=256 << 10) as repo:
        sds = []
        for s in range(4):
            g, sd = big(10 + s, 2)
            sds.append((repo.put(g, sd), sd))
        for mid, sd in sds:
            np.testing.assert_array_equal(repo.read_tensor(mid, "fc.w"), sd["fc.w"])
        assert repo.check()["ok"]


def test_redis_cluster_provider(redis_cluster):
    with Repository(f"{redis_cluster.url}?prefix={ns()}", chunk_bytes=2048) as repo:
        m = CNN()
        mid = repo.put(m, metrics={"val_acc": 0.4})
        assert_state_equal(repo.get(mid), m.state_dict())
        assert torch.equal(repo.read_tensor(mid, "conv1.weight", index=3), m.conv1.weight[3])
        assert repo.longest_prefix(CNN(seed=2))[0] == mid
        assert repo.delete(mid) > 0 and repo.stats()["bytes_stored"] == 0
