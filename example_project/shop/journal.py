"""The shop's data store (Redis at ``REDIS_URL``) and the record of every execution.

Tasks write their results here, as a real shop would write to its database.
Each execution is also appended to a journal (a capped Redis list), so the
demo can count executions per schedule slot without trusting logs, and an
overlap probe counts runs of the same work that were ever in flight at once.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from celery import Task

from celery_singleton_beat.beat import INSTANCE_HEADER, SLOT_HEADER

from .celery_app import NAMESPACE, REDIS_URL

#: Journal length kept in Redis; a long-running cluster trims the oldest records.
JOURNAL_CAP = 100_000

JOURNAL_KEY = f"{NAMESPACE}:journal"
OVERLAPS_KEY = f"{NAMESPACE}:overlaps"

_client: redis.Redis | None = None

# Write ``body`` under ``fence`` unless a write with a larger fence came first.
_FENCED_WRITE = """
local stored = tonumber(redis.call('HGET', KEYS[1], 'fence'))
if stored and tonumber(ARGV[1]) < stored then
    return 0
end
redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'body', ARGV[2])
return 1
"""


def store() -> redis.Redis:
    """The data store client of this process.

    redis-py's connection pool notices a ``fork()`` and opens new connections
    in the child, so prefork pool processes can share this module-level client.
    """
    global _client
    if _client is None:
        _client = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=5)
    return _client


def key(*parts: str | int) -> str:
    """A key in the shop's namespace: ``key("customers", 7)`` -> ``shop:customers:7``."""
    return ":".join([NAMESPACE, *map(str, parts)])


def record_execution(task: Task, **details: Any) -> None:
    """Append this execution of ``task`` to the journal.

    Call it first thing in a task body: for a ``SingletonTask`` the body only
    runs once the lock is taken, so a run skipped as a duplicate is not an
    execution. The slot and the beat instance come from the message headers
    the singleton scheduler adds (absent for messages not sent by beat).
    """
    request = task.request
    entry = {
        "task": task.name,
        "args": list(request.args or ()),
        "kwargs": dict(request.kwargs or {}),
        "slot": getattr(request, SLOT_HEADER, None),
        "beat": getattr(request, INSTANCE_HEADER, None),
        "worker": request.hostname,
        "pid": os.getpid(),
        "task_id": request.id,
        "at": time.time(),
        **details,
    }
    pipe = store().pipeline(transaction=False)
    pipe.rpush(JOURNAL_KEY, json.dumps(entry, separators=(",", ":")))
    pipe.ltrim(JOURNAL_KEY, -JOURNAL_CAP, -1)
    pipe.execute()


def read_journal(client: redis.Redis, start: int = 0) -> list[dict[str, Any]]:
    """Journal records from index ``start`` on, oldest first."""
    return [json.loads(raw) for raw in client.lrange(JOURNAL_KEY, start, -1)]


@contextmanager
def overlap_probe(name: str) -> Iterator[None]:
    """Count how many runs of ``name`` are in flight; record any overlap.

    The per-customer lock should keep this at one. A second run entering
    while one is inside bumps the ``overlaps`` counter, which the demo
    reports (and fails on).
    """
    inflight = key("inflight", name)
    if store().incr(inflight) > 1:
        store().incr(OVERLAPS_KEY)
    try:
        yield
    finally:
        store().decr(inflight)


def fenced_write(name: str, fence: int, body: dict[str, Any]) -> bool:
    """Store ``body`` as ``name`` unless a holder with a larger fencing token wrote it.

    This is what a downstream store does with the lock's fencing token: a run
    that lost its lease (paused, partitioned) and comes back late carries a
    smaller token than its successor and cannot overwrite the newer result.
    """
    written = store().eval(_FENCED_WRITE, 1, key("reports", name), fence,
                           json.dumps(body, separators=(",", ":")))
    return bool(written)
