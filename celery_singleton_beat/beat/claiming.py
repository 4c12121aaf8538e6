"""The Redis side of the scheduler mixin: claim round trips and sent marks.

:class:`ClaimRounds` is the base of
:class:`~celery_singleton_beat.beat.scheduler.SingletonSchedulerMixin`, which
holds the state used here (set in its ``__init__``) and Celery's scheduler hooks.
Each method is one round trip to Redis (:class:`~.claims.ClaimStore`):

* a claim of the slot being sent, with the slots of other due entries claimed
  ahead and the ``sent`` marks of earlier sends riding along;
* marking published claims ``sent`` (when no claim round trip comes soon).

What becomes of a claim won but not sent (hand-backs), or left unsent by another
beat (take-overs), is in its base, :class:`~.claim_handback.ClaimHandBacks`.
"""

from __future__ import annotations

import heapq
import time
from datetime import datetime
from typing import Any

import redis

from ..log import logger
from ..task.slot_delivery import parse_claim
from .claim_handback import ClaimHandBacks
from .claims import SENT, UNSENT, Claim, claim_value
from .entries import SlotSpec, entry_spec
from .slots import Slot, current_slot

__all__ = ["ClaimRounds"]


class ClaimRounds(ClaimHandBacks):
    """Claims and marks of a beat instance (see the module docstring); its base hands back
    and takes over."""

    # Set by SingletonSchedulerMixin.__init__ (and Celery's Scheduler: _heap), besides
    # those ClaimHandBacks declares.
    history_size: int
    _handled: dict[str, datetime]
    _hints: dict[str, datetime]
    _reserved: dict[str, Any]
    _provisional: dict[str, Any]

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
