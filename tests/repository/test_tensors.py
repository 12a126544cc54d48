"""Tensor ids and chunk checksums from one pass; chunks of earlier versions still read."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import xxhash

from tensorkv import Repository, codec
from tensorkv.errors import CorruptRecordError
from tensorkv.repository import tensors
from tensorkv.repository.layout import manifest_key

G = {"nodes": [{"name": "x", "op": "input", "type": "input"}]}


def _spec_id(arr: np.ndarray, rows: int, parts: list[bytes]) -> str:
    """The tensor id as docs/repository.md specifies it."""
    shape = ",".join(map(str, arr.shape))
    h = xxhash.xxh3_128(f"tensorkv.tensor/2|{tensors.dtype_name(arr.dtype)}|{shape}|{rows}|"
                        .encode())
    for p in parts:
        h.update(xxhash.xxh3_128_digest(p))  # each chunk's canonical digest
    return h.hexdigest()


@pytest.mark.parametrize("arr", [
    np.arange(1000, dtype=np.float32).reshape(250, 4),  # 16-byte rows: 64 rows a chunk
    np.arange(60, dtype=np.float32).reshape(15, 4),  # one chunk of 240 bytes
    np.arange(61, dtype=np.float32),  # one chunk of 244 bytes
    np.zeros((0, 3), np.float64), np.array(2.5), np.arange(7, dtype=np.int8),
    np.ones((9, 5), ml_dtypes.bfloat16),
])
def test_one_pass_gives_the_specified_ids_and_checksums(arr):
    e, flat = tensors.stage(arr, None, 1024)
    rows = e["rows"]
    data = arr.tobytes()
    step = rows * (arr.nbytes // arr.shape[0]) if e["chunks"] > 1 else arr.nbytes
    parts = [data[i * step:(i + 1) * step] for i in range(e["chunks"])]
    assert e["sums"] == [f"{xxhash.xxh3_64_intdigest(p):016x}" for p in parts]
    assert e["id"] == _spec_id(arr, rows, parts)
    assert [bytes(v) for _, v in tensors.chunk_values(flat, e)] == parts
    assert e["chunks"] == (4 if arr.shape == (250, 4) else 1)


def test_a_tensor_put_with_two_chunk_sizes_reads_back_both_ways(lmdb_url):
    arr = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    with Repository(lmdb_url, chunk_bytes=1024) as small, \
            Repository(lmdb_url, chunk_bytes=4096) as large:
        a = small.put(G, {"w": arr})
        b = large.put(G, {"w": arr})  # other chunk bounds: another id, its own chunks
        ea, eb = (r.manifest(m)["tensors"]["w"] for r, m in ((small, a), (large, b)))
        assert (ea["rows"], eb["rows"]) == (64, 256) and ea["id"] != eb["id"]
        for r, m in ((small, a), (large, b), (small, b), (large, a)):
            np.testing.assert_array_equal(r.read_tensor(m, "w", as_numpy=True), arr)
            np.testing.assert_array_equal(r.read_tensor(m, "w", index=slice(300, 700),
                                                        as_numpy=True), arr[300:700])
        assert small.check(verify=True)["ok"]


def test_records_of_earlier_versions_still_read(lmdb_url):
    """Chunks written as tensor records, entries without checksums: the earlier format."""
    arr = np.arange(3000, dtype=np.float64).reshape(300, 10)
    with Repository(lmdb_url, chunk_bytes=8000) as repo:
        mid = repo.put(G, {"w": arr})
        m = repo.manifest(mid)
        e = m["tensors"]["w"]
        for i, (key, value) in enumerate(tensors.chunk_values(tensors.stage(arr, None, 8000)[1],
                                                              e)):
            rows = np.frombuffer(value, np.float64).reshape(-1, 10)
            assert rows.shape[0] == min(e["rows"], 300 - i * e["rows"])
            repo.meta.put(key, codec.encode(rows))
        del e["sums"]
        repo.meta.put(manifest_key(mid), json.dumps(m).encode())
        repo.manifests.clear()
    with Repository(lmdb_url) as repo:
        np.testing.assert_array_equal(repo.read_tensor(mid, "w", as_numpy=True), arr)
        np.testing.assert_array_equal(repo.read_tensor(mid, "w", index=7, copy=False), arr[7])
        key = tensors.chunk_key(e["id"], 1)
        rec = bytearray(repo.meta.get(key))
        rec[-1] ^= 1
        repo.meta.put(key, bytes(rec))
        with pytest.raises(CorruptRecordError, match="checksum"):
            repo.read_tensor(mid, "w")
