"""Sending of the scheduler mixin: an entry's slot is reserved, claimed, then sent or skipped.

Celery's scheduler calls ``reserve`` (the slot is chosen here), then
``apply_entry`` / ``apply_async``: the slot is claimed (with the slots of other
due entries, :mod:`.claiming`) and only a slot this beat won is published, with
the slot, instance and claim in its headers and a task id derived from the
claim key (:func:`~.entries.slot_task_id`). A claim won but not published is
handed back, and sent again by this beat after a back-off if no other beat did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..log import logger
from ..task.slot_delivery import CLAIM_HEADER, ENTRY_HEADER, INSTANCE_HEADER, SLOT_HEADER
from .claiming import ClaimRounds
from .claims import Claim
from .entries import ENTRY_OPTION, SlotSpec, entry_spec, slot_task_id
from .slots import Slot, SlotError, current_slot, slot_before

__all__ = ["SlotSending"]


@dataclass
class Reservation:
    """A slot chosen when an entry was reserved, before it is claimed and sent."""

    slot: Slot | None
    previous: datetime | None
    error: str | None = None


if TYPE_CHECKING:  # pragma: no cover
    from celery.beat import Scheduler as _SchedulerBase
else:
    _SchedulerBase = object


class SlotSending(ClaimRounds, _SchedulerBase):
    """Reserve, claim and send (see the module docstring); a base of the mixin."""

    # Set by SingletonSchedulerMixin.__init__.
    _sending: tuple[Claim, float] | None
    _reheap: dict[str, float]
    _provisional: dict[str, Any]
    _unknown: dict[str, datetime]
    _since: dict[str, datetime]
    _next_look: tuple[Any, float] | None

    def settle(self) -> None:
        raise NotImplementedError  # SlotAnchoring

    def _spec(self, entry: Any) -> SlotSpec | None:
        raise NotImplementedError

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
        if reserved.slot is not None and reserved.slot.next is not None:
            # Where the entry goes back in the heap after this send: the slot after
            # the reserved one, not "when the send ended + the delay is_due gave
            # before it" (see _when).
            self._next_look = (new_entry, reserved.slot.next.timestamp())
        return new_entry

    def _when(self, entry: Any, next_time_to_run: Any, *args: Any, **kwargs: Any) -> float:
        """Heap time of ``entry``: for the entry just sent, no later than its next slot.

        After a send, Celery's ``tick`` puts the entry back in the heap at *the time
        after the send* plus the delay ``is_due`` gave *before* it. A send that took
        longer than the time left to the next slot (a publish waiting for the broker
        to come back) would then look again only after that slot had passed, and
        the slot would be lost. The slot after the one reserved comes from the
        schedule: once it is past, the entry is due at once, and its latest slot is
        claimed and sent, late.
        """
        when = float(super()._when(entry, next_time_to_run, *args, **kwargs))
        pending = self._next_look
        if pending is not None and pending[0] is entry:
            self._next_look = None
            when = min(when, pending[1])
        return when

    def _choose_slot(self, entry: Any, previous: datetime | None) -> Reservation:
        prefetched = self._prefetched.get(entry.name)
        if prefetched is not None:
            return Reservation(prefetched[0].slot, previous)
        try:
            slot = current_slot(entry.schedule, self._now(), self._hints.get(entry.name))
        except SlotError as exc:
            return Reservation(None, previous, str(exc))
        if slot is not None:
            self._hints[entry.name] = slot.at
        return Reservation(slot, previous)

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        if self._spec(entry) is None:
            super().apply_entry(entry, producer=producer)
            return
        decided = self._decide(entry)
        if decided is None:
            return
        self._sending = decided
        try:
            super().apply_entry(entry, producer=producer)
        finally:
            self._sending = None

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True,
                    **kwargs: Any) -> Any:
        if advance:
            entry = self.reserve(entry)
        decided: tuple[Claim, float] | None = None
        if self._spec(entry) is not None:
            sending = self._sending
            decided = sending if sending and sending[0].name == entry.name else None
            if decided is None:  # called directly (RedBeat, custom ticks): claim here
                decided = self._decide(entry)
                if decided is None:
                    return None
        return self._send(entry, producer, decided, **kwargs)

    def _send(self, entry: Any, producer: Any, decided: tuple[Claim, float] | None,
              **kwargs: Any) -> Any:
        """Send through the base scheduler with the slot in the headers.

        The message's task id is derived from the claim key (one id per slot,
        whichever beat sends it). The ``singleton`` option is not a publish
        option: it is left out of the options for the time of the call.
        """
        options = dict(entry.options or {})
        options.pop(ENTRY_OPTION, None)
        if decided is not None:
            claim = decided[0]
            headers = dict(options.get("headers") or {})
            headers[SLOT_HEADER] = claim.slot.label
            headers[INSTANCE_HEADER] = self.instance_id
            headers[CLAIM_HEADER] = claim.key
            headers[ENTRY_HEADER] = claim.key.split("{beat:", 1)[1].rsplit("}:", 1)[0]
            options["headers"] = headers
            options.setdefault("task_id", slot_task_id(claim.key))
        saved = entry.options
        entry.options = options
        try:
            result = super().apply_async(entry, producer=producer, advance=False, **kwargs)
        except Exception:
            # Not published (broker down, ...): hand the slot back so that the
            # other beats (or one starting within the slot) can still send it,
            # and send it again after a back-off if none did.
            if decided is not None:
                self._give_back_unpublished([decided[0]])
            raise
        finally:
            entry.options = saved
        if decided is not None:
            self.handover.sent(*decided)
        self.handover.published(time.monotonic())
        return result

    def _missed_or_unsure(self, name: str, slot: Slot) -> bool:
        """For an entry anchored while Redis could not tell whether its latest slot was
        missed (see :mod:`.anchoring`): whether ``slot`` may be sent. Not when it came
        before the entry was scheduled, nor, failing open while Redis still cannot
        tell, when it came before this beat saw the entry. (Failing closed, the claim
        fails too and the slot waits for Redis, as any slot.)"""
        self.settle()
        since = self._since.get(name)
        if since is not None:
            if slot.at < since:
                logger.info("beat: %s: slot %s came before the entry was scheduled (%s): not sent",
                            name, slot.label, since.isoformat())
                return False
            return True
        if self.singleton_settings.beat_fails_open:
            self._provisional.pop(name, None)
            seen = self._unknown.get(name)
            if seen is not None and slot.at < seen:
                logger.warning("beat: %s: slot %s not sent: Redis cannot tell whether it was "
                               "missed (it came before this beat started)", name, slot.label)
                return False
        return True

    def _decide(self, entry: Any) -> tuple[Claim, float] | None:
        """Claim the entry's reserved slot; ``(claim, claimed at)`` if this beat sends, else None."""
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
        if name in self._provisional and not self._missed_or_unsure(name, slot):
            return None

        decided = self._prefetched.pop(name, None)
        if decided is not None and decided[0].slot.at != slot.at:
            self._hand_back([decided[0]])
            decided = None
        if decided is None:
            decided = self._claim_with_batch(entry, spec, slot)
        claim = decided[0]

        if claim.won:
            logger.info("beat: %s: slot %s won by %s, sending", name, slot.label, self.instance_id)
            return decided
        if claim.won is False:
            logger.info("beat: %s: slot %s already claimed by %s, skipping",
                        name, slot.label, claim.holder or "another instance")
            return None
        if claim.deferred:  # never sent unclaimed, fail open or not: Redis answers
            logger.info("beat: %s: slot %s waits: %s", name, slot.label, claim.error)
            self._handled[name] = slot_before(entry.schedule, slot)
            self._reheap[name] = claim.deferred
            return None
        if self.singleton_settings.beat_fails_open:
            logger.warning("beat: %s: slot %s sent WITHOUT a claim (fail open): Redis unavailable: %s",
                           name, slot.label, claim.error)
            return decided
        # Fail closed: not sent; the slot stays due and is tried again after the back-off.
        self._handled[name] = slot_before(entry.schedule, slot)
        self._reheap[name] = self.breaker.remaining()
        self.breaker.report_unsent(name, slot, claim.error)
        return None
