"""Making decisions visible: task events for Flower (the log lines are :mod:`..log`'s).

A skipped duplicate sends a ``task-skipped`` task event: Celery's event state
(and so Flower) turns ``task-<name>`` events into the state ``<NAME>``, so the
task shows up as ``SKIPPED`` with the holder's task id and the lock key in its
fields. A lease that ended before its run sends ``task-lock-lost``.

Flower keeps every field of an event on its task, but its task list, task page
and ``/api/tasks`` show only Celery's standard task fields (``result``,
``exception``, ...). So a ``task-skipped`` event also carries a one-line
``result`` naming the holder and the key: that is what an operator reads in
Flower's Result column, and what ``result:`` searches match.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from .. import native
from ..log import logger

__all__ = [
    "SKIPPED",
    "TASK_LOCK_LOST",
    "TASK_SKIPPED",
    "send_task_event",
    "send_task_event_soon",
    "skip_summary",
]

#: Flower's state of a run skipped because another run held its lock, derived by Celery's
#: event state from the ``task-skipped`` event; the result backend stores ``REVOKED``.
SKIPPED = "SKIPPED"
#: Task event of a skipped duplicate; fields: holder_task_id, key, holder_node, result.
TASK_SKIPPED = "task-skipped"
#: Task event of a run whose lease ended before it did; fields: key, reason.
TASK_LOCK_LOST = "task-lock-lost"


def skip_summary(holder_task_id: str | None, key: str | None, holder_node: str | None = None) -> str:
    """The one line Flower shows as the ``result`` of a skipped duplicate."""
    where = f" on {holder_node}" if holder_node else ""
    return f"skipped: duplicate of {holder_task_id or 'an unknown holder'}{where} holding {key}"


def send_task_event(task: Task, event_type: str, **fields: Any) -> None:
    """Send a task event about the current run; never fails the run.

    ``task-skipped`` events get a ``result`` summary (see the module docstring)
    unless the caller passes one. Eager runs have no worker to speak for them
    and send nothing.
    """
    request = task.request
    if request.is_eager or request.id is None:
        return
    if event_type == TASK_SKIPPED and "result" not in fields:
        fields["result"] = skip_summary(fields.get("holder_task_id"), fields.get("key"),
                                        fields.get("holder_node"))
    try:
        task.send_event(event_type, retry=False, **fields)
    except Exception as exc:  # events are best effort, like Celery's own
        logger.warning("could not send %s event for %s[%s]: %s", event_type, task.name, request.id, exc)


def send_task_event_soon(app: Celery, hostname: str | None, task_id: str, event_type: str,
                         **fields: Any) -> None:
    """Send a task event about ``task_id`` from a short-lived background thread.

    For decisions taken outside the task's own thread (the lease keeper
    noticing a lost lease): the keeper must not wait on the broker while other
    leases are due for renewal.
    """
    def send() -> None:
        try:
            if native.green():
                # A real OS thread (see .native): the app's producer pool belongs to
                # the hub's thread, so this thread uses a connection of its own.
                with app.connection_for_write() as connection, \
                        app.events.Dispatcher(connection, hostname=hostname) as dispatcher:
                    dispatcher.send(event_type, uuid=task_id, retry=False, **fields)
            else:
                with app.events.default_dispatcher(hostname=hostname) as dispatcher:
                    dispatcher.send(event_type, uuid=task_id, retry=False, **fields)
        except Exception as exc:  # events are best effort, like Celery's own
            logger.warning("could not send %s event for %s: %s", event_type, task_id, exc)

    native.start_thread(send, f"singleton-{event_type}")
