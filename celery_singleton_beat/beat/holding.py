"""Entries held back by the scheduler mixin, and their place in Celery's heap.

An entry is held back when it may not be sent at its heap time: ``is_due``
holds it for the Redis back-off (fail closed, reported as not sent), its claim
failed (:mod:`.sending`), or, before Celery 5.7, an out-of-date heap time left
it on top of the heap. Such entries are noted in ``_reheap`` during a tick and
moved down the heap at its end, so that no entry held back keeps the entries
behind it from being sent.

:class:`HoldBack` is a base of
:class:`~celery_singleton_beat.beat.scheduler.SingletonSchedulerMixin`, which
holds the state used here (set in its ``__init__``) and calls these from
``is_due`` and ``tick``.
"""

from __future__ import annotations

import heapq
from datetime import datetime
from typing import Any

import celery

from .breaker import Breaker
from .slots import SlotError, current_slot

__all__ = ["CELERY_REHEAPS", "HoldBack"]

#: Celery 5.7+ moves an entry that is not due after all down the heap (celery/celery#7649).
CELERY_REHEAPS: bool = tuple(int(part) for part in celery.__version__.split(".")[:2]) >= (5, 7)


class HoldBack:
    """Entries held back and moved down the heap (see the module docstring); a base of the mixin."""

    # Set by SingletonSchedulerMixin.__init__ (and Celery's Scheduler: _heap).
    breaker: Breaker
    _hints: dict[str, datetime]
    _reheap: dict[str, float]
    _heap: Any  # Celery's Scheduler attribute (annotation only)

    def _now(self) -> datetime:
        raise NotImplementedError

    def _report_blocked(self, entry: Any) -> None:
        """Report ``entry``'s current slot as not sent: ``is_due`` holds it for the Redis back-off."""
        try:
            slot = current_slot(entry.schedule, self._now(), self._hints.get(entry.name))
        except SlotError:
            return
        if slot is not None:
            self.breaker.report_unsent(entry.name, slot, "Redis unavailable, waiting to try again")

    def _hold_back_top(self, entry: Any, wait: float) -> None:
        """Move ``entry`` to its next check if it sits on top of the heap, past its time.

        Its heap time can be out of date: the start-up rule decided, once Redis
        answered, that its missed slot was not missed after all. Celery 5.7
        moves such an entry down the heap itself; before, it stayed on top and
        held back every entry behind it until it came due (celery/celery#7649).
        """
        heap = getattr(self, "_heap", None)
        if heap and heap[0][2] is entry and heap[0][0] <= self._now().timestamp():
            self._reheap[entry.name] = max(float(wait), 0.0)

    def _move_down_heap(self) -> float:
        """Give the entries in ``_reheap`` their new time in the heap.

        An entry whose claim failed, or that ``is_due`` held back for the Redis
        back-off, comes back at the end of the back-off rather than at its next
        instant; Celery before 5.7 would leave an entry held back on top of the
        heap, where it kept every entry behind it (opted-out ones included) from
        being sent. Returns how long beat may sleep: 0 when another entry is due now.
        """
        moves, self._reheap = self._reheap, {}
        delay = min(moves.values())
        heap = getattr(self, "_heap", None)
        if isinstance(heap, list) and heap:
            now = self._now().timestamp()  # heap times follow the scheduler's clock
            top = heap[0]
            if len(moves) == 1 and top[2].name in moves and hasattr(top, "_replace"):
                # The usual case (the entry on top held back): no scan of the whole heap.
                heapq.heapreplace(heap, top._replace(time=now + moves[top[2].name]))
                return 0.0 if heap[0][0] <= now else delay
            changed = False
            for index, event in enumerate(heap):
                wait = moves.get(event[2].name)
                if wait is not None and event[0] != now + wait and hasattr(event, "_replace"):
                    heap[index] = event._replace(time=now + wait)
                    changed = True
            if changed:
                heapq.heapify(heap)
            if heap[0][0] <= now:
                return 0.0
        return delay
