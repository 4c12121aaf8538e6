"""``SingletonTask``: at most one run at a time per task and arguments.

Lifecycle of a run (``lock_mode="while_executing"``, the default)::

    worker receives message -> __call__ -> acquire lease (1 round trip)
        held by another run -> on_conflict: skip (REVOKED: TaskSkipped) | raise | retry
                               (:mod:`.conflicts`)
        taken                -> body runs; the keeper renews it (every
                                min(lock_ttl, singleton_liveness_ttl)/3)
    body ends in any way (return, exception, retry, Ignore, Reject)
        -> release (written at once, compare-and-delete: only if the lease is still ours)

The lock is taken in ``__call__``, which Celery's tracer calls for every run
(worker and eager), so a ``finally`` there sees every ending a process
survives. Endings it cannot see (the pool child killed, a hard time limit, a
revoke with terminate) are handled by the worker's main process through
:class:`~celery_singleton_beat.task.request.SingletonRequest`, and a node that died
altogether has its locks taken over by the next run that wants them, once
its liveness key is gone and the locks missed their renewals (:mod:`.liveness`).

Another delivery of the same message (same task id: ``acks_late`` redelivery
after a visibility timeout or a lost connection) is the same work, not a
duplicate: it waits (re-published with a countdown, nothing stored) while the
original runs on a live worker, ends without running once the original
completed (the done marker of ``acks_late`` runs), and runs when the original's
worker died (its lock is taken over, see :mod:`.liveness`).

Publish-time modes add a *claim* taken in ``apply_async`` (:mod:`.publish`):

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

import functools
import inspect
import logging
import time
import types
from typing import Any, ClassVar

import celery
import redis
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry
from kombu.utils.functional import maybe_list

from ..config import SingletonSettings, get_settings
from ..lease.holder import describe_holder
from ..lease.keeper import get_keeper
from ..lease.lease import Lease
from ..lease.liveness import boot_id
from ..lease.lock import AcquireResult, acquire
from ..lease.spec import LockSpec
from ..log import logger
from ..recovery.lock_redis import get_redis
from . import soft_limit
from . import worker as worker_support
from .conflicts import ConflictOutcomes, is_copy
from .keys import UniqueOn, lock_key, task_signature
from .options import LOCK_MODES, ON_CONFLICT, OPTIONS, check_options, misspelt_option
from .outage import claim_back, in_time, wait_for_redis
from .publish import PublishClaims
from .release import ReleaseAtEnd
from .request import compose_request
from .run import HeldRun, SingletonRun
from .run_settings import RunSettings

__all__ = ["LOCK_MODES", "ON_CONFLICT", "OPTIONS", "SingletonRun", "SingletonTask"]


#: Endings a body decides and has recorded itself: a soft limit held in ``_end`` is dropped.
_DECIDED = (Ignore, Reject, Retry)



class SingletonTask(RunSettings, ConflictOutcomes, PublishClaims, ReleaseAtEnd):
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
    Request = "celery_singleton_beat.task.request:SingletonRequest"

    # -- registration -----------------------------------------------------

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Check the task's singleton options when it is bound to its app."""
        super().on_bound(app)
        if cls.__dict__.get("name") is None and cls is SingletonTask:
            return
        unique_on = inspect.getattr_static(cls, "unique_on", None)
        if isinstance(unique_on, types.FunctionType):
            # ``@app.task(unique_on=f)`` or ``unique_on = f`` in a class body: a function
            # class attribute would be bound as a method (called with the task first).
            cls.unique_on = staticmethod(unique_on)
        cls._check_options()
        # A task's own Request class keeps working, with ours mixed in front.
        cls.Request = compose_request(cls.Request)  # type: ignore[assignment]  # a class now
        worker_support.install(app)

    @classmethod
    def _check_options(cls) -> None:
        check_options(cls, SingletonTask)

    @staticmethod
    def _singleton_looking(attribute: str) -> str | None:
        """What to say about a task attribute that looks like a misspelt option, else None
        (:func:`.options.misspelt_option`)."""
        return misspelt_option(attribute, SingletonTask)

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

    @property
    def singleton(self) -> SingletonRun | None:
        """The lock of the current run (None outside a run or when called directly)."""
        return getattr(self.request, "singleton", None)

    @property
    def singleton_run(self) -> SingletonRun:
        """The lock of the current run, for the body: ``self.singleton_run.ensure_held()``.

        :attr:`singleton` without the ``None``, so typed code needs no check.
        Raises ``RuntimeError`` where there is no run: outside a task body, or in
        a body called directly as a plain function (``task(...)``, no lock taken).
        """
        run = getattr(self.request, "singleton", None)
        if run is None:
            where = "outside a run" if self.request_stack.top is None else "called directly (no lock is taken)"
            raise RuntimeError(f"{self.name}: no singleton run: the task is {where}; "
                               f"use apply()/delay() to run it with its lock")
        return run  # type: ignore[no-any-return]  # request fields are Any to mypy

    # -- run --------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            # A plain function call in the caller's process, as with any Celery task.
            return super().__call__(*args, **kwargs)
        # The tracer (worker or eager) has pushed this run's request and the task: the body
        # runs as Celery runs a task without a __call__ of its own (``task.run``, no copy of
        # the request pushed), unless a class between here and Celery's Task has a __call__
        # to run, or this is a call nested in a run of this task (its own request then).
        direct = type(self)._singleton_direct_call() and "singleton" not in request.__dict__
        # A nested call sets its lock on the outer run's request (the one its own is copied
        # from): the outer body gets its own lock back once the nested call returned.
        outer = None if direct else request.__dict__.get("singleton")
        # One left from a run that ended is not this run's. Dropped here, not in _begin: one
        # landing as _begin starts is this run's, held there.
        soft_limit.drop_held()
        # From the lease kept to _end, no instruction of this frame may raise a soft time
        # limit (a frame not marked in soft_limit: "in the run") outside the try: _begin is
        # called inside it, and the ending is caught, not asked for (``sys.exc_info()``, a
        # C call, after which the interpreter runs pending signal handlers, in this frame).
        run: SingletonRun | None = None
        ending: BaseException | None = None
        try:
            run = request.singleton = self._begin(request, args, kwargs)
            soft_limit.raise_held()  # one held after _begin's own safe point: before the body
            if direct:
                # As a worker's stack protection marks the request when it runs the body on
                # it: a call nested in this run (``self(...)``) then gets a request of its own
                # from ``Task.__call__``, not this one (whose args are the outer run's).
                request._protected = 1
                return self.run(*args, **kwargs)
            return super().__call__(*args, **kwargs)
        except BaseException as exc:
            ending = exc  # this run's own (not one an outer body is handling: a call nested in an except)
            raise
        finally:
            if outer is not None:
                request.singleton = outer
            try:
                self._end(request, run, ending)
            finally:
                # One that landed in _end is raised, unless the run did not begin, or its body
                # decided its ending and had it recorded (a retry published, a message given
                # back, a state the body stored): it ends as that says, as in _begin.
                decided = run is None or isinstance(ending, _DECIDED)
                ending = None  # no cycle through this frame's traceback
                if decided:
                    soft_limit.drop_held()
                else:
                    soft_limit.raise_held()

    @classmethod
    def _singleton_direct_call(cls) -> bool:
        """Whether ``super().__call__`` from :class:`SingletonTask` is Celery's own
        ``Task.__call__`` (kept per class): then a traced run may call ``run`` directly."""
        known = cls.__dict__.get("_singleton_direct")
        if known is None:
            mro = cls.__mro__
            after = mro[mro.index(SingletonTask) + 1:]
            owner = next((klass for klass in after if "__call__" in vars(klass)), None)
            known = owner is celery.Task
            cls._singleton_direct = known
        return known

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

    def _take(self, key: str, ttl: float, counters: tuple[str, str], *, task_id: str | None,
              claim: bool = False) -> AcquireResult:
        """One acquire of ``key`` as this task outside a run (publish-time claims)."""
        settings = get_settings(self.app)
        spec = LockSpec(task=self.name, ttl=ttl, boot=boot_id(), claim=claim, stats_key=self._stats_key(settings),
                        counters=counters, wait_replicas=settings.wait_replicas, wait_timeout=settings.wait_timeout)
        return acquire(get_redis(self.app), key, spec, task_id)

    def _take_run_lock(self, request: Context, client: Any, key: str, spec: LockSpec, adopt: str | None,
                       copy: bool) -> AcquireResult:
        """One acquire of a run's lock. A lease granted by a reply that came too late to be
        vouched for is given back and fails the acquire as a timeout does (:func:`.outage.in_time`).
        A method, not a closure of ``_begin``: every start of a gevent worker's burst made two
        functions and their cells, held while it waited for its reply."""
        result = acquire(client, key, spec, request.id, node=request.hostname, adopt_claim_of=adopt, copy=copy)
        lease = result.lease
        if lease is not None and time.monotonic() >= lease.vouched_until:
            in_time(result, functools.partial(self._give_back, request, key, adopt))
        return result

    def _give_back(self, request: Context, key: str, adopt: str | None, lease: Lease) -> None:
        """Hand back a lease no run used (a late reply's): released, or, for a queued
        ``until_executed`` message, turned back into its claim (:func:`.outage.claim_back`)."""
        if adopt is None or request.is_eager:
            get_keeper().retry_release(lease, counted=False)  # no run used it
            return
        ttl = get_settings(self.app).queue_lock_ttl + self._backoff(request.retries or 0)
        claim_back(lease, ttl, lambda: self._take(key, ttl, ("claimed", ""), task_id=request.id, claim=True))

    def _begin(self, request: Context, args: tuple[Any, ...], kwargs: dict[str, Any]) -> SingletonRun:
        settings, client, spec, _ = self._run_context(bool(request.is_eager))
        key = self._key(settings, args, kwargs)
        adopt = request.id if self.lock_mode == "until_executed" else None
        copy = spec.check_done and is_copy(request)  # its done marker is read before the key is written
        started = time.monotonic()

        # A soft time limit landing in here, or in anything called from here, is held
        # (soft_limit) and raised at the safe point below, where the lease is abandoned.
        result: AcquireResult | None = None
        try:
            try:
                result = self._take_run_lock(request, client, key, spec, adopt, copy)
            except redis.RedisError as exc:
                if settings.fail_open:
                    run = self._run_unlocked(key, exc)
                    soft_limit.raise_held()  # no lock taken: raised before the body
                    return run
                take = functools.partial(self._take_run_lock, request, client, key, spec, adopt, copy)
                result = wait_for_redis(self, key, exc, take, started=started, client=client)
            if self.lock_mode == "until_executing":
                self._release_queue_claim(client, key)
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
            run = get_keeper().keep_entry(HeldRun(result.lease, self._lease_lost_callback(request),
                                                  settings.done_ttl if spec.check_done else None))
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("%s[%s] holds %s (fence %s)", self.name, request.id, key, result.lease.fence)
            # The safe point, the last call: a run cut short here abandons its lease below;
            # one landing after it would be held through the body.
            soft_limit.raise_held()
            return run
        except BaseException:  # the run never reaches its body, its end will not come
            if result is not None and result.lease is not None:
                get_keeper().abandon(result.lease)  # released now, not left until its TTL
            soft_limit.drop_held()  # it ends as what ended it says (a skip, a retry, ...)
            raise
