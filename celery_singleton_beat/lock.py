"""The lease: acquire, renew, release and fence one Redis lock.

A lock is one Redis string key whose value records who holds it::

    {"v":1,"token":"<random>","task":"<name>","task_id":"<id>","node":"<worker>",
     "pid":123,"boot":"<worker incarnation>","at":1700000000.123,"claim":false,
     "fence":1700000000123456}

* **acquire** is one round trip: a Lua script that does ``SET NX PX`` and bumps
  the key's fencing counter. The counter lives beside the lock (same hash tag)
  and is seeded from the Redis clock when it is first created, so fencing tokens
  keep growing even after the counter key expires.
* **renew** and **release** are one round trip each and compare the whole value:
  only the attempt that wrote it can extend or delete it, so a run whose lease
  expired and was taken by another can never cut the new holder's lease short.
* **release_task** deletes a lock only if a given task id holds it; the worker's
  main process uses it for pool children that died without releasing.

Scripts run with EVALSHA and are loaded on ``NOSCRIPT`` (after a Redis restart
or on a new replica), so the script text crosses the network once per server.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import NoScriptError

from .client import call_acknowledged

__all__ = [
    "AcquireResult",
    "Holder",
    "Lease",
    "LuaScript",
    "acquire",
    "fence_key",
    "parse_holder",
    "release_task",
    "release_value",
]

VALUE_FORMAT = 1


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


# Counters: when a stats hash is passed as the last key, the scripts count what
# they did in it (same round trip) and keep it for STATS_TTL_MS after the last
# update. Redis Cluster callers pass no stats key (it lives in another slot).
_COUNT = """
local function count(stats, field)
  if stats then
    redis.call('HINCRBY', stats, field, 1)
    redis.call('PEXPIRE', stats, ARGV[#ARGV])
  end
end
"""

# KEYS: lock, fence[, stats]. ARGV: value without its closing brace, ttl ms,
# fence ttl ms, task id allowed to adopt a publish-time claim ("" for none),
# counter to bump when taken, counter to bump on conflict, stats ttl ms.
# Returns {1, value, fence} when taken, {0, current value, pttl} when held.
_ACQUIRE = LuaScript(
    _COUNT
    + """
local current = redis.call('GET', KEYS[1])
if current and ARGV[4] ~= '' then
  local ok, holder = pcall(cjson.decode, current)
  if ok and holder['claim'] == true and holder['task_id'] == ARGV[4] then
    current = false
  end
end
if current then
  count(KEYS[3], ARGV[6])
  return {0, current, redis.call('PTTL', KEYS[1])}
end
local fence
if redis.call('EXISTS', KEYS[2]) == 1 then
  fence = redis.call('INCR', KEYS[2])
else
  local now = redis.call('TIME')
  fence = redis.call('INCRBY', KEYS[2], now[1] .. string.format('%06d', tonumber(now[2])))
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
local value = ARGV[1] .. ',"fence":' .. string.format('%d', fence) .. '}'
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
count(KEYS[3], ARGV[5])
return {1, value, fence}
"""
)

# KEYS: lock[, stats]. ARGV: value, ttl ms, stats ttl ms. 1 if extended, 0 if not ours.
_RENEW = LuaScript(
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

# KEYS: lock[, stats]. ARGV: value, counter if deleted, counter if not ours
# ("" for none), stats ttl ms. 1 if deleted, 0 if the value is not ours.
_RELEASE = LuaScript(
    _COUNT
    + """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  count(KEYS[2], ARGV[2])
  return 1
end
if ARGV[3] ~= '' then count(KEYS[2], ARGV[3]) end
return 0
"""
)

# KEYS: lock[, stats]. ARGV: task id, counter, stats ttl ms.
# 1 if that task held the lock and it was deleted (counted as ARGV[2]).
_RELEASE_TASK = LuaScript(
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


def fence_key(key: str) -> str:
    """The fencing counter beside ``key`` (same Redis Cluster slot)."""
    return f"{key}:fence"


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as recorded in its value."""

    task_id: str | None
    task: str | None
    node: str | None
    pid: int | None
    boot: str | None
    acquired_at: float | None
    fence: int | None
    claim: bool
    token: str | None

    @property
    def is_claim(self) -> bool:
        """True for a publish-time claim that waits for its run to start."""
        return self.claim


def parse_holder(raw: bytes | str | None) -> Holder | None:
    """Decode a lock value; tolerant of foreign or damaged values (fields become None)."""
    if raw is None:
        return None
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError
    except ValueError:
        data = {}
    return Holder(
        task_id=data.get("task_id"),
        task=data.get("task"),
        node=data.get("node"),
        pid=data.get("pid"),
        boot=data.get("boot"),
        acquired_at=data.get("at"),
        fence=data.get("fence"),
        claim=bool(data.get("claim", False)),
        token=data.get("token"),
    )


def _ms(seconds: float) -> int:
    return max(1, int(round(seconds * 1000)))


def _keys(key: str, stats_key: str | None) -> list[str]:
    return [key, stats_key] if stats_key else [key]


class Lease:
    """A lock held by this process: renew it, release it, read its fencing token."""

    def __init__(self, client: redis.Redis, key: str, value: str, ttl: float, fence: int,
                 stats_key: str | None = None) -> None:
        self.client = client
        self.key = key
        self.stats_key = stats_key
        self.value = value
        self.ttl = ttl
        self.fence = fence
        self.holder = parse_holder(value)
        #: Monotonic time until which the lease is known to be valid.
        self.valid_until = time.monotonic() + ttl

    def renew(self) -> bool:
        """Extend the lease by ``ttl``; False if the lock is no longer ours.

        Raises ``redis.RedisError`` when Redis cannot be asked; the caller
        decides (the keeper keeps trying until the lease would have expired).
        """
        started = time.monotonic()
        renewed = bool(_RENEW(self.client, _keys(self.key, self.stats_key),
                              [self.value, _ms(self.ttl), STATS_TTL_MS]))
        if renewed:
            self.valid_until = started + self.ttl
        return renewed

    def release(self) -> bool:
        """Delete the lock if it is still ours; True if it was (else counted as lost)."""
        return bool(_RELEASE(self.client, _keys(self.key, self.stats_key),
                             [self.value, "released", "lost", STATS_TTL_MS]))

    def __repr__(self) -> str:
        return f"<Lease {self.key} fence={self.fence} ttl={self.ttl}s>"


@dataclass(frozen=True)
class AcquireResult:
    """The outcome of :func:`acquire`: a ``lease``, or the current ``holder``."""

    lease: Lease | None
    holder: Holder | None = None
    holder_ttl: float | None = None

    @property
    def acquired(self) -> bool:
        return self.lease is not None


_HOSTNAME = socket.gethostname()


def acquire(
    client: redis.Redis,
    key: str,
    ttl: float,
    *,
    task: str,
    task_id: str | None,
    node: str | None = None,
    boot: str | None = None,
    claim: bool = False,
    adopt_claim_of: str | None = None,
    stats_key: str | None = None,
    counters: tuple[str, str] = ("acquired", "skipped"),
    wait_replicas: int = 0,
    wait_timeout: float = 1.0,
) -> AcquireResult:
    """Try once to take ``key`` for ``ttl`` seconds (one round trip).

    ``claim=True`` writes a publish-time claim (held for a queued message,
    not renewed). ``adopt_claim_of`` lets the run of that task id take over
    its own publish-time claim instead of conflicting with it. With
    ``stats_key``, the outcome is counted there in the same round trip:
    ``counters`` names the field for "taken" and the one for "held by another".
    With ``wait_replicas``, a taken lock must reach that many replicas within
    ``wait_timeout`` (``WAIT``), else it is given back and
    :class:`~celery_singleton_beat.client.ReplicasNotAcknowledged` (a
    ``RedisError``: "Redis unavailable") is raised.
    """
    record = {
        "v": VALUE_FORMAT,
        "token": secrets.token_hex(12),
        "task": task,
        "task_id": task_id,
        "node": node or _HOSTNAME,
        "pid": os.getpid(),
        "boot": boot,
        "at": round(time.time(), 3),
        "claim": claim,
    }
    encoded = json.dumps(record, separators=(",", ":"))
    ttl_ms = _ms(ttl)
    fence_ttl_ms = max(ttl_ms * 2, 10_000)
    keys = [key, fence_key(key)] + ([stats_key] if stats_key else [])
    args = [encoded[:-1], ttl_ms, fence_ttl_ms, adopt_claim_of or "", *counters, STATS_TTL_MS]

    def give_back(conn: Any, reply: Any) -> None:
        if reply[0]:
            _RELEASE(conn, _keys(key, stats_key), [reply[1], "unacknowledged", "", STATS_TTL_MS])

    taken, value, extra = call_acknowledged(
        client, key, lambda conn: _ACQUIRE(conn, keys, args),
        replicas=wait_replicas, timeout=wait_timeout, undo=give_back,
    )
    if taken:
        text = value.decode("utf-8") if isinstance(value, bytes) else value
        return AcquireResult(lease=Lease(client, key, text, ttl, int(extra), stats_key))
    pttl = int(extra)
    return AcquireResult(lease=None, holder=parse_holder(value), holder_ttl=pttl / 1000 if pttl > 0 else None)


def release_value(client: redis.Redis, key: str, value: bytes | str, *, stats_key: str | None = None,
                  counter: str = "released") -> bool:
    """Delete ``key`` if its value is still exactly ``value`` (compare-and-delete)."""
    return bool(_RELEASE(client, _keys(key, stats_key), [value, counter, "", STATS_TTL_MS]))


def release_task(client: redis.Redis, key: str, task_id: str, *, stats_key: str | None = None,
                 counter: str = "released") -> bool:
    """Delete ``key`` if the task ``task_id`` holds it (run lease or publish claim)."""
    return bool(_RELEASE_TASK(client, _keys(key, stats_key), [task_id, counter, STATS_TTL_MS]))


def read_holder(client: redis.Redis, key: str) -> Holder | None:
    """The current holder of ``key``, or None if it is free."""
    return parse_holder(client.get(key))
