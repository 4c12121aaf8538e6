"""Counting the demo's executions per schedule slot: slots, duplicates, missed.

Definitions (per beat entry; the JSON summary adds them up over all entries):

* **slot**: a nominal fire time of the entry, as the singleton scheduler names
  it (:func:`celery_singleton_beat.beat.current_slot`): epoch-aligned instants
  for intervals, the scheduled instants for crontabs. Each execution carries
  the slot it was sent for (a message header), recorded by the task.
* **observed window**: from the first execution of the run (the cluster is
  up: a beat sends and a worker executes) to the moment the beats are
  stopped, less the entry's last period (at most ``SETTLE_SECONDS``), whose
  slot may have been due but not yet sent when the beats stopped. The
  warm-up before the first execution is left out, and so is a catch-up slot a
  beat sends at start-up on a namespace beats ran before (it is due before the
  window opens; a first start sends none).
* **slots**: the entry's slots inside the observed window.
* **executions**: every recorded execution of the entry, catch-up included.
* **duplicates**: executions beyond the first of any slot, window or not.
* **missed**: slots inside the window that have no execution.
* **outside**: slots outside the window that ran (the slot running when the
  window opened, the tail's): why ``executions`` can exceed ``slots``, as
  ``executions = slots - missed + outside + duplicates``.

The demo also follows the slot claims of the beat it kills (:func:`claim_keys`,
:func:`read_claim`): a beat killed between claiming a slot and sending it
leaves the claim ``pending``, and a surviving beat sends that slot one
``singleton_beat_pending_lease`` after it found the claim, not at once. The
demo stops the beats only once no such claim is left unsent, so the count
never takes a slot the library was about to send for a missed one.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

from celery import Celery
from celery.schedules import BaseSchedule, crontab, maybe_schedule
from celery.schedules import schedule as interval

from celery_singleton_beat.beat import current_slot, entry_spec, format_slot, slot_key

__all__ = [
    "NOT_SENT",
    "SETTLE_SECONDS",
    "EntryCount",
    "ScheduledEntry",
    "Summary",
    "beat_pid",
    "claim_keys",
    "count_executions",
    "format_table",
    "read_claim",
    "scheduled_entries",
    "slots_between",
]

UTC = timezone.utc

#: Longest tail of the window left out: a slot this close to the stop may not
#: have been sent yet (beats send a few milliseconds after the slot instant).
SETTLE_SECONDS = 2.0

#: Claim states in which the claim's beat has not (provably) sent the slot
#: (docs/beat.md, "Keys and formats in Redis"); ``sent`` and ``received`` are sent.
NOT_SENT = ("pending", "released")


@dataclass(frozen=True)
class ScheduledEntry:
    """A beat entry as the report needs it: what it sends and when."""

    name: str
    task: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    schedule: BaseSchedule
    #: The name its slots are claimed under (``options["singleton"]``); None: not claimed.
    claim_name: str | None = None

    @property
    def when(self) -> str:
        """``every 2s`` or ``cron 0 * * * *``, for the table."""
        if isinstance(self.schedule, crontab):
            # repr: "<crontab: 0 * * * * (m/h/dM/MY/d)>", the fields in cron's order.
            return "cron " + repr(self.schedule).removeprefix("<crontab: ").split(" (")[0]
        if isinstance(self.schedule, interval):
            return f"every {self.schedule.run_every.total_seconds():g}s"
        return type(self.schedule).__name__

    def sent(self, record: dict[str, Any]) -> bool:
        """Whether a journal record is an execution sent by beat for this entry."""
        return (record.get("slot") is not None and record.get("task") == self.task
                and record.get("args") == list(self.args)
                and (record.get("kwargs") or {}) == self.kwargs)


def scheduled_entries(app: Celery) -> list[ScheduledEntry]:
    """The entries of ``app.conf.beat_schedule``, with schedules bound to ``app``."""
    entries = []
    for name, spec in app.conf.beat_schedule.items():
        args, kwargs = tuple(spec.get("args") or ()), dict(spec.get("kwargs") or {})
        claimed = entry_spec(SimpleNamespace(name=name, args=args, kwargs=kwargs,
                                             options=spec.get("options") or {}))
        entries.append(ScheduledEntry(name, spec["task"], args, kwargs,
                                      maybe_schedule(spec["schedule"], app=app),
                                      claimed.name if claimed is not None else None))
    return entries


def _utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def slots_between(schedule: BaseSchedule, after: datetime, until: datetime) -> list[datetime]:
    """The schedule's slots ``s`` with ``after < s <= until``, oldest first."""
    slot = current_slot(schedule, after)
    if slot is None:  # no instant yet at ``after`` (one-off schedules)
        return []
    slots = [slot.at] if after < slot.at <= until else []
    while slot.next is not None and slot.next <= until:
        following = current_slot(schedule, slot.next, slot.at)
        if following is None or following.at <= slot.at:  # the schedule ended
            break
        slots.append(following.at)
        slot = following
    return slots


