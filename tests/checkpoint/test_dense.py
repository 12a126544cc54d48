"""Dense tensors: round trips, slices, content sharing, corruption and mismatches."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorkv
from tensorkv.checkpoint import layout
from tensorkv.errors import CheckpointError, CorruptRecordError, ShapeError, TagNotFoundError

DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "uint64", "float16", "float32",
          "float64", "complex64"]


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {f"t_{d}": (rng.standard_normal((33, 7)) * 50).astype(d) for d in DTYPES}
    out["scalar"] = np.float32(3.5) * np.ones((), np.float32)
    out["empty"] = np.zeros((0, 4), np.float32)
    out["bf16"] = rng.standard_normal((5, 3)).astype(ml_dtypes.bfloat16)
    out["big"] = rng.standard_normal((3000, 100)).astype(np.float32)  # several chunks
    return out


def test_round_trip_every_backend(url):
    arrs = _arrays()
    tensorkv.save(arrs, url, "v1", step=1, chunk_bytes=64 * 1024, metadata={"lr": 0.1})
    got = tensorkv.load(None, url, "v1")
    assert set(got) == set(arrs)
    for k, v in arrs.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert got[k].tobytes() == v.tobytes()
    info = tensorkv.checkpoint.tag_manifest(url, "v1")
    assert info["step"] == 1 and info["metadata"] == {"lr": 0.1}
    assert len(info["dense"]["big"]["chunks"]) == 19  # 1.2 MB / 64 KiB


def test_torch_bfloat16_and_in_place_load(mem_url):
    src = {"a": torch.randn(17, 5).to(torch.bfloat16), "b": torch.arange(10, dtype=torch.int64)}
    tensorkv.save(src, mem_url, "t")
    dst = {"a": torch.zeros(17, 5, dtype=torch.bfloat16), "b": torch.zeros(10, dtype=torch.int64)}
    a_ref = dst["a"]
    tensorkv.load(dst, mem_url, "t")
    assert dst["a"] is a_ref  # loaded in place
    assert torch.equal(dst["a"], src["a"]) and torch.equal(dst["b"], src["b"])
    raw = tensorkv.load(None, mem_url, "t")["a"]
    assert raw.dtype == ml_dtypes.bfloat16
    assert np.array_equal(raw.view(np.int16), src["a"].view(torch.int16).numpy())


def test_module_round_trip(mem_url):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    m(torch.randn(8, 6))  # update BatchNorm running stats
    tensorkv.save(m, mem_url, "m")
    m2 = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    tensorkv.load(m2, mem_url, "m")
    for (k, v), (_, w) in zip(m.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.equal(v, w), k


@settings(max_examples=60, deadline=None)
@given(
    st.integers(-12, 12), st.integers(-12, 12), st.integers(-3, 3).filter(lambda s: s != 0),
    st.sampled_from([None, 0, -1, slice(1, 3), slice(None, None, -2)]),
)
def test_read_tensor_basic_slices(start, stop, step, second):
    url = "memory://ckpt-slices"
    arr = np.arange(11 * 5 * 3, dtype=np.float64).reshape(11, 5, 3)
    if not tensorkv.list_tags(url):
        tensorkv.save({"x": arr}, url, "s", chunk_bytes=1024)
    idx = (slice(start, stop, step),) if second is None else (slice(start, stop, step), second)
    assert np.array_equal(tensorkv.read_tensor(url, "s", "x", idx), arr[idx])


def test_read_tensor_reads_only_needed_chunks(mem_url):
    arr = np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64)  # 1 MiB, 64 chunks of 16 KiB
    tensorkv.save({"x": arr}, mem_url, "s", chunk_bytes=16 * 1024)
    with tensorkv.open_store(mem_url) as store:
        info = tensorkv.checkpoint.tag_manifest(store, "s")["dense"]["x"]
        # delete every chunk but the one holding rows 64..127: a read of those rows still works
        keep = layout.chunk_key(info["chunks"][1])
        store.delete_many(
            [layout.chunk_key(d) for d in info["chunks"] if layout.chunk_key(d) != keep]
        )
        assert np.array_equal(tensorkv.read_tensor(store, "s", "x", slice(64, 128)), arr[64:128])
        assert np.array_equal(tensorkv.read_tensor(store, "s", "x", 100), arr[100])
        got = tensorkv.read_tensor(store, "s", "x", (70, slice(3, 9)))
        assert np.array_equal(got, arr[70, 3:9])
        with pytest.raises(CorruptRecordError, match="'x': chunk 0 .*missing"):
            tensorkv.read_tensor(store, "s", "x", 0)
    with pytest.raises(IndexError, match="out of bounds"):
        tensorkv.read_tensor(mem_url, "s", "x", 5000)
    with pytest.raises(IndexError, match="basic index"):
        tensorkv.read_tensor(mem_url, "s", "x", [1, 2])


def test_unchanged_chunks_are_shared(mem_url):
    arrs = {"a": np.random.default_rng(1).standard_normal((1000, 100)).astype(np.float32)}
    tensorkv.save(arrs, mem_url, "one", chunk_bytes=4096)
    with tensorkv.open_store(mem_url) as store:
        n1 = store.count(layout.CHUNK)
        arrs["a"][0, 0] += 1  # one chunk changes
        tensorkv.save(arrs, store, "two", chunk_bytes=4096)
        assert store.count(layout.CHUNK) == n1 + 1
        tensorkv.delete_tag(store, "one")
        assert store.count(layout.CHUNK) == n1  # the replaced chunk went with its tag
    assert np.array_equal(tensorkv.load(None, mem_url, "two")["a"], arrs["a"])


def test_corrupted_chunk_names_variable_and_chunk(url):
    arrs = {"w": np.arange(100000, dtype=np.float32), "b": np.ones(3, np.float32)}
    tensorkv.save(arrs, url, "c", chunk_bytes=64 * 1024)
    with tensorkv.open_store(url) as store:
        d = tensorkv.checkpoint.tag_manifest(store, "c")["dense"]["w"]["chunks"][2]
        key = layout.chunk_key(d)
        val = bytearray(store.get(key))
        val[100] ^= 0x01
        store.put(key, bytes(val))
    target = {"w": np.zeros(100000, np.float32), "b": np.zeros(3, np.float32)}
    with pytest.raises(CorruptRecordError, match=r"variable 'w': chunk 2 .*checksum"):
        tensorkv.load(target, url, "c")
    assert not target["w"].any() and not target["b"].any()  # unchanged
    rep = tensorkv.checkpoint.check(url, verify=True)
    assert rep.corrupt and "chunk 2" in rep.corrupt[0]


def test_shape_and_dtype_mismatch_leave_target_unchanged(mem_url):
    tensorkv.save({"a": np.ones((3, 4), np.float32), "b": np.ones(2, np.int64)}, mem_url, "t")
    bad_shape = {"a": np.zeros((4, 3), np.float32), "b": np.zeros(2, np.int64)}
    with pytest.raises(ShapeError, match=r"'a'.*float32\(3, 4\).*float32\(4, 3\)"):
        tensorkv.load(bad_shape, mem_url, "t")
    assert not bad_shape["a"].any() and not bad_shape["b"].any()
    bad_dtype = {"a": torch.zeros(3, 4, dtype=torch.float16), "b": np.zeros(2, np.int64)}
    with pytest.raises(ShapeError, match="float16"):
        tensorkv.load(bad_dtype, mem_url, "t")
    assert not bad_dtype["a"].any()


def test_missing_tag_lists_available(mem_url):
    tensorkv.save({"a": np.ones(2)}, mem_url, "first")
    tensorkv.save({"a": np.ones(2)}, mem_url, "second")
    with pytest.raises(TagNotFoundError, match=r"'nope' does not exist.*'first', 'second'"):
        tensorkv.load(None, mem_url, "nope")
    with pytest.raises(KeyError):
        tensorkv.read_tensor(mem_url, "nope", "a")
    with pytest.raises(TagNotFoundError, match="no checkpoint tags"):
        tensorkv.load(None, "memory://", "latest")


def test_bad_inputs(mem_url):
    with pytest.raises(CheckpointError, match="tag 'a/b' contains '/'"):
        tensorkv.save({"a": np.ones(2)}, mem_url, "a/b")
    with pytest.raises(CheckpointError, match="reserved"):
        tensorkv.save({"a": np.ones(2)}, mem_url, "latest")
    with pytest.raises(CheckpointError, match="has type str"):
        tensorkv.save({"a": "text"}, mem_url, "x")
    with pytest.raises(CheckpointError, match="cannot save a list"):
        tensorkv.save([1, 2], mem_url, "x")
    with pytest.raises(CheckpointError, match="give both"):
        tensorkv.save({"a": np.ones(2)}, mem_url, "x", shard=0)
    with pytest.raises(CheckpointError, match=r"shard=3 must be an int in \[0, 2\)"):
        tensorkv.save({"a": np.ones(2)}, mem_url, "x", shard=3, num_shards=2)
    with pytest.raises(CheckpointError, match="metadata is not JSON"):
        tensorkv.save({"a": np.ones(2)}, mem_url, "x", metadata={"f": object()})
    tensorkv.save({"a": np.ones(2)}, mem_url, "x")
    with pytest.raises(CheckpointError, match="already exists"):
        tensorkv.save({"a": np.zeros(2)}, mem_url, "x")
    assert tensorkv.load(None, mem_url, "x")["a"].tolist() == [1, 1]
    with pytest.raises(CheckpointError, match=r"does not hold \['zz'\]"):
        tensorkv.load(None, mem_url, "x", variables=["zz"])
    assert tensorkv.list_tags(mem_url) == ["x"]


def test_variables_subset(mem_url):
    tensorkv.save({"a": np.ones(2), "b": np.zeros(3)}, mem_url, "x")
    assert list(tensorkv.load(None, mem_url, "x", variables=["b"])) == ["b"]
