"""What a run's end does with its lock: the release, sent as the ending says, and what it
found, reported (the ``SingletonTask`` mixin :class:`ReleaseAtEnd`).

The ending decides (the table of :mod:`.endings`): released soon (its reply read with the
next acquire) unless someone can see the end at once, released now, or turned into a
retry's publish-time claim. A release that finds the lock gone reports the run's lease
lost, once (the keeper may have reported it first); one that gets no answer is sent again
by the keeper until it runs, so the key is freed without waiting for the lock's TTL.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, ClassVar

import redis
from celery import Task
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry

from ..config import SingletonSettings
from ..lease.keeper import KeptLease, get_keeper
from ..lease.spec import LockSpec
from ..log import logger
from . import worker as worker_support
from .endings import Release, Report, ending_of
from .events import TASK_LOCK_LOST, send_task_event_soon
from .publish import delay_of
from .run import HeldRun, SingletonRun

__all__ = ["LostReport", "ReleaseAtEnd"]


def _has_followers(request: Context) -> bool:
    """Whether work is published when this run ends: callbacks/errbacks, a chain's next
    step, a chord's body (counted by its parts)."""
    return bool(request.callbacks or request.errbacks or request.chain or request.chord)


class LostReport:
    """The report of a lost lease (a :class:`.KeptLease`'s ``on_lost``): a log line and, in a
    worker, a task event, naming the run by its lease's task id.

    One object per task, worker hostname and eagerness, shared by every run of that task
    in the process (see :meth:`ReleaseAtEnd._lease_lost_callback`): a gevent worker holding
    thousands of leases takes in its next messages while every run already started holds
    its objects, and each full collection of Python's cyclic garbage collector goes through
    them all; an object per run (a closure before it, seven) was one more for each.
    """

    __slots__ = ("eager", "hostname", "task")

    def __init__(self, task: Task, hostname: str | None, eager: bool) -> None:
        self.task = task
        self.hostname = hostname
        self.eager = eager

    def __call__(self, kept: KeptLease, reason: str) -> None:
        lease = kept.lease
        logger.warning("%s[%s] lost its lock %s while running: %s", self.task.name, lease.task_id, lease.key, reason)
        if not self.eager and lease.task_id is not None:
            send_task_event_soon(self.task.app, self.hostname, lease.task_id, TASK_LOCK_LOST,
                                 key=lease.key, reason=reason)


