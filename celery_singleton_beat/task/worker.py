"""Worker-side support: liveness, and locks of runs that could not release them.

* :class:`SingletonWorkerStep` runs when a worker starts: it validates the
  ``singleton_*`` settings (a mistake stops the worker with a clear error),
  checks the lock Redis (:mod:`.startup`: a configuration error stops the
  worker with one line and exit code 78, an outage is retried) and starts the
  :class:`~celery_singleton_beat.lease.liveness.Heartbeat` that proves this
  incarnation alive. Locks of incarnations that stopped proving it are
  taken over by the next run that wants them (see :mod:`.liveness`), so no
  start-up sweep and no trust in node names is needed.
* :class:`~.request.SingletonRequest` (the request class of singleton tasks)
  frees, from the main process, the locks of pool children that died; the revoke
  control command is guarded here so that it leaves a running original's state alone.
* A prefork pool notices a dead child through the child's sentinel pipe. The
  pipe closes a moment before the kernel lets the parent reap the child; when
  Celery's check loses that race it looks again only at its periodic pool
  check, every 5 s, and the dead run's lock (and the replacement child) waits
  that long. :class:`SingletonWorkerStep` runs that check every
  :data:`POOL_CHECK_INTERVAL` seconds instead.
* At a warm shutdown, a prefork pool process that ran a job Celery had already
  forgotten (written into its pipe just before the consumer closed) waited 30 s for its
  main process to count a result nobody reads, or for ever to write one larger than
  its pipe holds; :class:`SingletonWorkerStep` lets the pool processes go once the pool
  stopped reading results, and reads what they still write (:func:`_let_pool_processes_go`).
* :class:`SingletonWorkerStep` tells runs waiting for their lock Redis
  (:mod:`.outage`) which pool the worker runs and when it begins to stop.
* A prefork child ends with ``os._exit`` (recycled by
  ``worker_max_tasks_per_child`` / ``worker_max_memory_per_child``, or at a
  shutdown): ``atexit`` never runs there. When it ends, the replies of its
  releases still unread are read and its counters written
  (:func:`~.counters.flush_at_exit`).
* A soft time limit that reaches a pool process after its run ended is dropped
  instead of being raised in billiard's own code (:mod:`.soft_limit`).
"""

from __future__ import annotations

import os
import selectors
import threading
import time
from typing import Any

from billiard.common import TERM_SIGNAME
from billiard.pool import TERMINATE
from celery import Celery, bootsteps, signals
from celery.exceptions import ImproperlyConfigured
from celery.platforms import signals as platform_signals

from ..config import get_settings
from ..lease import counters
from ..lease.keeper import send_pending_releases
from ..lease.liveness import Heartbeat
from ..log import logger
from ..recovery.lock_redis import get_redis
from ..recovery.startup import EX_CONFIG, LockRedisUnusable, StartupCheck, refuse_to_start
from . import outage
from .request import SingletonRequest, original_running, worker_pool_is
from .slot_delivery import SlotDeliveryStep
from .soft_limit import guard_soft_limits

__all__ = ["POOL_CHECK_INTERVAL", "SingletonWorkerStep", "install", "sends_task_events"]

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
    guard_soft_limits()


