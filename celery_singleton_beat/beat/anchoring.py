"""The start-up rule of the scheduler mixin: which slot an entry continues after.

A beat does not trust ``last_run_at`` from its schedule file: the first time it
sees an entry (at start, or when the entry is added or re-timed at run time) it
anchors the entry on its slots, by whether the entry's latest slot was *missed*
(:mod:`.records`: it came due while the entry was scheduled on some beat):

* not missed (the entry is new to every beat, or its record is gone): the slot
  counts as done, as with Celery's own scheduler, which sends nothing at start;
* missed, with ``singleton_beat_catch_up = "latest"``: the slot is due at once
  (claimed: sent only if no beat sent it); with ``"none"``: it counts as done.

A slot counted as done is still looked at once, in case another beat claimed
it and does not send it. When Redis cannot say (down at start), a ``"latest"``
beat anchors the entry as missed for now and decides when Redis answers, before
anything is sent.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import redis

from ..config import SingletonSettings
from ..log import logger
from .breaker import Breaker
from .claims import Claim
from .entries import entry_spec
from .handover import Handover
from .records import REFRESH, EntryRecords
from .slots import Slot, SlotError, current_slot, slot_before

__all__ = ["SlotAnchoring"]

#: Records renewed per tick (see ``_renew_records``).
RENEW_BATCH = 1000


@dataclass(frozen=True)
class Provisional:
    """An entry anchored as missed while Redis could not tell (see :meth:`SlotAnchoring.settle`)."""

    claim_name: str
    slot: Slot  # the latest slot when this beat first saw the entry
    anchored: datetime  # the anchor given: the entry's last_run_at until decided


class SlotAnchoring:
    """Anchors of entries on their slots (see the module docstring); a base of the mixin."""

    # Set by SingletonSchedulerMixin.__init__.
    singleton_settings: SingletonSettings
    handover: Handover
    breaker: Breaker
    records: EntryRecords
    _handled: dict[str, datetime]
    _hints: dict[str, datetime]
    _prefetched: dict[str, Any]
    #: Per entry name: since when it is scheduled on some beat (from its record).
    _since: dict[str, datetime]
    #: Entries anchored as missed while Redis could not tell.
    _provisional: dict[str, Provisional]
    #: Entries whose record could not be read, and when this beat first saw them.
    _unknown: dict[str, datetime]
    #: Monotonic time of the next renewal of the records, and the entries still to renew.
    _records_due: float
    _renewing: list[Any]
    #: Entries first seen since the last start-up report (see ``populate_heap``).
    _new_entries: list[str]
    schedule: Any  # Celery's Scheduler property (annotation only)

    def _now(self) -> datetime:
        raise NotImplementedError

    def handled_entries(self) -> dict[str, datetime]:
        """Per entry name, the latest slot this beat handled (a copy)."""
        return dict(self._handled)

    def reanchor(self, entry: Any, after: datetime) -> datetime:
        """Let ``entry`` continue after ``after`` on its current schedule; the new anchor.

        For schedules that change at run time: slots up to ``after`` count as
        handled, and slots missed before now follow ``singleton_beat_catch_up``
        (as at start-up). Every beat computes the same slots, so the claims
        still give one send per slot.
        """
        anchored = max(after, self._first_sight(entry))
        self._handled[entry.name] = anchored
        self._hints.pop(entry.name, None)
        self._provisional.pop(entry.name, None)
        return anchored

    def _normalize(self, entry: Any) -> None:
        """Give the entry the ``last_run_at`` its slots imply (not the stored one)."""
        handled = self._handled.get(entry.name)
        if handled is None:
            handled = self._first_sight(entry)
            self._handled[entry.name] = handled
        if entry.last_run_at != handled:
            entry.last_run_at = handled

    # ----------------------------------------------------------------- records

    def _sight(self, entries: Iterable[Any]) -> None:
        """Read (and write where missing) the records of ``entries`` not read yet, in one round trip."""
        names: dict[str, str] = {}
        for entry in entries:
            if entry.name not in self._since:
                try:
                    spec = entry_spec(entry)
                except ValueError:  # refused when applied
                    continue
                if spec is not None:
                    names[entry.name] = spec.name
        self._read_records(names)

    def _read_records(self, names: dict[str, str]) -> bool:
        """Records of ``names`` (entry name -> claim name) in one round trip; False if Redis failed.

        Each is written, where missing, with the time this beat first saw the
        entry. An entry whose record cannot be read is remembered as unknown
        (with that time): the start-up rule decides without it, and it is not
        asked again one by one.
        """
        if not names:
            return True
        now = self._now()
        first: dict[str, datetime] = {}
        for name, claim in names.items():
            at = self._since.get(name) or self._unknown.get(name) or now
            first[claim] = min(first.get(claim, at), at)
        try:
            since = self.records.sight({claim: at.timestamp() for claim, at in first.items()})
        except redis.RedisError as exc:
            self.breaker.failed(exc)
            for name in names:
                self._unknown.setdefault(name, now)
            return False
        for name, claim in names.items():
            self._since[name] = datetime.fromtimestamp(since[claim], timezone.utc)
            self._unknown.pop(name, None)
        return True

    def _renew_records(self, now: float) -> None:
        """Renew the records of every singleton entry every :data:`REFRESH`.

        :data:`RENEW_BATCH` entries per tick (one round trip each, ~30 ms for
        1,000 on a loaded machine), so that a large schedule does not hold up a
        slot; not between claims won ahead and their publish. A failure is tried
        again a minute later.
        """
        if self._prefetched or (not self._renewing and now < self._records_due):
            return
        if not self._renewing:
            self._renewing = list(self.schedule.values())
        batch, self._renewing = self._renewing[:RENEW_BATCH], self._renewing[RENEW_BATCH:]
        names: dict[str, str] = {}
        for entry in batch:
            try:
                spec = entry_spec(entry)
            except ValueError:
                continue
            if spec is not None:
                names[entry.name] = spec.name
        if not self._read_records(names):
            self._renewing = []
            self._records_due = now + 60.0
        elif not self._renewing:
            self._records_due = now + REFRESH.total_seconds()

    def settle(self) -> None:
        """Decide the entries anchored as missed while Redis could not tell (one round trip).

        A slot that came before the entry was scheduled on any beat was not
        missed after all: it counts as done (unless it was handled meanwhile).
        """
        if not self._provisional or not self._read_records(
                {name: item.claim_name for name, item in self._provisional.items()}):
            return
        pending, self._provisional = self._provisional, {}
        for name, item in pending.items():
            scheduled = self._since[name]
            if item.slot.at < scheduled and self._handled.get(name) == item.anchored:
                self._handled[name] = item.slot.at
                logger.info("beat: %s: slot %s came before the entry was scheduled (%s): not sent",
                            name, item.slot.label, scheduled.isoformat())

    # ----------------------------------------------------------------- the rule

    def _first_sight(self, entry: Any) -> datetime:
        """Start-up rule: the latest slot is due (missed, catch-up "latest") or counts as done.

        A slot counted as done is still watched: if another beat claimed it and
        does not send it (it stops mid-burst, its publish fails, it dies), this
        beat takes it over, as any slot lost to an unsent claim. Another beat's
        work in progress is not a missed slot.
        """
        now = self._now()
        try:
            slot = current_slot(entry.schedule, now)
        except SlotError:
            return now
        if slot is None:
            return now
        name = entry.name
        latest = self.singleton_settings.beat_catch_up == "latest"
        try:
            spec = entry_spec(entry)
        except ValueError:  # refused, and logged, when applied
            return slot_before(entry.schedule, slot) if latest else slot.at
        if spec is None:
            return now
        if name not in self._since and name not in self._unknown:
            self._read_records({name: spec.name})
        since = self._since.get(name)
        if since is None and latest:  # Redis cannot tell now: decided by settle()
            anchored = slot_before(entry.schedule, slot)
            self._provisional[name] = Provisional(spec.name, slot, anchored)
            return anchored
        if since is not None and slot.at < since:
            self._new_entries.append(name)
        elif since is not None and latest:
            logger.debug("beat: %s: slot %s missed (scheduled since %s): due now",
                         name, slot.label, since.isoformat())
            return slot_before(entry.schedule, slot)
        self._watch_started(entry, slot, (now - slot.at).total_seconds())
        return slot.at

    def _watch_started(self, entry: Any, slot: Slot, age: float) -> None:
        """Look at the claim of ``slot`` (``age`` seconds old) once its first pending
        lease is over: by then any beat that claimed it on time has, and an unsent
        claim found is watched like a slot lost to it (see ``_take_over_due``)."""
        try:
            spec = entry_spec(entry)
        except ValueError:  # refused when applied: nothing to take over
            return
        if spec is None:
            return
        claim = Claim(entry.name, slot, spec.key(self.singleton_settings.key_prefix, slot), False)
        self.handover.look(claim, time.monotonic() + max(0.0, self.handover.lease - age))