def claim_keys(entries: list[ScheduledEntry], prefix: str, since: datetime,
               until: datetime) -> dict[str, tuple[str, str]]:
    """The claim keys of the entries' slots from the one in effect at ``since`` to
    ``until``, each with its entry name and slot label (entries not claimed left out)."""
    keys: dict[str, tuple[str, str]] = {}
    for entry in entries:
        if entry.claim_name is None:
            continue
        current = current_slot(entry.schedule, since)
        start = current.at - timedelta(microseconds=1) if current is not None else since
        for at in slots_between(entry.schedule, start, until):
            keys[slot_key(prefix, entry.claim_name, at)] = (entry.name, format_slot(at))
    return keys


def read_claim(raw: bytes | str | None) -> tuple[str | None, str | None]:
    """``(instance, state)`` of a claim value; ``(None, None)`` for none (expired, never made)."""
    if raw is None:
        return None, None
    try:
        value = json.loads(raw)
    except ValueError:
        return None, None
    if not isinstance(value, dict):
        return None, None
    return value.get("instance"), value.get("state")


def last_period(schedule: BaseSchedule, at: datetime) -> timedelta:
    """The period of the slot in effect at ``at`` (a day for one-off schedules)."""
    slot = current_slot(schedule, at)
    return slot.period if slot is not None else timedelta(days=1)


@dataclass
class EntryCount:
    """What happened to one entry during the run."""

    name: str
    when: str
    slots: int = 0
    executions: int = 0
    duplicates: int = 0
    missed: int = 0
    outside: int = 0
    missed_slots: list[str] = field(default_factory=list)
    duplicate_slots: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"schedule": self.when, "slots": self.slots,
                                "executions": self.executions, "duplicates": self.duplicates,
                                "missed": self.missed, "outside": self.outside}
        if self.missed_slots:
            data["missed_slots"] = self.missed_slots
        if self.duplicate_slots:
            data["duplicate_slots"] = self.duplicate_slots
        return data


@dataclass
class Summary:
    """Counts of a whole run; ``window`` is (opened, closed) in epoch seconds.

    ``slots``, ``executions``, ``duplicates``, ``missed`` and ``outside`` are the
    sums over the entries.
    """

    entries: list[EntryCount]
    window: tuple[float, float] | None
    sent_by: dict[str, int]
    slots: int = field(init=False)
    executions: int = field(init=False)
    duplicates: int = field(init=False)
    missed: int = field(init=False)
    outside: int = field(init=False)

    def __post_init__(self) -> None:
        for total in ("slots", "executions", "duplicates", "missed", "outside"):
            setattr(self, total, sum(getattr(entry, total) for entry in self.entries))


def count_executions(entries: list[ScheduledEntry], records: list[dict[str, Any]],
                     stopped_at: float, beat_names: dict[str, str] | None = None) -> Summary:
    """Count ``records`` (the journal) against ``entries``' slots.

    ``stopped_at`` is when the beats were told to stop (epoch seconds);
    ``beat_names`` maps a beat's pid (as text) to its name for ``sent_by``.
    """
    opened = min((record["at"] for record in records), default=None)
    stop = _utc(stopped_at)
    counts: list[EntryCount] = []
    sent_by: Counter[str] = Counter()
    for entry in entries:
        per_slot = Counter(record["slot"] for record in records if entry.sent(record))
        count = EntryCount(entry.name, entry.when, executions=sum(per_slot.values()))
        count.duplicate_slots = {slot: n for slot, n in sorted(per_slot.items()) if n > 1}
        count.duplicates = sum(n - 1 for n in count.duplicate_slots.values())
        if opened is not None:
            settle = min(last_period(entry.schedule, stop), timedelta(seconds=SETTLE_SECONDS))
            window = [format_slot(at) for at in slots_between(entry.schedule, _utc(opened),
                                                              stop - settle)]
            count.slots = len(window)
            count.missed_slots = [slot for slot in window if slot not in per_slot]
            count.missed = len(count.missed_slots)
            count.outside = len(set(per_slot) - set(window))
        counts.append(count)
        for record in records:
            if entry.sent(record):
                sent_by[_beat_name(record.get("beat"), beat_names or {})] += 1
    window_bounds = (opened, stopped_at) if opened is not None else None
    return Summary(counts, window_bounds, dict(sorted(sent_by.items())))


def beat_pid(instance: str | None) -> str | None:
    """The pid in a scheduler instance id (``host:pid:token``), as text."""
    parts = (instance or "").split(":")
    return parts[-2] if len(parts) >= 3 else None


def _beat_name(instance: str | None, beat_names: dict[str, str]) -> str:
    """The demo's name for the beat with this instance id (the id itself if unknown)."""
    return beat_names.get(beat_pid(instance) or "", instance or "unknown")


def format_table(summary: Summary) -> str:
    """The per-entry table, with a total line."""
    header = ("entry", "schedule", "slots", "executions", "duplicates", "missed")
    rows = [(e.name, e.when, e.slots, e.executions, e.duplicates, e.missed)
            for e in summary.entries]
    rows.append(("all entries", "", summary.slots, summary.executions, summary.duplicates,
                 summary.missed))
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(row: tuple[Any, ...]) -> str:
        cells = [str(row[0]).ljust(widths[0]), str(row[1]).ljust(widths[1])]
        cells += [str(value).rjust(width) for value, width in zip(row[2:], widths[2:], strict=True)]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(header), rule, *map(line, rows[:-1]), rule, line(rows[-1])])
