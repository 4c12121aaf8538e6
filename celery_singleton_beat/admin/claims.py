"""Publish-time claims: list them and delete them (after ``celery purge``), never a running lock.

``until_executed`` and ``until_executing`` tasks claim their key when a message is
published (``"claim": true`` in the value; ``until_executing`` on ``<key>:queued``),
and the claim waits for that message's run for up to ``singleton_queue_lock_ttl``
(an hour by default). A message that is gone without a run (``celery purge``, a
deleted queue, a broker that lost its data) leaves its claim behind: until it
expires, a new publish of that key returns the purged message's ``AsyncResult``,
nothing runs, and ``.get()`` waits for ever. :func:`purge_claims` deletes such claims.

A claim is deleted only if it still holds the exact value read (compare-and-delete):
a claim its run took over meanwhile (it became a running lock) or a newer claim is
left alone. Deleting the claim of a message still in the queue costs only its
publish-time deduplication (a new publish queues a second message); each run still
takes the run lock.

Why publishes do not find such claims by themselves: a publish that meets a claim
frees it when Celery recorded its task as ended (revoked, expired), a cheap and
certain test. Whether a message still exists has no such test: with RabbitMQ a
queued message cannot be looked at without consuming it; with Redis as broker it
may sit in any of the task's queues and priority lists (a scan of each), in the
``unacked`` hash (reserved or prefetched by a worker, ETA tasks included), or
between the two while a worker takes it, and a claim is written before its message
is published. Guessing wrong would run a duplicate, so the operator who purged
the queue purges the claims.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from celery import Celery

from ..lease.behalf import release_value
from ..task.keys import task_stats_key
from ._common import connect
from .locks import HeldLock, ReleaseResult, list_locks

__all__ = ["find_claims", "is_claim", "purge_claims"]

#: The task counter a deleted claim is counted in (``celery singleton stats``, OTHER).
COUNTER = "claims_purged"


def is_claim(lock: HeldLock) -> bool:
    """True for a publish-time claim (a message waiting for its run), False for a running lock."""
    return lock.kind in ("claim", "queued") and lock.holder.claim


def find_claims(app: Celery, *, task: str | None = None) -> list[HeldLock]:
    """Every publish-time claim held now (of ``task`` only, if given), oldest first per task.

    Raises :class:`InvalidSettings`, :class:`RedisUnavailable` or :class:`AdminRedisError`.
    """
    return [lock for lock in list_locks(app, task=task, kind=("claim", "queued")) if is_claim(lock)]


def purge_claims(app: Celery, claims: Iterable[HeldLock] | None = None, *,
                 task: str | None = None) -> ReleaseResult:
    """Delete ``claims`` (default: :func:`find_claims` of ``task``), each only if unchanged.

    ``released``: deleted; ``changed``: left alone, no longer the value read (its run
    started and took the key over, or it expired and was claimed again). Each deletion
    is counted as ``claims_purged`` in the task's counters. Raises ``ValueError`` for
    anything that is not a claim (a running lock is never deleted here), and the
    errors of :func:`find_claims`; a Redis failure part way leaves the claims deleted
    before it deleted.
    """
    if claims is not None and task is not None:
        raise TypeError("give claims or task, not both")
    targets = find_claims(app, task=task) if claims is None else list(claims)
    refused = [lock.key for lock in targets if not is_claim(lock)]
    if refused:
        raise ValueError(f"not publish-time claims (running locks are never purged): {refused}")
    target = connect(app)
    released: list[HeldLock] = []
    changed: list[HeldLock] = []
    with target.guard():
        for lock in targets:
            stats_key = task_stats_key(target.prefix, lock.task) if target.settings.stats else None
            deleted = release_value(cast(Any, target.client), lock.key, lock.value,
                                    stats_key=stats_key, counter=COUNTER)
            (released if deleted else changed).append(lock)
    return ReleaseResult(tuple(released), tuple(changed))
