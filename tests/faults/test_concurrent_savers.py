"""Concurrent savers: of several savers of one tag exactly one wins; different tags all land.

Processes race on the multi-process backends (LMDB, Redis); threads sharing one store object
race on the single-writer ones (RocksDB, LevelDB, memory). The rule checked every time: each
saver either fails with TagExistsError or succeeded, the tag loads bit-identical to the
winner's model, and ``check`` finds nothing wrong (the losers wrote nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tensorkv
from tensorkv.errors import TagExistsError

from .saver_worker import assert_model_equal, model

WORKER = str(Path(__file__).with_name("saver_worker.py"))
SAVERS = 4


def _run_workers(url: str, tags: list[str]) -> list[str]:
    start = time.time() + 3.0  # every worker has imported and built its model by then
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [
        subprocess.Popen([sys.executable, WORKER, url, tag, str(i), str(start)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for i, tag in enumerate(tags)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    return [out.strip() for out, _ in outs]


@pytest.fixture(params=["lmdb", "redis"])
def shared_url(request, tmp_path):
    if request.param == "lmdb":
        return f"lmdb://{tmp_path}/db"
    server = request.getfixturevalue("redis_server")
    server.flushall()
    return server.url


def test_processes_saving_one_tag(shared_url):
    outs = _run_workers(shared_url, ["same"] * SAVERS)
    winners = [i for i, o in enumerate(outs) if o == "ok"]
    assert len(winners) == 1, outs
    assert all(o.startswith("exists: tag 'same'") for i, o in enumerate(outs) if i != winners[0])
    assert_model_equal(tensorkv.load(None, shared_url, "same"), model(winners[0]))
    rep = tensorkv.checkpoint.check(shared_url)
    assert rep.ok and not rep.pending and rep.tags == ["same"], rep.as_dict()


def test_processes_saving_different_tags(shared_url):
    tags = [f"t{i}" for i in range(SAVERS)]
    assert _run_workers(shared_url, tags) == ["ok"] * SAVERS
    for i, tag in enumerate(tags):
        assert_model_equal(tensorkv.load(None, shared_url, tag), model(i))
    rep = tensorkv.checkpoint.check(shared_url, verify=True)
    assert rep.ok and sorted(rep.tags) == tags, rep.as_dict()


@pytest.mark.parametrize("backend", ["rocksdb", "leveldb", "memory"])
def test_threads_saving_one_tag(backend, tmp_path):
    pytest.importorskip({"rocksdb": "rocksdict", "leveldb": "plyvel"}.get(backend, "numpy"))
    url = "memory://" if backend == "memory" else f"{backend}://{tmp_path}/db"
    models = [model(i) for i in range(SAVERS)]
    results: list[str | None] = [None] * SAVERS
    with tensorkv.open_store(url) as store:
        go = threading.Barrier(SAVERS)

        def save(i: int) -> None:
            go.wait()
            try:
                tensorkv.save(models[i], store, "same", block_rows=256, progress=False)
                results[i] = "ok"
            except TagExistsError:
                results[i] = "exists"

        threads = [threading.Thread(target=save, args=(i,)) for i in range(SAVERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == ["exists"] * (SAVERS - 1) + ["ok"], results  # type: ignore[arg-type]
        winner = results.index("ok")
        assert_model_equal(tensorkv.load(None, store, "same"), models[winner])
        rep = tensorkv.checkpoint.check(store)
        assert rep.ok and not rep.pending, rep.as_dict()


def test_a_dead_savers_claim_is_taken_over(tmp_path):
    """A saver killed mid-save leaves its claim; the next save of that tag takes it over."""
    url = f"lmdb://{tmp_path}/db"
    code = (
        "import os, signal, tensorkv\n"
        "from tensorkv.checkpoint import claims, layout\n"
        f"s = tensorkv.open_store({url!r})\n"
        "claims.claim(s, layout.pending_key('same', 0), 'tag same')\n"
        "s.put(layout.table_prefix('same', 'emb', 0) + b'junk', b'left by the dead save')\n"
        "s.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == -9, r.stderr
    rep = tensorkv.checkpoint.check(url)
    assert [p["owner"] for p in rep.pending] == ["dead"] and rep.pending[0]["stale"]
    assert len(rep.orphan_keys) == 1  # the dead save's record is reported at once, no grace
    tensorkv.save(model(0), url, "same", block_rows=256)
    assert_model_equal(tensorkv.load(None, url, "same"), model(0))
    rep = tensorkv.checkpoint.check(url)
    assert rep.ok and not rep.pending, rep.as_dict()


def test_a_live_savers_claim_is_respected(tmp_path):
    """A claim held by a running process makes a second save of the tag fail, naming it."""
    url = f"lmdb://{tmp_path}/db"
    with tensorkv.open_store(url) as s:
        from tensorkv.checkpoint import claims, layout

        c = claims.claim(s, layout.pending_key("busy", 0), "tag 'busy'")
        with pytest.raises(TagExistsError, match=rf"being saved by pid {os.getpid()} .*running"):
            tensorkv.save(model(1), s, "busy")
        rep = tensorkv.checkpoint.check(s)
        assert [p["owner"] for p in rep.pending] == ["running"] and not rep.pending[0]["stale"]
        claims.release(c)
        tensorkv.save(model(1), s, "busy")
        with pytest.raises(TagExistsError, match="already exists"):
            tensorkv.save(model(2), s, "busy")
        assert_model_equal(tensorkv.load(None, s, "busy"), model(1))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_processes_racing_for_one_stale_claim_take_it_over_once(shared_url):
    """Racers that all read the same dead owner's claim: exactly one takes it over."""
    import multiprocessing
    import socket

    from tensorkv.checkpoint import claims, layout

    from .claim_worker import race

    key = layout.pending_key("same", 0)
    dead = {**claims.owner_record("tag 'same'"), "pid": _dead_pid(), "host": socket.gethostname()}
    with tensorkv.open_store(shared_url) as s:
        s.put(key, json.dumps(dead).encode())
        s.flush()
    ctx = multiprocessing.get_context("spawn")
    read, done, results = ctx.Barrier(SAVERS), ctx.Barrier(SAVERS), ctx.Queue()
    procs = [ctx.Process(target=race, args=(shared_url, key, read, done, results))
             for _ in range(SAVERS)]
    for p in procs:
        p.start()
    outs = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert sorted(o[0] for o in outs) == ["exists"] * (SAVERS - 1) + ["won"], outs
    assert [o[1] for o in outs if o[0] == "won"] == [True]  # it took the dead owner's claim
    assert all("being saved by pid" in o[1] for o in outs if o[0] == "exists"), outs
    with tensorkv.open_store(shared_url) as s:
        assert s.get(key) is None  # the winner released it


def test_release_removes_only_its_own_claim(shared_url):
    """A claim taken over by another process survives the release of the claim it replaced."""
    from tensorkv.checkpoint import claims, layout

    key = layout.pending_key("r", 0)
    with tensorkv.open_store(shared_url) as s:
        mine = claims.claim(s, key, "tag 'r'")
        other = json.dumps({**claims.owner_record("tag 'r'"), "token": "other"}).encode()
        code = ("import sys, tensorkv\n"
                "s = tensorkv.open_store(sys.argv[1])\n"
                "ok = s.compare_and_set(sys.argv[2].encode(), sys.argv[3].encode(),"
                " sys.argv[4].encode())\n"
                "s.flush()\n"
                "print(ok)\n")
        r = subprocess.run([sys.executable, "-c", code, shared_url, key.decode(),
                            mine.value.decode(), other.decode()],
                           capture_output=True, text=True, timeout=120)
        assert r.stdout.strip() == "True", r.stderr
        claims.release(mine)
        assert s.get(key) == other
        assert s.compare_and_set(key, other, None)
        again = claims.claim(s, key, "tag 'r'")
        claims.release(again)
        assert s.get(key) is None  # its own claim is removed
