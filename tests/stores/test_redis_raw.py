"""The raw RESP path: commands framed with numpy, replies parsed with numba.

Parser cases on crafted bytes (every reply type, RESP3 nulls, replies split over many
``recv`` calls, replies it refuses), then round trips on real servers (plain, TLS, ACL user):
nil replies, error replies, a reply read 7 bytes at a time, connections left clean.
"""

from __future__ import annotations

import numpy as np
import pytest
import redis.exceptions as rex

import tensorkv
from tensorkv.embedding.redis import commit as redis_commit
from tensorkv.errors import CorruptRecordError, RowLockError, StoreError
from tensorkv.kernels import resp
from tensorkv.stores import open_store, redis_raw
from tensorkv.stores.redis_raw import RawFallback


class FakeSock:
    """Hands out ``data`` at most ``chunk`` bytes per ``recv_into``, then EOF."""

    def __init__(self, data: bytes, chunk: int) -> None:
        self.data, self.chunk, self.calls = data, chunk, 0

    def recv_into(self, view, n):
        self.calls += 1
        part = self.data[: min(n, self.chunk)]
        self.data = self.data[len(part):]
        view[: len(part)] = part
        return len(part)


MIXED = (b":-12\r\n+OK\r\n-ERR bad thing\r\n$3\r\nabc\r\n$-1\r\n_\r\n*-1\r\n"
         b"*6\r\n$2\r\nxy\r\n$-1\r\n_\r\n$0\r\n\r\n:-7\r\n-WRONGTYPE no\r\n*0\r\n")


def _read(data: bytes, n: int, chunk: int = 1 << 20, size_hint: int = 64) -> redis_raw.Replies:
    return redis_raw.read_replies(FakeSock(data, chunk), n, 16, size_hint, recv_bytes=chunk)


@pytest.mark.parametrize("chunk", [1, 2, 7, 1 << 20])
def test_parse_every_reply_type_in_any_split(chunk):
    r = _read(MIXED, 9, chunk, size_hint=1)  # the buffer grows from its 64-byte minimum
    assert r.rtype.tolist() == [resp.INT, resp.SIMPLE, resp.ERROR, resp.BULK, resp.NIL,
                                resp.NIL, resp.NIL, resp.ARRAY, resp.ARRAY]
    assert r.rval[0] == -12 and r.text(1) == "OK" and r.text(2) == "ERR bad thing"
    assert r.text(3) == "abc"
    first, count = int(r.roff[7]), int(r.rval[7])
    assert count == 6 and r.rval[8] == 0
    assert r.elen[first:first + 6].tolist() == [2, -1, -1, 0, -2, -3]
    assert bytes(r.buf[r.eoff[first]:r.eoff[first] + 2]) == b"xy"
    assert r.eoff[first + 4] == -7
    with pytest.raises(rex.ResponseError, match="no"):
        redis_raw.element_errors(r)


@pytest.mark.parametrize("data", [
    b"%1\r\n$1\r\na\r\n$1\r\nb\r\n",  # RESP3 map
    b"*1\r\n*1\r\n$1\r\na\r\n",  # nested array
    b"*1\r\n+OK\r\n",  # a simple string inside an array
    b"$3\r\nabcXY",  # no CRLF after a bulk string
    b":12a\r\n",  # not a number
    b"*20\r\n",  # more elements than the buffers hold
    b":1\r\n:2\r\n",  # bytes after the last reply
])
def test_unexpected_replies_fall_back(data):
    with pytest.raises(RawFallback):
        _read(data, 1)


def test_closed_mid_reply_is_a_connection_error():
    with pytest.raises(rex.ConnectionError, match="closed"):
        _read(b"*2\r\n$1\r\na\r\n", 1)


