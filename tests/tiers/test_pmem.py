import numpy as np
import pytest

from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.embedding.tiers.pmem import HEADER_BYTES, PMEMTier
from tensorkv.errors import CapacityError, StoreLockedError, StorePathError
from tensorkv.testing.tiers import TierTests, make_records


@pytest.fixture
def shm_path(tmp_path):
    import os
    import shutil
    import uuid

    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    d = os.path.join(base, f"tkv-pmem-{uuid.uuid4().hex}")
    os.makedirs(d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class TestPMEMTier(TierTests):
    @pytest.fixture
    def make_tier(self, shm_path):
        return lambda layout: PMEMTier(f"{shm_path}/emb.tier", layout, capacity=16)


LAY = RecordLayout(4, num_slots=1)


def test_grows_and_reuses_free_slots(shm_path):
    t = PMEMTier(f"{shm_path}/t", LAY, capacity=16)
    keys = np.arange(100, dtype=np.int64)
    t.put(keys, make_records(LAY, keys))
    assert t.stats()["grows"] >= 1 and t.stats()["capacity"] >= 100
    t.put(keys, make_records(LAY, keys, 1))  # copy-on-write needs room for one more copy
    cap = t.stats()["capacity"]
    for i in range(5):  # from then on overwrites and deletes reuse slots: no growth
        t.put(keys, make_records(LAY, keys, i))
        t.delete(keys[:50])
        t.put(keys[:50], make_records(LAY, keys[:50], i))
    assert t.stats()["capacity"] == cap
    assert t.check() == []
    t.close()


def test_max_bytes_refuses_and_writes_nothing(shm_path):
    t = PMEMTier(f"{shm_path}/t", LAY, capacity=16, max_bytes=HEADER_BYTES + 20 * 64)
    keys = np.arange(16, dtype=np.int64)
    t.put(keys, make_records(LAY, keys))
    more = np.arange(16, 64, dtype=np.int64)
    with pytest.raises(CapacityError, match="max_bytes"):
        t.put(more, make_records(LAY, more))
    assert len(t) == 16 and t.check() == []
    t.close()


def test_torn_slot_dropped_and_older_copy_kept(shm_path):
    p = f"{shm_path}/t"
    t = PMEMTier(p, LAY, capacity=16)
    keys = np.arange(4, dtype=np.int64)
    old = make_records(LAY, keys, 1)
    t.put(keys, old)
    slot_old = int(t.index.lookup(keys[:1])[0])
    # Simulate a crash after the new copy was written but before the old slot was freed.
    t._arr[slot_old, -1]  # noqa: B018 - touch the mapping
    new = make_records(LAY, keys[:1], 2)
    t.put(keys[:1], new)
    arr = t._arr
    arr[slot_old] = arr[slot_old]  # unchanged
    # re-mark the old slot as used (as if the free had not reached memory)
    from tensorkv.kernels import ssdhash as K

    tmp = np.empty((1, t.words - 1), np.uint64)
    tmp[:, :-1] = old[:1].view(np.uint64)
    tmp[:, -1] = 0  # an older write sequence
    sealed = np.empty((1, t.words), np.uint64)
    K.seal(tmp, K.FLAG_PUT, sealed, 0)
    arr[slot_old] = sealed[0]
    # and tear key 3's record
    s3 = int(t.index.lookup(keys[3:])[0])
    arr[s3, 2] ^= np.uint64(1)
    t.close()
    t = PMEMTier(p, LAY)
    found, got = t.get(keys)
    assert found.tolist() == [True, True, True, False]
    np.testing.assert_array_equal(got[0], new[0])
    assert t.stats()["dropped_slots"] == 2
    assert t.check() == []
    t.close()


def test_locked_and_bad_paths(shm_path):
    t = PMEMTier(f"{shm_path}/t", LAY)
    with pytest.raises(StoreLockedError):
        PMEMTier(f"{shm_path}/t", LAY)
    t.close()
    with pytest.raises(StorePathError):
        PMEMTier(f"{shm_path}/missing/t", LAY)
    with pytest.raises(StorePathError):
        PMEMTier(shm_path, LAY)
    with open(f"{shm_path}/junk", "wb") as f:
        f.write(b"x" * 5000)
    with pytest.raises(StorePathError, match="magic"):
        PMEMTier(f"{shm_path}/junk", LAY)
