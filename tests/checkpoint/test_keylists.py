"""Key lists: full lists at full tags, deltas at incremental tags, chains, old layouts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorkv
from tensorkv.checkpoint import keylists, layout
from tensorkv.checkpoint import manifest as _manifest
from tensorkv.checkpoint.keylists import KeySet, sorted_member
from tensorkv.codec import encode
from tensorkv.embedding.table import EmbeddingTable
from tensorkv.errors import CheckpointError, CorruptRecordError

from .helpers import assert_tables_equal, make_table, rows_of

I64 = np.iinfo(np.int64)


# ----------------------------------------------------------------------------- sorted_member
@pytest.mark.parametrize("sort_needles", [True, False])
def test_sorted_member_matches_isin(sort_needles):
    rng = np.random.default_rng(0)
    hay = np.unique(np.concatenate([rng.integers(I64.min, I64.max, 20000, dtype=np.int64),
                                    [I64.min, I64.max, 0]]))
    needles = np.concatenate([rng.choice(hay, 3000), rng.integers(-5, 5, 300),
                              [I64.min, I64.max, I64.min + 1, I64.max - 1]]).astype(np.int64)
    if sort_needles:
        needles = np.sort(needles)  # with duplicates
    assert np.array_equal(sorted_member(hay, needles), np.isin(needles, hay))


def test_sorted_member_edges():
    h = np.array([1, 3, 5], np.int64)
    assert sorted_member(h, np.arange(7, dtype=np.int64)).tolist() == [
        False, True, False, True, False, True, False]
    assert sorted_member(h, np.array([6, 7, 8], np.int64)).tolist() == [False] * 3
    assert sorted_member(np.empty(0, np.int64), np.array([1, 2])).tolist() == [False, False]
    assert sorted_member(h, np.empty(0, np.int64)).shape == (0,)
    assert sorted_member(h, np.array([3], np.int64)).tolist() == [True]


# ----------------------------------------------------------------------------- KeySet
def test_key_set_apply_and_fold():
    ks = KeySet(np.arange(0, 100, 2, dtype=np.int64))  # 50 even keys
    a = ks.apply(np.array([1, 3, 101], np.int64), np.array([0, 2], np.int64))
    assert len(a) == 51 and a.contains(np.array([0, 1, 2, 4, 101])).tolist() == [
        False, True, False, True, True]
    # remove a key added earlier, put back a base key removed earlier
    b = a.apply(np.array([2], np.int64), np.array([1], np.int64))
    assert b.to_array().tolist() == sorted({*range(4, 100, 2), 2, 3, 101})
    assert len(ks) == 50 and ks.to_array().tolist() == list(range(0, 100, 2))  # immutable
    with pytest.raises(ValueError):
        ks.base[0] = 7
    with pytest.raises(CorruptRecordError, match="adds keys the parent already holds"):
        ks.apply(np.array([4], np.int64), np.empty(0, np.int64))
    with pytest.raises(CorruptRecordError, match="removes keys the parent does not hold"):
        ks.apply(np.empty(0, np.int64), np.array([5], np.int64))


def test_key_set_folds_large_deltas():
    ks = KeySet(np.arange(10000, dtype=np.int64))
    big = ks.apply(np.arange(10000, 15000, dtype=np.int64), np.arange(0, 2000, dtype=np.int64))
    assert not len(big.added) and not len(big.removed)  # folded into one base
    assert np.array_equal(big.base, np.arange(2000, 15000))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sets(st.integers(-50, 50), max_size=15),
                          st.sets(st.integers(-50, 50), max_size=15)), max_size=8))
def test_key_set_matches_python_sets(steps):
    model = set(range(-20, 20, 3))
    ks = KeySet(np.array(sorted(model), np.int64))
    for add, rem in steps:
        rem = rem & model  # a delta removes keys of the parent
        add = add - model  # and adds keys the parent lacks
        ks = ks.apply(np.array(sorted(add), np.int64), np.array(sorted(rem), np.int64))
        model = (model - rem) | add
        assert ks.to_array().tolist() == sorted(model)
        assert len(ks) == len(model)
        probe = np.arange(-60, 60, dtype=np.int64)
        assert ks.contains(probe).tolist() == [int(p) in model for p in probe]


# ----------------------------------------------------------------------------- layout
def _train(t: EmbeddingTable, rng, step: int) -> None:
    keys = t.keys()
    ch = rng.choice(keys, 40, replace=False)
    t.apply_gradients(ch, rng.standard_normal((40, t.dim)).astype(np.float32), step=step)
    t.lookup(np.arange(30, dtype=np.int64) + 10**9 * step)  # new keys
    t.remove(rng.choice(np.setdiff1d(keys, ch), 10, replace=False))


def _table_keys(store, prefix: bytes) -> list[bytes]:
    return [bytes(k) for k in store.scan(prefix, keys_only=True)]


def test_incremental_tags_store_key_deltas(url):
    t = make_table(3000, 4)
    rng = np.random.default_rng(1)
    tensorkv.save({"e": t}, url, "s0", block_rows=128)
    for i in (1, 2):
        _train(t, rng, i)
        tensorkv.save({"e": t}, url, f"s{i}", incremental=True, block_rows=128)
    doc = tensorkv.checkpoint.tag_manifest(url, "s2")
    assert doc["version"] == _manifest.FORMAT_VERSION == 2
    info = doc["tables"]["e"]["shards"]["0"]
    assert info["key_list"] == "delta" and info["key_pieces"] == 0
    assert (info["added"], info["removed"], info["num_keys"]) == (30, 10, len(t))
    assert info["added_pieces"] == 1 and info["removed_pieces"] == 1
    with tensorkv.open_store(url) as store:
        keys = _table_keys(store, layout.table_prefix("s2", "e", 0))
        assert not [k for k in keys if b"/k/" in k]  # no full key list at a delta tag
        assert [k for k in keys if b"/a/" in k] and [k for k in keys if b"/r/" in k]
        for tag in ("s0", "s1", "s2"):  # the chain rebuilds each tag's key set exactly
            d = tensorkv.checkpoint.tag_manifest(store, tag)
            ks = keylists.chain_key_set(store, d, "e", "0", _manifest.getter(store))
            want = np.sort(tensorkv.load(None, store, tag)["e"].keys())
            assert np.array_equal(ks.to_array(), want), tag
    full = tensorkv.checkpoint.tag_manifest(url, "s0")["tables"]["e"]["shards"]["0"]
    assert full["key_list"] == "full" and full["key_pieces"] == 1
    assert tensorkv.checkpoint.check(url, verify=True).ok


def _read(store, tag):
    raw = store.get(layout.manifest_key(tag))
    return None if raw is None else _manifest.decode_manifest(raw, tag)


def test_parent_keys_from_store_equal_the_cached_ones(mem_url):
    """A saver that did not keep the parent's key set rebuilds it from the chain."""
    t = make_table(2000, 4)
    rng = np.random.default_rng(2)
    tensorkv.save({"e": t}, mem_url, "s0")
    _train(t, rng, 1)
    tensorkv.save({"e": t}, mem_url, "s1", incremental=True)
    _train(t, rng, 2)
    keylists._CACHE.clear()  # as after a restart: only the store knows the parent's keys
    tensorkv.save({"e": t}, mem_url, "s2", incremental=True)
    info = tensorkv.checkpoint.tag_manifest(mem_url, "s2")["tables"]["e"]["shards"]["0"]
    assert (info["added"], info["removed"], info["num_keys"]) == (30, 10, len(t))
    assert_tables_equal(tensorkv.load(None, mem_url, "s2")["e"], t)
    # a table that loaded the chain continues it from the store's key lists
    t2 = EmbeddingTable(4, optimizer="adagrad")
    tensorkv.load({"e": t2}, mem_url, "s2")
    _train(t2, rng, 3)
    tensorkv.save({"e": t2}, mem_url, "s3", incremental=True)
    assert_tables_equal(tensorkv.load(None, mem_url, "s3")["e"], t2)
    info = tensorkv.checkpoint.tag_manifest(mem_url, "s3")["tables"]["e"]["shards"]["0"]
    assert info["key_list"] == "delta" and info["num_keys"] == len(t2)


