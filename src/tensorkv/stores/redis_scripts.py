"""Lua scripts the Redis store runs server-side (one atomic step each)."""

# Compare-and-set of one key in one server-side step. ARGV: expect-absent flag, expected
# value, set flag (0 deletes), new value.
CAS_SCRIPT = """
local cur = redis.call('GET', KEYS[1])
if ARGV[1] == '1' then
  if cur then return 0 end
elseif cur ~= ARGV[2] then
  return 0
end
if ARGV[3] == '1' then redis.call('SET', KEYS[1], ARGV[4]) else redis.call('DEL', KEYS[1]) end
return 1
"""
# KEYS: the log's key prefix, then the keys of ``before``; ARGV: the entry, the first number
# to try, then the values of ``before``. The prefix's "next" key remembers where to start.
APPEND_SCRIPT = """
for i = 2, #KEYS do redis.call('SET', KEYS[i], ARGV[i + 1]) end
local seq = tonumber(ARGV[2])
local hint = tonumber(redis.call('GET', KEYS[1] .. 'next') or '0')
if hint > seq then seq = hint end
while redis.call('SET', KEYS[1] .. string.format('%012d', seq), ARGV[1], 'NX') == false do
  seq = seq + 1
end
redis.call('SET', KEYS[1] .. 'next', seq + 1)
return seq
"""

__all__ = ["APPEND_SCRIPT", "CAS_SCRIPT"]
