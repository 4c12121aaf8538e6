"""celery-singleton-beat: exactly-once Celery tasks and active-active beat.

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
