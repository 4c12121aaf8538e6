"""The Redis side of the hand-over path of the scheduler mixin: hand-backs and take-overs.

:class:`ClaimHandBacks` is the base of :class:`~.claiming.ClaimRounds`: the claim
rounds win slots, and what this beat won but did not send, or another beat left
unsent, goes through here (one compare-and-set round trip each,
:meth:`~.claims.ClaimStore.swap`); :class:`~.handover.Handover` keeps what is
waited for in between. Apart from the claim rounds because it is the other end of
a claim: what becomes of it once it was won, not how it is won.

* handing claims won but not sent back as ``released`` (those whose publish
  failed are sent again by this beat after a back-off if no other beat did);
* taking over, and sending, slots whose claim stayed unsent past its pending lease
  (slots lost to such a claim, and slots a catch-up ``"none"`` start counted as done).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import redis

from ..config import SingletonSettings
from ..log import logger
from ..task.slot_delivery import parse_claim
from .breaker import Breaker
from .claims import PENDING, RELEASED, UNSENT, Claim, ClaimStore, claim_value
from .handover import Handover

__all__ = ["ClaimHandBacks"]


class ClaimHandBacks:
    """Hand-backs and take-overs of a beat instance (see the module docstring)."""

    # Set by SingletonSchedulerMixin.__init__ (and Celery's Scheduler: schedule).
    singleton_settings: SingletonSettings
    instance_id: str
    claims: ClaimStore
    handover: Handover
    breaker: Breaker
    claim_batch_size: int
    _prefetched: dict[str, tuple[Claim, float]]
    schedule: Any  # Celery's Scheduler property (annotation only: no attribute here)

    def _now(self) -> datetime:
        raise NotImplementedError

    def _send(self, entry: Any, producer: Any, decided: tuple[Claim, float] | None,
              **kwargs: Any) -> Any:
        raise NotImplementedError

    def _record(self, won: list[tuple[Claim, Any]], lost: list[tuple[Claim, Any]],
                taken: list[tuple[Claim, Any]], at: float) -> None:
        raise NotImplementedError  # ClaimRounds

    def _hand_back(self, claims: list[Claim]) -> None:
        """Give claims won but not sent back as ``released``: others may send them at once."""
        swaps = [(claim.key, claim.value, claim_value(self.instance_id, 0, RELEASED), 0)
                 for claim in claims if claim.won and claim.value is not None]
        if not swaps:
            return
        try:
            self.claims.swap(swaps)
        except redis.RedisError as exc:
            logger.warning("beat: could not hand back %d unsent claim(s) (the pending lease "
                           "ends them): %s", len(swaps), exc)

    def _give_back_unpublished(self, claims: list[Claim], failed: bool = True) -> None:
        """Hand back claims whose slot this beat could not publish (``failed``: a publish
        failed; else it was not tried), and retry them after the back-off.

        The others may send a ``released`` slot at once; if none did when the back-off
        ends, this beat takes it back and sends it (:meth:`_take_over_due`). A claim
        that could not be handed back (Redis down too) is retried as it stands.
        """
        mine = [claim for claim in claims if claim.won and claim.value is not None]
        released = claim_value(self.instance_id, 0, RELEASED)
        expected: list[bytes | None]
        try:
            outcomes = self.claims.swap([(claim.key, claim.value or "", released, 0) for claim in mine])
        except redis.RedisError as exc:
            logger.warning("beat: could not hand back %d unsent claim(s): %s", len(mine), exc)
            expected = [(claim.value or "").encode() for claim in mine]
        else:
            # Not swapped: another beat took the slot over meanwhile (it sends it), or
            # the claim expired; neither is this beat's to send any more.
            expected = [released.encode() if swapped else None for swapped, _ in outcomes]
        retry = [Claim(claim.name, claim.slot, claim.key, False, holder=self.instance_id,
                       holder_value=value)
                 for claim, value in zip(mine, expected, strict=True) if value is not None]
        now = time.monotonic()
        if failed:
            self.handover.publish_failed(retry, now)
        else:
            self.handover.retry(retry, now)

    def _hand_back_prefetched(self) -> None:
        claims = [claim for claim, _ in self._prefetched.values()]
        self._prefetched.clear()
        if claims:
            logger.info("beat: handing back %d claimed but unsent slot(s)", len(claims))
            self._hand_back(claims)

    def _take_over_due(self, now: float) -> None:
        """Take over (and send) slots whose claim stayed unsent past its pending lease."""
        watches = self.handover.due_watches(now, self.claim_batch_size)
        if not watches:
            return
        error: redis.RedisError | None = None
        try:
            wait = self.claims.reach()
        except redis.RedisError as exc:
            wait, error = 0.0, exc
        if wait > 0 or error is not None:
            # A recovery window (the holder may be writing back a mark the server lost),
            # or Redis down: look again once it is over.
            if error is not None:
                self.breaker.failed(error)
            self.handover.later(watches, now + (wait or self.breaker.remaining()))
            return
        # A look put off until Redis could be used looks one lease later: the claims the
        # others held back (window, outage) are made now, maybe just after this tick.
        settling = [watch for watch in watches if watch.settling]
        if settling:
            self.handover.settle(settling, now)
            watches = [watch for watch in watches if not watch.settling]
            if not watches:
                return
        at = round(self._now().timestamp(), 3)
        mine = claim_value(self.instance_id, at, PENDING)
        swaps = [(w.claim.key, w.claim.holder_value or b"", mine,
                  round(max(self.singleton_settings.done_ttl, 1) * 1000)) for w in watches]
        try:
            outcomes = self.claims.swap(swaps)
        except redis.RedisError as exc:
            self.breaker.failed(exc)
            for watch in watches:
                if watch.retry:
                    self.handover.retry([watch.claim], now)
                elif watch.is_look:  # settles once Redis answers (see above)
                    self.handover.later([watch], now)
                else:
                    self.handover.watch(watch.claim, now)
            return
        taken: list[tuple[Claim, Any]] = []
        refused = False  # a publish of this round failed: the broker is down
        untried: list[Claim] = []
        for watch, (swapped, current) in zip(watches, outcomes, strict=True):
            claim = watch.claim
            if not swapped:
                claim.holder_value = current
                parsed = parse_claim(current)
                if (parsed is not None and parsed.get("state") in UNSENT
                        and parsed.get("instance") != self.instance_id):
                    # Someone else took it over (or, for a look, holds it): watch them.
                    claim.holder = parsed.get("instance")
                    self.handover.watch(claim, now)
                continue
            entry = self.schedule.get(claim.name)
            taken_claim = Claim(claim.name, claim.slot, claim.key, True, value=mine,
                                holder=self.instance_id, holder_value=claim.holder_value)
            if entry is None:
                self._hand_back([taken_claim])
                continue
            if refused:  # the others would fail too: they wait for the back-off
                untried.append(taken_claim)
                continue
            if watch.retry:
                logger.warning("beat: %s: slot %s was handed back after a failed publish; "
                               "sending it again", claim.name, claim.slot.label)
            else:
                logger.warning("beat: %s: slot %s took over from %s (claimed, not sent within "
                               "%.1fs); sending", claim.name, claim.slot.label,
                               claim.holder or "an unknown beat", self.handover.lease)
            try:
                self._send(entry, getattr(self, "producer", None), (taken_claim, now))
            except Exception as exc:  # handed back by _send; Celery's own tick logs likewise
                logger.error("beat: %s: slot %s not sent after take-over: %s",
                             claim.name, claim.slot.label, exc)
                refused = True
                continue
            taken.append((taken_claim, entry))
        if untried:
            self._give_back_unpublished(untried, failed=False)
        if taken:
            self._record([], [], taken, at)
