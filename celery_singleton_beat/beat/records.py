"""Since when each entry has been scheduled, shared by every beat: what makes a slot *missed*.

A slot is missed only if it came due while its entry was scheduled and no beat
sent it (every beat was down). A slot that came before the entry was in any
beat's schedule (a first deploy, a new Redis, an entry added or renamed) was
not missed, and is not sent: Celery's own scheduler does not send it either.

One record per claim name, ``<prefix>:{beat:<name>}:scheduled``, holds the
instant (epoch seconds, on the beats' clock) the first beat that had the entry
in its schedule saw it. The first beat writes it (``SET NX``); it is never
rewritten. Every beat with the entry renews its TTL when it starts and then
every :data:`REFRESH` while it runs. The TTL is ``singleton_beat_catch_up_window``
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

__all__ = ["REFRESH", "EntryRecords", "entry_record_key"]

#: How often a running beat renews the records of its entries.
REFRESH = timedelta(hours=1)


def entry_record_key(prefix: str, name: str) -> str:
    """``<prefix>:{beat:<name>}:scheduled``: in the hash slot of the entry's claims."""
    return f"{prefix}:{{beat:{name}}}:scheduled"


def _parse(raw: Any) -> float | None:
    try:
        return float(raw.decode() if isinstance(raw, bytes) else raw)
    except (TypeError, ValueError, UnicodeDecodeError):
        return None  # not written by this library


class EntryRecords:
    """The Redis side of the records (see the module docstring); one round trip per call."""

    def __init__(self, client_of: Callable[[], Any], prefix: str, window: float) -> None:
        self._client_of = client_of  # called each time: the app's client may be replaced
        self.prefix = prefix
        self.ttl_ms = round((window + REFRESH.total_seconds()) * 1000)

    def sight(self, seen: Mapping[str, float]) -> dict[str, float]:
        """Record each claim name of ``seen`` as scheduled since the given epoch time, unless
        it already is, and renew its TTL; return since when each one is scheduled.

        That is the earlier of the record found and the time given (a record written
        meanwhile by a beat that saw the entry later does not make it newer). Raises
        ``redis.RedisError``.
        """
        if not seen:
            return {}
        pipe = self._client_of().pipeline(transaction=False)
        for name, at in seen.items():
            key = entry_record_key(self.prefix, name)
            pipe.set(key, f"{at:.3f}", nx=True, px=self.ttl_ms)
            pipe.get(key)
            pipe.pexpire(key, self.ttl_ms)
        replies = pipe.execute()
        found: dict[str, float] = {}
        for (name, at), stored in zip(seen.items(), replies[1::3], strict=True):
            recorded = _parse(stored)
            found[name] = at if recorded is None else min(recorded, at)
        return found
