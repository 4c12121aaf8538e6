"""Schedules that change while the beat runs: entries re-timed, leaving, coming back.

A scheduler whose entries live outside the app (django-celery-beat's database,
RedBeat's Redis) sees them change between two ticks. :class:`ScheduleFollower`
goes in front of :class:`~.scheduler.SingletonSchedulerMixin`; each time the
heap is rebuilt (which such a scheduler makes happen after every change), it
compares every entry's schedule with the one it saw last:

* an entry given a new schedule continues after the last slot this beat
  handled, on the new schedule: an interval entry's next slot is the next
  multiple of the *new* period after it;
* an entry that left the schedule (disabled, deleted) and comes back has the
  slots it missed meanwhile handled by the start-up rule
  (``singleton_beat_catch_up``), as a beat started then would.

Every beat computes the same slots from the same schedule, so the claims still
give one send per slot while beats see a change at slightly different moments.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from celery import schedules

from ..log import logger
from .scheduler import SingletonSchedulerMixin

__all__ = ["ScheduleFollower"]

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)
_ABSENT = object()


def _floor(at: datetime, period: timedelta) -> datetime:
    """The latest epoch-aligned multiple of ``period`` at or before ``at`` (UTC)."""
    step = period // _MICROSECOND
    elapsed = (at.astimezone(timezone.utc) - _EPOCH) // _MICROSECOND
    return _EPOCH + timedelta(microseconds=elapsed // step * step)


# The follower goes in front of the mixin: typed as the mixin it extends, an object at run time.
if TYPE_CHECKING:  # pragma: no cover
    _Base = SingletonSchedulerMixin
else:
    _Base = object


class ScheduleFollower(_Base):
    """Re-anchor entries whose schedule changed or that came back (see the module docstring).

    Put it first: ``class S(ScheduleFollower, SingletonSchedulerMixin, BaseScheduler)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Per entry name: the schedule this beat last built its heap with.
        self._seen_schedules: dict[str, Any] = {}
        # Entries handled before that the schedule no longer has.
        self._away: set[str] = set()
        super().__init__(*args, **kwargs)

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        self._follow_schedule_changes(self.schedule)
        super().populate_heap(*args, **kwargs)

    def _follow_schedule_changes(self, entries: dict[str, Any]) -> None:
        """Re-anchor the entries of ``entries`` that were re-timed or came back.

        Slots missed meanwhile (the entry was away, or its new schedule has a
        slot between the last one handled and now) follow the start-up rule:
        ``"latest"`` sends the latest one at once (unless another beat already
        claimed it), ``"none"`` counts slots up to now as handled.
        """
        handled = self.handled_entries()
        for name in handled:
            if name not in entries and name not in self._away:
                # Disabled, deleted, or out of the source's window: kept, re-anchored if it comes back.
                logger.debug("beat: %s: no longer in the schedule", name)
                self._away.add(name)
        for name, entry in entries.items():
            schedule = entry.schedule
            seen = self._seen_schedules.get(name, _ABSENT)
            self._seen_schedules[name] = schedule
            back = name in self._away
            self._away.discard(name)
            if name not in handled or not (back or (seen is not _ABSENT and seen != schedule)):
                continue
            last = handled[name]
            if isinstance(schedule, schedules.schedule):
                last = _floor(last, schedule.run_every)
            anchored = self.reanchor(entry, last)
            if back:
                logger.debug("beat: %s: back in the schedule; slots after %s are due",
                             name, anchored.isoformat())
            else:
                logger.info("beat: %s: schedule changed from %s to %s; slots after %s are due",
                            name, seen, schedule, anchored.isoformat())
