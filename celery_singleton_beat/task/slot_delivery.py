"""Worker side of beat slots: a slot's message is executed once, whoever sent it.

Normally one beat sends each slot. When a beat dies after publishing a slot
but before marking it sent, another beat takes the slot over and sends it
again (see :mod:`celery_singleton_beat.beat.claims`). Both messages carry the
same task id, derived from the slot. This consumer step looks at every task
message before the worker accepts it: a message with a slot claim header is
accepted only if it comes from the beat instance that holds the claim (or the
claim was handed back unsent, ``released``), and the first acceptance pins
that instance (``received``). A copy sent by any other instance is
acknowledged and dropped, with a WARNING, a ``task-skipped`` event and the
``duplicates_dropped`` counter of the entry. It stores no state, so the
executed copy's result (same task id) stands.

Redeliveries of the accepted message (``acks_late``, visibility timeout) come
from the same instance and pass the claim check; on the connection that already
ran or dropped that message they are settled as described at the end. It works for any task, not
only :class:`~celery_singleton_beat.SingletonTask`: the worker needs this step,
which :func:`celery_singleton_beat.install` adds (apps with a singleton task
get it without asking).

**Redis unreachable** (the check raises): with ``singleton_beat_fail_open``
(``None``: ``singleton_fail_open``) the message runs unchecked, as beats then
send unclaimed slots. By default (fail closed) the worker *holds* it: neither
run nor acknowledged, counted outside the prefetch limit (as Celery does for
ETA tasks), and checked again after a back-off (:data:`RETRY_MIN` doubling to
:data:`RETRY_MAX`). While messages are held, later slot messages are held
behind them without asking Redis, and one check per back-off is the only
Redis call: a dead Redis costs the event loop one refused connection (a
stalled one: the client's socket timeout) per back-off, never a busy loop.
When Redis answers, the held messages are handled in order. A held message is
never requeued by the worker (on RabbitMQ a requeued message comes straight
back: a hot loop); if the worker loses its broker connection or stops, the
broker delivers it again as any unacknowledged message: RabbitMQ at once,
Redis when kombu restores it (at once if the worker can still reach the broker
as it closes the channel, else after ``visibility_timeout``). A message held
past the Redis broker's ``visibility_timeout`` is delivered again by kombu while
the worker still holds it; the worker keeps one of the two deliveries.

**A delivery of a slot message this connection already ran or dropped**
(kombu's restore read a held message just before the worker settled it, and
put a copy back; or the same beat published it twice) is not run again, nor
counted again as a duplicate send: it is
acknowledged and dropped once the run's message was acknowledged or rejected
for good, and left alone while that message is still unacknowledged with the
same delivery tag (``acks_late``: its settling settles both). A message the
worker gave back (rejected with requeue) is run again when it returns, as any
message.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import bootsteps
from celery.exceptions import InvalidTaskError
from kombu.exceptions import ContentDisallowed, DecodeError

from ..config import SingletonSettings, get_settings
from ..connection.pooled import run_script
from ..connection.wire import LuaScript
from ..lease.scripts import STATS_TTL_MS
from ..log import logger
from ..recovery.lock_redis import get_redis
from .events import TASK_SKIPPED
from .keys import beat_stats_key

__all__ = ["CLAIM_HEADER", "ENTRY_HEADER", "INSTANCE_HEADER", "RECEIVE_SCRIPT", "RETRY_MAX", "RETRY_MIN", "SLOT_HEADER",
           "SlotDeliveryStep", "SlotGate", "parse_claim", "receive_slot"]

#: Message headers of a sent slot: the task can read ``self.request.singleton_beat_slot``.
SLOT_HEADER = "singleton_beat_slot"
#: The beat instance that sent the message.
INSTANCE_HEADER = "singleton_beat_instance"
#: The slot's claim key, which the worker checks before it runs the message.
CLAIM_HEADER = "singleton_beat_claim"
#: The entry (claim) name, for the worker's counters.
ENTRY_HEADER = "singleton_beat_entry"


def parse_claim(raw: bytes | str | None) -> dict[str, Any] | None:
    """A claim value as a dict; None for no value or one this library did not write."""
    if raw is None:
        return None
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


#: A worker received a slot message. KEYS: claim, [counter hash]. ARGV: the
#: message's instance, the worker, TTL in ms for a claim the worker creates,
#: stats TTL ms. Returns {'run'} or {'drop', holder value}. A missing claim
#: (expired, Redis restarted, beat failed open) is created in the message's
#: name: the first delivery of a slot wins, later ones from others are dropped.
#: A ``released`` claim says its beat did not publish: a copy from another beat
#: (one that published and died before the take-over) is the one to run, and
#: the claim is pinned to it.
RECEIVE_SCRIPT = LuaScript("""
local current = redis.call('GET', KEYS[1])
if not current then
  redis.call('SET', KEYS[1], cjson.encode({instance = ARGV[1], state = 'received',
             worker = ARGV[2]}), 'PX', tonumber(ARGV[3]))
  return {'run'}