class ReleaseAtEnd(Task):
    """The end of a run that holds its lock: release it as the ending says, report what the
    release found. A base of ``SingletonTask``, which provides :meth:`_run_context`."""

    lock_mode: ClassVar[str]

    def _run_context(self, eager: bool) -> tuple[SingletonSettings, Any, LockSpec, bool]:
        """The run's settings, lock client, lock spec and whether results are stored."""
        raise NotImplementedError

    def _lease_lost_callback(self, request: Context) -> Callable[[KeptLease, str], None]:
        """Report a lost lease once, the moment it is noticed (keeper or release): the
        task's shared :class:`LostReport` for the request's worker and eagerness (the run
        is named by its lease's task id, the request's)."""
        where = (request.hostname, bool(request.is_eager))
        reports: dict[tuple[str | None, bool], LostReport] | None = self.__dict__.get("_singleton_lost_reports")
        if reports is None:
            reports = self.__dict__.setdefault("_singleton_lost_reports", {})
        report = reports.get(where)
        if report is None:
            report = reports.setdefault(where, LostReport(self, *where))
        return report

    def _release_reported(self, request: Context, kept: KeptLease,
                          done_ttl: float | None) -> Callable[[bool | None, BaseException | None], None]:
        """The handler of a release's reply, read after the run ended."""
        name, task_id = self.name, request.id

        def confirmed(released: bool | None, error: BaseException | None) -> None:
            if error is not None:
                self._release_again(name, task_id, kept, done_ttl, error)
            elif released is None:
                logger.info("%s[%s] released %s again on a new connection (the first reply was lost)",
                            name, task_id, kept.lease.key)
            elif not released:
                kept.mark_lost("the lock was gone when the run ended")

        return confirmed

    @staticmethod
    def _release_again(name: str, task_id: str | None, kept: KeptLease, done_ttl: float | None,
                       error: BaseException) -> None:
        """A release got no answer (``-BUSY``, a timeout, a cut connection): the keeper sends it
        again until it runs, so the key is freed (and an ``acks_late`` run's done marker
        written) without waiting for the lock's TTL."""
        logger.warning("%s[%s] could not release %s (%s); sending the release again until Redis "
                       "answers (the lock expires within %.0fs otherwise)",
                       name, task_id, kept.lease.key, error, kept.lease.ttl)
        get_keeper().retry_release(kept.lease, done_ttl)

    def _end_is_seen(self, request: Context, exc: BaseException | None) -> bool:
        """Whether someone can see this run's end once ``__call__`` returns.

        Its stored result (unless the task ignores results; errors still stored
        with ``store_errors_even_if_ignored``), its ``task-succeeded`` /
        ``task-failed`` event (a worker started with ``-E``), work published
        when it ends (a chain's next step, callbacks, a chord's body), the
        caller of an eager run. A caller who saw it and submits the same key
        again must never be skipped as a duplicate of this ended run.
        """
        if request.is_eager or _has_followers(request):
            return True
        if self.send_events and worker_support.sends_task_events():
            return True
        stored = self._run_context(False)[3]  # the app has a result backend (not eager here)
        if self.ignore_result or request.ignore_result:
            return stored and exc is not None and bool(self.store_errors_even_if_ignored) and \
                not isinstance(exc, (Ignore, Reject, Retry))
        return stored

    def _end(self, request: Context, run: SingletonRun | None, exc: BaseException | None) -> None:
        """Release the run's lock as its ending says (:mod:`.endings`)."""
        if not isinstance(run, HeldRun):  # not begun, or ran unlocked (fail-open)
            return
        kept = run
        # Renewed until its release is sent: the release may wait (a pooled connection, a busy
        # hub) longer than the lease has left (see LeaseKeeper.releasing). Everything inside
        # the try: an exception raised by a signal handler at any call (a function's start
        # runs pending handlers) must not leave the lease kept, renewed for the process's life.
        keeper = None
        try:
            keeper = get_keeper()
            keeper.releasing(kept)
            self._release(request, kept, exc)
        finally:
            (keeper or get_keeper()).forget(kept)

    def _release(self, request: Context, kept: HeldRun, exc: BaseException | None) -> None:
        """Send the release of ``kept``, the run, as its ending says; report what it found."""
        ending = ending_of(exc, self.lock_mode)
        done_ttl = kept._done_ttl if ending.marker else None
        claim_ttl = self._retry_claim_ttl(request, exc) if ending.release is Release.CLAIM else None
        if ending.release is Release.SOON and not self._end_is_seen(request, exc):
            try:
                if kept.lease.release_soon(self._release_reported(request, kept, done_ttl), done_ttl=done_ttl):
                    return
            except redis.RedisError as error:
                self._release_again(self.name, request.id, kept, done_ttl, error)
                return
        try:
            released = kept.lease.release(done_ttl=done_ttl, claim_ttl=claim_ttl)
        except redis.RedisError as error:
            if ending.report is Report.RUN:
                self._release_again(self.name, request.id, kept, done_ttl, error)
            else:
                logger.error("%s[%s] could not release %s (it expires within %.0fs): %s",
                             self.name, request.id, kept.lease.key, kept.lease.ttl, error)
            return
        if ending.report is Report.TERMINATION:
            if released:
                logger.warning("%s[%s] terminated (%s); freed its lock %s before exiting",
                               self.name, request.id, exc, kept.lease.key)
            elif released is False:  # the pool child is being terminated (hard time limit, revoke+terminate)
                logger.info("%s[%s] terminated; its lock %s was already freed by the worker's main process",
                            self.name, request.id, kept.lease.key)
        elif released is False:  # reported once, by the callback, unless the keeper already did
            kept.mark_lost("the lock was gone when the run ended")  # (None: unknown, sent again)

    def _retry_claim_ttl(self, request: Context, exc: BaseException | None) -> float:
        """Seconds the claim an ``until_executed`` run's lock turns into covers its retry:
        the queue lock's TTL and the retry's countdown or eta."""
        when = exc.when if isinstance(exc, Retry) else None
        return self._run_context(bool(request.is_eager))[0].queue_lock_ttl + delay_of(
            {"eta": when} if isinstance(when, datetime) else {"countdown": when})
