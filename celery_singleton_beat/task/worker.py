"""Worker-side support: liveness, and locks of runs that could not release them.

* :class:`SingletonWorkerStep` runs when a worker starts: it validates the
  ``singleton_*`` settings (a mistake stops the worker with a clear error),
  checks the lock Redis (:mod:`.startup`: a configuration error stops the
  worker with one line and exit code 78, an outage is retried) and starts the
  :class:`~celery_singleton_beat.lease.liveness.Heartbeat` that proves this
  incarnation alive. Locks of incarnations that stopped proving it are
  taken over by the next run that wants them (see :mod:`.liveness`), so no
  start-up sweep and no trust in node names is needed.
* :class:`SingletonRequest` runs in the worker's main process. When a pool
  child dies with a singleton run on it (SIGKILL, OOM killer, hard time limit,
  revoke with ``terminate=True``), the child's ``finally`` never runs; the main
  process deletes the lock if that task id still holds it, once the child is
  really gone (billiard reports a hard time limit before it kills the child).
  A message revoked or expired before it ran frees its publish-time claims.
* A prefork pool notices a dead child through the child's sentinel pipe. The
  pipe closes a moment before the kernel lets the parent reap the child; when
  Celery's check loses that race it looks again only at its periodic pool
  check, every 5 s, and the dead run's lock (and the replacement child) waits
  that long. :class:`SingletonWorkerStep` runs that check every
  :data:`POOL_CHECK_INTERVAL` seconds instead.
* :class:`SingletonWorkerStep` tells runs waiting for their lock Redis
  (:mod:`.outage`) which pool the worker runs and when it begins to stop.
* A prefork child ends with ``os._exit`` (recycled by
  ``worker_max_tasks_per_child`` / ``worker_max_memory_per_child``, or at a
  shutdown): ``atexit`` never runs there. When it ends, the replies of its
  releases still unread are read and its counters written
  (:func:`~.counters.flush_at_exit`).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import redis
from billiard.exceptions import WorkerLostError
from celery import Celery, bootsteps, signals
from celery.exceptions import ImproperlyConfigured, Terminated, TimeLimitExceeded
from celery.utils.imports import symbol_by_name
from celery.worker.request import Request

from ..config import get_settings
from ..lease import counters
from ..lease.behalf import read_holder, release_for
from ..lease.holder import Holder, describe_holder
from ..lease.keeper import send_pending_releases
from ..lease.liveness import Heartbeat, boot_id
from ..log import logger
from ..recovery.lock_redis import get_redis
from ..recovery.startup import EX_CONFIG, LockRedisUnusable, StartupCheck, refuse_to_start
from . import outage
from .keys import QUEUED_SUFFIX
from .slot_delivery import SlotDeliveryStep

__all__ = ["POOL_CHECK_INTERVAL", "SingletonRequest", "SingletonWorkerStep", "boot_id", "compose_request", "install",
           "sends_task_events"]

#: Endings after which the pool child cannot have released its lock.
_CHILD_GONE = (WorkerLostError, Terminated, TimeLimitExceeded, SystemExit, KeyboardInterrupt)
#: How long the main process waits for a timed-out child to exit before giving up.
_EXIT_WAIT = 30.0
#: Seconds between two looks for exited prefork pool children (Celery's own: 5 s).
POOL_CHECK_INTERVAL = 0.25


#: This process belongs to a worker that sends task events (``-E``,
#: ``worker_send_task_events``): a run's end is seen through its
#: ``task-succeeded``/``task-failed`` event. Set before the pool forks.
_task_events = False


def sends_task_events() -> bool:
    """True in a worker (pool children included) that sends task events."""
    return _task_events


def _flush_at_child_exit(**_: Any) -> None:
    """A prefork child ends (``os._exit``, no ``atexit``): send its pending releases once more,
    read its unread replies, write its counts."""
    try:
        send_pending_releases()  # releases that got no answer yet: once more
        counters.flush_at_exit()
    except Exception as exc:  # the child ends whatever happens here
        logger.warning("could not write this pool process's counters before it ended: %s", exc)


signals.worker_process_shutdown.connect(_flush_at_child_exit, weak=False)


def install(app: Celery) -> None:
    """Give ``app``'s workers the library's worker side (idempotent).

    :class:`SingletonWorkerStep` (settings check, liveness) and
    :class:`~celery_singleton_beat.task.slot_delivery.SlotDeliveryStep` (a beat
    slot's message runs once, for every task). Apps with a singleton task get
    it automatically; apps that use only the scheduler call it once in their
    app module.
    """
    app.steps["worker"].add(SingletonWorkerStep)
    app.steps["consumer"].add(SlotDeliveryStep)
    _guard_revoke()


def _guard_revoke() -> None:
    """Keep the ``revoke`` control command from writing a running original's state.

    Since Celery 5.6 every worker that receives ``revoke(id)`` (without
    ``terminate``) and does not run that task itself marks it ``REVOKED`` in
    the result backend when its state reads ``PENDING`` -- which is the state
    of a running task unless ``task_track_started`` is on. A worker that holds
    another delivery of the message (an ``acks_late`` redelivery, a re-publish
    with the same id) while the original runs under its lock elsewhere would so
    overwrite the original's state until its real result replaces it. For such
    ids this worker only flags the copy as revoked (it is discarded when it
    comes up, storing nothing: :meth:`SingletonRequest._announce_revoked`).
    A worker that knows nothing of the id does what Celery does.
    """
    from celery.worker import control
    from celery.worker import state as worker_state
    from kombu.utils.functional import maybe_list

    original = control.Panel.data.get("revoke")
    if original is None or getattr(original, "_singleton_guard", False):
        return

    def revoke(state: Any, task_id: Any, terminate: bool = False, signal: Any = None, **kwargs: Any) -> Any:
        ids = set(maybe_list(task_id) or [])
        copies = set() if terminate else {i for i in ids if _copy_of_a_running_original(worker_state, i)}
        if copies:
            worker_state.revoked.update(copies)
            logger.warning("revoke of %s: another delivery of the same message runs under its lock; the copy "
                           "here is discarded, the original's state is left alone", ", ".join(sorted(copies)))
            if not ids - copies:
                return {"ok": f"tasks {copies} flagged as revoked"}
            task_id = list(ids - copies)
        return original(state, task_id, terminate=terminate, signal=signal, **kwargs)

    revoke._singleton_guard = True  # type: ignore[attr-defined]
    revoke.__doc__ = original.__doc__
    control.Panel.data["revoke"] = revoke


def _copy_of_a_running_original(worker_state: Any, task_id: str) -> bool:
    """This worker holds a delivery of ``task_id`` that is not running, while a run of that id holds the lock."""
    request = worker_state.requests.get(task_id)
    return (isinstance(request, SingletonRequest) and request not in worker_state.active_requests
            and _original_running(request) is not None)


def compose_request(request_cls: Any) -> type[Request]:
    """A request class that is both the task's own and :class:`SingletonRequest`.

    A task that sets its own ``Request`` keeps it; the singleton behaviour
    (freeing locks of lost children, claims of revoked messages) is mixed in
    front of it, so the two cooperate through ``super()``.
    """
    cls: type[Any] = symbol_by_name(request_cls) if isinstance(request_cls, str) else request_cls
    if issubclass(cls, SingletonRequest):
        return cls
    composed: type[Any] = type(f"Singleton{cls.__name__}", (SingletonRequest, cls), {"__module__": cls.__module__})
    return composed


def _process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _keys_of(request: Request) -> tuple[Any, str] | None:
    """The task and lock key of ``request``'s message, or None (not a singleton task, bad arguments)."""
    task = request.task
    key_of = getattr(task, "singleton_key", None)
    if key_of is None:
        return None
    try:
        return task, key_of(request.args, request.kwargs)
    except Exception:  # bad arguments: the run never took a lock
        return None


def _release_for_request(request: Request, why: str, *, pid: int | None) -> None:
    """Free, from the main process, what the request's run or message held.

    ``pid``: the pool process whose run died: its run lock is deleted only if
    it names this worker incarnation, that process and the task id (a
    redelivered copy of the message, same task id, may hold it by now).
    ``None``: the message never ran (revoked, expired): only publish-time
    claims of its task id are freed, never a run lock -- that would be the
    lock of another delivery of the same message, still running.
    """
    found = _keys_of(request)
    if found is None:
        return
    task, key = found
    try:
        client = get_redis(task.app)
        stats_key = task.singleton_stats_key()
        freed = [k for k in (key, key + QUEUED_SUFFIX)
                 if release_for(client, k, request.id, boot=boot_id() if pid is not None and k == key else None,
                                pid=pid if k == key else None, claims_only=pid is None or k != key,
                                stats_key=stats_key, counter="reclaimed")]
    except redis.RedisError as exc:
        logger.error("%s[%s] %s; could not free %s (it expires after its TTL): %s",
                     request.name, request.id, why, key, exc)
        return
    if freed:
        logger.warning("%s[%s] %s; freed its lock %s", request.name, request.id, why, ", ".join(freed))


def _original_running(request: Request) -> Holder | None:
    """The run of the same task id that holds the message's lock, if one does (another delivery)."""
    found = _keys_of(request)
    if found is None:
        return None
    task, key = found
    try:
        holder = read_holder(get_redis(task.app), key)
    except redis.RedisError:
        return None
    if holder is not None and holder.task_id == request.id and not holder.claim:
        return holder
    return None


class SingletonRequest(Request):
    """Request class of singleton tasks: frees locks of pool children that died."""

    _singleton_released = False

    def _release_once(self, why: str) -> None:
        """Free the run's lock once its process is gone (never while the body may still run)."""
        if self._singleton_released:
            return
        self._singleton_released = True
        pid = self.worker_pid
        if not pid or pid == os.getpid():
            # Threads, gevent, eventlet, solo: the body ran here and its own
            # ``finally`` released (a timed-out greenlet is killed with an exception).
            return
        if _process_gone(pid):
            _release_for_request(self, why, pid=pid)
            return

        def wait_then_release() -> None:
            deadline = time.monotonic() + _EXIT_WAIT
            while not _process_gone(pid):
                if time.monotonic() >= deadline:
                    logger.error("%s[%s] %s, but pool process %s has not exited after %.0fs; its lock "
                                 "is left to its lease", self.name, self.id, why, pid, _EXIT_WAIT)
                    return
                time.sleep(0.02)
            _release_for_request(self, why, pid=pid)

        threading.Thread(target=wait_then_release, name="singleton-release", daemon=True).start()

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback wraps the real one
        if isinstance(exc, _CHILD_GONE):
            self._release_once(f"ended without releasing ({type(exc).__name__})")
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def reject(self, requeue: bool = False) -> Any:
        """Reject the message; one given back (``requeue``) that the broker cannot take stays
        unacknowledged, and the consumer lives on.

        kombu logs a reject that fails with a connection error; any other error is
        raised in the consumer's loop, and the worker stops ("Unrecoverable error").
        A Redis broker that refuses writes (out of memory, ``noeviction``) answers
        the requeue with an error reply: the runs that give their message back while
        Redis is unavailable (:mod:`.outage`) must not stop the worker for it. The
        message is delivered again once the broker's visibility timeout passes.
        """
        if requeue:
            self._connection_errors = (*getattr(self, "_connection_errors", ()), redis.ResponseError)
        return super().reject(requeue=requeue)

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        result = super().on_timeout(soft, timeout)
        if not soft:
            self._release_once(f"hit the hard time limit ({timeout}s)")
        return result

    def revoked(self) -> bool:
        revoked = bool(super().revoked())
        if revoked and not self._singleton_released and self.worker_pid is None:
            # Revoked or expired before it started: its publish-time claims
            # would otherwise block every publish until they expire.
            self._singleton_released = True
            _release_for_request(self, "was revoked or expired before it ran", pid=None)
        return revoked

    def _announce_revoked(self, reason: str, terminated: bool, signum: Any, expired: bool) -> Any:
        """A discarded copy of a message whose original still runs stores nothing.

        Celery marks the task id ``REVOKED`` in the result backend when it
        discards a revoked or expired message; for a second delivery of a
        message whose first delivery is running (``acks_late`` redelivery, a
        re-publish with the same id) that is the running task's state, which
        would read ``REVOKED`` until its real result replaces it. The copy is
        acknowledged and dropped with a log line; the original's outcome stands.
        """
        if not terminated and self.worker_pid is None:
            original = _original_running(self)
            if original is not None:
                from celery.worker.state import task_ready

                logger.warning("%s[%s]: discarded a %s copy; the original delivery runs on %s and keeps its "
                               "lock and result", self.name, self.id, reason, describe_holder(original))
                task_ready(self)
                self.acknowledge()
                self._already_revoked = True
                return None
        return super()._announce_revoked(reason, terminated, signum, expired)


class SingletonWorkerStep(bootsteps.StartStopStep):
    """Validates settings and the lock Redis when the worker starts; keeps its liveness key.

    A lock Redis that cannot be used as configured stops the worker before it
    consumes anything (:func:`~celery_singleton_beat.recovery.startup.refuse_to_start`);
    one that does not answer yet is checked again until it does. The heartbeat
    starts while the worker is being built, before the pool forks or any
    message is consumed, and is never stopped before the process ends: during
    a warm shutdown the running tasks still hold their locks.
    On a prefork pool it also looks for exited children every
    :data:`POOL_CHECK_INTERVAL` seconds, so a killed child's lock is freed
    (and the child replaced) within that, not within Celery's 5 s.
    """

    label = "singleton"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        global _task_events
        _task_events = bool(getattr(worker, "task_events", False))
        outage.worker_starts(worker.pool_cls)  # before the pool forks
        app, node = worker.app, worker.hostname
        try:
            self.settings = get_settings(app)
        except ImproperlyConfigured as exc:
            refuse_to_start(f"worker {node}", f"invalid configuration: {exc}")
        check = StartupCheck(f"worker {node}", lambda: get_redis(app), self.settings)
        server = check.run("singleton tasks wait (retry) until it answers")  # exits 78 if unusable
        self.heartbeat = Heartbeat(lambda: get_redis(app), self.settings.key_prefix,
                                   self.settings.liveness_ttl, node).start()
        if server is None:
            logger.warning("%s: liveness key %s (ttl %.0fs) is written once the lock Redis answers",
                           node, self.heartbeat.key, self.settings.liveness_ttl)
            threading.Thread(target=_check_until_up, args=(check,), name="singleton-recheck", daemon=True).start()
        else:
            logger.info("%s: lock Redis %s; liveness key %s (ttl %.0fs)", node, server.describe(),
                        self.heartbeat.key, self.settings.liveness_ttl)

    def register_with_event_loop(self, worker: Any, hub: Any) -> None:
        """Prefork: run the pool's own check for exited children more often.

        Called each time the consumer's event loop starts; Celery cancels the
        timers registered here when that loop ends (a reconnect), so they never pile up.
        """
        from celery.concurrency import prefork  # billiard's pool: only in workers that have one

        if isinstance(worker.pool, prefork.TaskPool):
            hub.call_repeatedly(POOL_CHECK_INTERVAL, worker.pool.maintain_pool)

    def close(self, worker: Any) -> None:
        """The worker stops, however (a signal, ``celery control shutdown``, an
        unrecoverable error): runs waiting for the lock Redis end their wait
        (:mod:`.outage`) instead of holding the pool's shutdown until Redis answers.
        Called before any step stops, so before the pool waits for its runs."""
        outage.worker_stops()


def _check_until_up(check: StartupCheck) -> None:
    """Thread of a worker that started during an outage: check until the lock Redis answers.

    A server that answers but cannot be used (the outage hid a wrong
    password, a missing database...) stops the worker as it would have at
    start: Celery's consumer loop sees ``should_stop`` and shuts down warm,
    with exit code 78.
    """
    from celery.worker import state

    while check.pending:
        time.sleep(check.wait())
        try:
            check.poll()
        except LockRedisUnusable:
            state.should_stop = EX_CONFIG
        except Exception:  # never let the thread die silently
            logger.exception("%s: checking the lock Redis failed", check.what)
            return


@signals.worker_init.connect  # type: ignore[untyped-decorator]  # celery is untyped
def _install_on_worker_init(sender: Any = None, **_: Any) -> None:
    """Add the worker step for apps whose singleton tasks are declared lazily.

    ``@app.task`` on an app that is not finalized yet creates the task class
    only at finalization, possibly after the worker blueprint was built; this
    receiver runs just before the blueprint, so it finalizes and checks.
    """
    app = getattr(sender, "app", None)
    if app is None:
        return
    scheduler = str(app.conf.beat_scheduler or "")
    if "celery_singleton_beat" in scheduler or any(
            hasattr(task, "singleton_key") for task in app.tasks.values()):
        install(app)
