"""Frames of small requests (tensorkv.distributed.wire): round trips, and a shard served by them."""

import numpy as np
import pytest

from tensorkv.distributed import wire
from tensorkv.distributed.shard import BEHIND, ShardServer


def _kc(keys, counts=None):
    keys = np.asarray(keys, np.int64)
    return np.stack([keys, np.ones_like(keys) if counts is None else np.asarray(counts)])


def test_requests_round_trip():
    kc = _kc([5, -3], [1, 2])
    method, name, worker, seq, args, op, parts = wire.unpack_request(
        wire.pack_request("pull", "tab", "wörker", 7, (kc, True, False)))
    assert (method, name, worker, seq, op, parts) == ("pull", "tab", "wörker", 7, 0, ())
    np.testing.assert_array_equal(args[0], kc)
    assert args[1:] == (True, False)
    assert wire.unpack_request(wire.pack_request("peek", "t", "w", 0, (kc,)))[4][0].shape == (2, 2)
    g = np.arange(6, dtype=np.float32).reshape(2, 3)
    _, _, _, _, (k, grads, step, tick), op, parts = wire.unpack_request(
        wire.pack_request("push", "t", "w", 3, (kc[0], g, 11, True), op=5, parts=(0, 2)))
    assert (op, parts) == (5, (0, 2))  # a staged part names its operation and its shards
    np.testing.assert_array_equal(k, kc[0])
    np.testing.assert_array_equal(grads, g)
    assert (step, tick) == (11, True)
    # an empty push keeps the gradients' width; no step means the table's next
    _, _, _, _, (k, grads, step, tick), _, _ = wire.unpack_request(
        wire.pack_request("push", "t", "w", 4, (kc[0, :0], g[:0], None, False)))
    assert k.shape == (0,) and grads.shape == (0, 3) and step is None and not tick


def test_replies_round_trip():
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    value, ck, delta, seq = wire.unpack_reply(wire.pack_reply((rows, 3, 1, 9)))
    np.testing.assert_array_equal(value, rows)
    assert (ck, delta, seq) == (3, 1, 9)
    absent = np.array([True, False, True])
    (a, r), *_ = wire.unpack_reply(wire.pack_reply(((absent, rows), 0, 2, 5)))
    np.testing.assert_array_equal(a, absent)
    np.testing.assert_array_equal(r, rows)
    assert wire.unpack_reply(wire.pack_reply(((4, 12), 1, 1, 1)))[0] == (4, 12)
    for status in (BEHIND, wire.REFUSED, wire.REREAD):
        assert wire.unpack_reply(wire.pack_reply(status)) == status
    assert wire.unpack_reply(wire.pack_reply(((wire.STAGED, True), 2, 0, 0))) == \
        ((wire.STAGED, True), 2, 0, 0)


def test_fits_only_small_data_path_requests():
    kc = _kc(np.arange(10))
    assert wire.fits("pull", (kc, True, False), 64)
    assert not wire.fits("call", ("len", ()), 64)
    big = _kc(np.arange(wire.FRAME_BYTES // 256 + 1))
    assert not wire.fits("pull", (big, True, False), 64)
    assert not wire.fits("push", (big[0], np.zeros((big.shape[1], 64), np.float32), None,
                                  False), 64)


def test_a_shard_answers_frames_as_it_answers_calls():
    s, ref = ShardServer("u", 0, 1), ShardServer("u", 0, 1)
    for x in (s, ref):
        x.create("t", {"dim": 4, "optimizer": "adagrad", "seed": 3})

    def both(method, seq, args):
        got = wire.unpack_reply(s.frame(wire.pack_request(method, "t", "w", seq, args)))
        want = getattr(ref, method)("t", "w", seq, *args)
        return got, want

    got, want = both("pull", 1, (_kc([1, 2, 2], [1, 2, 1]), True, False))
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1:] == want[1:]
    got, want = both("peek", 1, (_kc([1, 9]),))
    np.testing.assert_array_equal(got[0], want[0])
    got, want = both("push", 2, (np.array([1, 2]), np.ones((2, 4), np.float32), None, True))
    assert got == want
    got, want = both("pull", 3, (_kc([2, 30]), True, True))
    np.testing.assert_array_equal(got[0][0], want[0][0])
    np.testing.assert_array_equal(got[0][1], want[0][1])
    assert wire.unpack_reply(s.frame(wire.pack_request("push", "t", "w", 9, (
        np.array([1]), np.ones((1, 4), np.float32), None, False)))) == BEHIND
    with pytest.raises(Exception, match="no table 'x'"):
        s.frame(wire.pack_request("pull", "x", "w", 3, (_kc([1]), False, False)))
