"""A beat whose send takes past the next slot of an interval entry (``celery_singleton_beat.beat``).

Found by ``make chaos`` (standalone, seed 4, 2026-12-02): the broker was down while two
beats started; each beat's first publish waited in Celery's own reconnection loop
("beat: Connection error: ... Trying again in 2.0 seconds"), so the every-2 s entry's slot
14:46:06 went out at 14:46:08.03, and neither beat ever sent the slot 14:46:08: the next
one each sent was 14:46:10. Celery puts an entry back in its heap at *now after the
send* plus the delay ``is_due`` gave *before* it; the scheduler's delay runs to the next
aligned instant as seen before the send (2 s), so a send that took longer than that
moves the entry's next look past a whole slot, which nobody claims. The guarantees say
a broker outage loses no slot.

In process, on the session's redis-server: one beat, an every-2 s entry, a clock moved by
hand; the send of one slot moves the clock 2.5 s, as the reconnection loop did.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
from celery.result import AsyncResult

from .support import LOCK_DB, RedisServer
from .support.beat import ManualClock, RecordingScheduler, already_scheduled, beat_app, run_ticks, sent_slots
from .support.slots import UTC, labels

#: Just after an aligned instant of the every-2 s entry.
START = datetime(2024, 5, 1, 12, 0, 0, 100000, tzinfo=UTC)
EVERY_2S = {"e": {"task": "t.e", "schedule": 2.0}}
#: Seconds the stalled send takes (Celery's reconnection loop waits 2 s between tries).
STALL = 2.5


class SendsSlowlyOnce(RecordingScheduler):
    """Its first send takes :data:`STALL` seconds of the manual clock (a publish that waits
    for the broker to come back), then returns as a publish that went through."""

    stalled = False

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> AsyncResult:
        if not self.stalled:
            self.stalled = True
            self.app.clock.advance(STALL)
        return super().send_task(name, args, kwargs, **options)


@pytest.mark.xfail(strict=True, reason=(
    "an interval entry's next look is set from the time after a slow send plus the delay "
    "is_due computed before it: a send that outlasts the period skips the following slot "
    "(found by make chaos, standalone seed 4, 2026-12-02)"))
def test_a_send_that_outlasts_the_period_loses_no_slot(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    already_scheduled(redis_server.client(LOCK_DB), EVERY_2S)  # a running deployment, not a first sight
    clock = ManualClock(START)
    beat = SendsSlowlyOnce(app=beat_app(clock, EVERY_2S, redis_server.url(LOCK_DB)))
    run_ticks([beat], clock, 8, 0.1)
    assert beat.stalled, "the slow send happened"
    sent = sorted(sent_slots(beat))
    first = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
    assert sent[:5] == labels(first, 5, timedelta(seconds=2)), \
        f"every slot sent once, the one due during the slow send included: {sent}"
