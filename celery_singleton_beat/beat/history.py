"""The record of a claim round (history list and counters), written in the claims' own round trip.

A beat records each round of claims: the slots it won go to the capped history list
``<prefix>:{beat}:history``, and the ``won`` / ``lost`` counters of each entry and in
total are counted. Written as a second round trip after the claims' replies, that record
cost a lone due entry as much again as its claim (a round trip is most of what a claim
costs, see ``docs/performance.md``). So the record rides in the claims' pipeline:
:data:`RECORD_SCRIPT` runs right after the round's ``SET NX`` commands on the same
connection, and tells the slots won from those lost by the claim values it finds (a value
holds the instance and the claim's time: only this beat's claim of this round has it).

One server only: on Redis Cluster the keys of a round span hash slots, and with
``singleton_wait_replicas`` the claims wait for replicas first; there the record stays a
round trip of its own after the claims (:meth:`.claims.ClaimStore.record`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..connection.wire import LuaScript
from ..lease.scripts import STATS_TTL_MS
from ..task.keys import beat_stats_key
from .entries import history_key, stats_key

__all__ = ["RECORD_CHUNK", "RECORD_SCRIPT", "history_record", "record_calls"]

#: The record of a round of claims. KEYS: the history list, the totals hash, then per
#: claim its key and its entry's counter hash. ARGV: the round's claim value, the
#: history's cap, 1 to count (``singleton_stats``) else 0, the counters' TTL in ms, then per
#: claim its history record. A claim whose key holds the round's value was won: its record
#: is pushed, ``won`` counted; else ``lost``. An entry's hash gets its TTL when a field is
#: created and every 64th update, the totals' at each round (as the lock scripts do).
#: Returns the number of claims won.
RECORD_SCRIPT = LuaScript("""
local value, cap, count, ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1', ARGV[4]
local won, lost = 0, 0
for i = 1, (#KEYS - 2) / 2 do
  local field = 'lost'
  if redis.call('GET', KEYS[2 * i + 1]) == value then
    redis.call('LPUSH', KEYS[1], ARGV[4 + i])
    field, won = 'won', won + 1
  else
    lost = lost + 1
  end
  if count and redis.call('HINCRBY', KEYS[2 * i + 2], field, 1) % 64 == 1 then
    redis.call('PEXPIRE', KEYS[2 * i + 2], ttl)
  end
end
if won > 0 then redis.call('LTRIM', KEYS[1], 0, cap - 1) end
if count then
  if won > 0 then redis.call('HINCRBY', KEYS[2], 'won', won) end
  if lost > 0 then redis.call('HINCRBY', KEYS[2], 'lost', lost) end
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return won
""")
#: Claims per :data:`RECORD_SCRIPT` call (Redis runs nothing else meanwhile: ~1 ms).
RECORD_CHUNK = 500

_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def history_record(entry: str, key: str, task: str, slot: str, winner: str, at: float) -> str:
    """One record of the history list (JSON, fixed key order)."""
    return _ENCODE({"entry": entry, "key": key, "task": task, "slot": slot, "winner": winner, "at": at})


def record_calls(prefix: str, instance: str, value: str, at: float, claims: Sequence[Any],
                 tasks: Sequence[str], cap: int, stats: bool) -> list[tuple[list[str], list[Any]]]:
    """``(KEYS, ARGV)`` of the :data:`RECORD_SCRIPT` calls recording ``claims`` (each a
    :class:`.claims.Claim`, ``tasks`` their entries' task names) claimed with ``value``."""
    head = [history_key(prefix), stats_key(prefix)]
    calls = []
    for start in range(0, len(claims), RECORD_CHUNK):
        chunk = range(start, min(start + RECORD_CHUNK, len(claims)))
        keys = [*head]
        args: list[Any] = [value, cap, 1 if stats else 0, STATS_TTL_MS]
        for i in chunk:
            claim = claims[i]
            keys += [claim.key, beat_stats_key(prefix, claim.name)]
            args.append(history_record(claim.name, claim.key, tasks[i], claim.slot.label, instance, at))
        calls.append((keys, args))
    return calls
