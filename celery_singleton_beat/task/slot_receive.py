"""What a worker checks of a beat slot's message: its headers and the claim script.

:mod:`celery_singleton_beat.task.slot_delivery` decides with :func:`receive_slot`
which copy of a slot's message runs; the beat side (:mod:`celery_singleton_beat.beat`)
writes the headers and reads claims with :func:`parse_claim`.
"""

from __future__ import annotations

import json
from typing import Any

from ..connection.pooled import run_script
from ..connection.wire import LuaScript
from ..lease.scripts import STATS_TTL_MS

__all__ = ["CLAIM_HEADER", "ENTRY_HEADER", "INSTANCE_HEADER", "RECEIVE_SCRIPT", "SLOT_HEADER", "parse_claim",
           "receive_slot"]

#: Message headers of a sent slot: the task can read ``self.request.singleton_beat_slot``.
SLOT_HEADER = "singleton_beat_slot"
#: The beat instance that sent the message.
INSTANCE_HEADER = "singleton_beat_instance"
#: The slot's claim key, which the worker checks before it runs the message.
CLAIM_HEADER = "singleton_beat_claim"
#: The entry (claim) name, for the worker's counters.
ENTRY_HEADER = "singleton_beat_entry"


def parse_claim(raw: bytes | str | None) -> dict[str, Any] | None:
    """A claim value as a dict; None for no value or one this library did not write."""
    if raw is None:
        return None
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


#: A worker received a slot message. KEYS: claim, [counter hash]. ARGV: the
#: message's instance, the worker, TTL in ms for a claim the worker creates,
#: stats TTL ms. Returns {'run'} or {'drop', holder value}. A missing claim
#: (expired, Redis restarted, beat failed open) is created in the message's
#: name: the first delivery of a slot wins, later ones from others are dropped.
#: A ``released`` claim says its beat did not publish: a copy from another beat
#: (one that published and died before the take-over) is the one to run, and
#: the claim is pinned to it.
RECEIVE_SCRIPT = LuaScript("""
local current = redis.call('GET', KEYS[1])
if not current then
  redis.call('SET', KEYS[1], cjson.encode({instance = ARGV[1], state = 'received',
             worker = ARGV[2]}), 'PX', tonumber(ARGV[3]))
  return {'run'}
end
local ok, claim = pcall(cjson.decode, current)
if not ok or type(claim) ~= 'table' then return {'run'} end
if claim['instance'] ~= ARGV[1] then
  if claim['state'] ~= 'released' then
    if KEYS[2] then
      redis.call('HINCRBY', KEYS[2], 'duplicates_dropped', 1)
      redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[4]))
    end
    return {'drop', current}
  end
  claim['instance'] = ARGV[1]  -- pinned below, as the claim's own copy would be
end
if claim['state'] ~= 'received' then
  claim['state'] = 'received'
  claim['worker'] = ARGV[2]
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then redis.call('SET', KEYS[1], cjson.encode(claim), 'PX', ttl)
  else redis.call('SET', KEYS[1], cjson.encode(claim)) end
end
return {'run'}
""")


def receive_slot(client: Any, key: str, instance: str, worker: str, create_ttl_ms: int,
                 stats_key: str | None) -> tuple[bool, dict[str, Any] | None]:
    """Record that ``worker`` accepts the slot message sent by ``instance``.

    ``(True, None)``: run it. ``(False, holder)``: another instance's message of
    this slot was (or will be) the one executed; drop this one.
    """
    keys = [key] + ([stats_key] if stats_key else [])
    reply = run_script(client, RECEIVE_SCRIPT, keys, [instance, worker, create_ttl_ms, STATS_TTL_MS])
    verdict = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
    if verdict == "drop":
        return False, parse_claim(reply[1]) or {}
    return True, None
