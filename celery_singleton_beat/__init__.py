"""celery-singleton-beat: singleton Celery tasks and active-active beat, on Redis.

``SingletonTask`` runs at most one call at a time per task and arguments (a Redis
lease; a run cut short runs again, so it is not exactly once: see README,
"Guarantees and their limits"). ``SingletonScheduler`` lets several ``celery beat``
instances run the schedule, each slot sent once.

Public API::

    from celery_singleton_beat import SingletonTask, SingletonScheduler

``SingletonScheduler`` is also the beat scheduler alias ``-S singleton``.
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
from .task import SingletonRun, SingletonTask
from .worker import install

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

__version__ = "0.2.0"
