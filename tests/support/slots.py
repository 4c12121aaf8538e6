"""Time helpers: UTC datetimes and beat slot labels (``2024-05-01T12:00:00Z``)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta, timezone

UTC = timezone.utc


def utc(*args: int) -> datetime:
    """``datetime(*args)`` in UTC."""
    return datetime(*args, tzinfo=UTC)


def parse_slot(label: str) -> datetime:
    """The instant a slot label names (whole or fractional seconds)."""
    return datetime.strptime(label.replace("Z", "+0000"),
                             "%Y-%m-%dT%H:%M:%S.%f%z" if "." in label else "%Y-%m-%dT%H:%M:%S%z")


def slot_label(at: datetime) -> str:
    """The label of a whole-second slot at ``at``."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def labels(start: datetime, count: int, period: timedelta) -> list[str]:
    """Labels of ``count`` slots from ``start``, ``period`` apart."""
    return [slot_label(start + i * period) for i in range(count)]


def slot_floor(at: float, period: float) -> datetime:
    """The epoch-aligned slot of ``period`` seconds that contains the epoch time ``at``."""
    return datetime.fromtimestamp(at // period * period, UTC)


def expected_slots(first: datetime, last: datetime, period: timedelta) -> list[datetime]:
    """Every slot from ``first`` to ``last`` (inclusive), ``period`` apart."""
    slots, at = [], first
    while at <= last:
        slots.append(at)
        at += period
    return slots


def duplicates_and_misses(labels_sent: Iterable[str], period: timedelta) -> dict[str, int]:
    """For slot labels sent (with repeats): slots from the first to the last, sends,
    duplicate sends and slots never sent in between."""
    counts: dict[str, int] = {}
    for label in labels_sent:
        counts[label] = counts.get(label, 0) + 1
    if not counts:
        return {"slots": 0, "sent": 0, "duplicates": 0, "misses": 0}
    instants = sorted(parse_slot(label) for label in counts)
    expected = round((instants[-1] - instants[0]) / period) + 1
    return {"slots": expected, "sent": sum(counts.values()),
            "duplicates": sum(n - 1 for n in counts.values() if n > 1),
            "misses": expected - len(counts)}
