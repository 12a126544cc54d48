"""A shard of a sharded save SIGKILLed mid-save: its run can never publish, nor be mixed.

Shard 1 of 2 finishes in one process; shard 0 is saved by another that SIGKILLs itself at
its first table-record write (after it claimed its shard). Running the save again, with the
same size, with or without ``run=`` (a new id, or the crashed run's id again), is refused
with both runs named, and no tag appears; ``check`` lists the run as stale at once (its
saver is provably dead), ``gc`` removes it and the LevelDB/RocksDB stage the killed shard
left; then the save runs again and the tag loads bit-identical to the new model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.checkpoint.helpers import rows_of
from tests.checkpoint.shard_worker import reference, shard_table

import tensorkv
from tensorkv.errors import ShardRunError

from .conftest import make_url

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "checkpoint" / "shard_worker.py")


def _worker(url: str, shard: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, WORKER, url, "t", str(shard), "2", *extra],
                          capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["lmdb", "leveldb", "rocksdb", "redis"])
@pytest.mark.parametrize("first_run", [None, "attempt-1"])
def test_a_crashed_run_is_never_completed_by_another(backend, first_run, tmp_path, request):
    url = make_url(backend, tmp_path, request)
    ids = [] if first_run is None else ["--run", first_run]
    done = _worker(url, 1, *ids, "--seed", "1")
    assert done.stdout.strip() == "done", done.stdout + done.stderr
    killed = _worker(url, 0, *ids, "--seed", "1", "--die")
    assert killed.returncode == -9, killed.stdout + killed.stderr
    rep = tensorkv.checkpoint.check(url)
    assert not rep.ok and [(r["finished"], r["state"]) for r in rep.runs] == [([1], "stale")]
    assert "shard 0's saver" in rep.runs[0]["reason"] and "died" in rep.runs[0]["reason"]
    if backend in ("leveldb", "rocksdb"):
        assert [st["stale"] for st in rep.stages] == [True]  # the killed shard's stage
    # the job runs again (the new model has seed 2): same size, every kind of run id
    for run in (None, "attempt-2", first_run or "attempt-1"):
        for shard in (1, 0):  # shard 1 finished before; shard 0's saver died
            model = {"emb": shard_table(shard, 2, seed=2)}
            with pytest.raises(ShardRunError) as e:
                tensorkv.save(model, url, "t", shard=shard, num_shards=2, run=run)
            msg = str(e.value)
            assert "died before its shard was saved" in msg or "The two differ" in msg, msg
            assert "tensorkv.delete_tag(url, 't')" in msg
            if run != first_run:
                assert repr(run) in msg or "no run id" in msg
    assert tensorkv.list_tags(url) == []
    rep = tensorkv.checkpoint.gc(url)  # a dead saver: no grace period to wait
    assert [r["finished"] for r in rep.removed_runs] == [[1]] and not rep.stages
    rep = tensorkv.checkpoint.check(url)
    assert rep.ok and not rep.runs and not rep.pending and not rep.orphan_keys, rep.as_dict()
    for shard in (0, 1):
        tensorkv.save({"emb": shard_table(shard, 2, seed=2)}, url, "t", shard=shard,
                      num_shards=2, run="attempt-2")
    got = rows_of(tensorkv.load(None, url, "t")["emb"])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(rows_of(reference(2)), got, strict=True))
    assert tensorkv.checkpoint.check(url, verify=True).ok
    if backend in ("leveldb", "rocksdb"):
        assert not os.path.exists(url.split("://", 1)[1] + ".stage")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["leveldb", "rocksdb"])
def test_a_shard_killed_while_its_stage_moves_in_publishes_nothing(backend, tmp_path, request):
    # the records land in the store before the shard's manifest, so a kill in between
    # leaves no manifest that references missing records
    url = make_url(backend, tmp_path, request)
    killed = _worker(url, 0, "--die-moving")
    assert killed.returncode == -9, killed.stdout + killed.stderr
    rep = tensorkv.checkpoint.check(url)
    assert not rep.missing and [(r["finished"], r["state"]) for r in rep.runs] == [([], "stale")]
    rep = tensorkv.checkpoint.gc(url)
    assert rep.removed_runs and not rep.stages
    with tensorkv.open_store(url) as s:
        assert list(s.keys(b"ckpt/")) == []
    for shard in (0, 1):
        tensorkv.save({"emb": shard_table(shard, 2)}, url, "t", shard=shard, num_shards=2)
    got = rows_of(tensorkv.load(None, url, "t")["emb"])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(rows_of(reference()), got, strict=True))


@pytest.mark.timeout(300)
def test_a_run_whose_last_saver_died_before_publishing_is_kept_for_merge(tmp_path, request):
    url = make_url("lmdb", tmp_path, request)
    tensorkv.save({"emb": shard_table(0, 2)}, url, "t", shard=0, num_shards=2)
    killed = _worker(url, 1, "--die-before-publish")  # its shard saved, the tag not published
    assert killed.returncode == -9, killed.stdout + killed.stderr
    rep = tensorkv.checkpoint.check(url)
    assert rep.ok and [(r["finished"], r["state"]) for r in rep.runs] == [([0, 1], "complete")]
    assert tensorkv.checkpoint.gc(url, grace=0).removed_runs == []  # complete data is kept
    tensorkv.checkpoint.merge(url, "t")
    got = rows_of(tensorkv.load(None, url, "t")["emb"])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(rows_of(reference()), got, strict=True))
    rep = tensorkv.checkpoint.check(url, verify=True)
    assert rep.ok and not rep.runs, rep.as_dict()
