"""The publish side of :class:`~celery_singleton_beat.task.task.SingletonTask`: claims in ``apply_async``.

In the publish-time modes a publish claims the task's key before the message is
sent (see the :mod:`.task` docstring):

* ``until_executed``: the claim is the lock itself, adopted by the run;
* ``until_executing``: a separate queue key (``<lock key>:queued``), released
  when the run starts.

A second publish while the claim stands returns the holder's ``AsyncResult``
(``on_conflict="raise"``: :class:`~.exceptions.DuplicateTaskError`). A task's
own re-publish (retry, a redelivered copy waiting for its original) and a
publish that is part of a canvas never conflict here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

import redis
from celery import Task, states
from celery.result import AsyncResult
from celery.utils import uuid

from ..config import get_settings
from ..connection.client import RedisClient
from ..exceptions import DuplicateTaskError, LockUnavailable
from ..lease.behalf import release_for, release_value
from ..lease.holder import Holder, describe_holder
from ..lease.lock import AcquireResult
from ..log import logger
from ..recovery.lock_redis import get_redis
from .keys import QUEUED_SUFFIX

__all__ = ["PublishClaims", "delay_of"]

#: Options that make a publish part of a canvas: the canvas froze the task id
#: and waits on it, so a publish-time duplicate must still be sent (the run decides).
_CANVAS_OPTIONS = ("chord", "group_id", "link", "link_error", "chain")


def _in_canvas(options: dict[str, Any]) -> bool:
    return any(options.get(name) for name in _CANVAS_OPTIONS)


def delay_of(options: dict[str, Any]) -> float:
    """Seconds until a message published with these options may run (countdown / eta)."""
    countdown = options.get("countdown")
    if countdown:
        return max(0.0, float(countdown))
    eta = options.get("eta")
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if isinstance(eta, datetime):
        return max(0.0, (eta - datetime.now(eta.tzinfo)).total_seconds())  # naive eta: local time
    return 0.0


class PublishClaims(Task):
    """``apply_async`` with publish-time claims; the base of ``SingletonTask``."""

    lock_mode: ClassVar[str]
    on_conflict: ClassVar[str]

    def singleton_key(self, args: Any = None, kwargs: Any = None) -> str:
        raise NotImplementedError  # SingletonTask

    def _take(self, key: str, ttl: float, counters: tuple[str, str], *, task_id: str | None,
              claim: bool = False) -> AcquireResult:
        raise NotImplementedError  # SingletonTask

    def _republishing(self, task_id: str | None) -> bool:
        """True when the running task publishes its own message again (retry, deferral)."""
        request = self.request
        return task_id is not None and not request.called_directly and request.id == task_id

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    *more: Any, **options: Any) -> AsyncResult:
        """Publish; in publish-time modes, claim the key first (see the module docstring)."""
        if self.lock_mode == "while_executing":
            return super().apply_async(args, kwargs, task_id, *more, **options)
        if self._republishing(task_id):
            self._reclaim_queue(args, kwargs, task_id or "", options)  # _republishing: not None
            return super().apply_async(args, kwargs, task_id, *more, **options)
        if _in_canvas(options):
            # Nothing at publish: the run takes (or conflicts on) the key itself.
            return super().apply_async(args, kwargs, task_id, *more, **options)
        task_id = task_id or uuid()
        key = self.singleton_key(args, kwargs)
        claim_key = key + QUEUED_SUFFIX if self.lock_mode == "until_executing" else key
        client = get_redis(self.app)
        settings = get_settings(self.app)
        try:
            result = self._take(claim_key, settings.queue_lock_ttl + delay_of(options),
                                ("claimed", "publish_deduplicated"), task_id=task_id, claim=True)
        except redis.RedisError as exc:
            if not settings.fail_open:
                raise LockUnavailable(claim_key, exc) from exc
            logger.error("publishing %s[%s] without its claim on %s, Redis unavailable (fail-open): %s",
                         self.name, task_id, claim_key, exc)
            return super().apply_async(args, kwargs, task_id, *more, **options)
        holder = result.holder
        if not result.acquired and holder is not None and self._stale_claim(holder):
            # The queued message of that claim was revoked or expired: it will never run.
            release_value(client, claim_key, holder.raw or "")
            result = self._take(claim_key, settings.queue_lock_ttl + delay_of(options),
                                ("claimed", "publish_deduplicated"), task_id=task_id, claim=True)
            holder = result.holder
        if not result.acquired and holder is not None and holder.task_id != task_id:
            if self.on_conflict == "raise":
                raise DuplicateTaskError(self.name, claim_key, holder.task_id)
            logger.info("not publishing %s: %s already holds %s; returning its result",
                        self.name, describe_holder(holder), claim_key)
            return self.AsyncResult(holder.task_id)
        try:
            return super().apply_async(args, kwargs, task_id, *more, **options)
        except BaseException:
            if result.acquired:
                release_for(client, claim_key, task_id, claims_only=True)
            raise

    def _stale_claim(self, holder: Holder) -> bool:
        """A claim whose message already ended: revoked (Celery records that at once), expired."""
        if not holder.claim or not holder.task_id:
            return False
        try:
            return self.AsyncResult(holder.task_id).state in states.READY_STATES
        except Exception:  # no result backend, or it is down: the claim stands
            return False

    def _reclaim_queue(self, args: Any, kwargs: Any, task_id: str, options: dict[str, Any]) -> None:
        """``until_executing``: a re-published message waits in the queue under its claim again.

        Best effort: the message is published whatever happens here (a retry
        must not be lost); a copy queued meanwhile by another publish is met
        by the run lock instead.
        """
        if self.lock_mode != "until_executing":
            return  # until_executed: the lock itself became the claim (see _end)
        try:
            self._take(self.singleton_key(args, kwargs) + QUEUED_SUFFIX,
                       get_settings(self.app).queue_lock_ttl + delay_of(options),
                       ("claimed", ""), task_id=task_id, claim=True)
        except redis.RedisError as exc:
            logger.warning("%s[%s] re-published without its queue claim: %s", self.name, task_id, exc)

    def _release_queue_claim(self, client: RedisClient, key: str) -> None:
        try:
            release_for(client, key + QUEUED_SUFFIX, self.request.id, claims_only=True)
        except redis.RedisError as exc:  # it expires after queue_lock_ttl
            logger.error("could not release queue claim %s%s: %s", key, QUEUED_SUFFIX, exc)
