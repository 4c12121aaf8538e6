"""Slot math: the nominal instant each schedule fires for, in UTC. Pure: no Redis.

An entry's *slot* is the instant it fires for. Every beat computes the same
slot from the schedule and its own clock, without talking to the others:

* interval entries (``schedule(run_every=...)``) fire on instants aligned to
  the Unix epoch (``k x period``), whatever time each beat started;
* crontab entries fire on their scheduled instants: wall times in the
  schedule's time zone mapped to real instants (a wall time skipped by a
  spring-forward change maps to the instant the clocks jump, a repeated wall
  time to its first occurrence), found by walking forward from the last slot;
* solar entries fire on the event's instant, computed from a canonical start
  and truncated to the second so that every instance gets the same value.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any, TypeVar

from celery import schedules

__all__ = [
    "EARLY_TOLERANCE",
    "Slot",
    "SlotError",
    "crontab_slot",
    "current_slot",
    "format_slot",
    "generic_slot",
    "interval_slot",
    "slot_before",
    "solar_slot",
    "to_utc",
]

UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)

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

    @functools.cached_property
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
    # Celery before 5.7 looks for a later minute in the same hour only when the
    # position is on the day of the schedule's "now" (celery/celery#10494): the
    # probe's "now" is each position, so every Celery version answers alike.
    probe = _Probe(cron)

    def wall(at: datetime) -> datetime:
        return at.astimezone(tz).replace(tzinfo=None, fold=0)

    def step(position: datetime) -> datetime | None:
        aware = position.replace(tzinfo=tz)
        probe.clock = aware
        _, delta, _ = probe.schedule.remaining_delta(aware, tz=tz)
        following = (aware + delta).replace(tzinfo=None, fold=0)
        return following if following > position else None

    def instant(position: datetime) -> datetime:
        return _wall_to_utc(position, tz)

    hint_utc = to_utc(hint) if hint is not None else None
    start = wall(hint_utc) if hint_utc is not None and hint_utc <= now else None
    if start is not None and instant(start) != hint_utc:  # not an instant of this schedule
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


