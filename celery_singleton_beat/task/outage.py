"""A run whose lock Redis cannot be asked, fail closed: published again, or waiting in the worker.

The run never starts without its lock. After each failed acquire it is
published again with a back-off (no cap): once the broker takes that retry,
the run ends ``RETRY`` and waits in the queue, not in a pool slot. When the
retry cannot be published either (the lock Redis is the broker, or the broker
is down as well), Celery would reject the message for good; instead the run
waits in the worker, asks for its lock again after the back-off, and tries the
publish again at every attempt.

That wait must end before the run is ended for it:

* before the run's time limit, where the pool enforces one (prefork: soft and
  hard; gevent: hard; see :func:`time_limit_of`), leaving room for one
  more attempt (the lock client's connect + read timeouts, or the longest
  attempt so far): the pool would end the run as a ``FAILURE`` and acknowledge
  its message. The limit counts from when the worker accepted the run where
  this process knows it (gevent), else from the start of the acquire (a prefork
  child: what ran before it, ``task_prerun`` handlers, is not seen; a soft
  limit that strikes during the wait ends it the same way);
* as soon as the worker shuts down (:func:`shutting_down`), instead of
  holding the shutdown until Redis answers.

Then an ``acks_late`` run gives its message back (``Reject(requeue=True)``):
back in the queue, or, while the broker cannot take it, delivered again once
the broker's visibility timeout has passed (RabbitMQ: when the connection
closes). A run acknowledged when it started (``acks_late`` off, Celery's
default) has no message left to give back: it ends ``FAILURE`` with
:class:`~.exceptions.LockUnavailable`, without running, logged as an error.
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import redis
from celery import signals
from celery.exceptions import Reject, SoftTimeLimitExceeded

from ..connection.url import DEFAULT_REDIS_OPTIONS
from ..exceptions import LockUnavailable
from ..lease import counters
from ..lease.lease import Lease
from ..lease.lock import AcquireResult
from ..log import logger
from . import soft_limit
from .conflicts import ConflictOutcomes

__all__ = ["SHUTDOWN_LOOK", "LateLockReply", "OutageWait", "accepted_at", "claim_back", "in_time", "retry_uncapped",
           "shutting_down", "time_limit_of", "wait_for_redis", "worker_starts", "worker_stops"]

#: Seconds between two looks at whether the worker is shutting down while a wait pauses.
SHUTDOWN_LOOK = 0.1

# -- what a waiting run knows of its worker ------------------------------------

#: One byte, non-zero once this worker began to stop. A shared anonymous mapping
#: made at import, before any pool forks: the main process writes it, prefork
#: children read the same page (no signal is sent into a child's code).
_stopping = mmap.mmap(-1, 1)

#: Module of a pool class -> which time limits that pool enforces: (hard, soft).
#: gevent ends a run at its hard limit only; threads, solo and eventlet at none.
_POOL_LIMITS = {
    "celery.concurrency.prefork": (True, True),
    "celery.concurrency.gevent": (True, False),
    "celery.concurrency.eventlet": (False, False),
    "celery.concurrency.thread": (False, False),
    "celery.concurrency.solo": (False, False),
}
#: The time limits this worker's pool enforces, (hard, soft); a pool not known above
#: is taken to enforce both.
_pool_limits = (True, True)
#: The worker's main process, where the threads, gevent and solo pools run their tasks.
_worker_pid: int | None = None


def worker_starts(pool_cls: Any) -> None:
    """A worker of this process starts with ``pool_cls`` (called before its pool forks)."""
    global _pool_limits, _worker_pid
    _pool_limits = next((_POOL_LIMITS[k.__module__] for k in getattr(pool_cls, "__mro__", ())
                         if k.__module__ in _POOL_LIMITS), (True, True))
    _worker_pid = os.getpid()
    _stopping[0] = 0  # a worker started again in this process (tests) is not stopping


def worker_stops(**_: Any) -> None:
    """This process's worker begins to stop (warm or cold): waiting runs end their wait."""
    _stopping[0] = 1


# The shutdown signal handlers (SIGTERM, SIGINT, SIGQUIT) send this in the main
# process: the one sign a run waiting in a solo pool (the main thread) can see.
signals.worker_shutting_down.connect(worker_stops, weak=False)


def shutting_down() -> bool:
    """True once this process's worker began to stop (in its prefork children too)."""
    return _stopping[0] != 0


def time_limit_of(task: Any, request: Any) -> float | None:
    """Seconds after its start at which this worker's pool ends the run of ``request``
    (its first time limit the pool enforces), or None.

    The message's limits (``apply_async(time_limit=..., soft_time_limit=...)``) come
    first, then the task's (``@app.task(time_limit=...)``, else the app's
    ``task_time_limit`` / ``task_soft_time_limit``), as Celery's worker reads them.
    """
    hard_enforced, soft_enforced = _pool_limits
    hard, soft = request.timelimit or (None, None)
    limits = [float(limit) for limit, enforced in ((hard or task.time_limit, hard_enforced),
                                                   (soft or task.soft_time_limit, soft_enforced))
              if enforced and limit]
    return min(limits) if limits else None


