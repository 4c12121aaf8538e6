"""The request class of singleton tasks, in the worker's main process.

When a pool child dies with a singleton run on it (SIGKILL, the OOM killer, a
hard time limit, ``revoke(terminate=True)``), the child's ``finally`` never
runs: the main process deletes the lock if that run (task id, worker
incarnation, pid) still holds it, once the child is really gone.

Celery records some of these ends in the main process: a hard time limit's
``FAILURE`` (with its ``task-failed`` event, ``task_failure`` signal and
errbacks) before billiard stops the child, a revoke's ``REVOKED`` as soon as
the signal is sent. A caller who saw that end and submitted the same key again
would be skipped as a duplicate of a run that had ended. So here the end is
recorded after the key is free: a timed-out child is stopped first (as billiard
stops it: SIGTERM, SIGKILL 0.1 s later), a terminated run's ``REVOKED`` waits
for billiard to report the child gone, and the lock is freed before either is
stored. A child that outlives :data:`GONE_WAIT` after that is left to a
background thread, and its end recorded without waiting longer.

A message revoked or expired before it ran frees its publish-time claims, on a
thread of its own: Celery discards it in the worker's main loop, which also sends
the acknowledgements of finished runs, and a lock Redis that does not answer (writes
paused, a busy script) must not hold those back (an ``acks_late`` run whose
acknowledgement waited behind it was delivered again when its worker died).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from billiard.common import TERM_SIGNAME
from billiard.exceptions import WorkerLostError
from celery.exceptions import Terminated, TimeLimitExceeded
from celery.platforms import signals as platform_signals
from celery.utils.imports import symbol_by_name
from celery.worker.request import Request
from celery.worker.state import task_ready

from ..lease.behalf import read_holder, release_for
from ..lease.holder import Holder, describe_holder
from ..lease.liveness import boot_id
from ..log import logger
from ..recovery.lock_redis import get_redis
from .keys import QUEUED_SUFFIX

__all__ = ["GONE_WAIT", "RESEND_EVERY", "SingletonRequest", "compose_request", "original_running", "worker_pool_is"]

#: Endings after which the pool child cannot have released its lock.
_CHILD_GONE = (WorkerLostError, Terminated, TimeLimitExceeded, SystemExit, KeyboardInterrupt)
#: How long the main process waits for a timed-out child to exit before giving up.
_EXIT_WAIT = 30.0
#: Seconds the main process waits for a pool child it stopped (or that billiard
#: reported ending) to be gone before it records the run's end anyway.
GONE_WAIT = 2.0
#: billiard's pause between the SIGTERM and the SIGKILL of a timed-out child.
_TERM_GRACE = 0.1
#: Seconds between two sends of a release on a lost child's behalf that got no answer.
RESEND_EVERY = 0.25
#: Whether this process's worker runs tasks in pool child processes (prefork). Under
#: threads, gevent, eventlet and solo a request's ``worker_pid`` is not a child's pid
#: (gevent reports the greenlet's id): the run's own ``finally`` releases there.
_in_children = [False]


def _end_greenlet(pool: Any, worker_pid: Any) -> None:
    """A greenlet pool's run ends before Celery records its revoke: its ``finally`` (the
    release) runs first. gevent's ``terminate_job`` only schedules the kill, and Celery
    stores ``REVOKED`` right after it, before the greenlet has run again. Waits
    :data:`GONE_WAIT` seconds at most (cooperatively: other greenlets go on)."""
    greenlet = (getattr(pool, "_pool_map", None) or {}).get(worker_pid)
    kill = getattr(greenlet, "kill", None)
    if kill is not None:
        try:
            kill(block=True, timeout=GONE_WAIT)
        except Exception:
            logger.exception("could not end the greenlet of a terminated run")


def worker_pool_is(pool_cls: Any) -> None:
    """The worker of this process starts with ``pool_cls`` (its main process, before any run)."""
    _in_children[0] = any(k.__module__ == "celery.concurrency.prefork" for k in getattr(pool_cls, "__mro__", ()))


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


def _stop_child(pid: int) -> None:
    """Stop a timed-out pool child as billiard's timeout handler does: SIGTERM (to its
    process group when it leads one), then SIGKILL if it is still there 0.1 s later."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signum)
            else:
                os.kill(pid, signum)
        except OSError:
            return  # gone already
        if signum == signal.SIGTERM and _gone_within(pid, _TERM_GRACE):
            return


