"""The server-side steps of a Redis-resident table: Lua scripts, bucket fields, intent records.

Besides its rows (fields of 8 bytes: the keys), every bucket hash holds a few fields of two
bytes, which no key can be:

* ``~e``: the table's *epoch*, a random identity written when the table is created (or
  emptied under ``on_lost="start_empty"``); a bucket without it was lost.
* ``~v``: the bucket's version, incremented by every commit that writes the bucket; it only
  grows, so a bucket seen going back was restored from a stale copy.
* ``~m`` and ``~i``: an *intent*, a part of an operation spanning several Cluster nodes that
  is prepared and not yet applied: ``~m`` is ``<op>:<coordinator bucket>``, ``~i`` the
  rows to write and the keys to delete (:func:`intent_blob`).
* ``~o``: a receipt of each of the last :data:`RING` operations this bucket coordinated
  (``<op><version>``, newest first): a commit sent again is recognised and not applied twice.
* ``~a``: operations declared aborted here (they can never commit afterwards).
* ``~c``: operations committed here whose intents on other buckets are not all applied.

Every script checks the epoch and the lock fence before it writes anything, and a commit
script applies all its buckets or none. The protocol built on them: docs/redis_table.md
("Commits").
"""

from __future__ import annotations

import os

import numpy as np

#: Fields of a bucket that are not rows (every key field is 8 bytes long).
EPOCH, VERSION, MARK, INTENT = b"~e", b"~v", b"~m", b"~i"
RECEIPTS, ABORTED, COMMITTED = b"~o", b"~a", b"~c"
META_FIELDS = (EPOCH, VERSION, MARK, INTENT, RECEIPTS, ABORTED, COMMITTED)
#: The fields read beside the rows of a bucket, in one HMGET: epoch, version, intent mark.
HEAD = (EPOCH, VERSION, MARK)
#: Receipts kept per coordinator bucket.
RING = 64
#: Length of an operation id (hex characters), and of a ring entry.
OP_CHARS, ENTRY_CHARS = 16, 32

#: Replies of :data:`COMMIT`, :data:`PREPARE` (the first element).
OK, ALREADY, WAS_ABORTED, LOST_LOCK, LOST, FOREIGN_INTENT = 0, 1, 2, 3, 4, 5
#: Replies of :data:`DECIDE`.
D_COMMITTED, D_ABORTED, D_PENDING, D_UNKNOWN = 1, 2, 3, 4


