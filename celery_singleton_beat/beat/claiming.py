"""The Redis side of the scheduler mixin: claim round trips, sent marks, hand-backs, take-overs.

:class:`ClaimRounds` is the base of
:class:`~celery_singleton_beat.beat.scheduler.SingletonSchedulerMixin`, which
holds the state used here (set in its ``__init__``) and Celery's scheduler hooks.
Each method is one round trip to Redis (:class:`~.claims.ClaimStore`):

* a claim of the slot being sent, with the slots of other due entries claimed
  ahead and the ``sent`` marks of earlier sends riding along;
* marking published claims ``sent`` (when no claim round trip comes soon);
* handing claims won but not sent back as ``released`` (those whose publish
  failed are sent again by this beat after a back-off if no other beat did);
* taking over, and sending, slots whose claim stayed unsent past its pending lease
  (slots lost to such a claim, and slots a catch-up ``"none"`` start counted as done).
"""

from __future__ import annotations

import heapq
import time
from datetime import datetime
from typing import Any

import redis

from ..config import SingletonSettings
from ..log import logger
from ..task.slot_delivery import parse_claim
from .breaker import Breaker
from .claims import PENDING, RELEASED, SENT, UNSENT, Claim, ClaimStore, claim_value
from .entries import SlotSpec, entry_spec
from .handover import Handover
from .slots import Slot, current_slot

__all__ = ["ClaimRounds"]