end
local ok, claim = pcall(cjson.decode, current)
if not ok or type(claim) ~= 'table' then return {'run'} end
if claim['instance'] ~= ARGV[1] then
  if claim['state'] ~= 'released' then
    if KEYS[2] then
      redis.call('HINCRBY', KEYS[2], 'duplicates_dropped', 1)
      redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[4]))
    end
    return {'drop', current}
  end
  claim['instance'] = ARGV[1]  -- pinned below, as the claim's own copy would be
end
if claim['state'] ~= 'received' then
  claim['state'] = 'received'
  claim['worker'] = ARGV[2]
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then redis.call('SET', KEYS[1], cjson.encode(claim), 'PX', ttl)
  else redis.call('SET', KEYS[1], cjson.encode(claim)) end
end
return {'run'}
""")


def receive_slot(client: Any, key: str, instance: str, worker: str, create_ttl_ms: int,
                 stats_key: str | None) -> tuple[bool, dict[str, Any] | None]:
    """Record that ``worker`` accepts the slot message sent by ``instance``.

    ``(True, None)``: run it. ``(False, holder)``: another instance's message of
    this slot was (or will be) the one executed; drop this one.
    """
    keys = [key] + ([stats_key] if stats_key else [])
    reply = run_script(client, RECEIVE_SCRIPT, keys, [instance, worker, create_ttl_ms, STATS_TTL_MS])
    verdict = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
    if verdict == "drop":
        return False, parse_claim(reply[1]) or {}
    return True, None


_GUARDED = "_singleton_slot_guard"
#: Seconds between checks of held slot messages while Redis does not answer (doubling).
RETRY_MIN, RETRY_MAX = 1.0, 30.0
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


class SlotGate:
    """The slot check of one consumer connection, and the messages it holds while
    Redis cannot answer (see the module docstring)."""

    def __init__(self, c: Any, settings: SingletonSettings) -> None:
        self.c = c
        self.settings = settings
        self._held: deque[_Delivery] = deque()
        # Pools without Celery's event loop run timers in a thread of their own.
        self._lock = threading.RLock()
        self._timer: Any = None
        self._delay = 0.0
        self._closed = False
        # Slot messages this connection ran or dropped, by identity.
        self._seen: OrderedDict[tuple[Any, Any], _Seen] = OrderedDict()

    def on_message(self, delivery: _Delivery) -> Any:
        with self._lock:
            if self._seen_here(delivery):
                return None
            if self._held:  # Redis did not answer: wait behind them, ask nothing now
                self._hold(delivery, None)
                return None
            try:
                run = self._check(delivery.headers)
            except redis.RedisError as exc:
                if self.settings.beat_fails_open:
                    logger.warning("%s[%s]: could not check beat slot %s (%s); running it "
                                   "(fail open)", *_names(delivery.headers), exc)
                    run = True
                else:
                    self._hold(delivery, exc)
                    return None
            self._remember(delivery, ran=run)
        return delivery.run() if run else self._drop(delivery)

    def close(self) -> None:
        """The connection is gone (or the worker stops): what is held is the broker's again."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._cancel_timer()
            if self._held:
                logger.warning("%d beat slot message(s) held for the slot check are left to the "
                               "broker, which delivers them again", len(self._held))
                self._held.clear()

    # ----------------------------------------------------------------- holding

    def _hold(self, delivery: _Delivery, exc: BaseException | None) -> None:
        same = _identity(delivery.headers)
        for index, held in enumerate(self._held):
            if _identity(held.headers) == same:
                # Delivered again while held: the newer delivery waits in its place. Redis
                # broker, held past visibility_timeout: kombu restored the message, which
                # keeps its delivery tag (acknowledging the old delivery would acknowledge
                # the new one). Another message of the same id and beat (a publish sent
                # twice) is acknowledged: one copy of it is enough.
                self._held[index] = delivery
                if getattr(held.message, "delivery_tag", None) != getattr(
                        delivery.message, "delivery_tag", None):
                    held.ack(logger, self.c.connection_errors)
                logger.info("%s[%s]: beat slot %s delivered again while held; one copy kept",
                            *_names(delivery.headers))
                return
        self._held.append(delivery)
        qos = getattr(self.c, "qos", None)
        if qos is not None:  # a held message does not take the place of another task
            qos.increment_eventually()
        if exc is not None:
            logger.warning("%s[%s]: could not check beat slot %s (%s); holding the message "
                           "until Redis answers (fail closed)", *_names(delivery.headers), exc)
        else:
            logger.warning("%s[%s]: beat slot %s waits for Redis behind %d held message(s)",
                           *_names(delivery.headers), len(self._held) - 1)
        if self._timer is None:
            self._schedule()

    def _schedule(self) -> None:
        self._delay = min(max(self._delay * 2, RETRY_MIN), RETRY_MAX)
        self._timer = self.c.timer.call_after(self._delay, self._retry)

    def _cancel_timer(self) -> None:
        try:
            self.c.timer.cancel(self._timer)
        except Exception as exc:  # the timer may be stopping with the worker
            logger.debug("could not cancel the beat slot check: %r", exc)
        self._timer = None

    def _retry(self) -> None:
        """Check the held messages in order; on the first Redis error, back off again."""
        handled = 0
        with self._lock:
            self._timer = None  # this call
        while True:
            with self._lock:
                if self._closed or not self._held:
                    break
                delivery = self._held[0]
                try:
                    run = self._check(delivery.headers)
                except redis.RedisError as exc:
                    if self._timer is None:  # (a message that came meanwhile may have set one)
                        self._schedule()
                    logger.info("beat slot checks: Redis still unavailable (%s); %d message(s) "
                                "held, next check in %.0fs", exc, len(self._held), self._delay)
                    return
                self._held.popleft()
                qos = getattr(self.c, "qos", None)
                if qos is not None:
                    qos.decrement_eventually()
            handled += 1
            self._dispatch(delivery, run)
        if handled:
            self._delay = 0.0
            logger.info("beat slot checks: Redis answers again; %d held message(s) handled", handled)

    def _dispatch(self, delivery: _Delivery, run: bool) -> None:
        """Run or drop a message that was held; Celery's errors for a bad message apply."""
        with self._lock:
            self._remember(delivery, ran=run)
        if not run:
            self._drop(delivery)
            return
        try:
            delivery.run()
        except (InvalidTaskError, ContentDisallowed) as exc:
            self.c.on_invalid_task(None, delivery.message, exc)
        except DecodeError as exc:
            self.c.on_decode_error(delivery.message, exc)

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

    # ----------------------------------------------------------------- the check

    def _check(self, headers: dict[str, Any]) -> bool:
        """True to run the message; False for a second delivery of its slot. Raises
        ``redis.RedisError`` when Redis cannot answer."""
        settings = self.settings
        key, instance = str(headers[CLAIM_HEADER]), str(headers[INSTANCE_HEADER])
        entry = headers.get(ENTRY_HEADER)
        stats = beat_stats_key(settings.key_prefix, str(entry)) if settings.stats and entry else None
        run, holder = receive_slot(get_redis(self.c.app), key, instance, str(self.c.hostname),
                                   round(settings.done_ttl * 1000), stats)
        if not run:
            self._report_drop(headers, holder)
        return run

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


def _identity(headers: dict[str, Any]) -> tuple[Any, Any]:
    """What makes two deliveries one message: task id and sending beat instance."""
    return headers.get("id"), headers.get(INSTANCE_HEADER)


def _names(headers: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Task name, task id and claim key of a slot message, for log lines."""
    return headers.get("task"), headers.get("id"), headers.get(CLAIM_HEADER)
