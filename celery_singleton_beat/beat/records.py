"""Since when each entry has been scheduled, shared by every beat: what makes a slot *missed*.

A slot is missed only if it came due while its entry was scheduled and no beat
sent it (every beat was down). A slot that came before the entry was in any
beat's schedule (a first deploy, a new Redis, an entry added or renamed) was
not missed, and is not sent: Celery's own scheduler does not send it either.

One record per claim name, ``<prefix>:{beat:<name>}:scheduled``, holds the
instant (epoch seconds, on the beats' clock) the first beat that had the entry
in its schedule saw it. The first beat writes it; it is never rewritten. Every
beat with the entry renews its TTL when it starts and then every :data:`REFRESH`
while it runs (one script call per 500 records, :data:`RECORD_SCRIPT`; 10,000
entries took 0.23 s at start, 0.31 s to renew, measured on a loaded 2-core VM;
the renewal goes out 1,000 entries per tick). The TTL is ``singleton_beat_catch_up_window``
plus :data:`REFRESH`, so the record outlives the last running beat by at least
the window: a beat started within the window after an outage finds it and
catches up (``singleton_beat_catch_up``); after a longer outage, or when Redis
lost the record, the entry is seen for the first time again and no slot
before now is sent. Memory: one small key per entry, gone a window after the
entry left every beat's schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from ..connection.client import is_cluster
from ..connection.wire import LuaScript
from .scripted import evalsha_pipelined

__all__ = ["REFRESH", "EntryRecords", "entry_record_key"]

#: How often a running beat renews the records of its entries.
REFRESH = timedelta(hours=1)

#: Read-or-write of records, each keeping or getting a TTL. KEYS: records (one hash
#: slot per call with Redis Cluster). ARGV: TTL in ms, then per record the value to
#: write if it is missing. Returns per record the value it holds.
RECORD_SCRIPT = LuaScript("""
local out = {}
for i, key in ipairs(KEYS) do
  local current = redis.call('GET', key)
  if current then
    redis.call('PEXPIRE', key, ARGV[1])
  else
    current = ARGV[i + 1]
    redis.call('SET', key, current, 'PX', ARGV[1])
  end
  out[i] = current
end
return out
""")
#: Records per :data:`RECORD_SCRIPT` call.
CHUNK = 500


def entry_record_key(prefix: str, name: str) -> str:
    """``<prefix>:{beat:<name>}:scheduled``: in the hash slot of the entry's claims."""
    return f"{prefix}:{{beat:{name}}}:scheduled"


def _parse(raw: Any) -> float | None:
    try:
        return float(raw.decode() if isinstance(raw, bytes) else raw)
    except (TypeError, ValueError, UnicodeDecodeError):
        return None  # not written by this library


class EntryRecords:
    """The Redis side of the records (see the module docstring)."""

    def __init__(self, client_of: Callable[[], Any], prefix: str, window: float) -> None:
        self._client_of = client_of  # called each time: the app's client may be replaced
        self.prefix = prefix
        self.ttl_ms = round((window + REFRESH.total_seconds()) * 1000)

    def sight(self, seen: Mapping[str, float]) -> dict[str, float]:
        """Record each claim name of ``seen`` as scheduled since the given epoch time, unless
        it already is, and renew its TTL; return since when each one is scheduled.

        That is the earlier of the record found and the time given (a record written
        meanwhile by a beat that saw the entry later does not make it newer). One
        round trip: :data:`CHUNK` records per script call, pipelined (one record per
        call on Redis Cluster). Raises ``redis.RedisError``.
        """
        if not seen:
            return {}
        client = self._client_of()
        names = list(seen)
        keys = [entry_record_key(self.prefix, name) for name in names]
        values = [f"{seen[name]:.3f}" for name in names]
        step = 1 if is_cluster(client) else CHUNK
        calls = [(keys[i:i + step], [self.ttl_ms, *values[i:i + step]]) for i in range(0, len(keys), step)]
        stored = [value for reply in evalsha_pipelined(client, RECORD_SCRIPT, calls) for value in reply]
        found: dict[str, float] = {}
        for name, value in zip(names, stored, strict=True):
            recorded = _parse(value)
            found[name] = seen[name] if recorded is None else min(recorded, seen[name])
        return found
