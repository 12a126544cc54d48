"""Tags: list, latest, delete, expiry, copy, dump/restore, check/gc, hash tags, CLI, progress."""

from __future__ import annotations

import time

import numpy as np
import pytest
from click.testing import CliRunner

import tensorkv
from tensorkv.checkpoint import layout
from tensorkv.cli.main import main as cli
from tensorkv.errors import CheckpointError, CorruptRecordError, TagNotFoundError

from .helpers import assert_tables_equal, make_table


def test_list_latest_delete(mem_url):
    assert tensorkv.latest_tag(mem_url) is None
    for i in range(3):
        tensorkv.save({"a": np.full(3, i)}, mem_url, step=i)
    assert tensorkv.list_tags(mem_url) == ["step-0", "step-1", "step-2"]
    assert tensorkv.latest_tag(mem_url) == "step-2"
    assert tensorkv.load(None, mem_url)["a"].tolist() == [2, 2, 2]
    rows = tensorkv.list_tags(mem_url, details=True)
    assert rows[1]["step"] == 1 and rows[1]["dense_bytes"] == 24
    tensorkv.delete_tag(mem_url, "step-2")
    assert tensorkv.latest_tag(mem_url) == "step-1"
    with pytest.raises(TagNotFoundError, match="'step-2' does not exist.*'step-0', 'step-1'"):
        tensorkv.delete_tag(mem_url, "step-2")


def test_expiry(mem_url):
    tensorkv.save({"a": np.ones(2)}, mem_url, "keep")
    tensorkv.save({"a": np.zeros(2), "e": make_table(100)}, mem_url, "short", ttl=1.0)
    assert tensorkv.list_tags(mem_url) == ["keep", "short"]
    time.sleep(1.1)
    assert tensorkv.list_tags(mem_url) == ["keep"]
    assert tensorkv.latest_tag(mem_url) == "keep"
    with pytest.raises(TagNotFoundError, match="'short' has expired"):
        tensorkv.load(None, mem_url, "short")
    assert tensorkv.list_tags(mem_url, include_expired=True) == ["keep", "short"]
    rep = tensorkv.checkpoint.gc(mem_url)
    assert rep.removed_tags == ["short"]
    with tensorkv.open_store(mem_url) as store:
        assert store.count(layout.TABLE) == 0
    assert tensorkv.checkpoint.check(mem_url).ok
    tensorkv.checkpoint.expire_tag(mem_url, "keep", 1000)
    assert tensorkv.checkpoint.tag_manifest(mem_url, "keep")["expires"] > time.time() + 900
    with pytest.raises(CheckpointError, match="ttl"):
        tensorkv.save({"a": np.ones(2)}, mem_url, "bad", ttl=-1)


def test_copy_within_and_across_stores(url, mem_url):
    t = make_table(3000, 8)
    tensorkv.save({"emb": t, "w": np.arange(5.0)}, url, "a")
    t.apply_gradients(t.keys()[:10], np.ones((10, 8), np.float32), step=9)
    tensorkv.save({"emb": t, "w": np.arange(5.0)}, url, "b", incremental=True)
    tensorkv.copy_tag(url, "a", "a2")
    tensorkv.copy_tag(url, "b", dst_url=mem_url)  # incremental: folded on the way
    with pytest.raises(CheckpointError, match="onto itself"):
        tensorkv.copy_tag(url, "a")
    tensorkv.delete_tag(url, "b")
    tensorkv.delete_tag(url, "a")
    assert tensorkv.list_tags(url) == ["a2"]
    a2 = tensorkv.load(None, url, "a2")
    b = tensorkv.load(None, mem_url, "b")
    assert_tables_equal(b["emb"], t)
    assert len(a2["emb"]) == 3000 and np.array_equal(a2["w"], np.arange(5.0))
    assert not tensorkv.checkpoint.tag_manifest(mem_url, "b")["incremental"]
    assert tensorkv.checkpoint.check(url).ok


def test_dump_and_restore(url, tmp_path):
    t = make_table(2000, 8)
    tensorkv.save({"emb": t, "w": np.arange(50000.0)}, url, "a", chunk_bytes=64 * 1024)
    t.lookup(np.arange(10, dtype=np.int64))
    tensorkv.save({"emb": t, "w": np.arange(50000.0)}, url, "b", incremental=True)
    path = str(tmp_path / "b.tkv")
    assert tensorkv.dump_tag(url, "b", path) > 400000
    tensorkv.import_dump(path, "memory://", "x")  # private store: just checks it restores
    dst = "memory://ckpt-restore-" + str(abs(hash(url)))
    assert tensorkv.import_dump(path, dst, "b-restored") == "b-restored"
    got = tensorkv.load(None, dst, "b-restored")
    assert_tables_equal(got["emb"], t)
    assert np.array_equal(got["w"], np.arange(50000.0))
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    raw[5000] ^= 0xFF
    bad = tmp_path / "bad.tkv"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CorruptRecordError, match="checksum"):
        tensorkv.import_dump(str(bad), dst, "c")
    bad.write_bytes(bytes(raw[:1000]))
    with pytest.raises(CorruptRecordError, match="truncated"):
        tensorkv.import_dump(str(bad), dst, "c")
    assert tensorkv.list_tags(dst) == ["b-restored"]


