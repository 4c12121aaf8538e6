"""What a run of :class:`~celery_singleton_beat.task.task.SingletonTask` does when it cannot take its lock.

* Another run holds it: ``on_conflict`` says skip (stored ``REVOKED`` with
  :class:`~.exceptions.TaskSkipped`, a Flower event), raise
  (:class:`~.exceptions.DuplicateTaskError`) or retry later with back-off.
* The holder is this very message's original delivery, still running on a
  live worker (``acks_late`` redelivery): the copy waits, published again with a
  countdown and nothing stored.
* Redis cannot be asked: fail closed (retry with back-off, no cap; when the
  retry cannot be published either, wait in the worker until Redis answers,
  within the run's time limit and the worker's life: :mod:`.outage`) or, with
  ``singleton_fail_open``, run without the lock.

Eager runs (``apply()``, ``task_always_eager``) end as a worker's would, so a
test in eager mode sees what production sees: a skip is an ``EagerResult`` in
state ``REVOKED`` whose ``.get()`` raises :class:`~.exceptions.TaskSkipped`
(Celery's tracer knows no such ending: the run raises ``Ignore`` and
:meth:`ConflictOutcomes.apply` turns the ``IGNORED`` result into that), and a
retry waits out its back-off in the caller's process before the next attempt,
up to ``max_retries``, where Celery would run it again at once.
"""

from __future__ import annotations

import random
import time
from typing import Any

from celery import Task, states
from celery.exceptions import Ignore, Reject, Retry
from celery.result import EagerResult

from ..config import get_settings
from ..exceptions import DuplicateTaskError, TaskSkipped
from ..lease.holder import Holder, describe_holder
from ..lease.lock import AcquireResult
from ..log import logger
from .events import TASK_SKIPPED, send_task_event
from .run import SingletonRun, UnlockedRun

__all__ = ["COPY_HEADER", "ConflictOutcomes", "is_copy"]

#: The message header of a copy re-published to wait for its running original.
COPY_HEADER = "singleton_copy"


def is_copy(request: Any) -> bool:
    """Whether this delivery is known to repeat an earlier one of its message: the broker
    marked it redelivered (Redis' restore of unacknowledged messages, RabbitMQ), or it is
    a copy re-published to wait for its original (:data:`COPY_HEADER`). A message sent
    again under the same id by other means is not known as one."""
    info = request.delivery_info or {}
    return bool(info.get("redelivered") or getattr(request, COPY_HEADER, None))

#: Set on the DuplicateTaskError of an eager conflict retry, to tell it from other retries.
_EAGER_RETRY = "_singleton_eager_retry"


class _Skip(Ignore):
    """Ends the run of a skipped duplicate; carries what callers get (``TaskSkipped``).

    Rebuilt from its ``args`` when a pool child sends it to the worker's main
    process (pickle), so ``args`` is exactly the constructor's argument.
    """

    def __init__(self, skipped: TaskSkipped) -> None:
        super().__init__(skipped)
        self.skipped = skipped

    def __str__(self) -> str:
        return f"duplicate of {self.skipped.holder_task_id}"


def _revoked(result: EagerResult, skipped: TaskSkipped) -> EagerResult:
    """``result`` of an eager skip as a worker records it: ``REVOKED`` with ``TaskSkipped``."""
    try:
        return EagerResult(result.id, skipped, states.REVOKED, name=getattr(result, "name", None))
    except TypeError:  # Celery < 5.5: eager results have no name
        return EagerResult(result.id, skipped, states.REVOKED)


