"""A beat whose send takes past the next slot of an interval entry (``celery_singleton_beat.beat``).

Found by ``make chaos`` (standalone, seed 4, 2026-12-02): the broker was down while two
beats started; each beat's first publish waited in Celery's own reconnection loop
("beat: Connection error: ... Trying again in 2.0 seconds"), so the every-2 s entry's slot
14:46:06 went out at 14:46:08.03, and neither beat ever sent the slot 14:46:08: the next
one each sent was 14:46:10. Celery puts an entry back in its heap at *now after the
send* plus the delay ``is_due`` gave *before* it, so a send that took longer than the
period moved the entry's next look past a whole slot, which nobody claimed. The
scheduler now puts the entry back at its next slot, from the schedule: a late send
leaves that slot due at once.

In process, on the session's redis-server: beats on an every-2 s entry, a clock moved by
hand; a stalled send moves the clock, as the reconnection loop did.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.result import AsyncResult
from celery.schedules import crontab

from .support import LOCK_DB, RedisServer
from .support.beat import (
    BeatMonotonic,
    ManualClock,
    RecordingScheduler,
    RecordingSingletonScheduler,
    already_scheduled,
    beat_app,
    run_ticks,
    sent_slots,
)
from .support.slots import UTC, labels

#: Just after an aligned instant of the every-2 s entry.
START = datetime(2024, 5, 1, 12, 0, 0, 100000, tzinfo=UTC)
EVERY_2S = {"e": {"task": "t.e", "schedule": 2.0}}
#: Seconds the stalled send takes (Celery's reconnection loop waits 2 s between tries).
STALL = 2.5


class SlowFirstSend:
    """Its first send takes :attr:`stall` seconds of the manual clock (a publish that waits
    for the broker to come back), then returns as a publish that went through."""

    app: Any
    stalled = False
    stall: float = STALL
    #: The beat package's monotonic clock, when a test moves it by hand too.
    monotonic: BeatMonotonic | None = None

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> AsyncResult:
        if not self.stalled:
            self.stalled = True
            self.app.clock.advance(self.stall)
            if self.monotonic is not None:
                self.monotonic.advance(self.stall)
        return super().send_task(name, args, kwargs, **options)  # type: ignore[misc]


class SendsSlowlyOnce(SlowFirstSend, RecordingScheduler):
    """The mixin on Celery's in-memory scheduler, its first send slow."""


class SendsSlowlyOnceFromFile(SlowFirstSend, RecordingSingletonScheduler):
    """``SingletonScheduler`` (shelve-backed), its first send slow."""


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


def test_two_beats_held_up_by_the_broker_send_each_slot_once(
        redis_db: redis.Redis, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chaos run's case: both beats' first publishes wait for the broker (one after the
    other here: each beat's first tick sends, and stalls). Every slot goes out, the ones due
    during the stalls included, each once."""
    already_scheduled(redis_server.client(LOCK_DB), EVERY_2S)
    clock = ManualClock(START)
    monotonic = BeatMonotonic()
    monotonic.install(monkeypatch)
    beats = [SendsSlowlyOnce(app=beat_app(clock, EVERY_2S, redis_server.url(LOCK_DB))) for _ in range(2)]
    for beat in beats:
        beat.monotonic = monotonic
    for beat in beats:
        beat.tick()  # the first slot each sees: 12:00:00 sent at :02.6, then :02 at :05.1
    run_ticks(beats, clock, 10, 0.1)
    assert all(beat.stalled for beat in beats), "both slow sends happened"
    sent = sent_slots(*beats)
    first = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
    assert sorted(sent)[:5] == labels(first, 5, timedelta(seconds=2)), f"no slot lost: {sorted(sent)}"
    assert set(sent.values()) == {1}, f"each slot sent once: {sent}"


def test_a_send_stalled_over_several_periods_sends_the_latest_slot_not_a_backlog(
        redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """A send that outlasts two periods: the latest slot due meanwhile goes out at once,
    late; the older one is not sent (as for a beat that was down: only the latest missed
    slot is sent)."""
    already_scheduled(redis_server.client(LOCK_DB), EVERY_2S)
    clock = ManualClock(START)
    beat = SendsSlowlyOnce(app=beat_app(clock, EVERY_2S, redis_server.url(LOCK_DB)))
    beat.stall = 5.5  # slot 12:00:00 goes out at 12:00:05.6, past the slots :02 and :04
    run_ticks([beat], clock, 10, 0.1)
    assert beat.stalled, "the slow send happened"
    sent = sent_slots(beat)
    first = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
    expected = [*labels(first, 1, timedelta(seconds=2)), *labels(first + timedelta(seconds=4), 3, timedelta(seconds=2))]
    assert sorted(sent)[:4] == expected, f"the latest slot only, then on time: {sorted(sent)}"
    assert set(sent.values()) == {1}, f"each slot sent once: {sent}"


def test_a_crontab_send_that_outlasts_the_minute_loses_no_slot(
        redis_db: redis.Redis, redis_server: RedisServer, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The same for a crontab entry, on the shelve-backed scheduler: the 12:00 slot's send
    takes 70 s; 12:01 goes out right after it, then every minute on time."""
    every_minute = {"report": {"task": "t.report", "schedule": crontab(minute="*")}}
    already_scheduled(redis_server.client(LOCK_DB), every_minute)
    clock = ManualClock(START)
    beat = SendsSlowlyOnceFromFile(app=beat_app(clock, every_minute, redis_server.url(LOCK_DB)),
                                   schedule_filename=str(tmp_path / "schedule"))
    request.addfinalizer(beat.close)
    beat.stall = 70.0
    run_ticks([beat], clock, 190, 0.5)
    assert beat.stalled, "the slow send happened"
    sent = sent_slots(beat)
    first = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
    assert sorted(sent)[:4] == labels(first, 4, timedelta(minutes=1)), f"no slot lost: {sorted(sent)}"
    assert set(sent.values()) == {1}, f"each slot sent once: {sent}"