def test_check_and_gc_respect_pending_saves(mem_url):
    tensorkv.save({"a": np.arange(10.0), "e": make_table(100)}, mem_url, "ok")
    with tensorkv.open_store(mem_url) as store:
        # a save in progress: marker, a chunk and a table block, no manifest yet
        store.put(layout.pending_key("running", 0), b'{"started": %f}' % time.time())
        store.put(layout.chunk_key("0" * 32), b"x")
        store.put(layout.table_prefix("running", "e", 0) + b"b/00/00000000", b"y")
        # a dead save's leftovers
        store.put(layout.table_prefix("dead", "e", 0) + b"b/00/00000000", b"z")
    rep = tensorkv.checkpoint.check(mem_url)
    assert len(rep.orphan_keys) == 1 and not rep.ok and rep.pending[0]["tag"] == "running"
    tensorkv.checkpoint.gc(mem_url)
    with tensorkv.open_store(mem_url) as store:
        assert store.get(layout.chunk_key("0" * 32)) == b"x"  # protected
        assert store.count(layout.table_prefix("running", "e", 0)) == 1
        assert store.count(layout.table_prefix("dead", "e", 0)) == 0
    rep = tensorkv.checkpoint.gc(mem_url, grace=0)  # now the marker is stale
    assert rep.removed_keys == 2
    assert tensorkv.checkpoint.check(mem_url).ok
    assert len(tensorkv.load(None, mem_url, "ok")["e"]) == 100


@pytest.mark.parametrize("hash_tag", ["table", "bucket", "model7"])
def test_hash_tags_in_keys(mem_url, hash_tag):
    t = make_table(2000, 4)
    tensorkv.save({"emb": t}, mem_url, "h", hash_tag=hash_tag, block_rows=64)
    with tensorkv.open_store(mem_url) as store:
        keys = [bytes(k) for k in store.scan(layout.TABLE, keys_only=True)]
    blocks = [k for k in keys if b"/b/" in k] if hash_tag == "bucket" else keys
    assert blocks and all(b"{" in k and b"}" in k for k in blocks)
    if hash_tag == "table":
        assert {k[k.index(b"{"): k.index(b"}") + 1] for k in keys} == {b"{h/emb}"}
    if hash_tag == "model7":
        assert all(k.startswith(b"ckpt/t/{model7}/h/emb/") for k in keys)
    t.lookup(np.arange(5, dtype=np.int64))
    tensorkv.save({"emb": t}, mem_url, "h2", hash_tag=hash_tag, incremental=True)
    assert_tables_equal(tensorkv.load(None, mem_url, "h2")["emb"], t)
    assert tensorkv.checkpoint.check(mem_url).ok
    tensorkv.delete_tag(mem_url, "h", force=True)
    tensorkv.delete_tag(mem_url, "h2")
    with tensorkv.open_store(mem_url) as store:
        assert store.count(b"ckpt/") == 0


def test_cli(tmp_path):
    url = f"lmdb://{tmp_path}/db"
    t = make_table(500, 4)
    tensorkv.save({"emb": t, "w": np.ones(4)}, url, "a", step=1)
    t.lookup(np.arange(3, dtype=np.int64))
    tensorkv.save({"emb": t, "w": np.ones(4)}, url, "b", step=2, incremental=True)
    r = CliRunner().invoke(cli, ["tags", url])
    assert r.exit_code == 0 and "a " in r.output and "a+" in r.output, r.output
    r = CliRunner().invoke(cli, ["check", url])
    assert r.exit_code == 0, r.output
    with tensorkv.open_store(url) as store:
        store.put(layout.table_prefix("gone", "e", 0) + b"k/00000000", b"junk")
    r = CliRunner().invoke(cli, ["check", url])
    assert r.exit_code == 1 and "orphaned records: 1" in r.output
    r = CliRunner().invoke(cli, ["gc", url])
    assert r.exit_code == 0 and "removed: 1 records" in r.output, r.output
    r = CliRunner().invoke(cli, ["compact", url, "b"])
    assert r.exit_code == 0 and "full tag" in r.output
    assert not tensorkv.checkpoint.tag_manifest(url, "b")["incremental"]
    r = CliRunner().invoke(cli, ["compact", url, "zz"])
    assert r.exit_code != 0 and "'zz' does not exist" in r.output
    r = CliRunner().invoke(cli, ["check", url, "--verify", "--json"])
    assert r.exit_code == 0 and '"ok": true' in r.output


def test_progress_bar(mem_url, capsys, monkeypatch):
    from tensorkv import config

    monkeypatch.setattr(config, "PROGRESS_MIN_SECONDS", 0.0)
    tensorkv.save({"a": np.ones(1000)}, mem_url, "p", progress=True)
    tensorkv.load(None, mem_url, "p", progress=True)
    assert "save p" in capsys.readouterr().err
    tensorkv.save({"a": np.ones(1000)}, mem_url, "q", progress=False)
    assert capsys.readouterr().err == ""


def test_many_tags_are_listed(url):
    """Manifests are listed in pages (ordered stores); every tag is found, in order."""
    for i in range(40):
        tensorkv.save({"a": np.full(2, i)}, url, f"t{i:02d}", step=i)
    tensorkv.save({"e": make_table(300, 4)}, url, "z", step=99)  # table records after them
    assert tensorkv.list_tags(url) == [f"t{i:02d}" for i in range(40)] + ["z"]
    assert tensorkv.load(None, url)["e"].dim == 4


def test_missing_parent_leaves_no_pending_marker(mem_url):
    tensorkv.save({"e": make_table(100, 4)}, mem_url, "a")
    with pytest.raises(TagNotFoundError, match="'nope' does not exist"):
        tensorkv.save({"e": make_table(100, 4)}, mem_url, "b", incremental=True, parent="nope")
    with tensorkv.open_store(mem_url) as store:
        assert store.count(layout.PENDING) == 0
    assert tensorkv.list_tags(mem_url) == ["a"]