def accepted_at(request: Any) -> float | None:
    """Monotonic time the worker accepted the run of ``request``, where this process knows
    it: in the worker's own process (threads, gevent, solo), not in a prefork child.

    The pool's time limit counts from then; what ran before the task (the
    ``task-started`` event, ``task_prerun`` handlers) may have taken a while.
    """
    if os.getpid() != _worker_pid:
        return None
    from celery.worker import state

    accepted = getattr(state.requests.get(request.id), "time_start", None)
    return None if not accepted else time.monotonic() - (time.time() - float(accepted))


# -- the wait -----------------------------------------------------------------


class LateLockReply(redis.TimeoutError):
    """An acquire's reply was read after its holder could vouch for the lease it granted."""


def in_time(result: AcquireResult, give_back: Callable[[Any], object]) -> AcquireResult:
    """``result``, unless it granted a lease its holder could no longer vouch for when the
    reply was read.

    A lease counts from when its acquire was sent, and is vouched for until the earliest
    moment another could hold the key (``ensure_held``'s grace: the lease's end, a
    take-over, or a recovery window after a restart or a failover that lost the lock): a
    reply that took longer than that (a slow or stalled link, a process paused while it
    waited) grants a lock that may have been lost and taken since. The run must not start
    on it: the lock is handed to ``give_back`` (released if it is still ours, whenever
    Redis answers) and :class:`LateLockReply` raised, which fails the acquire as a timeout
    does: the run waits for its lock Redis (:func:`wait_for_redis`) and acquires again.
    The acquire counted the lock under ``acquired``; no run took it, so that count is
    taken back.
    """
    lease = result.lease
    if lease is not None:
        late = time.monotonic() - lease.vouched_until
        if late >= 0:
            spec = lease.spec
            counters.count(lease.client, spec.stats_key, spec.counters[0], -1)
            give_back(lease)
            raise LateLockReply(f"the reply granting the lock came {late + spec.grace:.1f}s after its "
                                f"request, past the {spec.grace:g}s its holder could vouch for it")
    return result


def claim_back(lease: Lease, claim_ttl: float, reclaim: Callable[[], object]) -> None:
    """The give-back of :func:`in_time` for a worker's ``until_executed`` run: the key stays
    claimed for the run's message (its retry, queued while the run waits for Redis).

    The acquire may have adopted the message's own publish claim: deleting the lock
    would leave the key free while the retry waits in the queue, and a publish of the
    same arguments would be queued beside it. The late lock is turned back into a claim
    of its task id for ``claim_ttl`` seconds if it is still the run's; if it expired
    already (the usual case: the reply came after the lease), ``reclaim()`` claims the
    key anew, unless another holder took it meanwhile (the retry meets it when it runs).
    Unanswered, the lock is left to expire by itself, as in an outage.
    """
    try:
        if not lease.release(claim_ttl=claim_ttl, counted=False):  # never run on: no loss
            reclaim()
    except redis.RedisError as exc:
        logger.warning("could not keep %s claimed for the message's retry: %s", lease.key, exc)


def wait_for_redis(task: ConflictOutcomes, key: str, exc: redis.RedisError, take: Callable[[], AcquireResult], *,
                   started: float, client: Any) -> AcquireResult:
    """The acquire of ``key`` failed with ``exc``: retry (publish or wait) until ``take()``
    answers; returns its result. Raises ``Retry`` (published), ``Reject`` or
    :class:`~.exceptions.LockUnavailable` (the wait had to end), or
    ``LockUnavailable`` at once in an eager run. ``started``: monotonic time the
    first acquire began."""
    if task.request.is_eager:
        raise LockUnavailable(key, exc) from exc
    wait = OutageWait(task, key, started, client)
    while True:
        try:
            wait.after_failure(exc)
            return take()
        except redis.RedisError as error:
            exc = error
        except SoftTimeLimitExceeded:  # not expected (the wait ends before): the limit itself
            wait.end("its soft time limit struck")