def new_op() -> bytes:
    """A fresh operation id (16 hex characters); it is also the token of its bucket locks."""
    return os.urandom(OP_CHARS // 2).hex().encode()


def new_epoch() -> str:
    """A fresh table epoch (16 hex characters)."""
    return os.urandom(8).hex()


_PRELUDE = """
local function has(ring, x)
  for i = 1, #ring, 32 do
    if string.sub(ring, i, i + 15) == x then return i end
  end
  return nil
end
local function push(key, field, entry, keep)
  local r = entry .. (redis.call('HGET', key, field) or '')
  if keep and #r > keep * 32 then r = string.sub(r, 1, keep * 32) end
  redis.call('HSET', key, field, r)
end
local function release(lock, x)
  if redis.call('GET', lock) == x then redis.call('DEL', lock) end
end
"""

# KEYS: n buckets (the first one coordinates), then the locks to check (n, when locked) and
# the locks to release afterwards (those n, then m more). ARGV: op, epoch, n, locked (1/0),
# two-phase (1: record the op as committed-not-finished), m, then per bucket the number of
# rows set and of keys deleted, then every field/value pair (bucket by bucket), then every
# deleted field. Reply: {OK, version of each bucket} or {code, bucket}.
COMMIT = _PRELUDE + """
local x, epoch, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local locked, two_pc, m = ARGV[4] == '1', ARGV[5] == '1', tonumber(ARGV[6])
local c = KEYS[1]
if has(redis.call('HGET', c, '~o') or '', x) then return {1} end
if has(redis.call('HGET', c, '~a') or '', x) then return {2} end
if locked then
  for i = 1, n do
    if redis.call('GET', KEYS[n + i]) ~= x then return {3, i} end
  end
end
for i = 1, n do
  local h = redis.call('HMGET', KEYS[i], '~e', '~m')
  if h[1] ~= epoch then return {4, i} end
  if h[2] and string.sub(h[2], 1, 16) ~= x then return {5, i} end
end
local p, total = 7 + 2 * n, 0
for i = 1, n do total = total + tonumber(ARGV[5 + 2 * i]) end
local d = p + 2 * total
local out = {0}
for i = 1, n do
  local ns, nd = tonumber(ARGV[5 + 2 * i]), tonumber(ARGV[6 + 2 * i])
  local a = 0
  while a < ns do
    local k = math.min(ns - a, 3000)
    redis.call('HSET', KEYS[i], unpack(ARGV, p + 2 * a, p + 2 * (a + k) - 1))
    a = a + k
  end
  p = p + 2 * ns
  a = 0
  while a < nd do
    local k = math.min(nd - a, 6000)
    redis.call('HDEL', KEYS[i], unpack(ARGV, d + a, d + a + k - 1))
    a = a + k
  end
  d = d + nd
  out[i + 1] = redis.call('HINCRBY', KEYS[i], '~v', 1)
end
push(c, '~o', x .. string.format('%016d', out[2]), 64)
if two_pc then push(c, '~c', x .. string.rep('0', 16), nil) end
for i = n + 1, #KEYS do release(KEYS[i], x) end
return out
"""

# KEYS: bucket, its lock. ARGV: op, epoch, mark (<op>:<coordinator>), intent blob.
# Reply: {OK} or {code}.
PREPARE = """
local x = ARGV[1]
if redis.call('GET', KEYS[2]) ~= x then return {3} end
local h = redis.call('HMGET', KEYS[1], '~e', '~m')
if h[1] ~= ARGV[2] then return {4} end
if h[2] and string.sub(h[2], 1, 16) ~= x then return {5} end
redis.call('HSET', KEYS[1], '~m', ARGV[3], '~i', ARGV[4])
return {0}
"""

# KEYS: bucket, its lock. ARGV: op, release (1/0). Applies the op's intent if the bucket
# still holds it (else it was applied already); releases the lock if the op holds it.
# Reply: the bucket's new version, or 0 when there was nothing to apply.
APPLY = _PRELUDE + """
local x, b = ARGV[1], KEYS[1]
local r = 0
local mark = redis.call('HGET', b, '~m')
if mark and string.sub(mark, 1, 16) == x then
  local blob = redis.call('HGET', b, '~i')
  local nl = string.find(blob, '\\n', 1, true)
  local w, ns, nd = string.match(string.sub(blob, 1, nl - 1), '^(%d+) (%d+) (%d+)')
  w, ns, nd = tonumber(w), tonumber(ns), tonumber(nd)
  local o, args = nl + 1, {}
  for j = 1, ns do
    args[#args + 1] = string.sub(blob, o, o + 7)
    args[#args + 1] = string.sub(blob, o + 8, o + 7 + w)
    o = o + 8 + w
    if #args >= 6000 then redis.call('HSET', b, unpack(args)); args = {} end
  end
  if #args > 0 then redis.call('HSET', b, unpack(args)); args = {} end
  for j = 1, nd do
    args[#args + 1] = string.sub(blob, o, o + 7)
    o = o + 8
    if #args >= 6000 then redis.call('HDEL', b, unpack(args)); args = {} end
  end
  if #args > 0 then redis.call('HDEL', b, unpack(args)) end
  redis.call('HDEL', b, '~m', '~i')
  r = redis.call('HINCRBY', b, '~v', 1)
end
if ARGV[2] == '1' then release(KEYS[2], x) end
return r
"""

# KEYS: bucket, its lock. ARGV: op, release (1/0). Drops the op's intent, if there.
ABORT = _PRELUDE + """
local mark = redis.call('HGET', KEYS[1], '~m')
if mark and string.sub(mark, 1, 16) == ARGV[1] then redis.call('HDEL', KEYS[1], '~m', '~i') end
if ARGV[2] == '1' then release(KEYS[2], ARGV[1]) end
return 0
"""

# KEYS: the coordinator bucket, its lock. ARGV: op, owner (1: the op's own writer asks),
# the coordinator's version the writer read (-1: unknown). Decides an operation: committed
# (its receipt is there), pending (its writer still holds the coordinator's lock: only
# for others), aborted (recorded, so that it can never commit afterwards), or unknown (the
# writer asks, its receipt may have left the ring).
DECIDE = _PRELUDE + """
local x, owner, vread = ARGV[1], ARGV[2] == '1', tonumber(ARGV[3])
local c = KEYS[1]
if has(redis.call('HGET', c, '~c') or '', x) then return 1 end
local ring = redis.call('HGET', c, '~o') or ''
if has(ring, x) then return 1 end
if has(redis.call('HGET', c, '~a') or '', x) then return 2 end
local held = redis.call('GET', KEYS[2]) == x
if held and not owner then return 3 end
local function abort()
  push(c, '~a', x .. string.rep('0', 16), 64)
  if held then redis.call('DEL', KEYS[2]) end
  return 2
end
if held or not owner then return abort() end
if tonumber(redis.call('HGET', c, '~v') or '0') == vread then return abort() end
if #ring < 64 * 32 or tonumber(string.sub(ring, #ring - 15)) <= vread + 1 then
  return abort()
end
return 4
"""

# KEYS: the coordinator bucket. ARGV: op. Forgets a two-phase op once applied everywhere.
FINISH = _PRELUDE + """
local r = redis.call('HGET', KEYS[1], '~c')
if r then
  local i = has(r, ARGV[1])
  if i then
    r = string.sub(r, 1, i - 1) .. string.sub(r, i + 32)
    if #r == 0 then redis.call('HDEL', KEYS[1], '~c') else redis.call('HSET', KEYS[1], '~c', r) end
  end
end
return 0
"""

# KEYS: bucket, lock. ARGV: new epoch, op, expected epoch ('' : any; a reset of lost rows),
# lock held by op (1/0). Empties the bucket under the new epoch; its version keeps growing.
# Reply: {OK} or {code}.
RESET = """
if ARGV[4] == '1' and redis.call('GET', KEYS[2]) ~= ARGV[2] then return {3} end
local h = redis.call('HMGET', KEYS[1], '~e', '~v')
if ARGV[3] ~= '' and h[1] ~= ARGV[3] then return {4} end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], '~e', ARGV[1], '~v', (tonumber(h[2]) or 0) + 1)
if ARGV[4] == '1' and redis.call('GET', KEYS[2]) == ARGV[2] then redis.call('DEL', KEYS[2]) end
return {0}
"""

# KEYS: bucket. ARGV: epoch. Empties a bucket that does not hold the epoch and gives it the
# epoch (creating a table, or emptying one under on_lost='start_empty'). Reply: 1 if emptied.
INIT = """
if redis.call('HGET', KEYS[1], '~e') == ARGV[1] then return 0 end
local v = tonumber(redis.call('HGET', KEYS[1], '~v') or '0')
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], '~e', ARGV[1], '~v', v + 1)
return 1
"""

# KEYS: bucket. ARGV: epoch. Gives a bucket the epoch, keeping its rows (a migration's target).
RELABEL = """
if redis.call('HGET', KEYS[1], '~e') ~= ARGV[1] then
  redis.call('HSET', KEYS[1], '~e', ARGV[1])
  redis.call('HINCRBY', KEYS[1], '~v', 1)
end
return 0
"""

# KEYS: bucket. ARGV: epoch. Writes the identity fields of a bucket that has none (a new
# table, or one written by a tensorkv that did not record them). Reply: the bucket's epoch.
ADOPT = """
if redis.call('HSETNX', KEYS[1], '~e', ARGV[1]) == 1 then redis.call('HSETNX', KEYS[1], '~v', 0) end
return redis.call('HGET', KEYS[1], '~e')
"""

# KEYS: bucket. Reply: {rows, epoch, version, intent mark}: the bucket's rows (fields of 8
# bytes) and its identity fields.
COUNT = """
local n = redis.call('HLEN', KEYS[1])
local h = redis.call('HMGET', KEYS[1], '~e', '~v', '~m', '~i', '~o', '~a', '~c')
for i = 1, 7 do if h[i] then n = n - 1 end end
return {n, h[1] or false, h[2] or false, h[3] or false}
"""

# KEYS: key. ARGV: expected value, new value. Compare-and-set of a string key.
SWAP = """
if (redis.call('GET', KEYS[1]) or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""

# KEYS: lock. ARGV: token. Releases a lock this token holds.
RELEASE = _PRELUDE + """
release(KEYS[1], ARGV[1])
return 0
"""

# KEYS: bucket. ARGV: n field/value pairs. Writes the rows the bucket does not hold yet; a
# bucket that received rows moves to a new version (as after every write of rows).
SET_ABSENT = """
local n = 0
for i = 1, #ARGV, 2 do n = n + redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) end
if n > 0 then redis.call('HINCRBY', KEYS[1], '~v', 1) end
return n
"""


def intent_blob(width: int, keys: np.ndarray, sealed: np.ndarray, deleted: np.ndarray,
                participants: list[int]) -> bytes:
    """The ``~i`` field of a prepared bucket: what :data:`APPLY` writes and deletes.

    A header line ``<row width> <rows> <deleted> <participant buckets, comma-separated>``,
    then each row as its 8 key bytes and its ``width`` sealed bytes, then each deleted key.
    """
    head = b"%d %d %d %s\n" % (width, keys.shape[0], deleted.shape[0],
                               ",".join(map(str, participants)).encode())
    body = np.empty((keys.shape[0], 8 + width), np.uint8)
    body[:, :8] = np.ascontiguousarray(keys, "<i8").view(np.uint8).reshape(-1, 8)
    body[:, 8:] = sealed
    return head + body.tobytes() + np.ascontiguousarray(deleted, "<i8").tobytes()


def parse_blob(blob: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """``(keys, sealed rows, deleted keys, participants)`` of an :func:`intent_blob`."""
    nl = blob.index(b"\n")
    width, ns, nd, parts = blob[:nl].split(b" ")
    w, ns_, nd_ = int(width), int(ns), int(nd)
    raw = np.frombuffer(blob, np.uint8, offset=nl + 1)
    body = raw[: ns_ * (8 + w)].reshape(ns_, 8 + w)
    keys = body[:, :8].copy().view("<i8").ravel().astype(np.int64)
    dels = raw[ns_ * (8 + w):].copy().view("<i8").astype(np.int64)
    if dels.shape[0] != nd_:
        raise ValueError("an intent record of another length than its header says")
    participants = [int(p) for p in parts.split(b",") if p]
    return keys, body[:, 8:], dels, participants


def mark_of(op: bytes, coordinator: int) -> bytes:
    """The ``~m`` field of a bucket prepared for ``op`` coordinated by bucket ``coordinator``."""
    return op + b":%d" % coordinator


def parse_mark(mark: bytes) -> tuple[bytes, int]:
    """``(op, coordinator bucket)`` of a ``~m`` field."""
    op, _, coord = mark.partition(b":")
    return op, int(coord)


__all__ = [
    "ABORT", "ABORTED", "ADOPT", "ALREADY", "APPLY", "COMMIT", "COMMITTED", "COUNT", "DECIDE",
    "D_ABORTED", "D_COMMITTED", "D_PENDING", "D_UNKNOWN", "ENTRY_CHARS", "EPOCH", "FINISH",
    "FOREIGN_INTENT", "HEAD", "INIT", "INTENT", "LOST", "LOST_LOCK", "MARK", "META_FIELDS", "OK",
    "OP_CHARS", "PREPARE", "RECEIPTS", "RELABEL", "RELEASE", "RESET", "RING", "SET_ABSENT",
    "SWAP", "VERSION", "WAS_ABORTED", "intent_blob", "mark_of", "new_epoch", "new_op",
    "parse_blob", "parse_mark",
]
