"""Spill directories: temporary by default, refused when they hold rows, overwrite on request.

A tiered table's lower tiers are its spill space. Without a path they live in a temporary
directory removed on close; an explicit path holding an earlier table's rows is refused
(never reopened as a table) unless ``overwrite=True``; relative paths are resolved against
the working directory and stated as absolute paths.
"""

import gc
import os
import re
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pytest

import tensorkv
from tensorkv import DRAM, KV, PMEM, EmbeddingTable, SSDHash, StorageOption
from tensorkv.embedding.tiers.base import RecordLayout
from tensorkv.embedding.tiers.pmem import PMEMTier
from tensorkv.embedding.tiers.ssdhash import SSDHashTier
from tensorkv.errors import ConfigError, SpillDataExistsError, StorePathError

README = Path(__file__).resolve().parents[2] / "README.md"
DIM = 4
LAYOUT = RecordLayout(DIM, num_slots=1)  # the records of EmbeddingTable(DIM, "adagrad")
SMALL = [16 * LAYOUT.record_bytes]  # tier 0 holds 16 rows; the rest spills


def spill(table, n=200):
    """Train ``n`` keys so most of them spill below tier 0; returns the keys."""
    keys = np.arange(n)
    for lo in range(0, n, 40):
        k = keys[lo:lo + 40]
        table.apply_gradients(k, np.ones((k.size, DIM), np.float32))
    table.wait_writes()
    assert sum(t["rows"] for t in table.stats()["tiers"][1:]) > 0
    return keys


def lower_paths(table):
    return [t.get("path") or t.get("url") for t in table.stats()["tiers"][1:]]


