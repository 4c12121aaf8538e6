"""``SingletonTask``: at most one run at a time per task and arguments.

Lifecycle of a run (``lock_mode="while_executing"``, the default)::

    worker receives message -> __call__ -> acquire lease (1 round trip)
        held by another run -> on_conflict: skip (REVOKED: TaskSkipped) | raise | retry
        taken                -> body runs; the keeper renews every lock_ttl/3
    body ends in any way (return, exception, retry, Ignore, Reject)
        -> release (1 round trip, only if the lease is still ours)

The lock is taken in ``__call__``, which Celery's tracer calls for every run
(worker and eager), so a ``finally`` there sees every ending a process
survives. Endings it cannot see (the pool child killed, a hard time limit, a
revoke with terminate) are handled by the worker's main process through
:class:`~celery_singleton_beat.worker.SingletonRequest`, and a node that died
altogether is cleaned up by its next start or by the lease's TTL.

Another delivery of the same message (same task id: ``acks_late`` redelivery
after a visibility timeout or a lost connection) is the same work, not a
duplicate: it waits (re-published with a countdown, nothing stored) while the
original runs on a live worker, ends without running once the original
completed (the done marker of ``acks_late`` runs), and runs when the original's
worker died (its lock is taken over, see :mod:`.liveness`).

Publish-time modes add a *claim* taken in ``apply_async``:

* ``until_executed``: the claim is the lock itself; the run adopts it and holds
  it until it returns. A second publish while one is queued or running conflicts.
* ``until_executing``: the claim is a separate queue key released when the run
  starts (the run itself still takes the run lock): at most one copy waits in
  the queue and at most one runs.

A claim covers ``countdown``/``eta``; a task's own re-publish (retry, or a
redelivered copy waiting for its original) never conflicts with its own claim;
a publish that is part of a canvas (chain, group, chord, callbacks) is never
deduplicated at publish time (the canvas waits on the task id it froze): the
run decides, with a ready outcome.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from datetime import datetime
from typing import Any, ClassVar

import celery
import redis
from celery import Task, states
from celery.app.task import Context
from celery.exceptions import Ignore, ImproperlyConfigured, Reject, Retry
from celery.result import AsyncResult
from celery.utils import uuid
from kombu.utils.functional import maybe_list

from . import worker as worker_support
from .client import RedisClient, get_redis
from .config import SingletonSettings, get_settings
from .events import TASK_LOCK_LOST, TASK_SKIPPED, logger, send_task_event, send_task_event_soon
from .exceptions import DuplicateTaskError, LockLost, LockUnavailable, TaskSkipped, describe_holder
from .keeper import KeptLease, get_keeper
from .keys import QUEUED_SUFFIX, UniqueOn, check_unique_on, lock_key, task_signature, task_stats_key
from .liveness import boot_id, publishes_liveness
from .lock import AcquireResult, Holder, acquire, release_task, release_value

__all__ = ["LOCK_MODES", "ON_CONFLICT", "SingletonRun", "SingletonTask"]

LOCK_MODES = ("while_executing", "until_executed", "until_executing")
ON_CONFLICT = ("skip", "raise", "retry", "return_existing")
#: Counter bumped when a run finds its lock held, by ``on_conflict``.
_CONFLICT_COUNTERS = {"skip": "skipped", "return_existing": "skipped", "raise": "refused", "retry": "deferred"}
#: Options that make a publish part of a canvas: the canvas froze the task id
#: and waits on it, so a publish-time duplicate must still be sent (the run decides).
_CANVAS_OPTIONS = ("chord", "group_id", "link", "link_error", "chain")


def _in_canvas(options: dict[str, Any]) -> bool:
    return any(options.get(name) for name in _CANVAS_OPTIONS)


def _delay_of(options: dict[str, Any]) -> float:
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


class SingletonRun:
    """What a running task knows about its lock: ``task.singleton`` in the body.

    ``fence`` is a number that grows with every acquisition of this key: pass it
    to a downstream store that rejects writes carrying a smaller one, and a run
    that lost its lease cannot overwrite the work of its successor.
    """

    def __init__(self, key: str, kept: KeptLease | None) -> None:
        self.key = key
        self._kept = kept

    @property
    def held(self) -> bool:
        """True while this run holds its lock (False when it runs unlocked, fail-open)."""
        return self._kept is not None and not self._kept.lost

    @property
    def lost(self) -> bool:
        """True once the lease was lost (deleted, expired, taken) during the run."""
        return self._kept is not None and self._kept.lost

    @property
    def fence(self) -> int | None:
        """The fencing token of this run's lease (None when running unlocked)."""
        return self._kept.lease.fence if self._kept is not None else None

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` if the lease is gone; call before irreversible work."""
        if self._kept is None:
            raise LockLost(self.key, "the run holds no lock (Redis was unavailable, fail-open)")
        if self._kept.lost:
            raise LockLost(self.key, self._kept.lost_reason or "lost")


class SingletonTask(Task):
    """Base class for tasks that must not run twice at once for the same arguments.

    Use it as ``@app.task(base=SingletonTask, unique_on=[...], lock_ttl=60)``.
    """

    #: Argument names that identify a run, or a callable taking the task's
    #: arguments and returning a JSON-like identity. ``None``: all arguments.
    unique_on: ClassVar[UniqueOn] = None
    #: Lease in seconds, renewed while the run lasts. ``None``: ``singleton_lock_ttl``.
    lock_ttl: ClassVar[float | None] = None
    #: ``"while_executing"`` | ``"until_executed"`` | ``"until_executing"``.
    lock_mode: ClassVar[str] = "while_executing"
    #: What a run does when another holds the lock: ``"skip"`` (REVOKED, TaskSkipped),
    #: ``"raise"`` (DuplicateTaskError), ``"retry"`` (later, with back-off).
    #: At publish (publish-time modes) a conflict returns the holder's
    #: AsyncResult, except with ``"raise"``; ``"return_existing"`` names that.
    on_conflict: ClassVar[str] = "skip"

    #: The worker's main process uses this request class to free the locks of
    #: pool children that died (SIGKILL, hard time limit, revoke+terminate).
    Request = "celery_singleton_beat.worker:SingletonRequest"

    # -- registration -----------------------------------------------------

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Check the task's singleton options when it is bound to its app."""
        super().on_bound(app)
        if cls.__dict__.get("name") is None and cls is SingletonTask:
            return
        cls._check_options()
        # A task's own Request class keeps working, with ours mixed in front.
        cls.Request = worker_support.compose_request(cls.Request)  # type: ignore[assignment]  # a class now
        worker_support.install(app)

    @classmethod
    def _check_options(cls) -> None:
        name = getattr(cls, "name", None) or cls.__name__

        def bad(option: str, message: str) -> ImproperlyConfigured:
            return ImproperlyConfigured(f"task {name}: {option} {message}")

        if cls.lock_mode not in LOCK_MODES:
            raise bad("lock_mode", f"must be one of {', '.join(LOCK_MODES)}; got {cls.lock_mode!r}")
        if cls.on_conflict not in ON_CONFLICT:
            raise bad("on_conflict", f"must be one of {', '.join(ON_CONFLICT)}; got {cls.on_conflict!r}")
        ttl = cls.lock_ttl
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0):
            raise bad("lock_ttl", f"must be a number of seconds > 0; got {ttl!r}")
        try:
            check_unique_on(name, task_signature(cls), cls.unique_on)
        except ValueError as exc:
            raise bad("unique_on", str(exc)) from None

    # -- keys and settings ------------------------------------------------

    def singleton_key(self, args: Any = None, kwargs: Any = None) -> str:
        """The lock key of a call with these arguments."""
        return self._key(get_settings(self.app), args, kwargs)

    def _key(self, settings: SingletonSettings, args: Any, kwargs: Any) -> str:
        signature = self.__dict__.get("_singleton_signature")
        if signature is None:
            signature = self._singleton_signature = task_signature(self)
        return lock_key(
            settings.key_prefix,
            self.name,
            signature,
            args if type(args) is tuple else tuple(maybe_list(args) or ()),
            kwargs or {},  # only read
            self.unique_on,
        )

    def singleton_stats_key(self) -> str | None:
        """The counter hash of this task, or None when counters are off."""
        return self._stats_key(get_settings(self.app))

    @property
    def effective_lock_ttl(self) -> float:
        """The lease of this task in seconds (task option, else the app setting)."""
        return float(self.lock_ttl) if self.lock_ttl is not None else get_settings(self.app).lock_ttl

    @property
    def singleton(self) -> SingletonRun | None:
        """The lock of the current run (None outside a run or when called directly)."""
        return getattr(self.request, "singleton", None)

    # -- publish ----------------------------------------------------------

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
            result = self._take(claim_key, settings.queue_lock_ttl + _delay_of(options),
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
            result = self._take(claim_key, settings.queue_lock_ttl + _delay_of(options),
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
                release_task(client, claim_key, task_id)
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
                       get_settings(self.app).queue_lock_ttl + _delay_of(options),
                       ("claimed", ""), task_id=task_id, claim=True)
        except redis.RedisError as exc:
            logger.warning("%s[%s] re-published without its queue claim: %s", self.name, task_id, exc)

    # -- run --------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            # A plain function call in the caller's process, as with any Celery task.
            return super().__call__(*args, **kwargs)
        run = request.singleton = self._begin(request, args, kwargs)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self._end(request, run, sys.exc_info()[1])

    if celery.VERSION[:2] < (5, 5):
        def push_request(self, *args: Any, **kwargs: Any) -> None:
            """Celery before 5.5: the request ``Task.__call__`` pushes keeps the current one's fields.

            ``__call__`` above runs the body through ``Task.__call__``, which pushes a
            new request. Before Celery 5.5 (celery/celery#9208) that request held only
            ``args`` and ``kwargs``: in eager runs (``apply()``, ``task_always_eager``)
            the body saw no ``self.singleton`` and no ``self.request.id``. Workers
            were not affected (their stack protection calls ``run`` directly). This is
            Celery 5.5's own ``push_request``.
            """
            self.request_stack.push(Context(*args, **{**self.request.__dict__, **kwargs}))

    def _take(self, key: str, ttl: float, counters: tuple[str, str], *,
              settings: SingletonSettings | None = None, **holder: Any) -> AcquireResult:
        """One acquire of ``key`` as this task: its name, counters and the WAIT settings."""
        settings = settings or get_settings(self.app)
        return acquire(get_redis(self.app), key, ttl, task=self.name, boot=boot_id(),
                       stats_key=self._stats_key(settings), counters=counters,
                       wait_replicas=settings.wait_replicas, wait_timeout=settings.wait_timeout, **holder)

    def _stats_key(self, settings: SingletonSettings) -> str | None:
        """This task's counter hash under ``settings`` (None when counters are off), kept per settings."""
        cached = self.__dict__.get("_singleton_stats")
        if cached is None or cached[0] is not settings:
            cached = self._singleton_stats = (
                settings, task_stats_key(settings.key_prefix, self.name) if settings.stats else None)
        return cached[1]

    def _begin(self, request: Context, args: tuple[Any, ...], kwargs: dict[str, Any]) -> SingletonRun:
        settings = get_settings(self.app)
        key = self._key(settings, args, kwargs)
        adopt = request.id if self.lock_mode == "until_executed" else None
        ttl = float(self.lock_ttl) if self.lock_ttl is not None else settings.lock_ttl
        try:
            result = self._take(key, ttl, ("acquired", _CONFLICT_COUNTERS[self.on_conflict]),
                                settings=settings,
                                task_id=request.id, node=request.hostname, adopt_claim_of=adopt,
                                live=publishes_liveness(), liveness_prefix=settings.key_prefix,
                                check_done=bool(self.acks_late) and not request.is_eager)
        except redis.RedisError as exc:
            return self._redis_unavailable(key, exc, fail_open=settings.fail_open)
        if self.lock_mode == "until_executing":
            self._release_queue_claim(get_redis(self.app), key)
        if result.completed:
            logger.info("%s[%s] already completed; this delivery of the same message ends without "
                        "running", self.name, request.id)
            raise Ignore(f"{request.id} already completed")
        if result.taken_over is not None:
            logger.warning("%s[%s] took over %s from %s, whose worker is gone",
                           self.name, request.id, key, describe_holder(result.taken_over))
        if not result.acquired:
            holder = result.holder
            if holder is not None and holder.task_id == request.id and not holder.claim:
                self._wait_for_original(key, holder)
            self._conflict(key, result)
        assert result.lease is not None
        kept = get_keeper().keep(result.lease, on_lost=self._lease_lost_callback(request))
        logger.debug("%s[%s] holds %s (fence %s)", self.name, request.id, key, result.lease.fence)
        return SingletonRun(key, kept)

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

    def _release_queue_claim(self, client: RedisClient, key: str) -> None:
        try:
            release_task(client, key + QUEUED_SUFFIX, self.request.id)
        except redis.RedisError as exc:  # it expires after queue_lock_ttl
            logger.error("could not release queue claim %s%s: %s", key, QUEUED_SUFFIX, exc)

    def _lease_lost_callback(self, request: Context) -> Callable[[KeptLease, str], None]:
        """Report a lost lease once, the moment it is noticed (keeper or release)."""
        app, task_name = self.app, self.name
        task_id, hostname, eager = request.id, request.hostname, request.is_eager

        def on_lost(kept: KeptLease, reason: str) -> None:
            logger.warning("%s[%s] lost its lock %s while running: %s",
                           task_name, task_id, kept.lease.key, reason)
            if not eager:
                send_task_event_soon(app, hostname, task_id, TASK_LOCK_LOST, key=kept.lease.key, reason=reason)

        return on_lost

    def _end(self, request: Context, run: SingletonRun | None, exc: BaseException | None) -> None:
        kept = run._kept if run is not None else None
        if kept is None:
            return
        get_keeper().forget(kept)
        settings = get_settings(self.app)
        # The same task id runs again after a retry or a requeue: no done marker then.
        again = isinstance(exc, Retry) or (isinstance(exc, Reject) and exc.requeue)
        done_ttl = settings.done_ttl if self.acks_late and not again and not request.is_eager else None
        claim_ttl = None
        if isinstance(exc, Retry) and self.lock_mode == "until_executed":
            # The retry waits in the queue under the lock, turned into its claim.
            when = exc.when  # the retry's countdown in seconds, or its eta
            claim_ttl = settings.queue_lock_ttl + _delay_of(
                {"eta": when} if isinstance(when, datetime) else {"countdown": when})
        if claim_ttl is None and not isinstance(exc, SystemExit):
            # The usual ending: write the release now, read its reply with the
            # next acquire (one blocking round trip per run instead of two).
            name, task_id = self.name, request.id

            def confirmed(released: bool | None, error: BaseException | None) -> None:
                if error is not None:
                    logger.warning("%s[%s] released %s, but its reply was lost (%s); if the release "
                                   "did not run, the lock expires within %.0fs",
                                   name, task_id, kept.lease.key, error, kept.lease.ttl)
                elif not released:
                    kept.mark_lost("the lock was gone when the run ended")

            try:
                if kept.lease.release_soon(confirmed, done_ttl=done_ttl):
                    return
            except redis.RedisError as error:
                logger.error("%s[%s] could not release %s (it expires within %.0fs): %s",
                             self.name, request.id, kept.lease.key, kept.lease.ttl, error)
                return
        try:
            released = kept.lease.release(done_ttl=done_ttl, claim_ttl=claim_ttl)
        except redis.RedisError as error:
            logger.error("%s[%s] could not release %s (it expires within %.0fs): %s",
                         self.name, request.id, kept.lease.key, kept.lease.ttl, error)
            return
        if released and isinstance(exc, SystemExit):
            logger.warning("%s[%s] terminated (%s); freed its lock %s before exiting",
                           self.name, request.id, exc, kept.lease.key)
        elif not released and isinstance(exc, SystemExit):
            # The pool child is being terminated (hard time limit, revoke+terminate).
            logger.info("%s[%s] terminated; its lock %s was already freed by the worker's main process",
                        self.name, request.id, kept.lease.key)
        elif not released:  # reported once, by the callback, unless the keeper already did
            kept.mark_lost("the lock was gone when the run ended")

    def _redis_unavailable(self, key: str, exc: Exception, *, fail_open: bool) -> SingletonRun:
        request = self.request
        if fail_open:
            logger.error("%s[%s] runs WITHOUT its lock %s: Redis unavailable (fail-open): %s",
                         self.name, request.id, key, exc)
            return SingletonRun(key, None)
        error = LockUnavailable(key, exc)
        if request.is_eager:
            raise error from exc
        countdown = self._backoff(request.retries or 0)
        logger.error("%s[%s] not started, Redis unavailable for %s; retrying in %.1fs: %s",
                     self.name, request.id, key, countdown, exc)
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