def test_parse_resumes_from_its_state():
    buf = np.frombuffer(b"*2\r\n$3\r\nabc\r\n$-1\r\n", np.uint8).copy()
    st = np.zeros(5, np.int64)
    rep = [np.zeros(1, np.int64) for _ in range(3)]
    eo, el = np.zeros(2, np.int64), np.zeros(2, np.int64)
    assert resp.parse_replies(buf, 10, st, *rep, eo, el) == resp.MORE
    assert resp.parse_replies(buf, buf.size, st, *rep, eo, el) == resp.DONE
    assert st.tolist() == [buf.size, 1, 0, 2, 0] and el.tolist() == [3, -1]


def test_frame_columns_and_heads():
    f = np.frombuffer(b"ab" b"cd", np.uint8).reshape(2, 2)
    v = np.frombuffer(b"xyz" b"uvw", np.uint8).reshape(2, 3)
    out = resp.frame_columns([f, v])
    assert out.tobytes() == b"$2\r\nab\r\n$3\r\nxyz\r\n$2\r\ncd\r\n$3\r\nuvw\r\n"
    swapped = resp.frame_columns([f, v], np.array([1, 0]))
    assert swapped.tobytes() == b"$2\r\ncd\r\n$3\r\nuvw\r\n$2\r\nab\r\n$3\r\nxyz\r\n"
    assert resp.array_head(3, (b"HSET", b"k")) == b"*3\r\n$4\r\nHSET\r\n$1\r\nk\r\n"


@pytest.mark.parametrize("chunk", [1, 5, 1 << 20])
def test_rows_of_the_asked_width_are_copied_as_they_come(chunk):
    data = b"*4\r\n$2\r\nab\r\n$-1\r\n$3\r\nxyz\r\n$2\r\ncd\r\n*1\r\n$2\r\nef\r\n"
    r = redis_raw.read_replies(FakeSock(data, chunk), 2, 5, 8, chunk, row_width=2)
    assert r.rows.tobytes() == b"abcdef" and r.elen.tolist() == [2, -1, 3, 2, 2]


# ---------------------------------------------------------------------------- real servers
def _hset_hmget(store, name: bytes, keys: np.ndarray, values: np.ndarray,
                ask: np.ndarray, recv_bytes: int = redis_raw.RECV_BYTES):
    framed = resp.frame_columns([keys.astype("<i8").view(np.uint8).reshape(-1, 8), values])
    head = resp.array_head(2 + 2 * keys.size, (b"HSET", name))
    (w,) = redis_raw.run(store, [name], [[head, framed]], [0], [16], read=False)
    assert w.rtype.tolist() == [resp.INT] and w.rval[0] == keys.size
    q = resp.frame_columns([ask.astype("<i8").view(np.uint8).reshape(-1, 8)])
    heads = [resp.array_head(2 + ask.size, (b"HMGET", name))] * 2
    (r,) = redis_raw.run(store, [name, name], [[heads[0], q], [heads[1], q]],
                         [ask.size] * 2, [16, 16], read=True, recv_bytes=recv_bytes,
                         row_width=552)
    return r


@pytest.mark.parametrize("recv_bytes", [7, redis_raw.RECV_BYTES])
def test_round_trip_with_nils(redis_server, recv_bytes):
    rng = np.random.default_rng(0)
    keys = np.arange(300, dtype=np.int64)
    values = rng.integers(0, 256, (300, 552), dtype=np.uint8)
    ask = np.array([5, 1000, 299, -1, 0])
    with open_store(f"redis://127.0.0.1:{redis_server.port}/0") as store:
        store.execute([(b"raw:rt", ("DEL", b"raw:rt"))])
        r = _hset_hmget(store, b"raw:rt", keys, values, ask, recv_bytes)
        assert r.rtype.tolist() == [resp.ARRAY] * 2
        for j in range(2):
            e = int(r.roff[j])
            assert r.elen[e:e + 5].tolist() == [552, -1, 552, -1, 552]
            np.testing.assert_array_equal(r.buf[r.eoff[e]:r.eoff[e] + 552], values[5])
        np.testing.assert_array_equal(r.rows, values[[5, 299, 0, 5, 299, 0]])
        # the pooled connection came back clean: the generic path still works on it
        assert store.execute([(b"raw:rt", ("HLEN", b"raw:rt"))]) == [300]


