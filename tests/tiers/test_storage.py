import json

import pytest

from tensorkv.embedding.chain.specs import (
    DRAM,
    HBM,
    KV,
    PMEM,
    STORAGE_TYPES,
    SSDHash,
    StorageOption,
    spec_from_dict,
)
from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.errors import ConfigError


def kinds(opt):
    return [s.kind for s in opt.tier_specs()]


def test_default_is_dram():
    assert kinds(StorageOption()) == ["DRAM"]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("DRAM", ["DRAM"]),
        ("HBM", ["HBM"]),
        ("HBM_DRAM", ["HBM", "DRAM"]),
        ("DRAM_PMEM", ["DRAM", "PMEM"]),
        ("DRAM_SSDHASH", ["DRAM", "SSDHASH"]),
        ("DRAM_LEVELDB", ["DRAM", "KV"]),
        ("DRAM_ROCKSDB", ["DRAM", "KV"]),
        ("DRAM_LMDB", ["DRAM", "KV"]),
        ("DRAM_PMEM_SSDHASH", ["DRAM", "PMEM", "SSDHASH"]),
        ("HBM_DRAM_SSDHASH", ["HBM", "DRAM", "SSDHASH"]),
        ("dram_ssdhash", ["DRAM", "SSDHASH"]),
    ],
)
def test_deeprec_names(name, expected):
    assert kinds(StorageOption(name, storage_path="/data/emb")) == expected


def test_paths_sizes_and_urls():
    opt = StorageOption("DRAM_PMEM_SSDHASH", storage_path="/data/emb",
                        storage_size=["4GiB", 1 << 30, "100GB"])  # fmt: skip
    d, p, s = opt.tier_specs()
    assert d.size == 4 << 30 and p.size == 1 << 30 and s.size == 100 * 10**9
    assert p.path == "/data/emb/pmem.tier" and s.path == "/data/emb/ssdhash"
    (_, kv) = StorageOption("DRAM_LEVELDB", storage_path="/data/emb").tier_specs()
    assert kv.url == "leveldb:///data/emb" and kv.size is None
    (_, r) = StorageOption("DRAM_REDIS", storage_path="redis://h:6379/0").tier_specs()
    assert r.url == "redis://h:6379/0"
    (_, kv) = StorageOption("DRAM_ROCKSDB", storage_path="rocksdb:///x/y").tier_specs()
    assert kv.url == "rocksdb:///x/y"
    assert StorageOption("DRAM", storage_size="1GiB").tier_specs()[0].size == 1 << 30


def test_explicit_tiers():
    opt = StorageOption(tiers=[DRAM("4GiB"), SSDHash("/data/emb", segment_bytes="64MiB")],
                        cache_strategy="LRU")  # fmt: skip
    assert kinds(opt) == ["DRAM", "SSDHASH"] and opt.cache_strategy == "lru"
    assert opt.tier_specs()[1].options == {"segment_bytes": "64MiB"}
    opt = StorageOption(tiers=[HBM("8GiB"), DRAM("64GiB"), PMEM("/pmem/t"), KV("rocksdb:///d")])
    assert kinds(opt) == ["HBM", "DRAM", "PMEM", "KV"]


def test_round_trip_through_json():
    opt = StorageOption(
        tiers=[DRAM("4GiB"), PMEM("/pm/x", "1GiB"), SSDHash("/d", async_compaction=True)]
    )
    d = json.loads(json.dumps(opt.to_dict()))
    assert StorageOption.from_dict(d) == opt
    assert spec_from_dict(DRAM(5).to_dict()) == DRAM(5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"storage_type": "SSD"}, "valid names"),
        ({"storage_type": "DRAM_FOO"}, "DRAM_SSDHASH"),
        ({"storage_type": 3}, "valid names"),
        ({"storage_type": "DRAM_REDIS"}, "Redis URL"),
        ({"storage_type": "DRAM_REDIS", "storage_path": "/x"}, "Redis URL"),
        ({"storage_type": "DRAM_SSDHASH", "storage_path": 3}, "path or a URL"),
        ({"storage_type": "DRAM_SSDHASH", "overwrite": "yes"}, "overwrite='yes'"),
        ({"storage_type": "DRAM", "storage_size": ["1GiB", "2GiB"]}, "at most one size"),
        ({"storage_type": "DRAM", "storage_size": ["lots"]}, "size"),
        ({"storage_type": "DRAM", "cache_strategy": "fifo"}, "lfu"),
        ({"tiers": [SSDHash("/d"), DRAM("1GiB")]}, "must start with DRAM or HBM"),
        ({"tiers": [DRAM("1GiB"), HBM("1GiB")]}, "cannot sit below"),
        ({"tiers": [HBM(), HBM()]}, "appears twice"),
        ({"tiers": [DRAM(), SSDHash("/a"), KV("lmdb:///b")]}, "at most one of"),
        ({"tiers": [DRAM(), PMEM("/a"), PMEM("/b")]}, "appears twice"),
        ({"tiers": []}, "non-empty"),
        ({"tiers": ["DRAM"]}, "not a tier spec"),
        ({"tiers": [DRAM()], "storage_size": [1]}, "not both"),
    ],
)
def test_impossible_options(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        StorageOption(**kwargs)


def test_spec_argument_errors():
    with pytest.raises(ConfigError, match="takes a path"):
        SSDHash("")
    with pytest.raises(ConfigError, match="takes a path"):
        PMEM(3)
    with pytest.raises(ConfigError, match="store URL"):
        KV("/no/scheme")
    with pytest.raises(ConfigError, match="size"):
        DRAM("-3")


def test_every_listed_name_builds():
    for name in STORAGE_TYPES:
        path = "redis://h:1/0" if "REDIS" in name else "/data/emb"
        assert StorageOption(name, storage_path=path).tier_specs()


def test_specs_open_tiers(tmp_path):
    lay = RecordLayout(4)
    for spec in (SSDHash(tmp_path / "s"), PMEM(tmp_path / "p"), KV(f"lmdb://{tmp_path}/k")):
        t = spec.open(lay)
        assert len(t) == 0
        t.close()
