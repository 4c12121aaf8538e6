"""Worker side of beat slots: a slot's message is executed once, whoever sent it.

Normally one beat sends each slot. When a beat dies after publishing a slot
but before marking it sent, another beat takes the slot over and sends it
again (see :mod:`celery_singleton_beat.beat.claims`). Both messages carry the
same task id, derived from the slot. This consumer step looks at every task
message before the worker accepts it: a message with a slot claim header is
accepted only if it comes from the beat instance that holds the claim (or the
claim was handed back unsent, ``released``), and the first acceptance pins
that instance (``received``; :func:`~.slot_receive.receive_slot`). A copy sent by
any other instance is acknowledged and dropped, with a WARNING, a ``task-skipped``
event and the ``duplicates_dropped`` counter of the entry. It stores no state, so
the executed copy's result (same task id) stands.

Redeliveries of the accepted message (``acks_late``, visibility timeout) come
from the same instance and pass the claim check; on the connection that already
ran or dropped that message they are settled as described at the end. It works for any task, not
only :class:`~celery_singleton_beat.SingletonTask`: the worker needs this step,
which :func:`celery_singleton_beat.install` adds (apps with a singleton task
get it without asking).

**Where the check runs.** The check is a Redis script. With Celery's event loop
(the kombu hub of the prefork, threads and solo pools) it runs on a thread of the
connection's own (:class:`~.slot_checker.SlotChecker`), never in the loop: a lock
Redis that does not answer (writes paused, a stalled connection) would otherwise
hold the whole loop for the lock connection's socket timeout, and with it the
messages handed to the pool, the results read and the ``acks_late``
acknowledgements sent. The outcome comes back to the loop through a pipe the hub
watches, and the message is run (handed to Celery's handler) or dropped on the loop,
the only thread that may touch Celery's and kombu's objects. Slot messages are
checked one at a time, in the order they arrived: a message that arrives while
earlier ones wait (being checked, or held) waits behind them, without a Redis call
of its own until its turn. Each waiting message is counted outside the prefetch
limit (as Celery does for ETA tasks), so plain tasks keep coming meanwhile. Without
the event loop (the gevent and eventlet pools, whose consumer is Celery's
synchronous loop, and transports without asynchronous support) the check runs
inline as before: in a green pool a check that waits on its (green) socket lets
the other greenlets run, and a real thread there would need a wake-up the green hub
does not offer; with a synchronous transport the loop waits for the check.

**Redis unreachable** (the check raises): with ``singleton_beat_fail_open``
(``None``: ``singleton_fail_open``) the message runs unchecked, as beats then
send unclaimed slots. By default (fail closed) the worker *holds* it: neither
run nor acknowledged, counted outside the prefetch limit, and checked again
after a back-off (:data:`RETRY_MIN` doubling to :data:`RETRY_MAX`). While
messages are held, later slot messages are held behind them without asking
Redis, and one check per back-off is the only Redis call. When Redis answers,
the held messages are handled in order. A held message is never requeued by
the worker (on RabbitMQ a requeued message comes straight back: a hot loop);
if the worker loses its broker connection or stops, the broker delivers it
again as any unacknowledged message: RabbitMQ at once, Redis when kombu
restores it (at once if the worker can still reach the broker as it closes the
channel, else after ``visibility_timeout``). A check still under way then is
left to end on its own: its outcome is not used (the message is the broker's
again). A message held past the Redis broker's ``visibility_timeout`` is
delivered again by kombu while the worker still holds it; the worker keeps one
of the two deliveries.

**A delivery of a slot message this connection already ran or dropped**
(kombu's restore read a held message just before the worker settled it, and
put a copy back; or the same beat published it twice) is not run again, nor
counted again as a duplicate send: it is
acknowledged and dropped once the run's message was acknowledged or rejected
for good, and left alone while that message is still unacknowledged with the
same delivery tag (``acks_late``: its settling settles both). A message the
worker gave back (rejected with requeue) is run again when it returns, as any
message.

The holding, and a delivery that takes the place of one that waits, are in
:class:`SlotGate`'s base, :class:`~.slot_holding.SlotHolding`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis
from celery import bootsteps
from celery.exceptions import InvalidTaskError
from kombu.exceptions import ContentDisallowed, DecodeError

from ..config import SingletonSettings, get_settings
from ..log import logger
from ..recovery.lock_redis import get_redis
from .events import TASK_SKIPPED
from .keys import beat_stats_key
from .slot_checker import Outcome, checker_for
from .slot_holding import RETRY_MAX, RETRY_MIN, SlotHolding, _Delivery, _identity, _names, _Waiting
from .slot_receive import (
    CLAIM_HEADER,
    ENTRY_HEADER,
    INSTANCE_HEADER,
    RECEIVE_SCRIPT,
    SLOT_HEADER,
    parse_claim,
    receive_slot,
)

__all__ = ["CLAIM_HEADER", "ENTRY_HEADER", "INSTANCE_HEADER", "RECEIVE_SCRIPT", "RETRY_MAX", "RETRY_MIN", "SLOT_HEADER",
           "SlotDeliveryStep", "SlotGate", "parse_claim", "receive_slot"]

_GUARDED = "_singleton_slot_guard"
#: Settled slot messages a connection remembers having run or dropped (the latest).
RAN_REMEMBERED = 1024


class SlotDeliveryStep(bootsteps.StartStopStep):
    """Consumer step: wraps each task's message handler with the slot check."""

    label = "singleton-slots"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.gate: SlotGate | None = None

    def start(self, c: Any) -> None:
        # Runs after Tasks built the handlers (again after each reconnection). A
        # new connection gets a new gate: what an old one held is the broker's again.
        self.gate = SlotGate(c, get_settings(c.app))
        for name, handler in list(c.strategies.items()):
            if not getattr(handler, _GUARDED, False):
                c.strategies[name] = _guard(self, handler)

    def stop(self, c: Any) -> None:
        if self.gate is not None:
            self.gate.close()

    def shutdown(self, c: Any) -> None:
        self.stop(c)


