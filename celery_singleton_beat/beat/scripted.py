"""Many Lua script calls in one round trip per server, for the beat's claims and records.

:func:`evalsha_pipelined` runs script calls in one pipeline per server (the library's
own requests per node on Cluster); :data:`SWAP_SCRIPT` and :func:`swap_many` are the
claims' compare-and-set, many claims per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError

from ..connection.client import cluster_moved, is_cluster
from ..connection.pooled import run_by_node
from ..connection.wire import LuaScript

__all__ = ["SWAP_CHUNK", "SWAP_SCRIPT", "evalsha_pipelined", "swap_calls", "swap_many", "swap_outcome"]

#: Compare-and-set of claims, each keeping (at least) its TTL. KEYS: claims (one
#: hash slot per call with Redis Cluster). ARGV: per claim, expected value, new
#: value, minimum TTL in ms (0: keep). Returns per claim {1} or {0, current}.
#: Many claims per call: a script call's set-up costs Redis more than its work.
SWAP_SCRIPT = LuaScript("""
local out = {}
for i, key in ipairs(KEYS) do
  local current = redis.call('GET', key)
  if current ~= ARGV[3 * i - 2] then
    out[i] = {0, current}
  else
    local ttl = redis.call('PTTL', key)
    local floor = tonumber(ARGV[3 * i])
    if floor > ttl then ttl = floor end
    if ttl > 0 then redis.call('SET', key, ARGV[3 * i - 1], 'PX', ttl)
    else redis.call('SET', key, ARGV[3 * i - 1]) end
    out[i] = {1}
  end
end
return out
""")
#: Claims per :data:`SWAP_SCRIPT` call (Redis runs nothing else meanwhile: ~1 ms).
SWAP_CHUNK = 500

def swap_many(client: Any, swaps: Sequence[tuple[str, bytes | str, str, int]]) -> list[tuple[bool, bytes | None]]:
    """Run :data:`SWAP_SCRIPT` for each ``(key, expected, new, min_ttl_ms)`` in one round trip.

    Returns ``(swapped, current value)`` per item, in order.
    """
    if not swaps:
        return []
    # A script's keys must share a hash slot on Cluster: one claim per call there.
    calls = ([([key], [old, new, ttl]) for key, old, new, ttl in swaps] if is_cluster(client)
             else swap_calls(swaps))
    return [swap_outcome(item) for reply in evalsha_pipelined(client, SWAP_SCRIPT, calls) for item in reply]


def swap_calls(swaps: Sequence[tuple[str, bytes | str, str, int]]) -> list[tuple[list[str], list[Any]]]:
    """``(KEYS, ARGV)`` of the :data:`SWAP_SCRIPT` calls for ``swaps``, :data:`SWAP_CHUNK` per call."""
    calls = []
    for start in range(0, len(swaps), SWAP_CHUNK):
        chunk = swaps[start:start + SWAP_CHUNK]
        calls.append(([key for key, _, _, _ in chunk],
                      [arg for _, old, new, ttl in chunk for arg in (old, new, ttl)]))
    return calls


def swap_outcome(reply: Sequence[Any]) -> tuple[bool, bytes | None]:
    """``(swapped, current value)`` from a :data:`SWAP_SCRIPT` reply (Lua false -> None)."""
    if reply[0]:
        return True, None
    current = reply[1] if len(reply) > 1 else None
    if isinstance(current, str):  # a client with decode_responses
        current = current.encode()
    return False, current if isinstance(current, bytes) else None


def evalsha_pipelined(client: Any, script: LuaScript,
                       calls: Sequence[tuple[list[str], list[Any]]]) -> list[Any]:
    """EVALSHA ``calls`` in one pipeline per server; load the script and redo once on NOSCRIPT.

    Redis Cluster clients refuse scripts in their pipelines: there the calls go as the
    library's own requests, one per node (:func:`.connection.pooled.run_by_node`, which
    loads the script where missing and follows ``-MOVED`` and ``-ASK``, to a node being
    added too). An error left is raised, the client's layout read again first when it
    says a slot moved, so that the next attempt (the beat retries with back-off) goes to
    the slot's owner.
    """
    if is_cluster(client):
        replies = run_by_node(client, [script.command(keys, args) for keys, args in calls], (script,))
        for reply in replies:
            if isinstance(reply, Exception):
                cluster_moved(client, reply)
                raise reply
        return replies

    def run(indexes: Sequence[int]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for i in indexes:
            keys, args = calls[i]
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        replies: list[Any] = pipe.execute(raise_on_error=False)
        return replies

    replies = run(range(len(calls)))
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        client.script_load(script.source)
        for i, reply in zip(missing, run(missing), strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies
