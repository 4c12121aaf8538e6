"""Worker side of beat slots: a slot's message is executed once, whoever sent it.

Normally one beat sends each slot. When a beat dies after publishing a slot
but before marking it sent, another beat takes the slot over and sends it
again (see :mod:`celery_singleton_beat.beat.claims`). Both messages carry the
same task id, derived from the slot. This consumer step looks at every task
message before the worker accepts it: a message with a slot claim header is
accepted only if it comes from the beat instance that holds the claim, and
the first acceptance pins that instance (``received``). A copy sent by any
other instance is acknowledged and dropped, with a WARNING, a ``task-skipped``
event and the ``duplicates_dropped`` counter of the entry. It stores no state,
so the executed copy's result (same task id) stands.

Redeliveries of the accepted message (``acks_late``, visibility timeout) come
from the same instance and are not dropped here. It works for any task, not
only :class:`~celery_singleton_beat.SingletonTask`: the worker needs this step,
which :func:`celery_singleton_beat.install` adds (apps with a singleton task
get it without asking).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from celery import bootsteps

from .beat.claims import receive_slot
from .beat.entries import CLAIM_HEADER, ENTRY_HEADER, INSTANCE_HEADER, SLOT_HEADER
from .client import get_redis
from .config import SingletonSettings, get_settings
from .events import TASK_SKIPPED, logger
from .keys import beat_stats_key

__all__ = ["SlotDeliveryStep"]

_GUARDED = "_singleton_slot_guard"


class SlotDeliveryStep(bootsteps.StartStopStep):
    """Consumer step: wraps each task's message handler with the slot check."""

    label = "singleton-slots"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        # Runs after Tasks built the handlers (again after each reconnection).
        settings = get_settings(c.app)
        for name, handler in list(c.strategies.items()):
            if not getattr(handler, _GUARDED, False):
                c.strategies[name] = _guard(c, handler, settings)


def _guard(c: Any, handler: Callable[..., Any], settings: SingletonSettings) -> Callable[..., Any]:
    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                   **kwargs: Any) -> Any:
        headers = message.headers or {}
        if headers.get(CLAIM_HEADER) and headers.get(INSTANCE_HEADER) \
                and not _first_delivery(c, headers, settings):
            ack(logger, c.connection_errors)
            return None
        return handler(message, body, ack, reject, callbacks, **kwargs)

    setattr(on_message, _GUARDED, True)
    return on_message


def _first_delivery(c: Any, headers: dict[str, Any], settings: SingletonSettings) -> bool:
    """True to run the message; False for a second delivery of its slot (logged, counted)."""
    key, instance = str(headers[CLAIM_HEADER]), str(headers[INSTANCE_HEADER])
    entry = headers.get(ENTRY_HEADER)
    stats = beat_stats_key(settings.key_prefix, str(entry)) if settings.stats and entry else None
    try:
        run, holder = receive_slot(get_redis(c.app), key, instance, str(c.hostname),
                                   round(settings.done_ttl * 1000), stats)
    except redis.RedisError as exc:
        logger.warning("%s[%s]: could not check beat slot %s (%s); running it",
                       headers.get("task"), headers.get("id"), key, exc)
        return True
    if run:
        return True
    winner = (holder or {}).get("instance", "another beat")
    summary = (f"dropped: beat slot {headers.get(SLOT_HEADER)} was already delivered "
               f"(sent by {winner}; this copy by {instance})")
    logger.warning("%s[%s] %s", headers.get("task"), headers.get("id"), summary)
    dispatcher = getattr(c, "event_dispatcher", None)
    if dispatcher is not None and getattr(dispatcher, "enabled", False):
        try:
            dispatcher.send(TASK_SKIPPED, uuid=headers.get("id"), key=key, holder_node=winner,
                            reason="beat-slot-duplicate", result=summary)
        except Exception as exc:  # events are best effort, like Celery's own
            logger.warning("could not send %s event: %s", TASK_SKIPPED, exc)
    return False
