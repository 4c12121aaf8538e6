"""Book-keeping of the pending -> sent life of claims, in one beat. Pure: no Redis.

Two lists, both keyed by claim key:

* *unmarked*: claims this beat won and published, not yet marked ``sent`` in
  Redis. Marks ride on the next claim round trip, or go out on their own
  once a third of the pending lease has passed since the claim was made; when
  claims won together in one batch are sent after that, one by one, their
  marks go out together at most every tenth of the lease (not one round trip
  per send): a mark waits at most that long after its send.
* *watched*: slots this beat lost to a claim that was still ``pending`` (or
  ``released``). Each is looked at again once the pending lease would have
  ended (at once for ``released``); the scheduler then takes over whatever is
  still unsent (see :mod:`.claims`). Slots a beat started with catch-up
  ``"none"`` counts as done are looked at too (holder not known yet); such a look
  put off by a recovery window or Redis down is made one lease after Redis
  answers again, when the claims the others held back until then are made. So are
  this beat's own slots whose publish failed (broker down), handed back: after
  a back-off that grows with consecutive failed publishes (one lease, doubling,
  up to :attr:`Handover.retry_max`), counted from the latest failed publish for
  all of them (they go together), and at once when a publish works again.
  The others may take such a slot at once; if none did, this beat sends it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from .claims import RELEASED, Claim

__all__ = ["Handover", "Watch"]


@dataclass(order=True)
class Watch:
    """A slot lost to an unsent claim; looked at again at ``due`` (monotonic seconds)."""

    due: float
    order: int
    claim: Claim = field(compare=False)  # ``holder_value`` is the exact value seen
    #: This beat's own slot, handed back after a failed publish: sent again by it.
    retry: bool = field(default=False, compare=False)
    #: A look put off by a recovery window or Redis down: once Redis answers it waits
    #: one more lease, as the start-up look waits out a slot's first lease (the others'
    #: claims held back until then are made as Redis answers, not before).
    settling: bool = field(default=False, compare=False)

    @property
    def is_look(self) -> bool:
        """A look at a slot this beat did not try to claim (its holder not known yet)."""
        return not self.retry and self.claim.holder_value is None


class Handover:
    """Claims waiting to be marked sent, and slots waiting to be taken over."""

    #: Longest wait (seconds) before this beat tries again to send a slot whose
    #: publish failed (the lease, if longer).
    retry_max: float = 30.0

    def __init__(self, lease: float) -> None:
        self.lease = lease
        #: Consecutive failed publishes (0 once one works again).
        self.publish_failures = 0
        # Insertion order is claim order, so the first item is the oldest.
        self._unmarked: dict[str, tuple[Claim, float]] = {}
        self._watched: list[Watch] = []  # a heap on ``due``
        self._order = itertools.count()
        #: Monotonic time of the last marks taken (-inf: none yet).
        self._last_marks = float("-inf")

    # ----------------------------------------------------------------- our sends

    def sent(self, claim: Claim, claimed_at: float) -> None:
        """``claim`` (won at monotonic ``claimed_at``) was published; mark it soon."""
        if claim.won and claim.value is not None:
            self._unmarked[claim.key] = (claim, claimed_at)

    def marks_due(self, now: float) -> bool:
        """Whether the unmarked claims must be marked now (see the module docstring)."""
        due = self._marks_at()
        return due is not None and now >= due

    def _marks_at(self) -> float | None:
        oldest = next(iter(self._unmarked.values()), None)
        if oldest is None:
            return None
        return max(oldest[1] + self.lease / 3, self._last_marks + self.lease / 10)

    def take_marks(self, now: float) -> list[Claim]:
        """Every unmarked claim (the caller marks them all in one round trip at ``now``)."""
        claims = [claim for claim, _ in self._unmarked.values()]
        self._unmarked.clear()
        if claims:
            self._last_marks = now
        return claims

    def published(self, now: float) -> None:
        """A publish worked: the slots waiting for the broker to come back are due now."""
        if not self.publish_failures:
            return
        self.publish_failures = 0
        for watch in self._watched:
            if watch.retry and watch.due > now:
                watch.due = now
        heapq.heapify(self._watched)

    def publish_failed(self, claims: Iterable[Claim], now: float) -> None:
        """A publish failed; ``claims`` (this beat's, handed back unsent) are retried
        after the back-off (see the module docstring), and so are the slots handed back
        earlier: the back-off counts from the latest failed publish, not from each slot's
        own (a slot whose shorter back-off ran out during a burst of failing publishes
        would otherwise be tried again right after a publish that found the broker down)."""
        self.publish_failures += 1
        due = now + self.retry_delay()
        moved = False
        for watch in self._watched:
            if watch.retry and watch.due < due:
                watch.due = due
                moved = True
        if moved:
            heapq.heapify(self._watched)
        self.retry(claims, now)

    def retry(self, claims: Iterable[Claim], now: float) -> None:
        """Look at ``claims`` (this beat's, unsent: ``holder_value`` as in Redis) again after
        the current back-off, and send them if they are still unsent."""
        due = now + self.retry_delay()
        for claim in claims:
            heapq.heappush(self._watched, Watch(due, next(self._order), claim, retry=True))

    def retry_delay(self) -> float:
        """Seconds until slots handed back now are tried again (a lease before any failure)."""
        doublings = min(max(self.publish_failures - 1, 0), 16)
        return float(min(self.lease * 2 ** doublings, max(self.lease, self.retry_max)))

    # ----------------------------------------------------------------- others' claims

    def watch(self, claim: Claim, now: float) -> None:
        """Look at ``claim`` (lost, holder unsent) again when its lease would end."""
        self.look(claim, now if claim.holder_state == RELEASED else now + self.lease)

    def look(self, claim: Claim, due: float) -> None:
        """Look at ``claim`` at ``due``; with no ``holder_value`` (a slot this beat did not
        try to claim), only to learn its holder: an unsent one found is then watched."""
        heapq.heappush(self._watched, Watch(due, next(self._order), claim))

    def later(self, watches: Iterable[Watch], due: float) -> None:
        """Put ``watches`` back, to be looked at (or retried) at ``due``: Redis cannot be
        used before (recovery window, or down). Looks among them settle once it can."""
        for watch in watches:
            heapq.heappush(self._watched, Watch(due, next(self._order), watch.claim, retry=watch.retry,
                                                settling=watch.settling or watch.is_look))

    def settle(self, watches: Iterable[Watch], now: float) -> None:
        """Redis answers again: ``watches`` (settling looks) are looked at one lease from ``now``."""
        for watch in watches:
            heapq.heappush(self._watched, Watch(now + self.lease, next(self._order), watch.claim))

    def due_watches(self, now: float, limit: int) -> list[Watch]:
        """Remove and return up to ``limit`` watches whose time has come."""
        due: list[Watch] = []
        while self._watched and self._watched[0].due <= now and len(due) < limit:
            due.append(heapq.heappop(self._watched))
        return due

    # ----------------------------------------------------------------- timing

    def next_wake(self, now: float) -> float | None:
        """Seconds until something here needs the scheduler; None when idle."""
        times = [self._watched[0].due] if self._watched else []
        marks = self._marks_at()
        if marks is not None:
            times.append(marks)
        return max(min(times) - now, 0.0) if times else None