class ClaimRounds:
    """Claims, marks, hand-backs and take-overs of a beat instance (see the module docstring)."""

    # Set by SingletonSchedulerMixin.__init__ (and Celery's Scheduler: schedule, _heap).
    singleton_settings: SingletonSettings
    instance_id: str
    claims: ClaimStore
    handover: Handover
    breaker: Breaker
    claim_batch_size: int
    history_size: int
    _handled: dict[str, datetime]
    _hints: dict[str, datetime]
    _reserved: dict[str, Any]
    _prefetched: dict[str, tuple[Claim, float]]
    _provisional: dict[str, Any]
    schedule: Any  # Celery's Scheduler property (annotation only: no attribute here)

    def _now(self) -> datetime:
        raise NotImplementedError

    def _send(self, entry: Any, producer: Any, decided: tuple[Claim, float] | None,
              **kwargs: Any) -> Any:
        raise NotImplementedError

    def _claim_with_batch(self, entry: Any, spec: SlotSpec, slot: Slot) -> tuple[Claim, float]:
        """Claim this slot, and ahead of time the slots of the other entries due now.

        Marks of earlier sends ride in the same round trip.
        """
        prefix = self.singleton_settings.key_prefix
        mine = Claim(entry.name, slot, spec.key(prefix, slot), None)
        now = time.monotonic()
        if self.breaker.is_open():
            mine.error = "Redis unavailable (waiting before the next attempt)"
            return mine, now
        try:
            wait = self.claims.reach()
            if wait <= 0:
                batch = [(mine, entry)]
                batch.extend(self._due_candidates(self._now(), exclude=entry.name,
                                                  limit=self.claim_batch_size - 1))
                self._claim_many(batch)
                wait = self.claims.window_left()
                if wait > 0:
                    # This very round trip found the server new (its connection was the first
                    # to it): a beat still on the former primary may have claimed the same
                    # slots there. Give them back and claim again once every beat wrote back.
                    self._hand_back([claim for claim, _ in batch if claim.won])
        except redis.RedisError as exc:
            self.breaker.failed(exc)
            mine.error = f"{type(exc).__name__}: {exc}"
            return mine, now
        self.breaker.ok()
        if wait > 0:  # a restart or failover: every beat writes back its claims first
            return Claim(entry.name, slot, mine.key, None, deferred=wait,
                         error=f"the lock Redis's recovery window ({wait:.1f}s left)"), now
        for claim, _ in batch[1:]:
            self._prefetched[claim.name] = (claim, now)
        return mine, now

    def _due_candidates(self, now: datetime, exclude: str, limit: int) -> list[tuple[Claim, Any]]:
        """Other singleton entries that the heap says are due at ``now``, in the order
        Celery's ``tick`` will take them off the heap.

        Walks only the due part of the heap (children of a node that is not due
        are not due either), smallest first: the entries claimed ahead are the ones
        sent next, so a burst larger than a batch claims each batch once, and each
        claim waits for its send no longer than it must. The cost follows the
        number of due entries looked at (a heap of the walk's frontier).
        """
        heap = getattr(self, "_heap", None)
        if not isinstance(heap, list) or not heap or limit <= 0:
            return []
        prefix = self.singleton_settings.key_prefix
        now_ts = now.timestamp()
        found: list[tuple[Claim, Any]] = []
        frontier: list[tuple[Any, int]] = [(heap[0], 0)]  # (heap event, its index): events compare as in the heap
        size = len(heap)
        while frontier and len(found) < limit:
            event, index = heapq.heappop(frontier)
            if event[0] > now_ts:
                break  # the smallest left is not due: nothing after it is
            for child in (2 * index + 1, 2 * index + 2):
                if child < size:
                    heapq.heappush(frontier, (heap[child], child))
            entry = event[2]
            name = entry.name
            if (name == exclude or name in self._prefetched or name in self._reserved
                    or name in self._provisional):  # decided when it is sent
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
            found.append((Claim(name, slot, spec.key(prefix, slot), None), entry))
        return found

    def _claim_many(self, batch: list[tuple[Claim, Any]]) -> None:
        """Claim ``batch`` (and mark earlier sends) in one round trip; watch the slots lost
        to unsent claims; record the outcome (in the same round trip on one server)."""
        marks = self.handover.take_marks(time.monotonic())
        at = round(self._now().timestamp(), 3)
        self.claims.history_size = self.history_size  # a class attribute users may change
        try:
            _, recorded = self.claims.claim([claim for claim, _ in batch], at, self._mark_swaps(marks),
                                            [entry.task for _, entry in batch])
        except redis.RedisError:
            for claim in marks:  # not marked: try again with the next round trip
                self.handover.sent(claim, time.monotonic())
            raise
        now = time.monotonic()
        won: list[Any] = []
        lost: list[Any] = []
        for claim, entry in batch:
            (won if claim.won else lost).append((claim, entry))
            if not claim.won and claim.holder_state in UNSENT:
                self.handover.watch(claim, now)
        if not recorded:  # the record could not ride along (Cluster, replicas waited for)
            self._record(won, lost, [], at)

    def _record(self, won: list[tuple[Claim, Any]], lost: list[tuple[Claim, Any]],
                taken: list[tuple[Claim, Any]], at: float) -> None:
        self.claims.history_size = self.history_size  # a class attribute users may change
        try:
            self.claims.record(won, lost, taken, at)
        except redis.RedisError as exc:
            logger.warning("beat: could not record %d claim(s) in the history: %s",
                           len(won) + len(lost) + len(taken), exc)

    def _mark_swaps(self, claims: list[Claim]) -> list[tuple[str, str, str, int]]:
        swaps = []
        for claim in claims:
            assert claim.value is not None
            parsed = parse_claim(claim.value) or {}
            swaps.append((claim.key, claim.value,
                          claim_value(self.instance_id, parsed.get("at", 0), SENT), 0))
        return swaps

    def _mark_sent(self) -> None:
        """Mark every published, unmarked claim ``sent`` (one round trip)."""
        marks = self.handover.take_marks(time.monotonic())
        if not marks:
            return
        try:
            self.claims.swap(self._mark_swaps(marks))
        except redis.RedisError as exc:
            self.breaker.failed(exc)
            for claim in marks:  # try again after the back-off; the lease may pass meanwhile
                self.handover.sent(claim, time.monotonic())
            logger.warning("beat: could not mark %d sent slot(s): %s", len(marks), exc)

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