class OutageWait:
    """One run's wait for its lock Redis; made at its first failed acquire."""

    def __init__(self, task: ConflictOutcomes, key: str, started: float, client: Any) -> None:
        """``started``: monotonic time the run's first acquire began."""
        self.task, self.key = task, key
        self.request = task.request
        #: The time limit the pool ends this run at, in seconds from its start (None: none).
        self.limit = time_limit_of(task, self.request)
        accepted = accepted_at(self.request)  # the pool's clock started then, where it is known
        origin = started if accepted is None else min(started, accepted)
        self.ends_at = None if self.limit is None else origin + self.limit
        #: Seconds one attempt (acquire, then publish) may take.
        self.attempt_takes = _request_bound(client)
        self.attempt_started = started
        self.attempts = 0
        self.error = LockUnavailable(key, "not asked yet")

    def after_failure(self, exc: redis.RedisError) -> None:
        """An acquire failed with ``exc``: publish the retry (raises ``Retry``), end the
        wait (raises), or pause until the next attempt may start (returns).

        A soft time limit is raised at once in here (:mod:`.soft_limit`), and ends the
        wait: nothing is held, and the pause must not outlast the run's time. In the
        retry's publish it is held (``retry()`` would take it for a failed publish) and
        raised once the publish failed."""
        task, request = self.task, self.request
        self.error = LockUnavailable(self.key, exc)
        countdown = task._backoff(max(request.retries or 0, self.attempts))
        if self.attempts == 0:
            logger.error("%s[%s] not started, Redis unavailable for %s; retrying in %.1fs: %s",
                         task.name, request.id, self.key, countdown, exc)
        refused = self._publish(countdown)
        now = time.monotonic()
        self.attempt_takes = max(self.attempt_takes, now - self.attempt_started)
        if self.attempts == 0:
            limit = "" if self.limit is None else f" (before its {self.limit:g}s time limit)"
            logger.error("%s[%s] could not be published again either (%s); waiting in this worker until "
                         "Redis answers%s", task.name, request.id, refused, limit)
        else:
            logger.warning("%s[%s] still waiting for Redis (lock %s), next try in %.1fs: %s",
                           task.name, request.id, self.key, countdown, exc)
        self.attempts += 1
        # One that landed while the acquire was in flight was held (nothing is held now):
        # the wait ends on it, as on one landing in the pause (raised at once there).
        soft_limit.raise_held()
        if shutting_down():
            self.end("the worker is shutting down")
        pause = countdown
        if self.ends_at is not None:
            room = self.ends_at - self.attempt_takes - now  # the next attempt must be over by then
            if room <= 0:
                self.end(f"its time limit ({self.limit:g}s) is near")
            pause = min(pause, room)
        if not _pause(pause):
            self.end("the worker is shutting down")
        self.attempt_started = time.monotonic()

    def _publish(self, countdown: float) -> str:
        """Publish the retry (raises ``Retry``); when it cannot be published, return why."""
        try:
            retry_uncapped(self.task, self.error, countdown)
        except Reject as refused:
            return str(refused.reason)
        raise AssertionError("retry() returned")  # pragma: no cover - it always raises

    def end(self, why: str) -> NoReturn:
        """End the wait: an ``acks_late`` run gives its message back; any other ends
        ``FAILURE`` (``LockUnavailable``), without running."""
        task, request = self.task, self.request
        if task.acks_late:
            logger.warning("%s[%s] gives its message back to the broker (%s): Redis unavailable for %s; "
                           "it is delivered again (once the broker's visibility timeout passes if the "
                           "broker cannot take it back now)", task.name, request.id, why, self.key)
            raise Reject(self.error, requeue=True) from None  # the reason is in the line above
        logger.error("%s[%s] ends without running (LockUnavailable): %s, Redis unavailable for %s; its message "
                     "was acknowledged when the run started (the task is not acks_late) and cannot be given "
                     "back: publish it again", task.name, request.id, why, self.key)
        raise self.error from None


def _pause(seconds: float) -> bool:
    """Sleep ``seconds``; False as soon as the worker is shutting down (looked at every
    :data:`SHUTDOWN_LOOK` s)."""
    end = time.monotonic() + seconds
    while not shutting_down():
        left = end - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(left, SHUTDOWN_LOOK))
    return False


def _request_bound(client: Any) -> float:
    """Seconds one request on ``client`` may take before it fails: its connect + read timeouts."""
    pool = getattr(client, "connection_pool", None) or getattr(client, "nodes_manager", None)
    options = getattr(pool, "connection_kwargs", None) or DEFAULT_REDIS_OPTIONS
    return sum(float(options.get(name) or 0) for name in ("socket_connect_timeout", "socket_timeout"))


def retry_uncapped(task: ConflictOutcomes, error: Exception, countdown: float) -> NoReturn:
    """``task.retry`` without a retry limit; raises ``Retry`` (or ``Reject`` if it could not publish)."""
    # No cap: a run never starts unlocked (max_retries=None would mean the
    # task's own default and end in FAILURE after a short outage). Celery
    # keeps an explicit max_retries on the shared task object, where
    # autoretry_for would read it for later runs: put back what was there.
    had = "override_max_retries" in task.__dict__
    previous = task.__dict__.get("override_max_retries")
    try:
        raise task.retry(exc=error, countdown=countdown, max_retries=sys.maxsize)
    finally:
        if had:
            task.override_max_retries = previous
        else:
            task.__dict__.pop("override_max_retries", None)