def _guard_revoke() -> None:
    """Keep the ``revoke`` control command from writing the state of a run that goes on
    elsewhere, or that has not ended yet.

    Since Celery 5.6 every worker that receives ``revoke(id)`` and does not run
    that task itself marks it ``REVOKED`` in the result backend when its state
    reads ``PENDING`` -- which is the state of a running task unless
    ``task_track_started`` is on. Two cases go wrong for a singleton run:

    * without ``terminate``, a worker that holds another delivery of the message
      (an ``acks_late`` redelivery, a re-publish with the same id) while the
      original runs under its lock elsewhere would overwrite the original's
      state until its real result replaces it. For such ids this worker only
      flags the copy as revoked (it is discarded when it comes up, storing
      nothing: :meth:`.request.SingletonRequest._announce_revoked`);
    * with ``terminate``, every other worker would record ``REVOKED`` as the
      signal is sent, before the run's child is gone and its lock free: a
      caller who saw it and submitted the key again would be skipped. A worker
      that knows nothing of the id only flags it revoked (as before Celery
      5.6); the worker that runs it records ``REVOKED`` once its lock is free,
      and one that receives the message later discards it and records it then.

    A worker that holds the id (and runs it, or holds its only delivery) does what
    Celery does. The ``terminate`` control command (``celery control terminate``)
    calls Celery's revoke directly: it is guarded the same way.
    """
    from celery.worker import control
    from celery.worker import state as worker_state
    from kombu.utils.functional import maybe_list

    original = control.Panel.data.get("revoke")
    if original is None or getattr(original, "_singleton_guard", False):
        return

    def revoke(state: Any, task_id: Any, terminate: bool = False, signal: Any = None, **kwargs: Any) -> Any:
        ids = set(maybe_list(task_id) or [])
        copies = {i for i in ids if _copy_of_a_running_original(worker_state, i)}
        if copies:
            logger.warning("revoke of %s: another delivery of the same message runs under its lock; the copy "
                           "here is discarded, the original's state is left alone", ", ".join(sorted(copies)))
        # With terminate, a worker that knows nothing of an id leaves its state alone too.
        left_alone = copies | ({i for i in ids if i not in worker_state.requests} if terminate else set())
        if left_alone:
            worker_state.revoked.update(left_alone)
            if not ids - left_alone:
                return {"ok": "terminate: tasks unknown" if terminate else f"tasks {left_alone} flagged as revoked"}
            task_id = list(ids - left_alone)
        running = _terminate_here(state, worker_state, ids - left_alone, signal) if terminate else set()
        rest = ids - left_alone - running
        if running and not rest:
            return {"ok": f"terminate: {', '.join(sorted(running))}"}
        return original(state, list(rest) if running else task_id, terminate=terminate, signal=signal, **kwargs)

    def terminate(state: Any, signal: Any, task_id: Any, **kwargs: Any) -> Any:
        return revoke(state, task_id, terminate=True, signal=signal)

    guards: tuple[tuple[str, Any], ...] = (("revoke", revoke), ("terminate", terminate))
    for command, guarded in guards:
        if command in control.Panel.data:  # ``terminate`` calls Celery's revoke directly: guarded too
            guarded._singleton_guard = True
            guarded.__doc__ = control.Panel.data[command].__doc__
            control.Panel.data[command] = guarded


def _terminate_here(state: Any, worker_state: Any, ids: set[str], signal: Any) -> set[str]:
    """Terminate the singleton runs of ``ids`` that this worker runs now; their ids.

    Celery before 5.7 marks every revoked id ``REVOKED`` in the result backend as the
    signal is sent, the one running here included; the run's own request records it
    once its pool child is gone and its lock free (:meth:`.request.SingletonRequest.terminate`).
    """
    from celery.worker import control

    running = {i for i in ids if isinstance(request := worker_state.requests.get(i), SingletonRequest)
               and request in worker_state.active_requests}
    if running:
        worker_state.revoked.update(running)
        signum = platform_signals.signum(signal or TERM_SIGNAME)
        for task_id in sorted(running):
            control.logger.info("Terminating %s (%s)", task_id, signum)
            worker_state.requests[task_id].terminate(state.consumer.pool, signal=signum)
    return running


def _copy_of_a_running_original(worker_state: Any, task_id: str) -> bool:
    """This worker holds a delivery of ``task_id`` that is not running, while a run of that id holds the lock."""
    request = worker_state.requests.get(task_id)
    return (isinstance(request, SingletonRequest) and request not in worker_state.active_requests
            and original_running(request) is not None)


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
        worker_pool_is(worker.pool_cls)
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
            _let_pool_processes_go(getattr(worker.pool, "_pool", None))

    def close(self, worker: Any) -> None:
        """The worker stops, however (a signal, ``celery control shutdown``, an
        unrecoverable error): runs waiting for the lock Redis end their wait
        (:mod:`.outage`) instead of holding the pool's shutdown until Redis answers.
        Called before any step stops, so before the pool waits for its runs."""
        outage.worker_stops()


#: What a pool process's count of results read is set to once nothing reads them (a C int).
_ALL_READ = 2**31 - 1