def _gone_within(pid: int, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``pid`` to be gone; whether it is."""
    deadline = time.monotonic() + seconds
    while not _process_gone(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


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
    boot = boot_id()

    def release() -> list[str]:
        client = get_redis(task.app)
        stats_key = task.singleton_stats_key()
        return [k for k in (key, key + QUEUED_SUFFIX)
                if release_for(client, k, request.id, boot=boot if pid is not None and k == key else None,
                               pid=pid if k == key else None, claims_only=pid is None or k != key,
                               stats_key=stats_key, counter="reclaimed")]

    try:
        freed = release()
    except redis.RedisError as exc:
        ttl = task.effective_lock_ttl
        logger.error("%s[%s] %s; could not free %s yet, sent again until Redis answers (at most %.0fs, its "
                     "lease): %s", request.name, request.id, why, key, ttl, exc)
        threading.Thread(target=_resend, args=(request, why, key, release, time.monotonic() + ttl),
                         name="singleton-release-again", daemon=True).start()
        return
    if freed:
        logger.warning("%s[%s] %s; freed its lock %s", request.name, request.id, why, ", ".join(freed))


def _resend(request: Request, why: str, key: str, release: Callable[[], list[str]], until: float) -> None:
    """Send a release on a lost run's behalf again every :data:`RESEND_EVERY` until Redis
    answers it (a ``-BUSY`` script, a restart) or the lease would have expired anyway."""
    while time.monotonic() < until:
        time.sleep(RESEND_EVERY)
        try:
            freed = release()
        except redis.RedisError:
            continue
        logger.warning("%s[%s] %s; freed its lock %s once Redis answered", request.name, request.id, why,
                       ", ".join(freed) if freed else f"{key} (already free)")
        return
    logger.error("%s[%s] %s; Redis did not answer the release of %s before its lease ran out",
                 request.name, request.id, why, key)


#: Claims of discarded messages still to free, in the order the messages were discarded.
_discarded: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_discarding_lock = threading.Lock()
_discarding: list[threading.Thread] = []


def _free_discarded() -> None:
    """The thread that frees the claims of discarded messages, one after the other."""
    while True:
        work = _discarded.get()
        try:
            work()
        except Exception:
            logger.exception("could not free the claims of a discarded message")


def _in_background(work: Callable[[], None]) -> None:
    """Run ``work`` on the discards' thread (started on first use, again if it died): the
    caller, the worker's main loop, never waits for the lock Redis."""
    _discarded.put(work)
    with _discarding_lock:
        if not (_discarding and _discarding[0].is_alive()):
            thread = threading.Thread(target=_free_discarded, name="singleton-discards", daemon=True)
            thread.start()
            _discarding[:] = [thread]


def original_running(request: Request) -> Holder | None:
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
    """Request class of singleton tasks: frees locks of pool children that died, before
    their end is recorded."""

    _singleton_released = False
    #: The signal of a ``revoke(terminate=True)`` sent to this run's pool child.
    _singleton_terminated_by: int | None = None

    def _in_pool_child(self) -> int | None:
        """The pid of the pool child running this request, or None (threads, gevent,
        eventlet, solo: the body runs in this process, and its own ``finally`` releases)."""
        pid = self.worker_pid
        return pid if _in_children[0] and pid and pid != os.getpid() else None

    def _free_before_the_end(self, why: str, *, stop: bool = False) -> None:
        """Free the run's lock before its end is recorded: stop the child first (``stop``),
        wait until it is gone (at most :data:`GONE_WAIT`), then delete the lock if the
        run still holds it. A child still there after that is left to
        :meth:`_release_once` (freed once it is gone; its end is recorded now)."""
        pid = self._in_pool_child()
        if self._singleton_released or pid is None:
            self._singleton_released = True
            return
        if stop:
            _stop_child(pid)
        if _gone_within(pid, GONE_WAIT):
            self._singleton_released = True
            _release_for_request(self, why, pid=pid)
            return
        logger.warning("%s[%s] %s; pool process %s is still there after %.0fs: its end is recorded now, its "
                       "lock freed once it exits", self.name, self.id, why, pid, GONE_WAIT)
        self._release_once(why)

    def _release_once(self, why: str) -> None:
        """Free the run's lock once its process is gone (never while the body may still run)."""
        if self._singleton_released:
            return
        self._singleton_released = True
        pid = self._in_pool_child()
        if pid is None:
            # Threads, gevent, eventlet, solo: the body ran here and its own
            # ``finally`` released (a timed-out greenlet is killed with an exception).
            return
        if _process_gone(pid):
            _release_for_request(self, why, pid=pid)
            return

        def wait_then_release() -> None:
            if not _gone_within(pid, _EXIT_WAIT):
                logger.error("%s[%s] %s, but pool process %s has not exited after %.0fs; its lock "
                             "is left to its lease", self.name, self.id, why, pid, _EXIT_WAIT)
                return
            _release_for_request(self, why, pid=pid)

        threading.Thread(target=wait_then_release, name="singleton-release", daemon=True).start()

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback wraps the real one
        if isinstance(exc, _CHILD_GONE):
            # billiard reports a hard time limit before it stops the child: stop it here.
            self._free_before_the_end(f"ended without releasing ({type(exc).__name__})",
                                      stop=isinstance(exc, TimeLimitExceeded))
        if isinstance(exc, _CHILD_GONE) and self._singleton_terminated_by is not None:
            # The revoke, announced now that the child is gone and its lock free. However
            # billiard reports the end (Terminated; WorkerLostError when the child was
            # reaped before the terminate marked it), the terminate ended it: no FAILURE,
            # no requeue.
            if not self._already_revoked:
                self._announce_revoked("terminated", True, self._singleton_terminated_by, False)
            else:
                task_ready(self)
            return None
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def terminate(self, pool: Any, signal: Any = None) -> None:
        """``revoke(terminate=True)``: signal the pool child; ``REVOKED`` is recorded once
        billiard reports it gone (:meth:`on_failure`), after its lock is freed.

        Celery records it as the signal is sent. A run the signal does not end (a
        signal the task handles) goes on, and its own end is what is recorded.
        """
        pid = self._in_pool_child() if self.time_start else None
        if pid is None:
            if self.time_start:
                _end_greenlet(pool, self.worker_pid)
            super().terminate(pool, signal)  # not started yet, or not in a pool child
            return
        signum = platform_signals.signum(signal or TERM_SIGNAME)  # SIGQUIT where REMAP_SIGTERM says so
        self._singleton_terminated_by = signum
        pool.terminate_job(pid, signum)
        result = self._apply_result() if self._apply_result is not None else None
        if result is not None:
            result.terminate(signum)

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
        if not soft:  # before Celery records the FAILURE (freed already when on_failure came first)
            self._free_before_the_end(f"hit the hard time limit ({timeout}s)", stop=True)
        return super().on_timeout(soft, timeout)

    def revoked(self) -> bool:
        revoked = bool(super().revoked())
        if revoked and not self._singleton_released and self.worker_pid is None:
            # Revoked or expired before it started: its publish-time claims
            # would otherwise block every publish until they expire. Not here: this
            # is the worker's main loop, and the lock Redis may not answer.
            self._singleton_released = True
            _in_background(lambda: _release_for_request(self, "was revoked or expired before it ran", pid=None))
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
            original = original_running(self)
            if original is not None:
                logger.warning("%s[%s]: discarded a %s copy; the original delivery runs on %s and keeps its "
                               "lock and result", self.name, self.id, reason, describe_holder(original))
                task_ready(self)
                self.acknowledge()
                self._already_revoked = True
                return None
        return super()._announce_revoked(reason, terminated, signum, expired)


