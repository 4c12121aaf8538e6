"""The Lua scripts of the lease (:mod:`.lock`) and the runner they share.

Each script is one round trip and compares before it writes, so a client that
retries after a lost reply, or an attempt whose lease another has taken, can
never change what another attempt wrote. ``KEYS``/``ARGV`` are listed above each.
"""

from __future__ import annotations

import hashlib
from typing import Any

from redis.exceptions import NoScriptError

__all__ = ["ACQUIRE", "RELEASE", "RELEASE_TASK", "RENEW", "STATS_TTL_MS", "LuaScript"]


class LuaScript:
    """A Lua script run with EVALSHA, loaded into the server on ``NOSCRIPT``."""

    def __init__(self, source: str) -> None:
        self.source = source.encode("utf-8")
        self.sha = hashlib.sha1(self.source).hexdigest()

    def __call__(self, client: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.source)
            return client.evalsha(self.sha, len(keys), *keys, *args)


# Counters: when a stats hash is passed as the key at index ``stats``, the
# scripts count what they did in it (same round trip) and keep it for
# STATS_TTL_MS (the last ARGV) after the last update. Redis Cluster callers
# pass no stats key (it lives in another slot).
_COUNT = """
local function count(stats, field)
  if stats and field ~= '' then
    -- The TTL is set when a field is created and refreshed every 64th update
    -- of it, not on each: one command less per lock operation.
    local n = redis.call('HINCRBY', stats, field, 1)
    if n % 64 == 1 then redis.call('PEXPIRE', stats, ARGV[#ARGV]) end
  end
end
"""

# KEYS: lock, fence, done marker of this task id[, stats].
# ARGV: 1 value without its closing brace, 2 ttl ms, 3 fence ttl ms,
#       4 task id allowed to adopt a publish-time claim ("" for none),
#       5 counter when taken, 6 counter on conflict,
#       7 a dead holder's exact value to take over ("" for none),
#       8 "1" to refuse when the done marker exists, 9 this task id,
#       10 stats ttl ms.
# Returns {1, value, fence} when taken, {0, current value, pttl} when held,
# {2, "", 0} when the done marker says this task id already completed.
# A value that starts with ARGV[1] is this very attempt (a client library
# replayed the call after a lost reply): it is reported as taken.
ACQUIRE = LuaScript(
    _COUNT
    + """
if ARGV[8] == '1' and redis.call('EXISTS', KEYS[3]) == 1 then
  count(KEYS[4], 'completed_copies')
  return {2, '', 0}
end
local current = redis.call('GET', KEYS[1])
if current then
  if string.sub(current, 1, string.len(ARGV[1])) == ARGV[1] then
    return {1, current, string.match(current, '"fence":(%d+)}$')}
  end
  if current == ARGV[7] then
    current = false
    count(KEYS[4], 'taken_over')
  elseif ARGV[4] ~= '' then
    local ok, holder = pcall(cjson.decode, current)
    if ok and holder['claim'] == true and holder['task_id'] == ARGV[4] then
      current = false
    end
  end
end
if current then
  if ARGV[9] ~= '' and string.find(current, '"task_id":"' .. ARGV[9] .. '"', 1, true) then
    count(KEYS[4], 'redelivered')
  else
    count(KEYS[4], ARGV[6])
  end
  return {0, current, redis.call('PTTL', KEYS[1])}
end
local fence = redis.call('INCR', KEYS[2])
if fence == 1 then
  -- A new counter starts from the server clock in microseconds, so a token is
  -- still larger than any earlier one after the counter expired.
  local now = redis.call('TIME')
  fence = redis.call('INCRBY', KEYS[2], now[1] .. string.format('%06d', tonumber(now[2])))
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
local value = ARGV[1] .. ',"fence":' .. string.format('%d', fence) .. '}'
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
count(KEYS[4], ARGV[5])
return {1, value, fence}
"""
)

# KEYS: lock[, stats]. ARGV: value, ttl ms, stats ttl ms. 1 if extended, 0 if not ours.
RENEW = LuaScript(
    _COUNT
    + """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  count(KEYS[2], 'renewed')
  return 1
end
return 0
"""
)

# KEYS: lock, done marker[, stats]. ARGV: 1 value, 2 counter if ours,
# 3 counter if not ours ("" for none), 4 done marker ttl ms ("" for none),
# 5 value to leave in the lock's place ("" to delete it), 6 its ttl ms,
# 7 stats ttl ms. 1 if the lock was ours (deleted or replaced), 0 if not.
RELEASE = LuaScript(
    _COUNT
    + """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[5] ~= '' then
    redis.call('SET', KEYS[1], ARGV[5], 'PX', ARGV[6])
  else
    redis.call('DEL', KEYS[1])
  end
  if ARGV[4] ~= '' then
    redis.call('SET', KEYS[2], '1', 'PX', ARGV[4])
  end
  count(KEYS[3], ARGV[2])
  return 1
end
count(KEYS[3], ARGV[3])
return 0
"""
)

# KEYS: lock[, stats]. ARGV: task id, counter, stats ttl ms.
# 1 if that task held the lock and it was deleted (counted as ARGV[2]).
RELEASE_TASK = LuaScript(
    _COUNT
    + """
local current = redis.call('GET', KEYS[1])
if not current then return 0 end
local ok, holder = pcall(cjson.decode, current)
if ok and holder['task_id'] == ARGV[1] then
  redis.call('DEL', KEYS[1])
  count(KEYS[2], ARGV[2])
  return 1
end
return 0
"""
)

#: How long a counter hash lives after its last update (30 days).
STATS_TTL_MS = 30 * 24 * 3600 * 1000