def _let_pool_processes_go(pool: Any) -> None:
    """At a shutdown, let billiard's pool processes exit once their main process stopped
    reading their results, instead of 30 s later or never (idempotent; a no-op on a
    billiard without that reading).

    At a warm shutdown the consumer closes first, and Celery's pool forgets the jobs
    whose process had not yet reported taking them up (the broker delivers them again);
    a job already written into a process's pipe still runs there. When the pool stops,
    its main process reads results only while it still knows a job
    (``on_stop_not_started``), then waits for its processes to exit. A forgotten job's
    result is never read, so:

    * a pool process that ends waits until its main process has counted every result it
      sent (``on_ready_counter``), up to 300 looks 0.1 s apart: the worker took 30 s more
      to exit. Once that reading is over nothing counts results any more, so every count
      is set to "all read";
    * a result larger than the pipe holds (64 KiB on Linux; the exception information of
      a failure or a retry is often that large, see :func:`_read_until_processes_exit`)
      blocks its pool process in the write for good, and the worker never exited. The
      main process goes on reading, and dropping, what its processes write until each
      has exited.
    """
    handler = getattr(pool, "_result_handler", None)
    counts = getattr(pool, "_on_ready_counters", None)
    if handler is None or not isinstance(counts, dict) or getattr(handler, "_singleton_lets_go", False):
        return
    read_until_known_jobs_done = handler.on_stop_not_started

    def on_stop_not_started() -> None:
        try:
            read_until_known_jobs_done()
        finally:
            for count in list(counts.values()):
                with count.get_lock():
                    count.value = _ALL_READ
        _read_until_processes_exit(pool)

    handler.on_stop_not_started = on_stop_not_started
    handler._singleton_lets_go = True


#: Bytes read from a pool process's result pipe at once when nothing uses them any more.
_DROP_CHUNK = 1 << 16


def _read_until_processes_exit(pool: Any) -> None:
    """Read, and drop, what ``pool``'s processes write to their main process until each
    has exited (or the pool is terminated): no result is awaited any more.

    A pool process sends each result whole, and a result larger than its pipe holds
    waits in the write for its main process to read. The exception information of a
    failure or a retry carries, on Python 3.11 and later, the position of every
    instruction of every function on its traceback (billiard's ``ExceptionInfo``):
    a ``SingletonTask`` retried because its lock Redis did not answer sends about
    76 KB. A process that has exited closes its end of its sentinel pipe, which is
    then readable.
    """
    watched: dict[int, tuple[Any, int]] = {}  # sentinel -> (process, its result pipe)
    for process in list(getattr(pool, "_pool", ())):
        popen = getattr(process, "_popen", None)
        try:
            results = process.outq._reader.fileno()
        except (AttributeError, OSError, ValueError):  # its queues are gone: nothing to read
            continue
        if popen is not None and popen.sentinel is not None and popen.poll() is None:
            watched[popen.sentinel] = (process, results)
    with selectors.DefaultSelector() as selector:

        def forget(fd: int) -> None:
            if fd in selector.get_map():
                selector.unregister(fd)

        def gone(process: Any) -> bool:  # exited (reaped here or by another thread)
            popen = process._popen
            return popen is None or popen.poll() is not None

        for fd in {fd for sentinel, (_, results) in watched.items() for fd in (sentinel, results)}:
            selector.register(fd, selectors.EVENT_READ)
        while watched and getattr(pool, "_state", None) != TERMINATE:
            for key, _ in selector.select(timeout=1.0):
                if key.fd in watched:  # its sentinel: exited
                    forget(watched.pop(key.fd)[1])
                    forget(key.fd)
                    continue
                try:
                    if not os.read(key.fd, _DROP_CHUNK):  # end of file: nothing more comes
                        forget(key.fd)
                except BlockingIOError:
                    pass
                except OSError:  # closed: nothing more comes from there
                    forget(key.fd)
            # A sentinel another process still holds open (a child of the pool process)
            # never becomes readable: look at each process once a second as well.
            for sentinel, (process, results) in list(watched.items()):
                if gone(process):
                    del watched[sentinel]
                    forget(sentinel)
                    forget(results)


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
