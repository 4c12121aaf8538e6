"""The Redis back-off of a beat ends when the beat sees the claims Redis answer again.

In-process scheduler, a manual wall clock and a manual monotonic clock, a real
redis-server for the claims that is down when the beat starts. The back-off
doubles with each failed try (1 s up to 30 s): after an outage of 15 s it is
16 s long. A beat that finds the server answering again (its start-up check,
which looks every second) must not sit out the rest of that back-off: every beat
that started in the same outage would be silent for as long, and the slots
meanwhile lost.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis

from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer
from .support.beat import BeatMonotonic, ManualClock, RecordingScheduler, beat_app, sent_slots
from .support.slots import UTC

START = datetime(2024, 5, 1, 12, 0, 0, 300000, tzinfo=UTC)
EVERY_SECOND = {"tick": {"task": "t.tick", "schedule": 1.0}}
#: Seconds the claims Redis is down from the beat's start: the back-off reaches 16 s.
OUTAGE = 20.0
STEP = 0.25


class DefaultBackOff(RecordingScheduler):
    """A recording scheduler with the library's own back-off (1 s doubling to 30 s)."""

    redis_retry_min = 1.0
    redis_retry_max = 30.0


def advance(clock: ManualClock, monotonic: BeatMonotonic, beat: Any, seconds: float) -> None:
    """Tick ``beat`` as beat's loop would while both clocks move ``seconds`` forward."""
    end = clock.value + timedelta(seconds=seconds)
    while clock.value < end:
        for _ in range(10_000):
            if beat.tick() > 0:
                break
        clock.advance(STEP)
        monotonic.advance(STEP)


def test_a_beat_that_started_in_an_outage_sends_once_it_sees_redis_answer(
        make_redis: Callable[..., RedisServer], redis_db: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Down at start for 20 s: the slot after the server answers is sent, not 16 s later."""
    monotonic = BeatMonotonic()
    monotonic.install(monkeypatch)
    # The start-up check looks again once per second of the same clock.
    monkeypatch.setattr(sys.modules["celery_singleton_beat.recovery.startup"], "time", monotonic)
    claims = make_redis(start=False)
    clock = ManualClock(START)
    beat = DefaultBackOff(app=beat_app(clock, EVERY_SECOND, claims.url(0),
                                       singleton_redis_options={"socket_timeout": 1}))
    assert beat._server_check.pending, "the beat started while the claims Redis was down"
    advance(clock, monotonic, beat, OUTAGE)
    assert not sent_slots(beat), "fail closed: nothing sent while Redis is down"
    assert beat.breaker.remaining() > 5, "the back-off grew past a few seconds"

    claims.start()
    mark_in_use(claims.client(0))  # a server in use already: no recovery window
    advance(clock, monotonic, beat, 4)
    assert not beat._server_check.pending, "the start-up check saw the server answer"
    sent = sorted(sent_slots(beat))
    assert sent, ("nothing sent in the 4 s after the claims Redis answered: the beat waits out "
                  f"its back-off ({beat.breaker.remaining():.1f}s left)")
    assert sent[0] <= "2024-05-01T12:00:22Z", sent


def test_a_beat_whose_claims_redis_went_down_while_it_ran_sends_once_it_answers(
        make_redis: Callable[..., RedisServer], redis_db: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Up at start, then down for 20 s: the beat looks once per second during its back-off,
    and the slot after the server answers again is sent, not up to 30 s later."""
    monotonic = BeatMonotonic()
    monotonic.install(monkeypatch)
    monkeypatch.setattr(sys.modules["celery_singleton_beat.beat.breaker"], "time", monotonic)
    # Restarted from its append-only file: the same data, so no recovery window follows.
    claims = make_redis("--appendonly", "yes", "--appendfsync", "always")
    mark_in_use(claims.client(0))  # a server in use already: no recovery window
    clock = ManualClock(START)
    beat = DefaultBackOff(app=beat_app(clock, EVERY_SECOND, claims.url(0),
                                       singleton_redis_options={"socket_timeout": 1}))
    advance(clock, monotonic, beat, 2)
    assert sent_slots(beat), "sending while Redis answers"
    claims.stop()
    before = len(sent_slots(beat))
    advance(clock, monotonic, beat, OUTAGE)
    assert len(sent_slots(beat)) == before, "fail closed: nothing sent while Redis is down"
    assert beat.breaker.remaining() > 5, "the back-off grew past a few seconds"

    claims.start()
    back = clock.value
    advance(clock, monotonic, beat, 4)
    later = sorted(slot for slot in sent_slots(beat) if slot >= back.strftime("%Y-%m-%dT%H:%M:%SZ"))
    assert later, ("nothing sent in the 4 s after the claims Redis answered again: the beat waits out "
                   f"its back-off ({beat.breaker.remaining():.1f}s left)")
