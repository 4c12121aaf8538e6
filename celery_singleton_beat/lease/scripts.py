"""The Lua scripts of the lease: where a server lacks a native command, and the rare paths.

The common path uses no Lua (see :mod:`.commands`): an acquire is one write
(``SET NX PX GET`` and ``TIME``, no ``MULTI``), a release is ``DELIFEQ`` /
``DELEX ... IFEQ`` and a renewal ``SET ... IFEQ`` where the server has them.
The scripts below stand in for those on older servers (:data:`RELEASE`,
:data:`RENEW`) and do what no single command does (the acquire of a copy of an
``acks_late`` message, which must not write when its done marker exists), each
in one round trip, comparing before it writes, so that a repeated call or an
attempt whose lease another has taken never changes what another attempt
wrote. Those that replace a value report the value they found instead, and
:mod:`.commands` decides: finding the new value itself means the call ran
before (its reply was lost), which is success. ``KEYS``/``ARGV`` are listed
above each.
"""

from __future__ import annotations

from ..connection.wire import LuaScript

__all__ = ["ACQUIRE_UNLESS_DONE", "ADOPT", "CLAIM_ON_RETRY", "RELEASE", "RELEASE_FOR", "RENEW", "RENEW_MANY",
           "STATS_TTL_MS", "TAKE_OVER", "LuaScript"]

# KEYS: lock. ARGV: value. 1 if it was ours and is deleted, 0 if not.
RELEASE = LuaScript("""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
""")

# KEYS: lock, the done marker of the run's task id.
# ARGV: value, ttl ms.
# The acquire of a delivery known to be a copy of an ``acks_late`` message (a
# first delivery checks the marker right behind its plain ``SET``): a copy of a
# message whose run completed must not take the key even for a moment (a caller who saw the result and
# submits the key again would be skipped as a duplicate of an ended run), so
# the marker is read before the ``SET``. The ``SET`` is the first write: a
# server out of memory refuses the script there, as it refuses a plain
# ``SET`` (once a script has written, its later writes are let through).
# {seconds, microseconds, taken, completed[, the value found]}: the server's
# clock is the fencing token.
ACQUIRE_UNLESS_DONE = LuaScript("""
local now = redis.call('TIME')
local current = redis.call('GET', KEYS[1])
if redis.call('EXISTS', KEYS[2]) == 1 then return {now[1], now[2], 0, 1, current} end
if current then return {now[1], now[2], 0, 0, current} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {now[1], now[2], 1, 0}
""")

# KEYS: lock. ARGV: value, ttl ms.
# 1 renewed; 0 held by another value; -1 gone (expired, deleted, lost by the server).
RENEW = LuaScript("""
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if current then return 0 end
return -1
""")

# KEYS: locks. ARGV: each lock's value and ttl ms, in pairs (the lock's RENEW, for many).
# The 1-based positions of the locks not renewed, each followed by 0 (another value holds
# it) or -1 (gone): empty when every lock was renewed, which is the usual reply.
RENEW_MANY = LuaScript("""
local failed = {}
for i = 1, #KEYS do
  local current = redis.call('GET', KEYS[i])
  if current == ARGV[2 * i - 1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
  else
    failed[#failed + 1] = i
    failed[#failed + 1] = current and 0 or -1
  end
end
return failed
""")

# KEYS: lock. ARGV: value, the claim to leave in its place, its ttl ms.
# A retried ``until_executed`` run: its lock becomes the retry's publish claim.
# {1} when replaced; {0, current value} otherwise.
CLAIM_ON_RETRY = LuaScript("""
local current = redis.call('GET', KEYS[1])
if current ~= ARGV[1] then return {0, current} end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {1}
""")

# KEYS: lock. ARGV: the exact value to replace, the new value, ttl ms.
# A run adopting its own publish claim. {1, seconds, microseconds} when
# replaced (the server's clock: the fencing token); {0, seconds,
# microseconds, current value} otherwise.
ADOPT = LuaScript("""
local current = redis.call('GET', KEYS[1])
local now = redis.call('TIME')
if current ~= ARGV[1] then return {0, now[1], now[2], current} end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {1, now[1], now[2]}
""")

# KEYS: lock. ARGV: the holder's exact value, the lock's expiry (server clock, Unix
# ms) at the first look, the new value, ttl ms, "1" where PEXPIRETIME reads the expiry
# as stored (Redis 7.0+), else "0".
# Taken over only if the holder is still that value and the lock was not renewed
# since the first look: its expiry did not move (a renewal moves it later by the time
# since the previous one). Where PEXPIRETIME is missing (Redis 6.2) the expiry is the
# clock read after PTTL, which can come out later than stored by the time between the
# two reads, hence 50 ms of slack there; the expiry is never compared with a clock
# read at another moment. A key without expiry (made persistent since the look) is not
# replaced: it never is the take-over's (see ``missed_renewals``). The caller checked
# just before that the holder's liveness key is still gone (it lives in another hash
# slot). Same replies as ADOPT.
TAKE_OVER = LuaScript("""
local current = redis.call('GET', KEYS[1])
local expires, slack
if ARGV[5] == '1' then
  expires, slack = redis.call('PEXPIRETIME', KEYS[1]), 0
else
  local pttl = redis.call('PTTL', KEYS[1])
  local t = redis.call('TIME')
  expires, slack = t[1] * 1000 + math.floor(t[2] / 1000) + pttl, 50
  if pttl < 0 then expires = pttl end
end
local now = redis.call('TIME')
if current ~= ARGV[1] or expires < 0 or expires > tonumber(ARGV[2]) + slack then
  return {0, now[1], now[2], current}
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
return {1, now[1], now[2]}
""")

# KEYS: lock. ARGV: task id, worker incarnation ("" for any), pid ("" for
# any), "1" to free only a publish-time claim.
# A release on someone else's behalf (a dead pool child, a discarded copy):
# deleted only if the value names that very holder. 1 if deleted, else 0.
RELEASE_FOR = LuaScript("""
local current = redis.call('GET', KEYS[1])
if not current then return 0 end
local ok, holder = pcall(cjson.decode, current)
if not ok or type(holder) ~= 'table' or holder['task_id'] ~= ARGV[1] then return 0 end
if ARGV[4] == '1' and holder['claim'] ~= true then return 0 end
if ARGV[2] ~= '' and holder['boot'] ~= ARGV[2] then return 0 end
if ARGV[3] ~= '' and tostring(holder['pid']) ~= ARGV[3] then return 0 end
redis.call('DEL', KEYS[1])
return 1
""")

#: How long a counter hash lives after its last update (30 days).
STATS_TTL_MS = 30 * 24 * 3600 * 1000
