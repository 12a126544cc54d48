"""Redis Cluster hash slots: the compiled kernel, its pure-Python source and known values."""

import numpy as np

from tensorkv.stores import redis_keys


def test_slots_match_redis_and_the_python_source():
    keys = [b"foo", b"123456789", b"{user1000}.following", b"{user1000}.followers", b"{}x",
            b"a{}{b}", b"{b", b"", b"tensorkv/\xff\x00key"]
    got = redis_keys.key_slots(keys)
    assert got[0] == 12182  # CLUSTER KEYSLOT foo
    assert got[1] == 0x31C3 % 16384  # CRC16/XMODEM check value of "123456789"
    assert got[2] == got[3]  # a hash tag picks the slot
    offsets = np.zeros(len(keys) + 1, np.int64)
    np.cumsum([len(k) for k in keys], out=offsets[1:])
    buf = np.frombuffer(b"".join(keys), np.uint8)
    np.testing.assert_array_equal(redis_keys._slots_py(buf, offsets, redis_keys._CRC16_TABLE), got)
    assert ((got >= 0) & (got < 16384)).all()