def test_readme_tiered_example_runs_twice_in_one_directory(tmp_path, monkeypatch):
    text = README.read_text()
    section = text.split("\n## Tiered storage\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    monkeypatch.chdir(tmp_path)
    for run in (1, 2):
        exec(compile(code, f"README.md Tiered storage, run {run}", "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("storage", [
    "DRAM_SSDHASH", "DRAM_PMEM", "DRAM_LMDB", "DRAM_LEVELDB", "DRAM_ROCKSDB", "DRAM_PMEM_SSDHASH",
    StorageOption(tiers=[DRAM(SMALL[0]), SSDHash()]),
    StorageOption(tiers=[DRAM(SMALL[0]), PMEM()]),
    StorageOption(tiers=[DRAM(SMALL[0]), KV("rocksdb://")]),
], ids=str)
def test_no_path_is_a_temporary_directory_removed_on_close(storage):
    kw = {"storage_size": SMALL} if isinstance(storage, str) else {}
    tables = [EmbeddingTable(DIM, optimizer="adagrad", storage=storage, **kw) for _ in range(2)]
    paths = []
    for t in tables:
        spill(t)
        tiers = t.stats()["tiers"][1:]
        assert all(st["temporary"] for st in tiers)
        paths.append([p.removeprefix("lmdb://").removeprefix("leveldb://")
                      .removeprefix("rocksdb://") for p in lower_paths(t)])
        for p in paths[-1]:
            assert p.startswith(tempfile.gettempdir() + os.sep) and os.path.exists(p)
            assert f"{p} (temporary)" in repr(t)
    assert not set(paths[0]) & set(paths[1])  # each table its own directory
    for t, ps in zip(tables, paths, strict=True):
        t.close()
        for p in ps:
            top = p if os.path.basename(p).startswith("tensorkv-spill-") else os.path.dirname(p)
            assert os.path.basename(top).startswith("tensorkv-spill-")
            assert not os.path.exists(top)


def test_an_unclosed_temporary_tier_is_removed_when_collected():
    tier = SSDHash().open(LAYOUT)
    path = tier.location
    assert os.path.isdir(path) and tier.temporary
    del tier
    gc.collect()
    assert not os.path.exists(path)


def test_an_explicit_path_outlives_close(tmp_path):
    with EmbeddingTable(DIM, optimizer="adagrad", storage="DRAM_SSDHASH",
                        storage_path=tmp_path / "s", storage_size=SMALL) as t:
        spill(t)
        assert t.stats()["tiers"][1]["temporary"] is False
        assert "(temporary)" not in repr(t)
    assert (tmp_path / "s" / "TIER.json").exists()


def used(kind, path, **extra):
    """A StorageOption of ``kind`` at ``path``; the first table through it leaves rows."""
    if kind in ("SSDHASH", "PMEM"):
        opt = lambda **o: StorageOption(f"DRAM_{kind}", storage_path=path,  # noqa: E731
                                        storage_size=SMALL, **o)
    else:
        opt = lambda **o: StorageOption(tiers=[DRAM(SMALL[0]), KV(path, **extra)],  # noqa: E731
                                        **o)
    with EmbeddingTable(DIM, optimizer="adagrad", storage=opt()) as t:
        spill(t)
        n = sum(st["rows"] for st in t.stats()["tiers"][1:])
    return opt, n


def spill_locations(tmp_path):
    return {"SSDHASH": str(tmp_path / "ssd"), "PMEM": str(tmp_path / "pm" / "tier"),
            "LMDB": f"lmdb://{tmp_path}/lmdb", "ROCKSDB": f"rocksdb://{tmp_path}/rocks",
            "LEVELDB": f"leveldb://{tmp_path}/level"}


@pytest.mark.parametrize("kind", ["SSDHASH", "PMEM", "LMDB", "ROCKSDB", "LEVELDB", "REDIS"])
def test_a_path_holding_rows_is_refused_then_overwritten(kind, tmp_path, request):
    extra = {}
    if kind == "REDIS":
        server = request.getfixturevalue("redis_server")
        extra = {"prefix": f"spill-{uuid.uuid4().hex[:8]}/"}
        path = server.url
    else:
        path = spill_locations(tmp_path)[kind]
    opt, n = used(kind if kind in ("SSDHASH", "PMEM") else "KV", path, **extra)
    assert n > 0
    where = path if "://" in path else os.path.abspath(path)
    with pytest.raises(SpillDataExistsError) as e:
        EmbeddingTable(DIM, optimizer="adagrad", storage=opt())
    msg = str(e.value)
    assert f"at '{where}" in msg and f"already holds {n} rows" in msg
    assert "overwrite=True" in msg and "not reopened" in msg and "tensorkv.save/load" in msg
    assert isinstance(e.value, ConfigError) and isinstance(e.value, FileExistsError)
    # refused: the spill data is as it was (the same rows are still there)
    with pytest.raises(SpillDataExistsError, match=f"already holds {n} rows"):
        EmbeddingTable(DIM, optimizer="adagrad", storage=opt())
    with EmbeddingTable(DIM, optimizer="adagrad", storage=opt(overwrite=True)) as t:
        assert len(t) == 0 and t.stats()["tiers"][1]["rows"] == 0
        keys = spill(t, 100)
        assert len(t) == 100 and t.contains(keys).all()
        assert t.contains(np.arange(100, 200)).sum() == 0  # the old rows are gone


def test_redis_overwrite_leaves_other_keys_alone(redis_server):
    prefix = f"spill-{uuid.uuid4().hex[:8]}/"
    with tensorkv.open_store(redis_server.url) as store:
        store.put(b"other/key", b"kept")
        store.put(prefix.encode()[:-1] + b"x", b"kept too")
        opt, n = used("KV", redis_server.url, prefix=prefix)
        with EmbeddingTable(DIM, optimizer="adagrad", storage=opt(overwrite=True)) as t:
            assert len(t) == 0
        assert store.get(b"other/key") == b"kept"
        assert store.get(prefix.encode()[:-1] + b"x") == b"kept too"


@pytest.mark.parametrize("kind", ["SSDHASH", "PMEM", "LMDB"])
def test_rows_of_another_layout_are_refused_then_overwritten(kind, tmp_path):
    path = spill_locations(tmp_path)[kind]
    opt, _ = used(kind if kind != "LMDB" else "KV", path)
    with pytest.raises(SpillDataExistsError, match=r"already holds rows of another layout.*"
                                                   r"overwrite=True"):
        EmbeddingTable(DIM * 2, optimizer="adagrad", storage=opt())
    with EmbeddingTable(DIM * 2, optimizer="adagrad", storage=opt(overwrite=True)) as t:
        assert len(t) == 0
        t.lookup(np.arange(50))


def test_overwrite_refuses_what_is_not_a_tier(tmp_path):
    d = tmp_path / "home"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    with pytest.raises(StorePathError, match=r"not SSDHASH tier files \(\['notes.txt'\]\)"):
        EmbeddingTable(DIM, storage=StorageOption("DRAM_SSDHASH", storage_path=d,
                                                  overwrite=True))
    assert (d / "notes.txt").read_text() == "mine"
    f = tmp_path / "data.bin"
    f.write_bytes(b"precious bytes")
    with pytest.raises(StorePathError, match="not a tensorkv PMEM tier file"):
        PMEMTier(f, LAYOUT, overwrite=True)
    assert f.read_bytes() == b"precious bytes"


def test_overwrite_of_a_tier_held_open_elsewhere_is_refused(tmp_path):
    with SSDHashTier(tmp_path / "s", LAYOUT) as tier:
        tier.put(np.arange(3), _records(np.arange(3)))
        with pytest.raises(tensorkv.errors.StoreLockedError):
            SSDHashTier(tmp_path / "s", LAYOUT, overwrite=True)
        assert len(tier) == 3


def _records(keys):
    from tensorkv.testing.tiers import make_records

    return make_records(LAYOUT, keys)


def test_relative_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    opt = StorageOption("DRAM_SSDHASH", storage_path="emb", storage_size=SMALL)
    assert opt.storage_path == str(tmp_path / "emb")
    assert opt.tier_specs()[1].path == str(tmp_path / "emb")
    (_, kv) = StorageOption("DRAM_LEVELDB", storage_path="db").tier_specs()
    assert kv.url == f"leveldb://{tmp_path}/db"
    (_, pm, ssd) = StorageOption("DRAM_PMEM_SSDHASH", storage_path="two").tier_specs()
    assert (pm.path, ssd.path) == (str(tmp_path / "two/pmem.tier"), str(tmp_path / "two/ssdhash"))
    assert SSDHash("x").path == PMEM(Path("x")).path == str(tmp_path / "x")
    monkeypatch.chdir("/")  # resolved when the option was made, not when it is opened
    with EmbeddingTable(DIM, optimizer="adagrad", storage=opt) as t:
        spill(t)
        assert t.stats()["tiers"][1]["path"] == str(tmp_path / "emb")
        assert repr(t).endswith(f"spill=['{tmp_path / 'emb'}'])")
    with pytest.raises(SpillDataExistsError, match=f"at '{tmp_path / 'emb'}'"):
        EmbeddingTable(DIM, optimizer="adagrad", storage=opt)
    # store URLs keep their rule: an absolute path (a URL has no relative form)
    with pytest.raises(tensorkv.errors.InvalidURLError, match="absolute path"):
        EmbeddingTable(DIM, storage=StorageOption(tiers=[DRAM(), KV("lmdb://rel/db")]))