def test_error_replies(redis_server):
    with open_store(f"redis://127.0.0.1:{redis_server.port}/0") as store:
        store.execute([(b"raw:str", ("SET", b"raw:str", b"x"))])
        head = resp.array_head(4, (b"HSET", b"raw:str", b"f", b"v"))
        with pytest.raises(StoreError, match="WRONGTYPE"):
            store.execute_raw([b"raw:str"], [[head]], [0], [16])
        head = resp.array_head(3, (b"EVALSHA", b"0" * 40, b"0"))
        with pytest.raises(RawFallback, match="script"):
            store.execute_raw([b"raw:str"], [[head]], [0], [16])
        # a reply of a shape the raw path does not parse: the connection is dropped
        store.execute([(b"raw:h", ("HSET", b"raw:h", b"f", b"v"))])
        head = resp.array_head(3, (b"HSCAN", b"raw:h", b"0"))
        with pytest.raises(RawFallback):
            store.execute_raw([b"raw:h"], [[head]], [0], [16])
        assert store.execute([(b"raw:str", ("GET", b"raw:str"))]) == [b"x"]


def _table(url: str, tag: str, **options) -> tensorkv.EmbeddingTable:
    opt = tensorkv.StorageOption("REDIS", storage_path=url,
                                 redis_options={"model_tag_runtime": tag, **options})
    return tensorkv.EmbeddingTable(8, optimizer="adagrad", seed=1, storage=opt)


def test_table_scripts_and_wrong_type(redis_server):
    """The commit script goes as text (a flushed script cache changes nothing); a bucket
    that is not a hash raises the store's error."""
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    ref = tensorkv.EmbeddingTable(8, optimizer="adagrad", seed=1)
    t = _table(url, "rawfb", storage_slice=2)
    keys = np.arange(40)
    grads = np.ones((40, 8), np.float32)
    for tab in (t, ref):
        tab.lookup(keys)
    c = redis_server.client()
    try:
        c.script_flush()  # the raw path sends the scripts' text: nothing to reload
    finally:
        c.close()
    for tab in (t, ref):
        tab.apply_gradients(keys, grads)
    engine = t._rows.engine
    assert engine.counters["raw_fallbacks"] == 0
    np.testing.assert_array_equal(t.lookup(keys, insert=False), ref.lookup(keys, insert=False))
    c = redis_server.client()
    try:  # a bucket that is not a hash: the store's error
        c.delete(engine.runtime.names[0])
        c.set(engine.runtime.names[0], b"x")
    finally:
        c.close()
    with pytest.raises(StoreError, match="WRONGTYPE"):
        t.lookup(keys, insert=False)
    t.close()


@pytest.mark.parametrize("server", ["redis_tls_server", "redis_acl_server"])
def test_table_on_tls_and_acl(server, request):
    srv = request.getfixturevalue(server)
    ref = tensorkv.EmbeddingTable(8, optimizer="adagrad", seed=1)
    t = _table(srv.url, f"raw{server}", storage_slice=3)
    keys = np.arange(100)
    for tab in (t, ref):
        tab.lookup(keys)
        tab.apply_gradients(keys, np.full((100, 8), 0.5, np.float32))
    np.testing.assert_array_equal(t.lookup(keys, insert=False), ref.lookup(keys, insert=False))
    engine = t._rows.engine
    assert engine.counters["raw_fallbacks"] == 0
    before = engine.counters["raw_fallbacks"]
    for tab in (t, ref):
        tab.apply_gradients(keys, np.full((100, 8), 0.25, np.float32))
    np.testing.assert_array_equal(t.lookup(keys, insert=False), ref.lookup(keys, insert=False))
    assert engine.counters["raw_fallbacks"] == before
    t.close()


