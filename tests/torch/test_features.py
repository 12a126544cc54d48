"""Feature inputs of the embedding collections: every malformed input is refused by name.

``parse_features`` checks a batch before any table is touched; each case below gives a clear
``ShapeError`` (or ``ConfigError`` for feature names) that names the feature and the fix.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from tensorkv.errors import ConfigError, ShapeError  # noqa: E402
from tensorkv.torch.features import KeyedTensor, parse_features  # noqa: E402

T = torch.tensor
IDS = T([1, 2, 3])
BAD = [
    (([1, 2], T([0])), ShapeError, "int64 .*torch tensor; got list"),
    (torch.zeros((1, 1, 1), dtype=torch.int64), ShapeError, "shape \\(1, 1, 1\\)"),
    ({"values": IDS}, ShapeError, "'lengths' or 'offsets'"),
    ({"values": IDS, "lengths": T([3]), "x": 1}, ShapeError, "'values' \\(or 'ids'\\)"),
    ({"values": IDS.reshape(3, 1), "lengths": T([3])}, ShapeError, "jagged values must be 1-D"),
    ({"values": IDS, "lengths": T([[3]])}, ShapeError, "lengths must be a 1-D integer"),
    ({"values": IDS, "lengths": T([4, -1])}, ShapeError, "negative count"),
    ({"values": IDS, "offsets": T([0, 3, 2])}, ShapeError, "must end at the number of ids"),
    ({"values": IDS, "offsets": T([1, 3])}, ShapeError, "must start at 0"),
    ({"values": IDS, "offsets": T([[0, 3]])}, ShapeError, "offsets must be a 1-D integer"),
    ({"values": IDS, "lengths": T([3]), "weights": T([1, 2, 3])}, ShapeError,
     "weights must be a float tensor of shape \\(3,\\)"),
    ((IDS.reshape(3, 1), T([0])), ShapeError, "needs 1-D ids"),
    ((IDS, T([], dtype=torch.int64)), ShapeError, "3 ids but no bags"),
    ((IDS, T([0, 5])), ShapeError, "must not decrease and must stay within"),
]


@pytest.mark.parametrize("value, error, words", BAD, ids=range(len(BAD)))
def test_a_malformed_feature_is_refused_by_name(value, error, words):
    with pytest.raises(error, match=words) as info:
        parse_features({"f": value}, ["f"])
    assert "'f'" in str(info.value)


def test_feature_names_and_the_container_are_checked():
    with pytest.raises(ShapeError, match="features of type list"):
        parse_features([IDS], ["f"])
    with pytest.raises(ConfigError, match=r"\['g'\] are not features .* are \['f'\]"):
        parse_features({"f": IDS, "g": IDS}, ["f"])
    with pytest.raises(ConfigError, match=r"\['g'\] are missing"):
        parse_features({"f": IDS}, ["f", "g"])


def kjt(keys, values, lengths=None, offsets=None):
    """An object with a KeyedJaggedTensor's fields (TorchRec's class is not needed)."""
    return SimpleNamespace(keys=lambda: keys, values=lambda: values,
                           lengths=lambda: lengths, offsets=lambda: offsets)


def test_malformed_keyed_jagged_tensors():
    with pytest.raises(ShapeError, match="neither lengths nor offsets"):
        parse_features(kjt(["f"], IDS), ["f"])
    with pytest.raises(ShapeError, match="values\\(\\) must be 1-D"):
        parse_features(kjt(["f"], IDS.reshape(3, 1), T([3])), ["f"])
    with pytest.raises(ShapeError, match="without keys holds 3 values"):
        parse_features(kjt([], IDS, T([3])), [])
    with pytest.raises(ShapeError, match="names feature 'f' twice"):
        parse_features(kjt(["f", "f"], IDS, T([1, 2])), ["f"])
    got = parse_features(kjt(["f", "g"], IDS, offsets=T([0, 1, 3])), ["f", "g"])
    assert got["f"].ids.tolist() == [1] and got["g"].ids.tolist() == [2, 3]
    assert parse_features(kjt([], T([], dtype=torch.int64), T([], dtype=torch.int64)), []) == {}


def test_keyed_tensor_views():
    kt = KeyedTensor(["a", "b"], {"a": torch.ones(2, 3), "b": torch.zeros(2, 1)})
    assert kt.values().shape == (2, 4) and kt.length_per_key() == [3, 1]
    assert kt.offset_per_key() == [0, 3, 4] and list(kt) == ["a", "b"] and len(kt) == 2
    assert "a" in kt and "c" not in kt and kt["b"].shape == (2, 1)
    assert set(kt.to_dict()) == {"a", "b"} and "widths=[3, 1]" in repr(kt)