def _to_v1(store, tag: str, keys: np.ndarray) -> None:
    """Rewrite an incremental tag as format 1 wrote it: a full key list, no key_list field."""
    doc = _read(store, tag)
    doc["version"] = 1
    for name, ent in doc["tables"].items():
        for s, info in ent["shards"].items():
            prefix = layout.table_prefix(tag, name, int(s))
            store.delete_many(
                [keylists.piece_key(prefix, keylists.ADDED, i)
                 for i in range(info.pop("added_pieces", 0))]
            )
            info.pop("added", None)
            info.pop("key_list", None)
            store.put(keylists.piece_key(prefix, keylists.FULL, 0), encode(keys))
            info["key_pieces"] = 1
    store.put(layout.manifest_key(tag), _manifest.encode_manifest(doc))


def test_format_1_chains_still_load_and_continue(mem_url):
    t = make_table(1500, 4)
    rng = np.random.default_rng(3)
    tensorkv.save({"e": t}, mem_url, "s0")
    _train(t, rng, 1)
    tensorkv.save({"e": t}, mem_url, "s1", incremental=True)
    with tensorkv.open_store(mem_url) as store:
        _to_v1(store, "s1", np.sort(t.keys()))
        assert _read(store, "s1")["version"] == 1
    want = rows_of(t)
    got = rows_of(tensorkv.load(None, mem_url, "s1")["e"])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(want, got, strict=True))
    # a format-2 delta on a format-1 parent, read back from the store
    keylists._CACHE.clear()
    _train(t, rng, 2)
    tensorkv.save({"e": t}, mem_url, "s2", incremental=True)
    assert_tables_equal(tensorkv.load(None, mem_url, "s2")["e"], t)
    assert tensorkv.checkpoint.check(mem_url, verify=True).ok
    tensorkv.compact(mem_url, "s2")
    tensorkv.delete_tag(mem_url, "s0", force=True)
    tensorkv.delete_tag(mem_url, "s1", force=True)
    assert_tables_equal(tensorkv.load(None, mem_url, "s2")["e"], t)
    assert tensorkv.checkpoint.check(mem_url).ok


