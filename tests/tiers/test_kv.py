import itertools
import uuid

import numpy as np
import pytest

from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.embedding.tiers.kv import KVTier, decode_keys, encode_keys
from tensorkv.errors import ConfigError, CorruptRecordError, ShapeError
from tensorkv.stores import open_store
from tensorkv.testing.tiers import TierTests, make_records

_n = itertools.count()


class TestKVTierMemory(TierTests):
    @pytest.fixture
    def make_tier(self):
        url = f"memory://tier-{uuid.uuid4().hex}"  # named: survives close within the process
        return lambda layout: KVTier(url, layout)


class TestKVTierLMDB(TierTests):
    @pytest.fixture
    def make_tier(self, tmp_path):
        return lambda layout: KVTier(f"lmdb://{tmp_path}/db", layout, batch_rows=64)


class TestKVTierRocksDB(TierTests):
    @pytest.fixture
    def make_tier(self, tmp_path):
        return lambda layout: KVTier(f"rocksdb://{tmp_path}/db", layout, batch_rows=64)


class TestKVTierLevelDB(TierTests):
    @pytest.fixture
    def make_tier(self, tmp_path):
        return lambda layout: KVTier(f"leveldb://{tmp_path}/db", layout, batch_rows=64)


class TestKVTierRedis(TierTests):
    @pytest.fixture
    def make_tier(self, redis_server):
        prefix = f"tier{next(_n)}-{uuid.uuid4().hex[:8]}/"
        return lambda layout: KVTier(redis_server.url, layout, prefix=prefix, batch_rows=64)


LAY = RecordLayout(4, num_slots=2)


def test_key_encoding_orders_like_int64():
    keys = np.array([np.iinfo(np.int64).min, -(1 << 40), -256, -1, 0, 1, 255, 256, 1 << 40,
                     np.iinfo(np.int64).max], np.int64)  # fmt: skip
    enc = encode_keys(b"p/", keys)
    assert all(len(k) == 10 and k.startswith(b"p/") for k in enc)
    assert enc == sorted(enc)
    assert enc[4] == b"p/\x80" + b"\x00" * 7  # trailing zero bytes survive
    np.testing.assert_array_equal(decode_keys(2, enc), keys)


def test_ordered_store_scans_in_key_order(tmp_path):
    t = KVTier(f"lmdb://{tmp_path}/db", LAY)
    keys = np.array([5, -3, 100, -(1 << 50), 0], np.int64)
    t.put(keys, make_records(LAY, keys))
    assert t.keys().tolist() == sorted(keys.tolist())
    t.close()


def test_prefixes_isolate_tables_and_shared_store_stays_open():
    store = open_store("memory://")
    a = KVTier(store, LAY, prefix=b"a/")
    b = KVTier(store, LAY, prefix=b"b/")
    ka = np.arange(10, dtype=np.int64)
    a.put(ka, make_records(LAY, ka))
    assert len(a) == 10 and len(b) == 0 and b.keys().size == 0
    a.close()
    assert not store.closed  # a store passed in is left open
    with pytest.raises(ShapeError, match="another prefix"):
        KVTier(store, RecordLayout(5), prefix=b"a/")
    store.close()


def test_bad_options():
    with pytest.raises(ConfigError, match="prefix"):
        KVTier("memory://", LAY, prefix=b"")
    with pytest.raises(ConfigError, match="prefix"):
        KVTier("memory://", LAY, prefix=b"\x00x")
    with pytest.raises(ConfigError, match="batch_rows"):
        KVTier("memory://", LAY, batch_rows=0)
    with pytest.raises(ConfigError, match="URL"):
        KVTier(42, LAY)


def test_foreign_value_reported():
    store = open_store("memory://")
    t = KVTier(store, LAY, prefix=b"t/")
    keys = np.arange(3, dtype=np.int64)
    t.put(keys, make_records(LAY, keys))
    store.put(encode_keys(b"t/", keys[1:2])[0], b"short")
    with pytest.raises(CorruptRecordError, match="bytes"):
        t.get(keys)
    assert t.check() and "bytes" in t.check()[0]
    t.close()
    store.close()
