"""The start-up rule of the scheduler mixin: which slot an entry continues after.

A beat does not trust ``last_run_at`` from its schedule file: the first time it
sees an entry (at start, or when the entry is added or re-timed at run time) it
anchors the entry on its slots. With ``singleton_beat_catch_up = "latest"`` the
latest slot is due at once (claimed: sent only if no beat sent it); with
``"none"`` it counts as done, and is only looked at in case another beat
claimed it and does not send it.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from ..config import SingletonSettings
from .claims import Claim
from .entries import entry_spec
from .handover import Handover
from .slots import Slot, SlotError, current_slot, slot_before

__all__ = ["SlotAnchoring"]


class SlotAnchoring:
    """Anchors of entries on their slots (see the module docstring); a base of the mixin."""

    # Set by SingletonSchedulerMixin.__init__.
    singleton_settings: SingletonSettings
    handover: Handover
    _handled: dict[str, datetime]
    _hints: dict[str, datetime]

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
        return anchored

    def _normalize(self, entry: Any) -> None:
        """Give the entry the ``last_run_at`` its slots imply (not the stored one)."""
        handled = self._handled.get(entry.name)
        if handled is None:
            handled = self._first_sight(entry)
            self._handled[entry.name] = handled
        if entry.last_run_at != handled:
            entry.last_run_at = handled

    def _first_sight(self, entry: Any) -> datetime:
        """Start-up rule: the latest slot is due ("latest") or counts as done ("none").

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
        if self.singleton_settings.beat_catch_up == "latest":
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