def test_newer_format_is_refused(mem_url):
    tensorkv.save({"a": np.ones(2)}, mem_url, "x")
    with tensorkv.open_store(mem_url) as store:
        doc = _read(store, "x")
        doc["version"] = _manifest.FORMAT_VERSION + 1
        store.put(layout.manifest_key("x"), _manifest.encode_manifest(doc))
    with pytest.raises(CheckpointError, match="format 3.*reads up to 2.*upgrade tensorkv"):
        tensorkv.load(None, mem_url, "x")


def _chain(mem_url):
    t = make_table(1000, 4)
    rng = np.random.default_rng(4)
    tensorkv.save({"e": t}, mem_url, "s0")
    _train(t, rng, 1)
    tensorkv.save({"e": t}, mem_url, "s1", incremental=True)
    _train(t, rng, 2)
    keylists._CACHE.clear()
    return t


def test_missing_added_keys_record_is_reported(mem_url):
    t = _chain(mem_url)
    with tensorkv.open_store(mem_url) as store:
        store.delete(keylists.piece_key(layout.table_prefix("s1", "e", 0), keylists.ADDED, 0))
    with pytest.raises(CorruptRecordError, match=r"table 'e' \(tag 's1'.*/a/00000000 is missing"):
        tensorkv.save({"e": t}, mem_url, "s2", incremental=True)
    assert tensorkv.list_tags(mem_url) == ["s0", "s1"]
    rep = tensorkv.checkpoint.check(mem_url, verify=True)
    assert not rep.ok and any("s1" in c and "is missing" in c for c in rep.corrupt)


def test_key_count_mismatch_is_reported(mem_url):
    t = _chain(mem_url)
    with tensorkv.open_store(mem_url) as store:
        doc = _read(store, "s1")
        doc["tables"]["e"]["shards"]["0"]["num_keys"] += 1
        store.put(layout.manifest_key("s1"), _manifest.encode_manifest(doc))
    with pytest.raises(CorruptRecordError, match="key lists hold .* the manifest says"):
        tensorkv.save({"e": t}, mem_url, "s2", incremental=True)


def test_broken_chain_of_key_lists_is_reported(mem_url):
    t = _chain(mem_url)
    with tensorkv.open_store(mem_url) as store:
        store.delete(layout.manifest_key("s0"))  # behind delete_tag's back
    with pytest.raises(CheckpointError, match="delta on tag 's0', which is missing"):
        tensorkv.save({"e": t}, mem_url, "s2", incremental=True, parent="s1")


def test_failed_incremental_save_leaves_its_key_deltas_to_gc(mem_url, monkeypatch):
    t = _chain(mem_url)
    from tensorkv.checkpoint import manifest as m

    real = m.encode_manifest

    def boom(doc):
        if doc.get("tag") == "s2":
            raise OSError("disk full")
        return real(doc)

    monkeypatch.setattr(m, "encode_manifest", boom)
    with pytest.raises(OSError, match="disk full"):
        tensorkv.save({"e": t}, mem_url, "s2", incremental=True)
    monkeypatch.setattr(m, "encode_manifest", real)
    with tensorkv.open_store(mem_url) as store:  # the failed save cleaned up after itself
        assert not _table_keys(store, layout.table_prefix("s2", "e", 0))
        # a killed save would not have: plant its leftovers
        store.put(keylists.piece_key(layout.table_prefix("s9", "e", 0), keylists.ADDED, 0),
                  encode(np.arange(3, dtype=np.int64)))
    rep = tensorkv.checkpoint.check(mem_url)
    assert len(rep.orphan_keys) == 1 and b"/a/" in rep.orphan_keys[0]
    assert tensorkv.checkpoint.gc(mem_url).removed_keys == 1
    assert tensorkv.checkpoint.check(mem_url).ok


def test_manifest_fields_are_json(mem_url):
    t = _chain(mem_url)
    tensorkv.save({"e": t}, mem_url, "s2", incremental=True)
    info = tensorkv.checkpoint.tag_manifest(mem_url, "s2")["tables"]["e"]["shards"]["0"]
    json.dumps(info)
    assert {"key_list", "key_pieces", "added", "added_pieces", "removed", "removed_pieces",
            "num_keys"} <= set(info)