def test_busy_lock_taken_with_the_read(redis_server):
    """A busy lock fails the folded SET NX: the locks after it are released, then retried."""
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    t = _table(url, "rawlock", storage_slice=3, lock_wait_seconds=5)
    keys = np.arange(30)
    t.lookup(keys)
    engine = t._rows.engine
    c = redis_server.client()
    try:
        c.set(engine.runtime.locks[1], b"other", px=300)  # expires while we wait
    finally:
        c.close()
    token = b"0123456789abcdef"
    pos, recs = engine.lock_get(np.arange(3), keys, token)
    assert engine.counters["lock_waits"] >= 1
    assert pos.size == 30 and recs.shape == (30, engine.width)
    c = redis_server.client()
    try:
        assert [c.get(k) for k in engine.runtime.locks] == [token] * 3
    finally:
        c.close()
    engine.unlock(np.arange(3), token)
    t.close()


def test_engine_reads_wrong_sized_rows_as_corrupt(redis_server):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    t = _table(url, "rawsize", storage_slice=1)
    t.upsert(np.arange(4), np.ones((4, 8), np.float32))
    engine = t._rows.engine
    c = redis_server.client()
    try:
        c.hset(engine.runtime.names[0], np.int64(2).tobytes(), b"short")
    finally:
        c.close()
    with pytest.raises(CorruptRecordError, match="5"):
        t.lookup(np.arange(4), insert=False)
    bad: list[np.ndarray] = []
    pos, _ = engine.get_found(np.arange(4), bad_out=bad)
    assert sorted(pos.tolist()) == [0, 1, 3] and np.concatenate(bad).tolist() == [2]
    t.close()


def test_generic_path_gives_the_same_rows(redis_server, monkeypatch):
    """With the raw path refused every time, the generic path does all the work."""
    from tensorkv.stores.redis import RedisStore

    def refuse(*args, **kwargs):
        raise RawFallback("refused by the test")

    url = f"redis://127.0.0.1:{redis_server.port}/0"
    ref = tensorkv.EmbeddingTable(8, optimizer="adagrad", seed=1)
    t = _table(url, "rawgeneric", storage_slice=2)
    monkeypatch.setattr(RedisStore, "execute_raw", refuse)
    keys = np.arange(50)
    for tab in (t, ref):
        tab.lookup(keys)
        tab.apply_gradients(keys, np.ones((50, 8), np.float32))
        tab.upsert(keys[:10], np.full((10, 8), 3.0, np.float32))
        tab.remove(keys[40:])
    np.testing.assert_array_equal(t.lookup(keys, insert=False), ref.lookup(keys, insert=False))
    engine = t._rows.engine
    assert engine.counters["raw_fallbacks"] >= 4
    c = redis_server.client()
    try:
        c.hset(engine.runtime.names[0], np.int64(2).tobytes(), b"short")
    finally:
        c.close()
    bad: list[np.ndarray] = []
    pos, _ = engine.get_found(np.arange(4), bad_out=bad)
    assert sorted(pos.tolist()) == [0, 1, 3] and np.concatenate(bad).tolist() == [2]
    with pytest.raises(CorruptRecordError, match="5"):
        t.lookup(np.arange(4), insert=False)
    t.close()


