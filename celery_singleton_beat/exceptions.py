"""Exceptions raised by celery-singleton-beat.

Every exception derives from :class:`SingletonError`, so callers can catch the
library's failures in one place. Configuration problems use Celery's own
:class:`~celery.exceptions.ImproperlyConfigured` so they look like any other
Celery set-up error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery.exceptions import ImproperlyConfigured

if TYPE_CHECKING:  # pragma: no cover
    from .lock import Holder

__all__ = [
    "DuplicateTaskError",
    "ImproperlyConfigured",
    "LockLost",
    "LockUnavailable",
    "SingletonError",
    "SingletonKeyError",
]


class SingletonError(Exception):
    """Base class of every error raised by this library."""


class SingletonKeyError(SingletonError, TypeError):
    """An argument cannot be encoded into a stable lock key.

    Raised with the task name and the argument name, so the fix is obvious:
    pass an encodable value, or leave the argument out through ``unique_on``.
    """

    def __init__(self, task_name: str, argument: str, value: Any, reason: str) -> None:
        self.task_name = task_name
        self.argument = argument
        self.value = value
        super().__init__(
            f"{task_name}: argument {argument!r} cannot be part of a singleton key: {reason} "
            f"(value {value!r} of type {type(value).__name__}). Pass a JSON-like value "
            f"(str, int, float, bool, None, list, tuple, dict, UUID, date, datetime, "
            f"Decimal, bytes) or leave the argument out with unique_on."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.task_name, self.argument, repr(self.value), "see message"))


class DuplicateTaskError(SingletonError):
    """Another run (or queued message) already holds the lock for these arguments.

    Raised when ``on_conflict="raise"``. ``holder_task_id`` names the run that
    holds the lock, ``key`` the Redis key.
    """

    def __init__(self, task_name: str, key: str, holder_task_id: str | None) -> None:
        self.task_name = task_name
        self.key = key
        self.holder_task_id = holder_task_id
        super().__init__(
            f"{task_name}: duplicate of task {holder_task_id} which holds {key}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.task_name, self.key, self.holder_task_id))


class LockLost(SingletonError):
    """The run's lease ended before the run did (expired, deleted or taken over).

    Raised by ``task.singleton.ensure_held()``; code that writes downstream can
    call it before committing, or pass ``task.singleton.fence`` to a store that
    rejects stale fencing tokens.
    """

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"lock {key} lost: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.reason))


class LockUnavailable(SingletonError):
    """Redis could not be asked for the lock (connection refused, timeout, ...).

    With the default fail-closed policy the run does not start; the worker
    retries it later.
    """

    def __init__(self, key: str, cause: BaseException | str) -> None:
        self.key = key
        self.cause = str(cause)
        super().__init__(f"cannot reach Redis for lock {key}: {cause}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.cause))


def describe_holder(holder: "Holder | None") -> str:
    """A short human description of a lock holder for log lines."""
    if holder is None:
        return "an unknown holder"
    return f"task {holder.task_id} on {holder.node} (pid {holder.pid})"
