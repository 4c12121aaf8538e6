"""Slot messages that wait for their check, and their holding while Redis does not answer.

:class:`SlotHolding` is the base of :class:`~.slot_delivery.SlotGate`, which holds
the state used here (set in its ``__init__``), takes the messages in and checks them
in order. When a check fails (fail closed), every waiting message is held and the
first is checked again after a back-off (:data:`RETRY_MIN` doubling to
:data:`RETRY_MAX`); a delivery of a message that waits (kombu restored it past the
Redis broker's ``visibility_timeout``, or the beat published it twice) takes the
place of the one that waits. Apart from the gate because it is what becomes of a
message while it waits (mostly: while Redis is away), not how it is checked, run or
dropped.

What a waiting message is (:class:`_Delivery`, :class:`_Waiting`) and the header
helpers are here too: the gate builds on them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..log import logger
from .slot_receive import CLAIM_HEADER, INSTANCE_HEADER

__all__ = ["RETRY_MAX", "RETRY_MIN", "SlotHolding"]

#: Seconds between checks of held slot messages while Redis does not answer (doubling).
RETRY_MIN, RETRY_MAX = 1.0, 30.0


@dataclass
class _Delivery:
    """A slot message and what Celery handed over with it (to run or drop it later)."""

    handler: Callable[..., Any]
    message: Any
    body: Any
    ack: Any
    reject: Any
    callbacks: Any
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, Any]:
        return self.message.headers or {}

    def run(self) -> Any:
        return self.handler(self.message, self.body, self.ack, self.reject, self.callbacks, **self.kwargs)


@dataclass
class _Waiting:
    """A slot message waiting for its check (or held), in arrival order. A delivery of the
    same message that comes meanwhile takes the place of ``delivery``."""

    delivery: _Delivery
    held: bool = False  # logged as held: its check (or one ahead of it) failed


class SlotHolding:
    """The holding of a gate's waiting messages while Redis does not answer (see the
    module docstring)."""

    # Set by SlotGate.__init__.
    c: Any
    _queue: deque[_Waiting]
    _lock: threading.RLock
    _timer: Any
    _holding: bool
    _delay: float

    def _pump(self) -> None:
        raise NotImplementedError  # SlotGate

    # ----------------------------------------------------------------- holding

    def _hold(self, exc: BaseException) -> None:
        """The first waiting message's check failed (fail closed): every waiting message is
        held, and the first is checked again after a back-off."""
        again = self._queue[0].held
        for index, waiting in enumerate(self._queue):
            if waiting.held:
                continue
            waiting.held = True
            if index == 0:
                logger.warning("%s[%s]: could not check beat slot %s (%s); holding the message "
                               "until Redis answers (fail closed)", *_names(waiting.delivery.headers), exc)
            else:
                logger.warning("%s[%s]: beat slot %s waits for Redis behind %d held message(s)",
                               *_names(waiting.delivery.headers), index)
        self._holding = True
        self._delay = min(max(self._delay * 2, RETRY_MIN), RETRY_MAX)
        self._timer = self.c.timer.call_after(self._delay, self._retry)
        if again:
            logger.info("beat slot checks: Redis still unavailable (%s); %d message(s) held, next "
                        "check in %.0fs", exc, len(self._queue), self._delay)

    def _retry(self) -> None:
        with self._lock:
            self._timer = None  # this call
        self._pump()

    def _cancel_timer(self) -> None:
        try:
            self.c.timer.cancel(self._timer)
        except Exception as exc:  # the timer may be stopping with the worker
            logger.debug("could not cancel the beat slot check: %r", exc)
        self._timer = None

    def _replace(self, delivery: _Delivery) -> bool:
        """True if a delivery of the same message waits: the newer delivery takes its place.

        Redis broker, held past visibility_timeout: kombu restored the message, which keeps
        its delivery tag (acknowledging the old delivery would acknowledge the new one).
        Another message of the same id and beat (a publish sent twice) is acknowledged: one
        copy of it is enough. A check under way for the old delivery answers for the new.
        """
        same = _identity(delivery.headers)
        for waiting in self._queue:
            if _identity(waiting.delivery.headers) != same:
                continue
            old, waiting.delivery = waiting.delivery, delivery
            if getattr(old.message, "delivery_tag", None) != getattr(delivery.message, "delivery_tag", None):
                old.ack(logger, self.c.connection_errors)
            logger.info("%s[%s]: beat slot %s delivered again while held; one copy kept",
                        *_names(delivery.headers))
            return True
        return False


def _identity(headers: dict[str, Any]) -> tuple[Any, Any]:
    """What makes two deliveries one message: task id and sending beat instance."""
    return headers.get("id"), headers.get(INSTANCE_HEADER)


def _names(headers: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Task name, task id and claim key of a slot message, for log lines."""
    return headers.get("task"), headers.get("id"), headers.get(CLAIM_HEADER)
