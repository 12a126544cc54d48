import numpy as np
import pytest

import tensorkv.embedding.tiers as tiers
from tensorkv.embedding.tiers.base import RecordLayout, as_keys
from tensorkv.errors import ConfigError, KeyTypeError, ShapeError


@pytest.mark.parametrize(
    "dim, dtype, slots, expected",
    [(64, "float32", 1, 544), (64, "float32", 0, 288), (64, "float32", 2, 800),
     (3, "float16", 1, 32 + 8 + 16), (5, "bfloat16", 0, 32 + 16), (1, "float32", 1, 32 + 8 + 8)],
)  # fmt: skip
def test_record_bytes(dim, dtype, slots, expected):
    lay = RecordLayout(dim, dtype, slots)
    assert lay.record_bytes == expected and lay.record_bytes % 8 == 0
    assert lay.slots_offset % 8 == 0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_pack_unpack_views(dtype):
    lay = RecordLayout(7, dtype, 2)
    rng = np.random.default_rng(0)
    keys = np.array([np.iinfo(np.int64).min, 0, 5], np.int64)
    vals = rng.standard_normal((3, 7)).astype(np.float32)
    slots = rng.standard_normal((3, 14)).astype(np.float32)
    buf = lay.pack(keys, vals, slots, freq=[1, 2, 3], version=9, seq=np.array([4, 5, 6]))
    f = lay.unpack(buf)
    np.testing.assert_array_equal(f.keys, keys)
    assert f.freq.tolist() == [1, 2, 3] and f.version.tolist() == [9] * 3
    assert f.change_seq.tolist() == [4, 5, 6]
    assert f.values.dtype == lay.dtype
    np.testing.assert_array_equal(f.values, vals.astype(lay.dtype))
    np.testing.assert_array_equal(f.slots, slots)
    f.freq[1] = 77  # views write through
    assert lay.unpack(buf).freq[1] == 77


def test_layout_errors():
    with pytest.raises(ConfigError, match="dim"):
        RecordLayout(0)
    with pytest.raises(ConfigError, match="num_slots"):
        RecordLayout(4, num_slots=-1)
    with pytest.raises(ConfigError, match="float32"):
        RecordLayout(4, "int8")
    lay = RecordLayout(4, num_slots=1)
    with pytest.raises(ShapeError, match=r"\(2, 4\)"):
        lay.pack(np.arange(2), np.zeros((2, 3)))
    with pytest.raises(ShapeError, match="num_slots"):
        lay.pack(np.arange(2), np.zeros((2, 4)), np.zeros((2, 5)))
    with pytest.raises(ShapeError, match="RecordLayout.pack"):
        lay.unpack(np.zeros((2, 8), np.uint8))


def test_layout_dict_round_trip():
    lay = RecordLayout(16, "bfloat16", 2)
    assert RecordLayout.from_dict(lay.to_dict()) == lay


def test_as_keys():
    assert as_keys([1, 2]).dtype == np.int64
    assert as_keys(np.array([1], np.uint32)).dtype == np.int64
    for bad in (np.array([1.0]), np.array([1], np.uint64), "x", 3, [1.5], np.array([[1]])):
        with pytest.raises((KeyTypeError, ShapeError)):
            as_keys(bad)


def test_package_exports_lazily():
    assert tiers.SSDHashTier.kind == "ssdhash"
    assert tiers.PMEMTier.kind == "pmem"
    assert tiers.KVTier.kind == "kv"
    with pytest.raises(AttributeError):
        tiers.Nope  # noqa: B018
