"""Active-active ``celery beat``: every instance ticks, one sends each slot.

Every beat instance runs the whole schedule. When an entry comes due, the
instance works out the entry's *slot* -- the nominal instant the entry fires
for, in UTC -- and claims it in Redis before sending::

    SET <prefix>:{beat:<entry>}:<slot> <claim> NX PX <ttl>

Only the instance whose ``SET`` succeeds sends; the others log that they
skipped. Claims expire by themselves (``ttl`` = the entry's period + the
``singleton_beat_claim_margin``), so an entry has ``1 + margin / period``
claim keys alive at a time (one for a daily entry, 61 for a 1 s entry with
the default 60 s margin), whatever the number of ticks.

Slots are a pure function of the schedule and the instance's clock, so every
instance names the same slot without talking to the others:

* interval entries (``schedule(run_every=...)``) fire on instants aligned to
  the Unix epoch (``k x period``), whatever time each beat started;
* crontab entries fire on their scheduled instants: wall times in the
  schedule's time zone mapped to real instants (a wall time skipped by a
  spring-forward change maps to the instant the clocks jump, a repeated wall
  time to its first occurrence), found by walking forward from the last slot;
* solar entries fire on the event's instant, computed from a canonical start
  and truncated to the second so that every instance gets the same value.

Local schedule state (``last_run_at`` in the shelve file) never decides: a
beat that starts sets each entry's ``last_run_at`` from the slots (see
``singleton_beat_catch_up``), and Redis claims decide who sends.
See ``docs/beat.md`` for the full rules.
"""

from __future__ import annotations

import copy
import hashlib
import heapq
import json
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone, tzinfo
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from celery import schedules
from celery.beat import PersistentScheduler, Scheduler
from celery.exceptions import ImproperlyConfigured

from .client import ReplicasNotAcknowledged, get_redis, group_by_node, is_cluster
from .config import SingletonSettings, get_settings, sanitize_redis_url
from .events import logger
from .keys import beat_stats_key
from .lock import STATS_TTL_MS, release_value

__all__ = [
    "INSTANCE_HEADER",
    "SLOT_HEADER",
    "Slot",
    "SlotError",
    "SlotSpec",
    "SingletonScheduler",
    "SingletonSchedulerMixin",
    "crontab_slot",
    "current_slot",
    "entry_spec",
    "format_slot",
    "history_key",
    "interval_slot",
    "read_history",
    "slot_key",
    "solar_slot",
    "stats_key",
]

UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)

#: Message headers of a sent slot: the task can read ``self.request.singleton_beat_slot``.
SLOT_HEADER = "singleton_beat_slot"
INSTANCE_HEADER = "singleton_beat_instance"

#: The entry option (``options={"singleton": ...}``) read by the scheduler.
ENTRY_OPTION = "singleton"

#: A firing this much before a slot boundary counts for that slot (timer rounding).
EARLY_TOLERANCE = timedelta(milliseconds=1)
#: Claim lifetime for a schedule with no next instant (one-off schedules).
NO_NEXT_PERIOD = timedelta(days=1)
#: How far back to look for the latest instant of a schedule when there is no
#: previous slot to walk from. 29 years covers "Feb 29 that is a Monday".
LOOKBACKS = tuple(
    timedelta(days=d) for d in (1 / 1440, 1 / 24, 1, 7, 32, 366, 5 * 366, 29 * 366)
)
#: Steps walked from a start before switching to bisection.
WALK_STEPS = 64


class SlotError(ValueError):
    """The slots of a schedule cannot be computed (unsupported or broken schedule)."""


# --------------------------------------------------------------------------- slots


@dataclass(frozen=True)
class Slot:
    """One firing of a schedule: its nominal instant and the next one, in UTC."""

    at: datetime
    next: datetime | None

    @property
    def period(self) -> timedelta:
        """Time to the next slot (a day for schedules that do not repeat)."""
        return NO_NEXT_PERIOD if self.next is None else self.next - self.at

    @property
    def label(self) -> str:
        """The slot as it appears in keys, headers and history (ISO 8601, UTC)."""
        return format_slot(self.at)