class ConflictOutcomes(Task):
    """The endings of a run that did not get its lock; the base of ``SingletonTask``."""

    def apply(self, args: Any = None, kwargs: Any = None, **options: Any) -> EagerResult:
        """Run eagerly (Celery's ``apply``); a skip or a conflict retry ends as on a worker.

        A skipped duplicate returns an ``EagerResult`` in state ``REVOKED`` whose
        ``.get()`` raises :class:`~.exceptions.TaskSkipped`, with or without
        ``task_eager_propagates`` (a skip is an outcome, not an error of the
        caller: it is not raised here). With ``task_eager_propagates`` Celery
        raises an eager ``Retry`` to the caller instead of running it again; a
        conflict retry (which waited out its back-off already) runs again here.
        """
        try:
            result = super().apply(args, kwargs, **options)
        except Retry as retry:
            if retry.sig is None or not getattr(retry.exc, _EAGER_RETRY, False):
                raise
            return retry.sig.apply()
        if result.state == states.IGNORED and isinstance(result.result, _Skip):
            return _revoked(result, result.result.skipped)
        return result

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
            self.signature_from_request(request, countdown=countdown).apply_async(headers={COPY_HEADER: True})
        except Exception as exc:
            logger.error("%s[%s] could not be re-published (%s); the message goes back to the queue",
                         self.name, request.id, exc)
            raise Reject(exc, requeue=True) from exc
        raise Ignore(f"{request.id} is still running on {holder.node}")

    def _run_unlocked(self, key: str, exc: Exception) -> SingletonRun:
        """Fail open: the lock could not be asked for, the run goes ahead without it."""
        logger.error("%s[%s] runs WITHOUT its lock %s: Redis unavailable (fail-open): %s",
                     self.name, self.request.id, key, exc)
        return UnlockedRun(key)

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
            self._retry_later(key, holder)
        logger.info("%s[%s] skipped: duplicate of %s holding %s",
                    self.name, request.id, describe_holder(holder), key)
        send_task_event(self, TASK_SKIPPED, holder_task_id=holder_id, key=key,
                        holder_node=holder.node if holder else None)
        skipped = TaskSkipped(self.name, key, holder_id)
        if not request.is_eager or self.store_eager_result:
            self._store_skipped(skipped)
        raise _Skip(skipped)

    def _decide_again_later(self, error: Exception) -> None:
        """The skip could not be stored: nobody would hear of it (a caller's ``.get()``
        waits for ever), so this delivery must not end as if it had been recorded. The
        message is published again after a back-off, and the next delivery decides
        again (skips and stores, or runs if the holder has ended); if the broker refuses
        that too, the message goes back to the queue (``acks_late``). Always raises."""
        request = self.request
        countdown = self._backoff(request.retries or 0)
        logger.error("%s[%s] could not record its skip in the result backend (%s); deciding again "
                     "in %.1fs", self.name, request.id, error, countdown)
        try:
            self.signature_from_request(request, countdown=countdown).apply_async()
        except Exception as exc:
            logger.error("%s[%s] could not be re-published (%s); the message goes back to the queue",
                         self.name, request.id, exc)
            raise Reject(exc, requeue=True) from exc
        raise Ignore(f"{request.id}: skip not recorded, published again")

    def _retry_later(self, key: str, holder: Holder | None) -> None:
        """``on_conflict="retry"``: the run is retried after a back-off; always raises.

        Once ``max_retries`` is spent, Celery's ``retry()`` raises the
        :class:`DuplicateTaskError` itself (``FAILURE``), without a wait. An eager
        run waits out the back-off here, in the caller's process, as its message
        would wait in the broker.
        """
        request = self.request
        retries = request.retries or 0
        error = DuplicateTaskError(self.name, key, holder.task_id if holder else None)
        countdown = self._backoff(retries)
        if self.max_retries is not None and retries + 1 > self.max_retries:
            logger.info("%s[%s] refused after %d retries: %s holds %s", self.name, request.id, retries,
                        describe_holder(holder), key)
        else:
            logger.info("%s[%s] waits %.1fs: %s holds %s", self.name, request.id, countdown,
                        describe_holder(holder), key)
            if request.is_eager:
                setattr(error, _EAGER_RETRY, True)
                time.sleep(countdown)
        raise self.retry(exc=error, countdown=countdown)

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
        except Exception as error:
            if request.is_eager:  # the caller holds the outcome (EagerResult) in its hands
                logger.error("%s[%s] could not record its skip in the result backend: %s",
                             self.name, request.id, error)
                return
            self._decide_again_later(error)  # an outcome nobody could see