@pytest.fixture(params=["standalone", "cluster"])
def where(request):
    """``(url, admin client factory)``: the session's standalone server (MULTI/EXEC commits)
    or Cluster (Lua commits, two-phase over several buckets)."""
    if request.param == "standalone":
        srv = request.getfixturevalue("redis_server")
        return f"redis://127.0.0.1:{srv.port}/0", srv.client
    cl = request.getfixturevalue("redis_cluster")
    from redis.cluster import RedisCluster

    return cl.url, lambda: RedisCluster(host="127.0.0.1", port=cl.ports[0])


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("value", [None, b"someone-else"])
def test_commit_refused_when_the_lock_changes(where, monkeypatch, value, which):
    """A lock (of the first or the second bucket) that expires or changes hands before the
    commit runs: nothing is written, in any bucket, and the step stays."""
    url, client = where
    kind = "cl" if "cluster" in url else "sa"
    t = _table(url, f"rawwatch{value is None}{kind}{which}", storage_slice=2)
    keys = np.arange(10)
    t.upsert(keys, np.ones((10, 8), np.float32))
    before = t.lookup(keys, insert=False)
    real = redis_commit.commit

    def change_locks(engine, *args):
        c = client()
        try:
            k = engine.runtime.locks[which]  # one bucket's lock: no bucket is written
            c.delete(k) if value is None else c.set(k, value)
        finally:
            c.close()
        return real(engine, *args)

    monkeypatch.setattr(redis_commit, "commit", change_locks)
    with pytest.raises(RowLockError, match="nothing was written"):
        t.apply_gradients(keys, np.full((10, 8), 5.0, np.float32))
    assert t.step == 0
    monkeypatch.undo()
    c = client()
    try:
        c.delete(*t._rows.engine.runtime.locks)
    finally:
        c.close()
    np.testing.assert_array_equal(t.lookup(keys, insert=False), before)
    t.upsert(keys, np.full((10, 8), 5.0, np.float32))
    assert (t.lookup(keys, insert=False) == 5).all()
    assert t._rows.engine.counters["raw_fallbacks"] == 0
    t.close()


def test_commit_script_error(where):
    """A bucket that is not a hash: the commit's error is the store's; no lock stays."""
    url, client = where
    t = _table(url, f"rawexecerr{'cl' if 'cluster' in url else 'sa'}", storage_slice=1)
    engine = t._rows.engine
    c = client()
    try:
        c.delete(engine.runtime.names[0])
        c.set(engine.runtime.names[0], b"x")
    finally:
        c.close()
    op = b"0123456789abcdef"
    engine.lock(np.arange(1), op)
    with pytest.raises(StoreError, match="WRONGTYPE"):
        redis_commit.commit(engine, op, np.arange(2),
                            engine.seal(np.zeros((2, engine.width), np.uint8)),
                            np.zeros(0, np.int64), np.arange(1), True)
    engine.unlock(np.arange(1), op)
    c = client()
    try:
        assert not c.exists(engine.runtime.locks[0])
    finally:
        c.close()
    t.close()


def test_reply_lost_after_the_commit_ran(redis_server, monkeypatch):
    """The connection drops after the commit's MULTI/EXEC ran: the commit is sent again as
    the Lua script, finds its receipt and writes nothing more (applied once)."""
    real = redis_raw.read_replies
    dropped = []

    def drop_after(sock, n, *args, **kwargs):
        r = real(sock, n, *args, **kwargs)
        if (n >= 3 and r.rtype[1] == resp.SIMPLE and r.text(1) == "QUEUED"
                and r.rtype[-1] == resp.ARRAY and not dropped):
            dropped.append(1)  # EXEC ran; its reply is "lost"
            raise rex.ConnectionError("dropped by the test")
        return r

    url = f"redis://127.0.0.1:{redis_server.port}/0"
    ref = tensorkv.EmbeddingTable(8, optimizer="adagrad", seed=1)
    t = _table(url, "rawdrop", storage_slice=2)
    keys = np.arange(20)
    for tab in (t, ref):
        tab.lookup(keys)
    monkeypatch.setattr(redis_raw, "read_replies", drop_after)
    for tab in (t, ref):
        tab.apply_gradients(keys, np.ones((20, 8), np.float32))
    monkeypatch.undo()
    assert dropped and t._rows.engine.counters["raw_fallbacks"] >= 1
    np.testing.assert_array_equal(t.lookup(keys, insert=False), ref.lookup(keys, insert=False))
    np.testing.assert_array_equal(t.frequency(keys), ref.frequency(keys))
    assert t.step == ref.step == 1
    t.close()
