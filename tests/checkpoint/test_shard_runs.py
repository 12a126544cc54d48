"""Run identity of sharded saves: shards of different runs never make one tag.

Every mix-up is refused with both sides named; the shards a crashed or abandoned run leaves
are listed by ``check``, removed by ``gc`` after the grace period and by ``delete_tag``, and
``check --verify`` flags a published tag whose shards disagree. Crashes of real processes
are in ``tests/faults/test_shard_crash.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import tensorkv
from tensorkv.checkpoint import claims, layout, manifest, runs
from tensorkv.errors import CheckpointError, ShardRunError, StoreLockedError, TagExistsError

from .helpers import make_table, rows_of

ROWS = 3000


def part(shard: int, n: int, seed: int = 7):
    """The rows of a reference table (``seed``) that shard ``shard`` of ``n`` owns."""
    keys, vals, slots, freq, ver = rows_of(make_table(ROWS, 4, "adagrad", seed=seed))
    m = layout.shard_of_keys(keys, n) == shard
    t = tensorkv.EmbeddingTable(4, optimizer="adagrad")
    t.import_([(keys[m], vals[m], slots[m], freq[m], ver[m])])
    return t


def model(shard: int, n: int, seed: int = 7) -> dict:
    return {"emb": part(shard, n, seed), "w": np.full(5, seed, np.float32)}


def assert_whole(url: str, tag: str, seed: int = 7) -> None:
    """The tag loads bit-identical to the reference table of ``seed``."""
    got = tensorkv.load(None, url, tag)
    want = rows_of(make_table(ROWS, 4, "adagrad", seed=seed))
    assert all(a.tobytes() == b.tobytes()
               for a, b in zip(want, rows_of(got["emb"]), strict=True))
    assert np.array_equal(got["w"], np.full(5, seed, np.float32))


def ckpt_keys(url: str) -> list[bytes]:
    with tensorkv.open_store(url) as s:
        return sorted(bytes(k) for k in s.keys(b"ckpt/"))


def test_leftover_shard_of_another_size_is_refused(url):
    # a crashed run of 3 shards left shard 1; a new run of 2 shards must not use it
    tensorkv.save(model(1, 3), url, "t", shard=1, num_shards=3)
    for s in (0, 1):
        with pytest.raises(ShardRunError, match=(
                r"of 3 shards, .*finished shards: \[1\]; not started: \[0, 2\]\. The two "
                r"differ: this shard has num_shards=2, that save num_shards=3")) as e:
            tensorkv.save(model(s, 2), url, "t", shard=s, num_shards=2)
        assert "tensorkv.delete_tag(url, 't')" in str(e.value)
    assert tensorkv.list_tags(url) == []
    rep = tensorkv.checkpoint.check(url)
    assert [(r["num_shards"], r["finished"], r["state"]) for r in rep.runs] == [
        (3, [1], "waiting")], rep.as_dict()
    tensorkv.delete_tag(url, "t")
    assert ckpt_keys(url) == []
    for s in (0, 1):
        tensorkv.save(model(s, 2), url, "t", shard=s, num_shards=2)
    assert_whole(url, "t")
    assert tensorkv.checkpoint.check(url, verify=True).ok


def _to_old_layout(url: str, tag: str) -> None:
    """Turn the finished shards of the run saving ``tag`` into what earlier versions wrote:
    ``ckpt/s/<tag>/<shard>`` manifests without a run, no run record."""
    with tensorkv.open_store(url) as s:
        r = runs.read(s, tag)
        assert r is not None
        for i, doc in runs.parts(s, tag, r.token).items():
            doc.pop("run")
            s.put(layout.shard_manifest_key(tag, i), manifest.encode_manifest(doc))
        s.delete_prefix(layout.run_parts_prefix(tag, r.token))
        s.delete(layout.run_key(tag))


def test_leftover_shard_saved_before_run_ids_is_refused(mem_url):
    tensorkv.save(model(1, 3), mem_url, "t", shard=1, num_shards=3)
    _to_old_layout(mem_url, "t")
    with pytest.raises(ShardRunError, match=r"shards \[1\] of 3 \(saved before run ids existed"):
        tensorkv.save(model(0, 2), mem_url, "t", shard=0, num_shards=2)
    rep = tensorkv.checkpoint.check(mem_url)
    assert [(r["token"], r["finished"], r["state"]) for r in rep.runs] == [(None, [1], "waiting")]
    assert tensorkv.checkpoint.gc(mem_url).removed_runs == []  # within the grace period
    assert tensorkv.checkpoint.gc(mem_url, grace=0).removed_runs[0]["finished"] == [1]
    assert ckpt_keys(mem_url) == []
    for s in (0, 1):
        tensorkv.save(model(s, 2), mem_url, "t", shard=s, num_shards=2)
    assert_whole(mem_url, "t")


@pytest.mark.filterwarnings("ignore:incremental save of table")  # p0, p1 hold no table
@pytest.mark.parametrize("first,second,match", [
    ({"run": "a"}, {"run": "b"}, r"this shard has run='b', that save has run='a'"),
    ({"run": "a"}, {}, r"this shard has no run id, that save has run='a'"),
    ({}, {"run": "b"}, r"this shard has run='b', that save has no run id"),
    ({"step": 5}, {"step": 6}, r"this shard has step=6, that save step=5"),
    ({"incremental": True}, {}, "this shard has incremental=False, that save incremental=True"),
    ({"incremental": True, "parent": "p0"}, {"incremental": True, "parent": "p1"},
     "this shard has parent='p1', that save parent='p0'"),
])
def test_shards_of_one_save_must_agree(mem_url, first, second, match):
    for p in ("p0", "p1"):
        tensorkv.save({"w": np.zeros(3)}, mem_url, p)
    tensorkv.save(model(0, 2), mem_url, "t", shard=0, num_shards=2, **first)
    with pytest.raises(ShardRunError, match=match):
        tensorkv.save(model(1, 2), mem_url, "t", shard=1, num_shards=2, **second)
    assert tensorkv.list_tags(mem_url) == ["p0", "p1"]
    tensorkv.save(model(1, 2), mem_url, "t", shard=1, num_shards=2, **first)  # nothing lost
    assert_whole(mem_url, "t")
    assert tensorkv.checkpoint.tag_manifest(mem_url, "t")["run"]["id"] == first.get("run")


def test_incremental_shards_build_on_the_parent_the_run_fixed(mem_url):
    keys, vals, slots, freq, ver = rows_of(make_table(ROWS, 4, "adagrad"))
    owner = layout.shard_of_keys(keys, 2)
    parts = []
    for s in range(2):
        t = tensorkv.EmbeddingTable(4, optimizer="adagrad")
        m = owner == s
        t.import_([(keys[m], vals[m], slots[m], freq[m], ver[m])])
        tensorkv.save({"emb": t}, mem_url, "b0", shard=s, num_shards=2)
        t.apply_gradients(t.keys()[:20], np.ones((20, 4), np.float32), step=2)
        parts.append(t)
    tensorkv.save({"emb": parts[0]}, mem_url, "b1", shard=0, num_shards=2, incremental=True)
    tensorkv.save({"x": np.ones(2)}, mem_url, "other")  # the latest tag now, while b1 runs
    tensorkv.save({"emb": parts[1]}, mem_url, "b1", shard=1, num_shards=2, incremental=True)
    doc = tensorkv.checkpoint.tag_manifest(mem_url, "b1")
    assert doc["parent"] == "b0" and doc["incremental"]
    want = [np.concatenate(x) for x in zip(*(rows_of(p) for p in parts), strict=True)]
    order = np.argsort(want[0])
    got = rows_of(tensorkv.load(None, mem_url, "b1")["emb"])
    assert all(a[order].tobytes() == b.tobytes() for a, b in zip(want, got, strict=True))


def test_merge_refuses_a_shard_of_another_run(mem_url):
    tensorkv.save(model(1, 2), mem_url, "y", shard=1, num_shards=2, run="b")
    with tensorkv.open_store(mem_url) as s:
        rb = runs.read(s, "y")
        stray = s.get(layout.run_part_key("y", rb.token, 1))
        tensorkv.save(model(0, 2), s, "x", shard=0, num_shards=2, run="a")
        ra = runs.read(s, "x")
        with pytest.raises(ShardRunError, match="merge it without run= or with run='a'"):
            tensorkv.checkpoint.merge(s, "x", run="c")
        s.put(layout.run_part_key("x", ra.token, 1), stray)  # a shard of run b under run a
        with pytest.raises(ShardRunError, match=r"shard 1 was saved by run 'b' \(~r[0-9a-f]+\), "
                                                r"the tag's save is run 'a'"):
            tensorkv.checkpoint.merge(s, "x")
        assert tensorkv.list_tags(s) == []
        s.delete(layout.run_part_key("x", ra.token, 1))
    tensorkv.save(model(1, 2), mem_url, "x", shard=1, num_shards=2, run="a")
    assert_whole(mem_url, "x")


def test_the_last_shard_refuses_to_publish_a_stray_shard(mem_url):
    tensorkv.save(model(1, 2), mem_url, "y", shard=1, num_shards=2, run="b")
    tensorkv.save(model(1, 2), mem_url, "x", shard=1, num_shards=2, run="a")
    with tensorkv.open_store(mem_url) as s:
        ra, rb = runs.read(s, "x"), runs.read(s, "y")
        # shard 1 of run a replaced by run b's: shard 0 of run a must not publish the pair
        s.put(layout.run_part_key("x", ra.token, 1),
              s.get(layout.run_part_key("y", rb.token, 1)))
    with pytest.raises(ShardRunError, match="shard 1 was saved by run 'b'"):
        tensorkv.save(model(0, 2), mem_url, "x", shard=0, num_shards=2, run="a")
    assert tensorkv.list_tags(mem_url) == []


def test_stale_run_is_removed_by_gc_after_the_grace_period(url):
    tensorkv.save(model(0, 2), url, "t", shard=0, num_shards=2)
    rep = tensorkv.checkpoint.check(url)
    assert rep.ok and rep.incomplete == ["t"]
    assert [(r["finished"], r["missing"], r["state"]) for r in rep.runs] == [([0], [1], "waiting")]
    rep = tensorkv.checkpoint.gc(url)  # shard 1 may still come: kept
    assert rep.removed_runs == [] and rep.runs[0]["state"] == "waiting"
    assert tensorkv.checkpoint.check(url, grace=0).stale_runs[0]["finished"] == [0]
    rep = tensorkv.checkpoint.gc(url, grace=0)
    assert [r["finished"] for r in rep.removed_runs] == [[0]] and rep.runs == []
    assert ckpt_keys(url) == []
    with pytest.raises(tensorkv.errors.TagNotFoundError):
        tensorkv.load(None, url, "t")
    for s in range(3):  # the tag is free again, for a save of any size
        tensorkv.save(model(s, 3), url, "t", shard=s, num_shards=3)
    assert_whole(url, "t")


def test_delete_tag_removes_an_unpublished_run_unless_a_shard_runs(mem_url):
    tensorkv.save(model(0, 2), mem_url, "t", shard=0, num_shards=2)
    with tensorkv.open_store(mem_url) as s:
        r = runs.read(s, "t")
        c = claims.claim(s, layout.pending_key(r.data_tag, 1), "shard 1")  # a running saver
        with pytest.raises(CheckpointError, match=rf"saving: shard 1 by pid {os.getpid()} "
                                                  r".*\(running\).*Wait for its shards"):
            tensorkv.delete_tag(s, "t")
        claims.release(c)
    tensorkv.delete_tag(mem_url, "t")
    assert ckpt_keys(mem_url) == []
    with pytest.raises(tensorkv.errors.TagNotFoundError):
        tensorkv.delete_tag(mem_url, "t")


def test_no_unsharded_save_or_copy_into_a_tag_a_sharded_save_holds(mem_url):
    tensorkv.save(model(0, 2), mem_url, "t", shard=0, num_shards=2)
    tensorkv.save({"w": np.ones(2)}, mem_url, "other")
    with pytest.raises(TagExistsError, match=r"tag 't' is being saved as 2 shards"):
        tensorkv.save({"w": np.ones(2)}, mem_url, "t")
    with pytest.raises(TagExistsError, match=r"tag 't' is being saved as 2 shards"):
        tensorkv.copy_tag(mem_url, "other", "t")
    tensorkv.save(model(1, 2), mem_url, "t", shard=1, num_shards=2)
    assert_whole(mem_url, "t")


def test_bad_sharded_save_arguments(mem_url):
    with pytest.raises(CheckpointError, match="give tag= or step="):
        tensorkv.save({"w": np.ones(2)}, mem_url, shard=0, num_shards=2)
    for bad in ("", 7, "x" * 201, "a\nb"):
        with pytest.raises(CheckpointError, match=r"run=.* must be a non-empty printable str"):
            tensorkv.save({"w": np.ones(2)}, mem_url, "t", shard=0, num_shards=2, run=bad)
    assert ckpt_keys(mem_url) == []


def _old_layout_tag(url: str, tag: str, pieces: list[tuple[int, int]]) -> None:
    """Publish ``tag`` from shards as versions before run ids merged them: no run check.

    ``pieces`` are ``(shard, num_shards)``; each is saved as a real shard of a scratch tag,
    then its records are moved under ``tag`` with the old layout.
    """
    docs = {}
    with tensorkv.open_store(url) as s:
        for shard, n in pieces:
            scratch = f"scratch-{shard}-{n}"
            tensorkv.save(model(shard, n), s, scratch, shard=shard, num_shards=n)
            r = runs.read(s, scratch)
            doc = runs.parts(s, scratch, r.token)[shard]
            for k, v in list(s.scan(layout.tag_table_prefix(r.data_tag))):
                s.put(k.replace(r.data_tag.encode(), tag.encode(), 1), v)
            s.delete_prefix(layout.tag_table_prefix(r.data_tag))
            s.delete_prefix(layout.run_parts_prefix(scratch, r.token))
            s.delete(layout.run_key(scratch))
            doc.pop("run")
            doc["tag"] = tag
            for ent in doc["tables"].values():
                ent.pop("data_tag")
            s.put(layout.shard_manifest_key(tag, shard), manifest.encode_manifest(doc))
            docs[shard] = doc
        first = docs[min(docs)]
        merged = dict(first, shards=sorted(docs), tables={
            "emb": {**first["tables"]["emb"],
                    "shards": {k: v for d in docs.values()
                               for k, v in d["tables"]["emb"]["shards"].items()}}})
        s.put(layout.manifest_key(tag), manifest.encode_manifest(merged))


def test_verify_flags_a_tag_whose_shards_disagree(mem_url):
    # what versions before run ids published: shard 0 of 2 beside a leftover shard 1 of 3
    _old_layout_tag(mem_url, "mixed", [(0, 2), (1, 3)])
    assert tensorkv.checkpoint.check(mem_url).ok  # a published tag: found by --verify
    rep = tensorkv.checkpoint.check(mem_url, verify=True)
    assert rep.corrupt == ["mixed: its shards disagree: shard 1 was saved as one of 3 shards, "
                           "the tag has 2; delete the tag and save it again"], rep.corrupt
    _old_layout_tag(mem_url, "fine", [(0, 2), (1, 2)])
    assert [c.split(":")[0] for c in tensorkv.checkpoint.check(mem_url, verify=True).corrupt] == [
        "mixed"]
    tensorkv.delete_tag(mem_url, "mixed")
    assert tensorkv.checkpoint.check(mem_url, verify=True).ok


def test_verify_flags_a_missing_or_foreign_shard(mem_url):
    tensorkv.save(model(0, 2), mem_url, "t", shard=0, num_shards=2, run="a")
    tensorkv.checkpoint.merge(mem_url, "t", allow_missing=True)  # published on purpose
    assert tensorkv.checkpoint.tag_manifest(mem_url, "t")["missing_shards"] == [1]
    assert tensorkv.checkpoint.check(mem_url, verify=True).ok
    with tensorkv.open_store(mem_url) as s:
        doc = manifest.read(s, "t")
        doc.pop("missing_shards")  # as if the shard had been lost
        s.put(layout.manifest_key("t"), manifest.encode_manifest(doc))
    rep = tensorkv.checkpoint.check(mem_url, verify=True)
    assert rep.corrupt == ["t: its shards disagree: shards [1] of 2 are missing; delete the tag "
                           "and save it again"]
    for s in (0, 1):
        tensorkv.save(model(s, 2, seed=9), mem_url, "u", shard=s, num_shards=2, run="b")
    with tensorkv.open_store(mem_url) as s:
        tu = manifest.read(s, "u")["run"]["token"]
        tt = doc["run"]["token"]
        # run a's kept shard manifest of t replaced by run b's of u
        s.put(layout.run_part_key("t", tt, 0), s.get(layout.run_part_key("u", tu, 0)))
    rep = tensorkv.checkpoint.check(mem_url, verify=True)
    assert any("shard 0 was saved by run 'b'" in c and "the tag by run 'a'" in c
               for c in rep.corrupt), rep.corrupt


@pytest.mark.parametrize("backend", ["leveldb", "rocksdb"])
def test_a_store_object_kept_open_here_is_named(backend, tmp_path):
    pytest.importorskip({"leveldb": "plyvel", "rocksdb": "rocksdict"}[backend])
    url = f"{backend}://{tmp_path}/db"
    with tensorkv.open_store(url) as s:
        with pytest.raises(StoreLockedError, match="kept open by a store object of this process"):
            tensorkv.save(model(0, 2), url, "t", shard=0, num_shards=2)
        for i in (0, 1):  # the open store object itself is written directly
            tensorkv.save(model(i, 2), s, "t", shard=i, num_shards=2)
    assert_whole(url, "t")
