"""What a run of :class:`~celery_singleton_beat.task.SingletonTask` does when it cannot take its lock.

* Another run holds it: ``on_conflict`` says skip (stored ``REVOKED`` with
  :class:`~.exceptions.TaskSkipped`, a Flower event), raise
  (:class:`~.exceptions.DuplicateTaskError`) or retry later with back-off.
* The holder is this very message's original delivery, still running on a
  live worker (``acks_late`` redelivery): the copy waits, published again with a
  countdown and nothing stored.
* Redis cannot be asked: fail closed (retry with back-off, no cap; when the
  retry cannot be published either, wait in the worker until Redis answers)
  or, with ``singleton_fail_open``, run without the lock.
"""

from __future__ import annotations

import random
import sys
import time

from celery import Task, states
from celery.exceptions import Ignore, Reject

from .config import get_settings
from .events import TASK_SKIPPED, logger, send_task_event
from .exceptions import DuplicateTaskError, LockUnavailable, TaskSkipped, describe_holder
from .lock import AcquireResult, Holder
from .run import SingletonRun

__all__ = ["ConflictOutcomes"]


class ConflictOutcomes(Task):
    """The endings of a run that did not get its lock; the base of ``SingletonTask``."""

    def _wait_for_original(self, key: str, holder: Holder) -> None:
        """Another delivery of a message whose original still runs on a live worker.

        Neither a duplicate to skip nor work to run now: the message is
        published again with a countdown and this delivery ends without storing
        anything (the original's state stands). The next look finds the
        original completed (done marker: ends), gone (taken over: runs) or
        still running (waits again). Always raises.
        """
        request = self.request
        if request.is_eager:
            raise DuplicateTaskError(self.name, key, holder.task_id)
        countdown = get_settings(self.app).liveness_ttl / 2
        logger.warning("%s[%s] is already running on %s (another delivery of the same message); "
                       "looking again in %.1fs", self.name, request.id, describe_holder(holder), countdown)
        try:
            self.signature_from_request(request, countdown=countdown).apply_async()
        except Exception as exc:
            logger.error("%s[%s] could not be re-published (%s); the message goes back to the queue",
                         self.name, request.id, exc)
            raise Reject(exc, requeue=True) from exc
        raise Ignore(f"{request.id} is still running on {holder.node}")

    def _redis_unavailable(self, key: str, exc: Exception, *, fail_open: bool, attempt: int) -> SingletonRun | None:
        """The lock could not be asked for: run unlocked (fail open), or defer the run.

        Fail closed, the run is published again with a back-off (no cap) and
        this delivery ends (``RETRY``). When that publish fails too -- the
        broker is the same Redis, or is down as well -- the message is not
        dropped (Celery would reject it for good): this worker waits with the
        same back-off and returns None, and the caller asks for the lock again;
        the run executes here once Redis answers.
        """
        request = self.request
        if fail_open:
            logger.error("%s[%s] runs WITHOUT its lock %s: Redis unavailable (fail-open): %s",
                         self.name, request.id, key, exc)
            return SingletonRun(key, None)
        error = LockUnavailable(key, exc)
        if request.is_eager:
            raise error from exc
        countdown = self._backoff(max(request.retries or 0, attempt))
        if attempt == 0:
            logger.error("%s[%s] not started, Redis unavailable for %s; retrying in %.1fs: %s",
                         self.name, request.id, key, countdown, exc)
            try:
                self._retry_uncapped(error, countdown)
            except Reject as refused:  # the retry could not be published: keep the message here
                logger.error("%s[%s] could not be published again either (%s); waiting in this worker "
                             "until Redis answers", self.name, request.id, refused.reason)
        else:
            logger.warning("%s[%s] still waiting for Redis (lock %s), next try in %.1fs: %s",
                           self.name, request.id, key, countdown, exc)
        time.sleep(countdown)
        return None

    def _retry_uncapped(self, error: Exception, countdown: float) -> None:
        """``self.retry`` without a retry limit; raises ``Retry`` (or ``Reject`` if it could not publish)."""
        # No cap: a run never starts unlocked (max_retries=None would mean the
        # task's own default and end in FAILURE after a short outage). Celery
        # keeps an explicit max_retries on the shared task object, where
        # autoretry_for would read it for later runs: put back what was there.
        had = "override_max_retries" in self.__dict__
        previous = self.__dict__.get("override_max_retries")
        try:
            raise self.retry(exc=error, countdown=countdown, max_retries=sys.maxsize)
        finally:
            if had:
                self.override_max_retries = previous
            else:
                self.__dict__.pop("override_max_retries", None)

    def _backoff(self, retries: int) -> float:
        """Exponential back-off with full jitter, capped by ``singleton_retry_backoff_max``."""
        cap = min(get_settings(self.app).retry_backoff_max, 2.0 ** min(retries, 30))
        return random.uniform(cap / 2, cap)

    def _conflict(self, key: str, result: AcquireResult) -> None:
        """Handle a run whose lock is held by another run; always raises."""
        request = self.request
        holder: Holder | None = result.holder
        holder_id = holder.task_id if holder else None
        if self.on_conflict == "raise":
            logger.info("%s[%s] refused: %s holds %s", self.name, request.id, describe_holder(holder), key)
            raise DuplicateTaskError(self.name, key, holder_id)
        if self.on_conflict == "retry":
            countdown = self._backoff(request.retries or 0)
            logger.info("%s[%s] waits %.1fs: %s holds %s", self.name, request.id, countdown,
                        describe_holder(holder), key)
            raise self.retry(exc=DuplicateTaskError(self.name, key, holder_id), countdown=countdown)
        logger.info("%s[%s] skipped: duplicate of %s holding %s",
                    self.name, request.id, describe_holder(holder), key)
        send_task_event(self, TASK_SKIPPED, holder_task_id=holder_id, key=key,
                        holder_node=holder.node if holder else None)
        if not request.is_eager:
            self._store_skipped(TaskSkipped(self.name, key, holder_id))
        raise Ignore(f"duplicate of {holder_id}")

    def _store_skipped(self, exc: TaskSkipped) -> None:
        """Record a skip as ``REVOKED`` so callers, chains and chords see an end.

        Celery's own failure path does the propagation: the rest of a chain is
        marked ``REVOKED``, a chord counts its part (its body fails with a
        ``ChordError``). The task's own errbacks are not called: a skip is not
        an error of the task.
        """
        request = self.request
        try:
            self.backend.mark_as_failure(request.id, exc, request=request, state=states.REVOKED,
                                         store_result=not self.ignore_result, call_errbacks=False)
        except NotImplementedError:  # no result backend configured
            pass
        except Exception as error:  # the skip itself stands; say why waiters may not see it
            logger.error("%s[%s] could not record its skip in the result backend: %s",
                         self.name, request.id, error)