def to_utc(value: datetime) -> datetime:
    """``value`` as an aware UTC datetime; naive values are taken as UTC (Celery's rule)."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def format_slot(at: datetime) -> str:
    """``2024-03-31T01:00:00Z``; microseconds appear only when not zero."""
    at = to_utc(at)
    text = at.strftime("%Y-%m-%dT%H:%M:%S")
    if at.microsecond:
        text += f".{at.microsecond:06d}"
    return text + "Z"


def interval_slot(period: timedelta, now: datetime) -> Slot:
    """The epoch-aligned slot of an interval schedule at ``now``.

    Slots are the instants ``k x period`` since the Unix epoch, so beats that
    started at different times fire (and claim) the same instants.
    """
    step = period // _MICROSECOND
    if step <= 0:
        raise SlotError(f"an interval schedule needs a positive period, got {period}")
    elapsed = (to_utc(now) + EARLY_TOLERANCE - EPOCH) // _MICROSECOND
    at = EPOCH + timedelta(microseconds=elapsed // step * step)
    return Slot(at, at + timedelta(microseconds=step))


P = TypeVar("P")  # a position: a naive wall time (crontab) or an aware UTC instant


def _latest_instant(
    step: Callable[[P], P | None],
    instant: Callable[[P], datetime],
    now: datetime,
    hint: P | None,
    lookback: Callable[[timedelta], P],
    upper: P,
) -> Slot | None:
    """The latest instant <= ``now`` of a schedule given as a ``step`` function.

    ``step(p)`` is the first position after ``p`` (or None), ``instant(p)`` its
    real instant, non-decreasing along positions. ``hint`` is a position known
    to be an instant <= now (the previous slot): walking from it costs one or
    two steps in steady state. Without it, growing look-back windows are tried;
    long walks switch to bisection, so a stale start costs O(log) steps.
    ``upper`` is a position whose successor is after ``now``.
    """
    if hint is not None:
        found = _walk(step, instant, now, hint, upper, include_start=True)
        if found is not None:
            return found
    for window in LOOKBACKS:
        found = _walk(step, instant, now, lookback(window), upper, include_start=False)
        if found is not None:
            return found
    return None


def _walk(step: Callable[[P], P | None], instant: Callable[[P], datetime], now: datetime,
          start: P, upper: P, include_start: bool) -> Slot | None:
    best: P | None = start if include_start else None
    previous: P = start
    while True:
        position = previous
        for _ in range(WALK_STEPS):
            following = step(position)
            if following is None or instant(following) > now:
                if best is None:
                    return None
                return Slot(instant(best), None if following is None else instant(following))
            previous, position = position, following
            best = following
        # Still walking: bisect for the last position whose successor is <= now.
        lo, hi = previous, upper
        while hi - lo > timedelta(milliseconds=1):  # type: ignore[operator]
            mid = lo + (hi - lo) / 2  # type: ignore[operator]
            following = step(mid)
            if following is not None and instant(following) <= now:
                lo = mid
            else:
                hi = mid
        previous = lo


def _wall_to_utc(wall: datetime, tz: tzinfo) -> datetime:
    """The real instant of a naive wall time in ``tz`` (monotone in ``wall``).

    A repeated wall time (autumn) maps to its first occurrence; a wall time
    that does not exist (spring gap) maps to the instant the clocks jumped.
    """
    first = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    if first.astimezone(tz).replace(tzinfo=None) == wall:
        return first
    # In a gap: fold=1 reads it with the offset after the jump (an instant
    # before the jump), fold=0 with the offset before it (after the jump).
    low = int(wall.replace(tzinfo=tz, fold=1).astimezone(UTC).timestamp())
    high = int(first.timestamp())
    if low > high:
        low, high = high, low
    after = datetime.fromtimestamp(high, UTC).astimezone(tz).utcoffset()
    while high - low > 1:
        mid = (low + high) // 2
        if datetime.fromtimestamp(mid, UTC).astimezone(tz).utcoffset() == after:
            high = mid
        else:
            low = mid
    return datetime.fromtimestamp(high, UTC)


def crontab_slot(cron: schedules.crontab, now: datetime, hint: datetime | None = None) -> Slot | None:
    """The latest scheduled instant of ``cron`` at or before ``now``, and the next one.

    Walks wall times in the crontab's time zone with Celery's own
    ``remaining_delta`` (so every crontab feature behaves as in Celery) and
    maps each wall time to a real instant with :func:`_wall_to_utc`.
    ``hint`` is a previous slot of the entry; any value gives the same result.
    """
    tz = cron.tz
    now = to_utc(now) + EARLY_TOLERANCE

    def wall(at: datetime) -> datetime:
        return at.astimezone(tz).replace(tzinfo=None, fold=0)

    def step(position: datetime) -> datetime | None:
        aware = position.replace(tzinfo=tz)
        _, delta, _ = cron.remaining_delta(aware, tz=tz)
        following = (aware + delta).replace(tzinfo=None, fold=0)
        return following if following > position else None

    def instant(position: datetime) -> datetime:
        return _wall_to_utc(position, tz)

    start = wall(to_utc(hint)) if hint is not None and to_utc(hint) <= now else None
    if start is not None and instant(start) != to_utc(hint):  # not an instant of this schedule
        start = None
    return _latest_instant(step, instant, now, start, lambda window: wall(now - window),
                           wall(now) + timedelta(days=1))


class _Probe:
    """A copy of a schedule whose clock is set by the caller.

    ``remaining_estimate(t)`` is "next instant after t" minus "now"; with a
    known "now" it yields the next instant itself.
    """

    def __init__(self, schedule: schedules.BaseSchedule) -> None:
        try:
            probe = copy.copy(schedule)
            probe.app = schedule.app
            probe.nowfun = self._now
        except Exception as exc:  # pragma: no cover - exotic schedule classes
            raise SlotError(f"cannot evaluate schedule {schedule!r}: {exc}") from exc
        self.schedule = probe
        self.clock = EPOCH

    def _now(self) -> datetime:
        return self.clock

    def next_after(self, at: datetime) -> datetime | None:
        self.clock = at
        try:
            following = at + self.schedule.remaining_estimate(at)
        except NotImplementedError as exc:
            raise SlotError(f"schedule {self.schedule!r} cannot tell its next run") from exc
        following = to_utc(following)
        return following if following > at else None


def solar_slot(sun: schedules.solar, now: datetime, hint: datetime | None = None) -> Slot | None:
    """The latest solar event at or before ``now``, and the next one.

    ``ephem`` returns an event time that depends slightly (milliseconds) on
    where its search starts, so each event is recomputed from a canonical
    start (the whole hour at least an hour before it) and truncated to the
    second: every instance gets the same slot.
    """
    probe = _Probe(sun)

    def step(position: datetime) -> datetime | None:
        start = position
        for _ in range(3):
            rough = probe.next_after(start)
            if rough is None:
                return None
            anchor = (rough - timedelta(hours=1)).replace(minute=0, second=0, microsecond=0)
            exact = probe.next_after(anchor) if anchor < rough else rough
            if exact is None or exact < rough - timedelta(minutes=5):
                exact = rough  # another event between anchor and rough: keep rough
            event = exact.replace(microsecond=0)
            if event > position:
                return event
            start = rough + timedelta(seconds=1)
        return None

    now = to_utc(now) + EARLY_TOLERANCE
    start = to_utc(hint) if hint is not None and to_utc(hint) <= now else None
    return _latest_instant(step, lambda at: at, now, start, lambda window: now - window, now)


def generic_slot(schedule: schedules.BaseSchedule, now: datetime,
                 hint: datetime | None = None) -> Slot | None:
    """Slots of any other schedule that implements ``remaining_estimate``.

    Correct only if the schedule's instants do not depend on where the search
    starts (true of django-celery-beat's ``clocked``).
    """
    probe = _Probe(schedule)
    now = to_utc(now) + EARLY_TOLERANCE
    start = to_utc(hint) if hint is not None and to_utc(hint) <= now else None
    return _latest_instant(probe.next_after, lambda at: at, now, start,
                           lambda window: now - window, now)


def current_slot(schedule: Any, now: datetime, hint: datetime | None = None) -> Slot | None:
    """The slot an entry with ``schedule`` fires for at ``now`` (None: no instant yet).

    ``hint`` (the entry's previous slot) only makes the search cheaper.
    Raises :class:`SlotError` for schedules whose slots cannot be computed.
    """
    if isinstance(schedule, schedules.schedule):
        return interval_slot(schedule.run_every, now)
    if isinstance(schedule, schedules.crontab):
        return crontab_slot(schedule, now, hint)
    if isinstance(schedule, schedules.solar):
        return solar_slot(schedule, now, hint)
    if isinstance(schedule, schedules.BaseSchedule):
        return generic_slot(schedule, now, hint)
    raise SlotError(f"unsupported schedule type {type(schedule).__name__}")


def slot_before(schedule: Any, slot: Slot) -> datetime:
    """A ``last_run_at`` that makes the entry due for ``slot`` by its own schedule."""
    if isinstance(schedule, schedules.schedule):
        return slot.at - slot.period
    return slot.at - timedelta(seconds=1)


# --------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class SlotSpec:
    """How one entry is claimed: the name part of its slot keys."""

    name: str

    def key(self, prefix: str, slot: Slot) -> str:
        return slot_key(prefix, self.name, slot.at)


def slot_key(prefix: str, name: str, at: datetime) -> str:
    """``<prefix>:{beat:<name>}:<slot>``; the hash tag keeps an entry's slots in one Cluster slot."""
    return f"{prefix}:{{beat:{name}}}:{format_slot(at)}"


def history_key(prefix: str) -> str:
    """Capped list of recent claims won, newest first (JSON records)."""
    return f"{prefix}:{{beat}}:history"


def stats_key(prefix: str) -> str:
    """Hash of counters over all entries and instances: ``won`` and ``lost`` slot claims.

    Per-entry counters are in :func:`celery_singleton_beat.keys.beat_stats_key`.
    """
    return f"{prefix}:{{beat}}:stats"


def entry_spec(entry: Any) -> SlotSpec | None:
    """Read an entry's ``singleton`` option; None when the entry opted out.

    Accepted values: absent or ``True`` (claim by entry name), ``False`` (send
    from every beat, as plain Celery does), or a dict with ``key`` (the name
    to claim under instead of the entry name) and/or ``include_args`` (add a
    digest of the entry's args and kwargs to the key). Raises ``ValueError``.
    """
    option = (entry.options or {}).get(ENTRY_OPTION, True)
    if option is True:
        return SlotSpec(entry.name)
    if option is False:
        return None
    if not isinstance(option, dict):
        raise ValueError(f"options['{ENTRY_OPTION}'] must be True, False or a dict, got {option!r}")
    unknown = set(option) - {"key", "include_args"}
    if unknown:
        raise ValueError(f"unknown options['{ENTRY_OPTION}'] field(s) {sorted(unknown)}; "
                         "known: 'key', 'include_args'")
    name = option.get("key", entry.name)
    if not isinstance(name, str) or not name:
        raise ValueError(f"options['{ENTRY_OPTION}']['key'] must be a non-empty string, got {name!r}")
    include_args = option.get("include_args", False)
    if not isinstance(include_args, bool):
        raise ValueError(f"options['{ENTRY_OPTION}']['include_args'] must be True or False, "
                         f"got {include_args!r}")
    if include_args:
        try:
            encoded = json.dumps([list(entry.args or ()), dict(entry.kwargs or {})],
                                 sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"include_args needs JSON-encodable args and kwargs: {exc}") from exc
        name = f"{name}:{hashlib.sha256(encoded.encode()).hexdigest()[:16]}"
    return SlotSpec(name)


def read_history(client: redis.Redis, prefix: str, limit: int = 100) -> list[dict[str, Any]]:
    """The latest ``limit`` claims won (newest first), as written by the scheduler."""
    records = []
    for raw in client.lrange(history_key(prefix), 0, max(limit, 1) - 1):
        try:
            records.append(json.loads(raw))
        except ValueError:
            continue
    return records


# --------------------------------------------------------------------------- scheduler


@dataclass
class _Claim:
    """What happened to one slot of one entry in this instance."""

    name: str
    slot: Slot
    key: str
    won: bool | None  # None: Redis could not be asked
    value: str | None = None
    holder: str | None = None
    error: str | None = None


@dataclass
class _Reserved:
    """A slot chosen when an entry was reserved, before it is claimed and sent."""

    slot: Slot | None
    previous: datetime | None
    error: str | None = None


if TYPE_CHECKING:  # pragma: no cover
    _SchedulerBase = Scheduler
else:
    _SchedulerBase = object


class SingletonSchedulerMixin(_SchedulerBase):
    """Claim each due entry's slot in Redis; send only the slots this beat won.

    Mix it in front of any :class:`celery.beat.Scheduler` subclass::

        class Scheduler(SingletonSchedulerMixin, DatabaseScheduler): ...

    It wraps the points every scheduler goes through: ``is_due`` (an entry's
    ``last_run_at`` is set from its slots before the schedule is asked, so
    interval entries stay on epoch-aligned instants), ``reserve`` (the slot is
    chosen), ``apply_entry`` / ``apply_async`` (claimed, then sent or skipped)
    and ``populate_heap`` / ``tick`` (batched claims and Redis back-off).
    """

    #: Claims sent to Redis in one pipeline when many entries are due at once.
    claim_batch_size: int = 1000
    #: Records kept in the ``<prefix>:{beat}:history`` list.
    history_size: int = 1000
    #: Back-off (seconds) after Redis failed, doubling up to the maximum.
    redis_retry_min: float = 1.0
    redis_retry_max: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        app = kwargs["app"] if "app" in kwargs else args[0]
        # Fails beat start with ImproperlyConfigured on a bad singleton_* setting.
        self.singleton_settings: SingletonSettings = get_settings(app)
        #: Who this beat is in claims and logs: host, pid and a random suffix.
        self.instance_id: str = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        # Per entry name: the latest slot this instance handled (sent, skipped or
        # given up); it is the value given to the entry's last_run_at.
        self._handled: dict[str, datetime] = {}
        # Per entry name: the latest real slot instant chosen (a search hint).
        self._hints: dict[str, datetime] = {}
        self._reserved: dict[str, _Reserved] = {}
        self._prefetched: dict[str, _Claim] = {}
        self._sending: _Claim | None = None
        self._retry_names: set[str] = set()
        self._reported: set[tuple[str, datetime]] = set()
        self._breaker_until = 0.0
        self._breaker_delay = 0.0
        self._redis_down_since: float | None = None
        self._use_set_get = True
        # True while consecutive ticks send due entries (a burst), see schedules_equal.
        self._in_burst = False
        self._burst_compared = False
        super().__init__(*args, **kwargs)

    # ----------------------------------------------------------------- set-up

    def setup_schedule(self) -> None:
        super().setup_schedule()
        self._check_entries()
        settings = self.singleton_settings
        logger.info(
            "beat: singleton scheduler %s: catch-up %s, %s, claims in %s",
            self.instance_id, settings.beat_catch_up,
            "fail open" if settings.beat_fails_open else "fail closed",
            sanitize_redis_url(settings.redis_url),
        )
        try:
            get_redis(self.app).ping()
        except redis.RedisError as exc:
            logger.warning("beat: Redis for slot claims is unreachable at start (%s); "
                           "due slots are %s until it is", exc,
                           "sent unclaimed" if settings.beat_fails_open else "not sent")

    def _check_entries(self) -> None:
        """Reject entries whose singleton option or schedule cannot work (at beat start)."""
        now = self._now()
        for entry in list(self.schedule.values()):
            try:
                if entry_spec(entry) is not None:
                    current_slot(entry.schedule, now)
            except SlotError as exc:
                raise ImproperlyConfigured(
                    f"beat entry {entry.name!r}: {exc} (set options={{'{ENTRY_OPTION}': False}} "
                    "to send it from every beat without a claim)"
                ) from exc
            except ValueError as exc:
                raise ImproperlyConfigured(f"beat entry {entry.name!r}: {exc}") from exc

    @property
    def info(self) -> str:
        settings = self.singleton_settings
        line = (
            f"    . singleton -> {sanitize_redis_url(settings.redis_url)} "
            f"prefix={settings.key_prefix} instance={self.instance_id} "
            f"catch-up={settings.beat_catch_up} "
            f"{'fail-open' if settings.beat_fails_open else 'fail-closed'}"
        )
        base = super().info
        return f"{base}\n{line}" if base else line

    # ----------------------------------------------------------------- timing

    def _now(self) -> datetime:
        """The scheduler's clock (``app.now()``), in UTC."""
        return to_utc(self.app.now())

    def _spec(self, entry: Any) -> SlotSpec | None:
        try:
            return entry_spec(entry)
        except ValueError:
            # Reported (and the send refused) when the entry is applied.
            return SlotSpec(entry.name)

    def _normalize(self, entry: Any) -> None:
        """Give the entry the ``last_run_at`` its slots imply (not the stored one)."""
        handled = self._handled.get(entry.name)
        if handled is None:
            handled = self._first_sight(entry)
            self._handled[entry.name] = handled
        if entry.last_run_at != handled:
            entry.last_run_at = handled

    def _first_sight(self, entry: Any) -> datetime:
        """Start-up rule: the latest slot is due ("latest") or counts as done ("none")."""
        now = self._now()
        try:
            slot = current_slot(entry.schedule, now)
        except SlotError:
            return now
        if slot is None:
            return now
        if self.singleton_settings.beat_catch_up == "latest":
            return slot_before(entry.schedule, slot)
        return slot.at

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        for entry in self.schedule.values():
            if self._spec(entry) is not None:
                self._normalize(entry)
        super().populate_heap(*args, **kwargs)

    def is_due(self, entry: Any) -> Any:
        if self._spec(entry) is None:
            return super().is_due(entry)
        self._normalize(entry)
        state = super().is_due(entry)
        if not state[0]:
            return state
        if self._breaker_open() and not self.singleton_settings.beat_fails_open:
            self._report_blocked(entry)
            return schedules.schedstate(False, self._breaker_remaining())
        if isinstance(entry.schedule, schedules.schedule):
            # Celery would check again one period after *now*, drifting off the
            # aligned instants; check again at the next aligned instant instead.
            now = self._now()
            following = interval_slot(entry.schedule.run_every, now).next
            assert following is not None
            return schedules.schedstate(True, max((following - now).total_seconds(), 0.0))
        return state

    def tick(self, *args: Any, **kwargs: Any) -> float:
        delay = super().tick(*args, **kwargs)
        if self._retry_names:
            delay = min(delay, self._reschedule_retries())
        self._in_burst = delay <= 0
        if not self._in_burst:
            self._burst_compared = False
            if self._prefetched:
                # The burst of due entries is over: give back claims won ahead
                # for entries that did not come due after all.
                self._release_prefetched()
        return delay

    def schedules_equal(self, old_schedules: Any, new_schedules: Any) -> bool:
        """Compare the schedule with its copy once per burst, not once per tick.

        Celery's ``tick`` compares every entry on every tick and sends one due
        entry per tick, so a burst of n due entries costs O(n^2) comparisons
        (minutes for 10,000 entries). Within a burst (ticks that return 0) the
        comparison made at its start stands; changes are picked up when the
        burst ends, at most a few seconds later.
        """
        if (self._in_burst and self._burst_compared and old_schedules is not None
                and new_schedules is not None and len(old_schedules) == len(new_schedules)):
            return True
        equal = bool(super().schedules_equal(old_schedules, new_schedules))
        self._burst_compared = equal
        return equal

    def close(self) -> None:
        if self._prefetched:
            self._release_prefetched()
        super().close()

    # ----------------------------------------------------------------- sending

    def reserve(self, entry: Any) -> Any:
        new_entry = super().reserve(entry)
        spec = self._spec(entry)
        if spec is None:
            return new_entry
        previous = self._handled.get(entry.name)
        reserved = self._choose_slot(entry, previous)
        self._reserved[entry.name] = reserved
        if reserved.slot is not None and (previous is None or reserved.slot.at > previous):
            self._handled[entry.name] = reserved.slot.at
        if entry.name in self._handled:
            new_entry.last_run_at = self._handled[entry.name]
        return new_entry

    def _choose_slot(self, entry: Any, previous: datetime | None) -> _Reserved:
        prefetched = self._prefetched.get(entry.name)
        if prefetched is not None:
            return _Reserved(prefetched.slot, previous)
        try:
            slot = current_slot(entry.schedule, self._now(), self._hints.get(entry.name))
        except SlotError as exc:
            return _Reserved(None, previous, str(exc))
        if slot is not None:
            self._hints[entry.name] = slot.at
        return _Reserved(slot, previous)

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        if self._spec(entry) is None:
            super().apply_entry(entry, producer=producer)
            return
        claim = self._decide(entry)
        if claim is None:
            return
        self._sending = claim
        try:
            super().apply_entry(entry, producer=producer)
        finally:
            self._sending = None

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True,
                    **kwargs: Any) -> Any:
        if advance:
            entry = self.reserve(entry)
        claim: _Claim | None = None
        if self._spec(entry) is not None:
            claim = self._sending if self._sending and self._sending.name == entry.name else None
            if claim is None:  # called directly (RedBeat, custom ticks): claim here
                claim = self._decide(entry)
                if claim is None:
                    return None
        return self._send(entry, producer, claim, **kwargs)

    def _send(self, entry: Any, producer: Any, claim: _Claim | None, **kwargs: Any) -> Any:
        """Send through the base scheduler with the slot in the headers.

        The ``singleton`` option is not a publish option: it is left out of the
        options for the time of the call.
        """
        options = dict(entry.options or {})
        options.pop(ENTRY_OPTION, None)
        if claim is not None:
            headers = dict(options.get("headers") or {})
            headers[SLOT_HEADER] = claim.slot.label
            headers[INSTANCE_HEADER] = self.instance_id
            options["headers"] = headers
        saved = entry.options
        entry.options = options
        try:
            return super().apply_async(entry, producer=producer, advance=False, **kwargs)
        except Exception:
            # Not published (broker down, ...): give the slot back so that a beat
            # starting within the slot can still send it.
            if claim is not None:
                self._release([claim])
            raise
        finally:
            entry.options = saved

    def _decide(self, entry: Any) -> _Claim | None:
        """Claim the entry's reserved slot; the claim if this beat sends, else None."""
        name = entry.name
        reserved = self._reserved.pop(name, None)
        if reserved is None:  # not reserved through this class
            previous = self._handled.get(name)
            reserved = self._choose_slot(entry, previous)
            if reserved.slot is not None and (previous is None or reserved.slot.at > previous):
                self._handled[name] = reserved.slot.at
        try:
            spec = entry_spec(entry)
        except ValueError as exc:
            logger.error("beat: %s: not sent: bad options['%s']: %s", name, ENTRY_OPTION, exc)
            return None
        assert spec is not None
        slot = reserved.slot
        if slot is None:
            logger.error("beat: %s: not sent: %s", name,
                         reserved.error or "the schedule has no instant yet")
            return None
        if reserved.previous is not None and slot.at <= reserved.previous:
            logger.debug("beat: %s: slot %s already handled by this instance", name, slot.label)
            return None

        claim = self._prefetched.pop(name, None)
        if claim is not None and claim.slot.at != slot.at:
            self._release([claim])
            claim = None
        if claim is None:
            claim = self._claim_with_batch(entry, spec, slot)

        if claim.won:
            logger.info("beat: %s: slot %s won by %s, sending", name, slot.label, self.instance_id)
            return claim
        if claim.won is False:
            logger.info("beat: %s: slot %s already claimed by %s, skipping",
                        name, slot.label, claim.holder or "another instance")
            return None
        if self.singleton_settings.beat_fails_open:
            logger.warning("beat: %s: slot %s sent WITHOUT a claim (fail open): Redis unavailable: %s",
                           name, slot.label, claim.error)
            return claim
        # Fail closed: not sent; the slot stays due and is tried again after the back-off.
        self._handled[name] = slot_before(entry.schedule, slot)
        self._retry_names.add(name)
        self._report_unavailable(name, slot, claim.error)
        return None

    # ----------------------------------------------------------------- claims

    def _claim_with_batch(self, entry: Any, spec: SlotSpec, slot: Slot) -> _Claim:
        """Claim this slot, and ahead of time the slots of the other entries due now."""
        prefix = self.singleton_settings.key_prefix
        mine = _Claim(entry.name, slot, spec.key(prefix, slot), None)
        if self._breaker_open():
            mine.error = "Redis unavailable (waiting before the next attempt)"
            return mine
        batch = [(mine, entry)]
        batch.extend(self._due_candidates(self._now(), exclude=entry.name,
                                          limit=self.claim_batch_size - 1))
        try:
            self._claim_many(batch)
        except redis.RedisError as exc:
            self._redis_failed(exc)
            mine.error = f"{type(exc).__name__}: {exc}"
            return mine
        self._redis_ok()
        for claim, _ in batch[1:]:
            self._prefetched[claim.name] = claim
        return mine

    def _due_candidates(self, now: datetime, exclude: str, limit: int) -> list[tuple[_Claim, Any]]:
        """Other singleton entries that the heap says are due at ``now``.

        Walks only the due part of the heap (children of a node that is not due
        are not due either), so the cost follows the number of due entries.
        """
        heap = getattr(self, "_heap", None)
        if not isinstance(heap, list) or limit <= 0:
            return []
        prefix = self.singleton_settings.key_prefix
        now_ts = now.timestamp()
        found: list[tuple[_Claim, Any]] = []
        stack = [0]
        while stack and len(found) < limit:
            index = stack.pop()
            if index >= len(heap) or heap[index][0] > now_ts:
                continue
            stack.extend((2 * index + 2, 2 * index + 1))
            entry = heap[index][2]
            name = entry.name
            if name == exclude or name in self._prefetched or name in self._reserved:
                continue
            handled = self._handled.get(name)
            if handled is None:
                continue
            try:
                spec = entry_spec(entry)
                slot = current_slot(entry.schedule, now, self._hints.get(name)) if spec else None
            except ValueError:
                continue
            if spec is None or slot is None or slot.at <= handled:
                continue
            self._hints[name] = slot.at
            found.append((_Claim(name, slot, spec.key(prefix, slot), None), entry))
        return found

    def _claim_many(self, batch: list[tuple[_Claim, Any]]) -> None:
        """``SET NX PX`` every claim of ``batch`` in one round trip; record the outcome.

        With Redis >= 7 the ``GET`` option returns the holder of a slot already
        claimed (for the log); older servers reject it and get a plain ``SET NX``.
        """
        client = get_redis(self.app)
        at = round(self._now().timestamp(), 3)
        value = json.dumps({"instance": self.instance_id, "at": at}, separators=(",", ":"))
        try:
            replies = self._set_claims(client, batch, value)
        except redis.ResponseError as exc:
            if not (self._use_set_get and "syntax" in str(exc).lower()):
                raise
            self._use_set_get = False  # Redis < 7 cannot combine NX and GET
            replies = self._set_claims(client, batch, value)
        for (claim, _), reply in zip(batch, replies):
            claim.value = value
            if self._use_set_get:
                claim.won = reply is None
                holder = None if reply is None else reply
            else:
                claim.won = bool(reply)
                holder = None
            if holder is not None:
                text = holder.decode("utf-8", "replace") if isinstance(holder, bytes) else str(holder)
                try:
                    claim.holder = json.loads(text).get("instance", text)
                except (ValueError, AttributeError):
                    claim.holder = text
            elif claim.won:
                claim.holder = self.instance_id
        self._record(client, batch, at)

    def _set_claims(self, client: redis.Redis, batch: list[tuple[_Claim, Any]],
                    value: str) -> list[Any]:
        """``SET NX PX`` each claim, pipelined; the raw replies, in ``batch`` order.

        With ``singleton_wait_replicas``, each server's pipeline ends with
        ``WAIT`` (same connection as its SETs, so it counts them). Fewer
        replicas in time: the claims this call won are given back and
        :class:`ReplicasNotAcknowledged` is raised, a ``RedisError``, so the
        slots are handled as with Redis down (fail closed unless
        ``singleton_beat_fail_open``).
        """
        margin = timedelta(seconds=self.singleton_settings.beat_claim_margin)

        def add_sets(pipe: Any, items: Iterable[tuple[_Claim, Any]]) -> None:
            for claim, _ in items:
                ttl_ms = (claim.slot.period + margin) // timedelta(milliseconds=1)
                pipe.set(claim.key, value, nx=True, px=max(1, ttl_ms), get=self._use_set_get)

        replicas = self.singleton_settings.wait_replicas
        if replicas <= 0:
            pipe = client.pipeline(transaction=False)
            add_sets(pipe, batch)
            return pipe.execute()

        timeout = self.singleton_settings.wait_timeout
        keys = [claim.key for claim, _ in batch]
        replies: list[Any] = [None] * len(batch)
        won: list[str] = []
        try:
            for group in group_by_node(client, keys):
                server = (client.get_redis_connection(client.get_node_from_key(keys[group[0]]))
                          if is_cluster(client) else client)
                pipe = server.pipeline(transaction=False)
                add_sets(pipe, (batch[i] for i in group))
                pipe.execute_command("WAIT", replicas, max(1, round(timeout * 1000)))
                *sets, acknowledged = pipe.execute()
                for index, reply in zip(group, sets):
                    replies[index] = reply
                    if (reply is None) if self._use_set_get else bool(reply):
                        won.append(keys[index])
                if int(acknowledged) < replicas:
                    raise ReplicasNotAcknowledged(keys[group[0]], int(acknowledged), replicas, timeout)
        except redis.RedisError:
            for key in won:  # an unacknowledged claim must not block the slot
                try:
                    release_value(client, key, value)
                except redis.RedisError:
                    pass  # it expires after its period
            raise
        return replies

    def _record(self, client: redis.Redis, batch: list[tuple[_Claim, Any]], at: float) -> None:
        """Append won claims to the capped history and bump the counters (best effort).

        Counters (``singleton_stats``): ``won`` / ``lost`` per entry and in total,
        kept for the library's stats TTL after their last update.
        """
        settings = self.singleton_settings
        prefix = settings.key_prefix
        won = [(claim, entry) for claim, entry in batch if claim.won]
        records = [
            json.dumps({"entry": entry.name, "key": claim.key, "task": entry.task,
                        "slot": claim.slot.label, "winner": self.instance_id, "at": at},
                       separators=(",", ":"))
            for claim, entry in won[-self.history_size:]
        ]
        try:
            pipe = client.pipeline(transaction=False)
            if records:
                pipe.lpush(history_key(prefix), *records)
                pipe.ltrim(history_key(prefix), 0, self.history_size - 1)
            if settings.stats:
                for claim, entry in batch:
                    key = beat_stats_key(prefix, entry.name)
                    pipe.hincrby(key, "won" if claim.won else "lost", 1)
                    pipe.pexpire(key, STATS_TTL_MS)
                totals = stats_key(prefix)
                if won:
                    pipe.hincrby(totals, "won", len(won))
                if len(batch) > len(won):
                    pipe.hincrby(totals, "lost", len(batch) - len(won))
                pipe.pexpire(totals, STATS_TTL_MS)
            pipe.execute()
        except redis.RedisError as exc:
            logger.warning("beat: could not record %d claim(s) in the history: %s", len(batch), exc)

    def _release(self, claims: Iterable[_Claim]) -> None:
        """Give back claims won ahead of time but not sent (compare-and-delete)."""
        for claim in claims:
            if not claim.won or claim.value is None:
                continue
            try:
                release_value(get_redis(self.app), claim.key, claim.value)
            except redis.RedisError as exc:
                logger.warning("beat: could not give back unused claim %s: %s", claim.key, exc)

    def _release_prefetched(self) -> None:
        claims = list(self._prefetched.values())
        self._prefetched.clear()
        if claims:
            logger.debug("beat: giving back %d claim(s) of entries that were not due", len(claims))
            self._release(claims)

    # ----------------------------------------------------------------- Redis trouble

    def _breaker_open(self) -> bool:
        return time.monotonic() < self._breaker_until

    def _breaker_remaining(self) -> float:
        return max(self._breaker_until - time.monotonic(), 0.05)

    def _redis_failed(self, exc: BaseException) -> None:
        self._breaker_delay = min(max(self._breaker_delay * 2, self.redis_retry_min),
                                  self.redis_retry_max)
        self._breaker_until = time.monotonic() + self._breaker_delay
        if self._redis_down_since is None:
            self._redis_down_since = time.monotonic()
            logger.error("beat: Redis for slot claims unavailable (%s: %s); due slots are %s; "
                         "retrying with back-off", type(exc).__name__, exc,
                         "sent unclaimed (fail open)" if self.singleton_settings.beat_fails_open
                         else "not sent (fail closed)")
        else:
            logger.debug("beat: Redis still unavailable (%s); next attempt in %.1fs",
                         exc, self._breaker_delay)

    def _redis_ok(self) -> None:
        if self._redis_down_since is not None:
            logger.info("beat: Redis for slot claims is back after %.1fs",
                        time.monotonic() - self._redis_down_since)
            self._redis_down_since = None
            self._reported.clear()
        self._breaker_delay = 0.0
        self._breaker_until = 0.0

    def _report_unavailable(self, name: str, slot: Slot, error: str | None) -> None:
        if (name, slot.at) in self._reported:
            logger.debug("beat: %s: slot %s still not claimable: %s", name, slot.label, error)
            return
        if len(self._reported) > 100_000:
            self._reported.clear()
        self._reported.add((name, slot.at))
        logger.warning("beat: %s: slot %s NOT sent: cannot claim it (fail closed): %s",
                       name, slot.label, error)

    def _report_blocked(self, entry: Any) -> None:
        try:
            slot = current_slot(entry.schedule, self._now(), self._hints.get(entry.name))
        except SlotError:
            return
        if slot is not None:
            self._report_unavailable(entry.name, slot, "Redis unavailable, waiting to try again")

    def _reschedule_retries(self) -> float:
        """Move entries whose claim failed to the end of the back-off in the heap."""
        names, self._retry_names = self._retry_names, set()
        delay = self._breaker_remaining()
        heap = getattr(self, "_heap", None)
        if isinstance(heap, list) and heap:
            soon = self._now().timestamp() + delay  # heap times follow the scheduler's clock
            changed = False
            for index, event in enumerate(heap):
                if event[2].name in names and event[0] > soon and hasattr(event, "_replace"):
                    heap[index] = event._replace(time=soon)
                    changed = True
            if changed:
                heapq.heapify(heap)
        return delay


class SingletonScheduler(SingletonSchedulerMixin, PersistentScheduler):
    """Celery's default (shelve-backed) scheduler, sending each slot from one beat only.

    Use with ``celery beat -S singleton`` or
    ``beat_scheduler = "celery_singleton_beat.SingletonScheduler"``.
    """
