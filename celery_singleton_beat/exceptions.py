"""Exceptions raised by celery-singleton-beat.

Every exception derives from :class:`SingletonError`, so callers can catch the
library's failures in one place. Configuration problems use Celery's own
:class:`~celery.exceptions.ImproperlyConfigured` so they look like any other
Celery set-up error.
"""

from __future__ import annotations

from typing import Any

# Every exception keeps its constructor arguments in ``args`` (plain strings) so
# Celery's JSON result serializer can rebuild it in the caller's process.
from celery.exceptions import ImproperlyConfigured, TaskRevokedError

__all__ = [
    "DuplicateTaskError",
    "ImproperlyConfigured",
    "LockLost",
    "LockUnavailable",
    "SingletonError",
    "SingletonKeyError",
    "TaskSkipped",
]


class SingletonError(Exception):
    """Base class of every error raised by this library."""


class SingletonKeyError(SingletonError, TypeError):
    """An argument cannot be encoded into a stable lock key.

    Raised with the task name and the argument name, so the fix is obvious:
    pass an encodable value, or leave the argument out through ``unique_on``.
    """

    def __init__(self, task_name: str, argument: str, value: Any, reason: str) -> None:
        # args are plain strings so the error survives Celery's JSON result encoding.
        super().__init__(task_name, argument, repr(value), reason)
        self.task_name, self.argument, self.value, self.reason = task_name, argument, value, reason

    def __str__(self) -> str:
        return (
            f"{self.task_name}: argument {self.argument!r} cannot be part of a singleton key: "
            f"{self.reason} (value {self.args[2]}). Pass a JSON-like value (str, int, float, "
            f"bool, None, list, tuple, dict, UUID, date, datetime, Decimal, bytes) or leave "
            f"the argument out with unique_on."
        )


class DuplicateTaskError(SingletonError):
    """Another run (or queued message) already holds the lock for these arguments.

    Raised when ``on_conflict="raise"``. ``holder_task_id`` names the run that
    holds the lock, ``key`` the Redis key.
    """

    def __init__(self, task_name: str, key: str, holder_task_id: str | None) -> None:
        super().__init__(task_name, key, holder_task_id)
        self.task_name, self.key, self.holder_task_id = task_name, key, holder_task_id

    def __str__(self) -> str:
        return f"{self.task_name}: duplicate of task {self.holder_task_id} which holds {self.key}"


class TaskSkipped(TaskRevokedError, SingletonError):
    """The stored outcome of a run skipped as a duplicate (``on_conflict="skip"``).

    The run is recorded as ``REVOKED`` with this exception, a state Celery
    treats as ready: ``AsyncResult.get()`` raises it (it is a
    :class:`~celery.exceptions.TaskRevokedError`), a chain stops and its
    remaining tasks are marked ``REVOKED`` too, a chord never runs its body and
    its result raises this exception. Flower shows ``SKIPPED`` (the ``task-skipped`` event).
    """

    def __init__(self, task_name: str, key: str, holder_task_id: str | None) -> None:
        super().__init__(task_name, key, holder_task_id)
        self.task_name, self.key, self.holder_task_id = task_name, key, holder_task_id

    def __str__(self) -> str:
        return f"{self.task_name}: skipped, duplicate of task {self.holder_task_id} which holds {self.key}"


class LockLost(SingletonError):
    """The run can no longer vouch for its lease: it was lost (expired, deleted or taken
    over), went unrenewed past its grace, or the run ended (its lock released).

    Raised by ``task.singleton_run.ensure_held()``; code that writes downstream can
    call it before committing, or pass ``task.singleton_run.fence`` to a store that
    rejects stale fencing tokens.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key, reason)
        self.key, self.reason = key, reason

    def __str__(self) -> str:
        return f"lock {self.key} lost: {self.reason}"


class LockUnavailable(SingletonError):
    """Redis could not be asked for the lock (connection refused, timeout, ...).

    With the default fail-closed policy the run does not start; the worker
    retries it later.
    """

    def __init__(self, key: str, cause: BaseException | str) -> None:
        super().__init__(key, str(cause))
        self.key, self.cause = key, str(cause)

    def __str__(self) -> str:
        return f"cannot reach Redis for lock {self.key}: {self.cause}"
