"""Opens that only read create nothing: ``create=False`` on stores, read-only checkpoint calls.

A mistyped path must fail with StoreNotFoundError and leave the file system as it was: no
directory, no lock file, no empty database that later reads as "no tags".
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import tensorkv
from servers import with_options
from tensorkv import checkpoint
from tensorkv.errors import StoreNotFoundError

EMBEDDED = ["lmdb", "rocksdb", "leveldb"]
MARKER = {"lmdb": "data.mdb", "rocksdb": "CURRENT", "leveldb": "CURRENT"}


def _snapshot(root) -> list[str]:
    """Every path under ``root`` (to prove nothing was created)."""
    out = []
    for d, dirs, files in os.walk(root):
        out += [os.path.join(d, n) for n in dirs + files]
    return sorted(out)


@pytest.mark.parametrize("scheme", EMBEDDED)
def test_create_false_on_a_missing_path(tmp_path, scheme):
    path = tmp_path / "typo" / "db"
    with pytest.raises(StoreNotFoundError, match="nothing was created") as info:
        tensorkv.open_store(f"{scheme}://{path}", create=False)
    assert str(path) in str(info.value)
    assert _snapshot(tmp_path) == []


@pytest.mark.parametrize("scheme", EMBEDDED)
@pytest.mark.parametrize("readonly", [False, True])
def test_create_false_on_an_empty_directory(tmp_path, scheme, readonly):
    path = tmp_path / "empty"
    path.mkdir()
    with pytest.raises(StoreNotFoundError, match=f"holds no {MARKER[scheme]}"):
        tensorkv.open_store(f"{scheme}://{path}?create=false", readonly=readonly)
    assert _snapshot(tmp_path) == [str(path)]


@pytest.mark.parametrize("scheme", EMBEDDED)
def test_create_false_opens_an_existing_store(tmp_path, scheme):
    url = f"{scheme}://{tmp_path / 'db'}"
    with tensorkv.open_store(url) as s:
        s.put(b"k", b"v")
    with tensorkv.open_store(url, create=False) as s:
        assert s.get(b"k") == b"v"
        s.put(b"k2", b"v2")  # create=False is not read-only
    with tensorkv.open_store(url, create=False, readonly=True) as s:
        assert s.get_many([b"k", b"k2"]) == [b"v", b"v2"]


def test_create_false_is_accepted_and_ignored_by_memory():
    with tensorkv.open_store("memory://", create=False) as s:
        s.put(b"k", b"v")
        assert s.get(b"k") == b"v"
    with pytest.raises(tensorkv.errors.ConfigError, match="create='maybe'"):
        tensorkv.open_store("memory://", create="maybe")


def test_create_false_is_accepted_and_ignored_by_redis(redis_server, key_prefix):
    url = with_options(redis_server.url, prefix=key_prefix, create="false")
    with tensorkv.open_store(url) as s:
        s.put(b"k", b"v")
        assert s.get(b"k") == b"v"


# ------------------------------------------------------------------ read-only checkpoint calls

READERS = {
    "list_tags": lambda url: checkpoint.list_tags(url),
    "latest_tag": lambda url: checkpoint.latest_tag(url),
    "tag_manifest": lambda url: checkpoint.tag_manifest(url, "v1"),
    "check": lambda url: checkpoint.check(url),
    "check_verify": lambda url: checkpoint.check(url, verify=True),
    "gc_dry_run": lambda url: checkpoint.gc(url, dry_run=True),
    "load": lambda url: tensorkv.load(None, url, "v1"),
    "load_into": lambda url: tensorkv.load({"w": np.zeros(3, np.float32)}, url, "v1"),
    "read_tensor": lambda url: checkpoint.read_tensor(url, "v1", "w"),
    "merge": lambda url: checkpoint.merge(url, "v1"),
    # not read-only, but they act on an existing tag: a mistyped path must not become a store
    "delete_tag": lambda url: checkpoint.delete_tag(url, "v1"),
    "expire_tag": lambda url: checkpoint.expire_tag(url, "v1", 60),
    "compact": lambda url: checkpoint.compact(url, "v1"),
}


@pytest.mark.parametrize("scheme", EMBEDDED)
@pytest.mark.parametrize("reader", sorted(READERS))
def test_read_only_checkpoint_calls_create_nothing(tmp_path, scheme, reader):
    path = tmp_path / "typo"
    with pytest.raises(StoreNotFoundError, match=f"no {scheme} store at"):
        READERS[reader](f"{scheme}://{path}")
    assert not path.exists()
    assert _snapshot(tmp_path) == []


@pytest.mark.parametrize("scheme", EMBEDDED)
def test_dump_and_copy_read_nothing_into_existence(tmp_path, scheme):
    src = f"{scheme}://{tmp_path / 'typo'}"
    with pytest.raises(StoreNotFoundError):
        checkpoint.dump_tag(src, "v1", str(tmp_path / "v1.dump"))
    with pytest.raises(StoreNotFoundError):
        checkpoint.copy_tag(src, "v1", "memory://")
    assert _snapshot(tmp_path) == []


@pytest.mark.parametrize("scheme", EMBEDDED)
def test_readers_still_read_existing_stores(tmp_path, scheme):
    url = f"{scheme}://{tmp_path / 'db'}"
    w = np.arange(6, dtype=np.float32)
    tensorkv.save({"w": w}, url, tag="v1")
    assert checkpoint.list_tags(url) == ["v1"]
    assert np.array_equal(tensorkv.load(None, url, "v1")["w"], w)
    assert np.array_equal(checkpoint.read_tensor(url, "v1", "w", slice(1, 3)), w[1:3])
    assert checkpoint.check(url, verify=True).ok
