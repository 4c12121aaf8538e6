"""celery-singleton-beat: singleton Celery tasks and active-active beat, on Redis.

``SingletonTask`` runs at most one call at a time per task and arguments (a Redis
lease; a run cut short runs again, so it is not exactly once: see
docs/guarantees.md). ``SingletonScheduler`` lets several ``celery beat``
instances run the schedule, each slot sent once.

Public API::

    from celery_singleton_beat import SingletonTask, SingletonScheduler

``SingletonScheduler`` is also the beat scheduler alias ``-S singleton``.

The modules, in the order a task's run meets them (``beat/`` and ``admin/`` are
packages of their own: the beat side, and what the CLI reads and changes)::

    publish        apply_async: publish-time claims (lock_mode until_executed / until_executing)
    worker         the worker: liveness, and locks of pool children that died
    slot_delivery  a beat slot's message is accepted once, whichever beat sent it
      slot_holding   slot messages waiting for their check, held while Redis does not answer
    task           SingletonTask.__call__: the run between its acquire and its release
      run_settings   the settings, lock client and lock spec of its runs, kept on the task
      keys           the call's lock key (arguments bound and encoded canonically)
      config         the singleton_* settings;  client / redis_url: the lock Redis client
      lock           acquire one lock (one request); the names below, importable from it
        holder         the lock's value: who holds it (encoded, decoded)
        lease          LockSpec, Lease: renew, put back, release (how often, how long vouched)
        takeover       the take-over of a dead worker's lock
        behalf         releases on someone else's behalf, read_holder
        commands       each operation spelled for the server at hand (native or Lua), named replies
        scripts        the Lua of the fallbacks and the rare paths
        server         what the server is, its restarts and failovers (recovery windows)
        channel        this thread's connection: one blocking round trip per run
        lock_connection  that connection's life: replaced when closed, dropped when replies are left
        wire           requests written in one go, replies read in order
      keeper         renews running leases from a real OS thread (native: gevent/eventlet)
      liveness       which worker incarnations are alive (take-over evidence)
      conflicts      the key is held, or Redis cannot be asked: skip, raise, retry, wait
      run            task.singleton_run: held, fence, ensure_held()
      counters, events, exceptions: what is counted, shown to Flower and logged, raised
    startup        the lock Redis checked when a worker or beat starts
    cli, testing, contrib.django: operations, pytest helpers, django-celery-beat
"""

from __future__ import annotations

from .beat import SingletonScheduler, SingletonSchedulerMixin
from .exceptions import (
    DuplicateTaskError,
    LockLost,
    LockUnavailable,
    SingletonError,
    SingletonKeyError,
    TaskSkipped,
)
from .task.task import SingletonRun, SingletonTask
from .task.worker import install

__all__ = [
    "DuplicateTaskError",
    "LockLost",
    "LockUnavailable",
    "SingletonError",
    "SingletonKeyError",
    "SingletonRun",
    "SingletonScheduler",
    "SingletonSchedulerMixin",
    "SingletonTask",
    "TaskSkipped",
    "install",
]

#: The package version (pyproject.toml reads it from here; CHANGELOG.md names it).
__version__ = "0.3.0"
