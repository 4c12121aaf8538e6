"""celery-singleton-beat: exactly-once Celery tasks and active-active beat.

Public API::

    from celery_singleton_beat import SingletonTask, SingletonScheduler
"""

from __future__ import annotations

from .exceptions import (
    DuplicateTaskError,
    LockLost,
    LockUnavailable,
    SingletonError,
    SingletonKeyError,
)
from .task import SingletonRun, SingletonTask

__all__ = [
    "DuplicateTaskError",
    "LockLost",
    "LockUnavailable",
    "SingletonError",
    "SingletonKeyError",
    "SingletonRun",
    "SingletonTask",
]

__version__ = "0.1.0"