def _guard(step: SlotDeliveryStep, handler: Callable[..., Any]) -> Callable[..., Any]:
    def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                   **kwargs: Any) -> Any:
        headers = message.headers or {}
        gate = step.gate
        if gate is None or not (headers.get(CLAIM_HEADER) and headers.get(INSTANCE_HEADER)):
            return handler(message, body, ack, reject, callbacks, **kwargs)
        return gate.on_message(_Delivery(handler, message, body, ack, reject, callbacks, kwargs))

    setattr(on_message, _GUARDED, True)
    return on_message


class SlotGate(SlotHolding):
    """The slot check of one consumer connection, and the messages waiting for it
    (see the module docstring).

    ``_queue`` holds the messages not yet run or dropped, in arrival order, each counted
    outside the prefetch limit; only the first is checked (``_busy`` while its check is
    under way), and none while a back-off timer runs (``_timer``). With an event loop
    every method runs on the loop's thread; without one, timers may run on another
    thread (or greenlet), hence the lock, never held across a Redis call.
    """

    def __init__(self, c: Any, settings: SingletonSettings) -> None:
        self.c = c
        self.settings = settings
        self._app = c.app
        self._hostname = str(c.hostname)
        self._queue: deque[_Waiting] = deque()
        self._lock = threading.RLock()
        self._busy = False
        self._timer: Any = None
        self._holding = False  # the last check failed (fail closed): back off
        self._delay = 0.0
        self._closed = False
        # Slot messages this connection ran or dropped, by identity.
        self._seen: OrderedDict[tuple[Any, Any], _Seen] = OrderedDict()
        self._checker = checker_for(getattr(c, "hub", None))

    def on_message(self, delivery: _Delivery) -> None:
        with self._lock:
            if self._seen_here(delivery) or self._replace(delivery):
                return
            waiting = _Waiting(delivery)
            self._queue.append(waiting)
            self._count(1)
            if self._holding:  # Redis did not answer: wait behind them, ask nothing now
                waiting.held = True
                logger.warning("%s[%s]: beat slot %s waits for Redis behind %d held message(s)",
                               *_names(delivery.headers), len(self._queue) - 1)
        self._pump()

    def close(self) -> None:
        """The connection is gone (or the worker stops): what waits is the broker's again,
        and a check still under way is not used."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._timer is not None:
                self._cancel_timer()
            if self._checker is not None:
                self._checker.close()
            if self._queue:
                logger.warning("%d beat slot message(s) held for the slot check are left to the "
                               "broker, which delivers them again", len(self._queue))
                self._count(-len(self._queue))
                self._queue.clear()

    # ----------------------------------------------------------------- checking, in order

    def _pump(self) -> None:
        """Check the first waiting message unless a check or a back-off is under way: on the
        checker's thread (the outcome comes back to :meth:`_on_outcome`), or here and now
        without an event loop, message after message."""
        while True:
            with self._lock:
                if self._closed or self._busy or self._timer is not None or not self._queue:
                    return
                self._busy = True
                waiting = self._queue[0]
                headers = dict(waiting.delivery.headers)
                checker = self._checker
            if checker is not None:
                checker.submit(partial(self._ask, headers), partial(self._on_outcome, waiting))
                return
            outcome: Outcome
            try:
                outcome = self._ask(headers)
            except Exception as exc:
                outcome = exc
            except BaseException:  # a greenlet killed in its check: the next message may check
                with self._lock:
                    self._busy = False
                raise
            settled = self._settle(waiting, outcome)
            if settled is not None:
                self._dispatch(*settled)

    def _on_outcome(self, waiting: _Waiting, outcome: Outcome) -> None:
        """On the loop: the checker's thread answered for ``waiting``."""
        try:
            settled = self._settle(waiting, outcome)
            if settled is not None:
                self._dispatch(*settled)
        finally:
            self._pump()

    def _settle(self, waiting: _Waiting, outcome: Outcome) -> tuple[_Delivery, bool] | None:
        """What to do with ``waiting`` after its check: ``(delivery, run)``, or None when it
        stays (held) or is no longer the gate's (closed)."""
        with self._lock:
            self._busy = False
            if self._closed or not self._queue or self._queue[0] is not waiting:
                return None
            delivery = waiting.delivery
            holder: dict[str, Any] | None = None
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, redis.RedisError):
                    logger.error("%s[%s]: the check of beat slot %s failed", *_names(delivery.headers),
                                 exc_info=outcome)
                if not self.settings.beat_fails_open:
                    self._hold(outcome)
                    return None
                logger.warning("%s[%s]: could not check beat slot %s (%s); running it "
                               "(fail open)", *_names(delivery.headers), outcome)
                run = True
            else:
                run, holder = outcome
                if self._holding:
                    self._holding, self._delay = False, 0.0
                    logger.info("beat slot checks: Redis answers again; %d held message(s) handled in order",
                                sum(1 for other in self._queue if other.held))
            self._queue.popleft()
            self._count(-1)
            self._remember(delivery, ran=run)
        if not run:
            self._report_drop(delivery.headers, holder)
        return delivery, run

    def _ask(self, headers: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
        """The check itself (on the checker's thread with an event loop): ``(True, None)`` to
        run the message, ``(False, holder)`` for a second delivery of its slot. Raises
        ``redis.RedisError`` when Redis cannot answer."""
        settings = self.settings
        key, instance = str(headers[CLAIM_HEADER]), str(headers[INSTANCE_HEADER])
        entry = headers.get(ENTRY_HEADER)
        stats = beat_stats_key(settings.key_prefix, str(entry)) if settings.stats and entry else None
        return receive_slot(get_redis(self._app), key, instance, self._hostname,
                            round(settings.done_ttl * 1000), stats)

    def _dispatch(self, delivery: _Delivery, run: bool) -> None:
        """Run or drop a checked message; Celery's errors for a bad message apply."""
        if not run:
            self._drop(delivery)
            return
        try:
            delivery.run()
        except (InvalidTaskError, ContentDisallowed) as exc:
            self.c.on_invalid_task(None, delivery.message, exc)
        except DecodeError as exc:
            self.c.on_decode_error(delivery.message, exc)

    def _count(self, n: int) -> None:
        """Waiting messages do not take the place of other tasks (the prefetch limit)."""
        qos = getattr(self.c, "qos", None)
        if qos is None or n == 0:
            return
        if n > 0:
            qos.increment_eventually(n)
        else:
            qos.decrement_eventually(-n)

    # ----------------------------------------------------------------- deliveries of a message seen before

    def _remember(self, delivery: _Delivery, ran: bool) -> None:
        """Remember ``delivery`` as run (or dropped) here, and whether Celery gives it back.

        Celery rejects a run's message through the ``reject`` callback it was handed,
        with ``requeue=True`` only when the message goes back to the queue (kombu's
        message state says REJECTED either way). Settled messages beyond
        :data:`RAN_REMEMBERED` are forgotten, oldest first; a run whose message is
        still unacknowledged is kept (the pool's size bounds those).
        """
        seen = _Seen(delivery.message, ran)
        if ran:
            reject = delivery.reject

            def reject_noting_requeue(*args: Any, **kwargs: Any) -> Any:
                seen.requeued = bool(kwargs.get("requeue", args[2] if len(args) > 2 else False))
                return reject(*args, **kwargs)

            delivery.reject = reject_noting_requeue
        identity = _identity(delivery.headers)
        self._seen[identity] = seen
        self._seen.move_to_end(identity)
        if len(self._seen) > RAN_REMEMBERED:
            settled = next((key for key, old in self._seen.items() if old.settled), None)
            if settled is not None:
                del self._seen[settled]

    def _seen_here(self, delivery: _Delivery) -> bool:
        """True (and the delivery settled) for another delivery of a message this
        connection ran or dropped.

        What became of that message decides: given back to the queue (rejected with
        requeue), the delivery runs again, as Celery would. Acknowledged, or rejected
        for good, the delivery is a leftover (kombu restored the message just before
        it was settled, or the beat published it twice): acknowledged and dropped, and
        not counted again as a duplicate send. Unsettled with the same delivery tag
        (``acks_late``, still running): the run's settling settles this delivery too,
        so it is left alone.
        """
        identity = _identity(delivery.headers)
        seen = self._seen.get(identity)
        if seen is None:
            return False
        if seen.requeued:
            del self._seen[identity]
            return False
        same_tag = getattr(seen.message, "delivery_tag", None) == getattr(delivery.message, "delivery_tag", None)
        if not seen.settled and same_tag:
            logger.info("%s[%s]: beat slot %s delivered again while its run's message is "
                        "unacknowledged; that acknowledgement settles this delivery", *_names(delivery.headers))
            return True
        logger.info("%s[%s]: beat slot %s delivered again after this worker %s it; dropped",
                    *_names(delivery.headers), "ran" if seen.ran else "dropped")
        self._drop(delivery)
        return True

    # ----------------------------------------------------------------- reporting

    def _report_drop(self, headers: dict[str, Any], holder: dict[str, Any] | None) -> None:
        winner = (holder or {}).get("instance", "another beat")
        summary = (f"dropped: beat slot {headers.get(SLOT_HEADER)} was already delivered "
                   f"(sent by {winner}; this copy by {headers.get(INSTANCE_HEADER)})")
        logger.warning("%s[%s] %s", headers.get("task"), headers.get("id"), summary)
        dispatcher = getattr(self.c, "event_dispatcher", None)
        if dispatcher is not None and getattr(dispatcher, "enabled", False):
            try:
                dispatcher.send(TASK_SKIPPED, uuid=headers.get("id"), key=headers.get(CLAIM_HEADER),
                                holder_node=winner, reason="beat-slot-duplicate", result=summary)
            except Exception as exc:  # events are best effort, like Celery's own
                logger.warning("could not send %s event: %s", TASK_SKIPPED, exc)

    def _drop(self, delivery: _Delivery) -> None:
        delivery.ack(logger, self.c.connection_errors)


@dataclass
class _Seen:
    """A slot message this connection ran or dropped, and whether Celery gave it back."""

    message: Any
    ran: bool
    requeued: bool = False

    @property
    def settled(self) -> bool:
        """Acknowledged or rejected (kombu's ACK_STATES): its delivery tag is no longer held."""
        return bool(getattr(self.message, "acknowledged", False))
