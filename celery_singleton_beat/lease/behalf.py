"""Releases on someone else's behalf, and reading who holds a lock.

A release not done by the run itself -- a pool child that died, a hard time
limit, a revoked or expired copy of a message, an administrator -- compares
the holder's whole identity (its exact value, or task id, worker incarnation
and pid): a task id alone is not an identity, since a redelivered copy of the
message carries the same one.

Sent again after its reply was lost, such a release finds nothing to delete:
the holder it names does not hold the key any more, which is what it was for,
so it reports the lock freed.
"""

from __future__ import annotations

from ..connection.client import RedisClient
from . import counters
from .commands import release_for_request, release_request
from .executor import execute
from .holder import Holder, parse_holder, text_of

__all__ = ["read_holder", "release_for", "release_value"]


def release_value(client: RedisClient, key: str, value: bytes | str, *, stats_key: str | None = None,
                  counter: str = "released") -> bool:
    """Delete ``key`` if its value is still exactly ``value`` (compare-and-delete)."""
    text = text_of(value)
    released = execute(client, key, lambda info: release_request(info, key, text), pooled=True) is not False
    if released:
        counters.count(client, stats_key, counter)
    return released


def release_for(client: RedisClient, key: str, task_id: str, *, boot: str | None = None, pid: int | None = None,
                claims_only: bool = False, stats_key: str | None = None, counter: str = "released") -> bool:
    """Delete ``key`` if it is held by exactly that holder: ``task_id``, and ``boot`` and
    ``pid`` where given; with ``claims_only``, only a publish-time claim of ``task_id``.

    For releases on someone else's behalf (a pool child that died, a copy of a
    message that was discarded).
    """
    released = execute(client, key, lambda info: release_for_request(key, task_id, boot, pid, claims_only),
                       pooled=True) is not False
    if released:
        counters.count(client, stats_key, counter)
    return released


def read_holder(client: RedisClient, key: str) -> Holder | None:
    """The current holder of ``key``, or None if it is free."""
    return parse_holder(client.get(key))
