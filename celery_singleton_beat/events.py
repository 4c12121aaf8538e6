"""Making decisions visible: task events for Flower, and the library's logger.

A skipped duplicate sends a ``task-skipped`` task event: Celery's event state
(and so Flower) turns ``task-<name>`` events into the state ``<NAME>``, so the
task shows up as ``SKIPPED`` with the holder's task id and the lock key in its
fields. A lease that ended before its run sends ``task-lock-lost``.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task

__all__ = ["logger", "send_task_event", "TASK_SKIPPED", "TASK_LOCK_LOST", "SKIPPED"]

#: The library's single logger; every decision is one line on it.
logger = logging.getLogger("celery_singleton_beat")

#: Result/Flower state of a run skipped because another run held its lock.
SKIPPED = "SKIPPED"
TASK_SKIPPED = "task-skipped"
TASK_LOCK_LOST = "task-lock-lost"


def send_task_event(task: Task, event_type: str, **fields: Any) -> None:
    """Send a task event about the current run; never fails the run.

    Eager runs have no worker to speak for them and send nothing.
    """
    request = task.request
    if request.is_eager or request.id is None:
        return
    try:
        task.send_event(event_type, retry=False, **fields)
    except Exception as exc:  # events are best effort, like Celery's own
        logger.warning("could not send %s event for %s[%s]: %s", event_type, task.name, request.id, exc)
