"""The Redis command packer: large values go on the wire without being copied."""

from __future__ import annotations

import numpy as np

from tensorkv.stores.redis_pack import LARGE_VALUE_BYTES, LargeValuePacker


def test_large_values_are_sent_from_their_own_memory():
    packer = LargeValuePacker()
    big = memoryview(np.arange(LARGE_VALUE_BYTES, dtype=np.uint8))
    out = packer.pack("MSET", b"k1", big, b"k2", b"small")
    assert any(part is big for part in out)  # the value itself, not a copy
    wire = b"".join(bytes(p) for p in out)
    assert wire.startswith(b"*5\r\n$4\r\nMSET\r\n$2\r\nk1\r\n$%d\r\n" % LARGE_VALUE_BYTES)
    assert wire.endswith(b"$2\r\nk2\r\n$5\r\nsmall\r\n")


def test_small_commands_pack_as_before():
    packer = LargeValuePacker()
    wire = b"".join(bytes(p) for p in packer.pack("SET", b"k", b"v"))
    assert wire == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n"
