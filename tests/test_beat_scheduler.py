"""SingletonSchedulerMixin in-process: several schedulers, one real redis-server, a manual clock.

The schedulers are Celery's own (plain ``Scheduler`` and ``PersistentScheduler``)
with the mixin; only publishing is replaced by a recorder so that each send
can be attributed to its slot. Beats as real processes are in
``test_beat_processes.py``.
"""

from __future__ import annotations

import heapq
import json
import logging
import shelve
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.exceptions import ImproperlyConfigured
from celery.schedules import crontab

from celery_singleton_beat.beat import (
    CLAIM_HEADER,
    ENTRY_HEADER,
    INSTANCE_HEADER,
    SLOT_HEADER,
    entry_record_key,
    history_key,
    read_history,
    slot_key,
    slot_task_id,
    stats_key,
)
from celery_singleton_beat.recovery.window import mark_in_use
from celery_singleton_beat.task.keys import beat_stats_key

from .support import LOCK_DB, RedisServer, wait_for
from .support.beat import (
    BeatMonotonic,
    ClockApp,
    ManualClock,
    RecordingScheduler,
    RecordingSingletonScheduler,
    already_scheduled,
    beat_app,
    run_ticks,
    sent_slots,
)
from .support.slots import UTC, labels, parse_slot, utc

START = datetime(2024, 5, 1, 12, 0, 0, 300000, tzinfo=UTC)
EVERY_SECOND = {"tick": {"task": "t.tick", "schedule": 1.0}}
PENDING_LEASE = 3600.0  # longer than any machine's ticks (0.01 reproduces the take-overs)


def scheduler_app(redis_server: RedisServer, clock: ManualClock, schedule: dict[str, Any],
                  **conf: Any) -> ClockApp:
    """An app for in-process schedulers whose claims go to the session server's lock database."""
    return beat_app(clock, schedule, redis_server.url(LOCK_DB), **conf)


def assert_contiguous_once(counts: Any, period: timedelta) -> list[str]:
    """Each slot sent once and no slot missing between the first and the last."""
    assert counts, "nothing sent"
    assert all(n == 1 for n in counts.values()), f"duplicates: {counts}"
    ordered = sorted(counts)
    assert ordered == labels(parse_slot(ordered[0]), len(ordered), period)
    return ordered


# ----------------------------------------------------------------- one send per slot

def test_two_plain_schedulers_send_each_slot_once(redis_db: redis.Redis,
                                                  redis_server: RedisServer) -> None:
    """The mixin on Celery's plain Scheduler: staggered start, 20 s, every slot once."""
    clock = ManualClock(START)
    first = RecordingScheduler(app=scheduler_app(redis_server, clock, EVERY_SECOND))
    clock.advance(0.37)
    second = RecordingScheduler(app=scheduler_app(redis_server, clock, EVERY_SECOND))
    run_ticks([first, second], clock, 20, 0.1)

    slots = assert_contiguous_once(sent_slots(first, second), timedelta(seconds=1))
    # The first slot that came due after the first beat started (a first deploy
    # sends no slot that began before it, as Celery's own scheduler).
    assert slots[0] == "2024-05-01T12:00:01Z"
    assert len(slots) == 20  # 12:00:01 .. 12:00:20


def test_persistent_schedulers_with_stale_files_do_not_burst(redis_db: redis.Redis,
                                                             redis_server: RedisServer,
                                                             tmp_path: Path,
                                                             request: pytest.FixtureRequest) -> None:
    """A (re)started beat whose schedule file says "last run a year ago" sends nothing already sent."""
    every_minute = {"report": {"task": "t.report", "schedule": crontab(minute="*")},
                    "tick": {"task": "t.tick", "schedule": 2.0}}
    # The schedule file a beat left a year ago: written by a real SingletonScheduler.
    stale = tmp_path / "stale"
    year_ago = ManualClock(START - timedelta(days=365))
    old = RecordingSingletonScheduler(app=scheduler_app(redis_server, year_ago, every_minute),
                                      schedule_filename=str(stale))
    run_ticks([old], year_ago, 5, 0.5)
    old.close()
    with shelve.open(str(stale)) as store:
        on_disk = {name: entry.last_run_at for name, entry in store["entries"].items()}
    assert set(on_disk) == {"report", "tick"}
    assert all(at < START - timedelta(days=364) for at in on_disk.values()), on_disk

    clock = ManualClock(START)
    running = RecordingSingletonScheduler(app=scheduler_app(redis_server, clock, every_minute),
                                          schedule_filename=str(tmp_path / "running"))
    request.addfinalizer(running.close)
    run_ticks([running], clock, 130, 0.5)
    assert sent_slots(running, task="t.report") == {
        "2024-05-01T12:00:00Z": 1, "2024-05-01T12:01:00Z": 1, "2024-05-01T12:02:00Z": 1}

    # A second beat starts at 12:02:10 from the year-old file.
    late = RecordingSingletonScheduler(app=scheduler_app(redis_server, clock, every_minute),
                                       schedule_filename=str(stale))
    request.addfinalizer(late.close)
    run_ticks([late, running], clock, 70, 0.5)

    assert sent_slots(late, running, task="t.report") == {
        f"2024-05-01T12:0{m}:00Z": 1 for m in range(4)}
    assert_contiguous_once(sent_slots(late, running, task="t.tick"), timedelta(seconds=2))
    # The late beat sent only slots that came due after it started.
    assert late.sent and all(s["slot"] >= "2024-05-01T12:02:10Z" for s in late.sent)


def test_clock_skew_between_beats_sends_each_slot_once(redis_db: redis.Redis,
                                                       redis_server: RedisServer) -> None:
    """Beats whose clocks are 0.4 s ahead and 0.4 s behind, on a 2 s interval."""
    every_two = {"tick": {"task": "t.tick", "schedule": 2.0}}
    clocks = [ManualClock(START + timedelta(seconds=offset)) for offset in (-0.4, 0.0, 0.4)]
    beats = [RecordingScheduler(app=scheduler_app(redis_server, clock, every_two)) for clock in clocks]
    for _ in range(200):  # 20 s of true time
        for beat in beats:
            while beat.tick() <= 0:
                pass
        for clock in clocks:
            clock.advance(0.1)
    slots = assert_contiguous_once(sent_slots(*beats), timedelta(seconds=2))
    assert len(slots) >= 10
    assert sum(1 for beat in beats if beat.sent) >= 2  # the ahead beat wins most, not all


def test_crontab_across_spring_forward_in_berlin(redis_db: redis.Redis,
                                                 redis_server: RedisServer) -> None:
    """Every minute, Europe/Berlin, 2024-03-31 00:58-01:03 UTC: one send per real minute."""
    clock = ManualClock(utc(2024, 3, 31, 0, 57, 40))
    schedule = {"minutely": {"task": "t.m", "schedule": crontab(minute="*")}}
    beats = [RecordingScheduler(app=scheduler_app(redis_server, clock, schedule,
                                             timezone="Europe/Berlin")) for _ in range(3)]
    run_ticks(beats, clock, 6 * 60, 5)
    slots = assert_contiguous_once(sent_slots(*beats), timedelta(minutes=1))
    assert slots[0] == "2024-03-31T00:58:00Z" and "2024-03-31T01:00:00Z" in slots
    assert slots[-1] == "2024-03-31T01:03:00Z"


# ----------------------------------------------------------------- start-up and catch-up

def run_then_stop(redis_server: RedisServer, clock: ManualClock, schedule: dict[str, Any],
                  seconds: float) -> RecordingScheduler:
    beat = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule))
    run_ticks([beat], clock, seconds, 0.25)
    beat.close()
    return beat


@pytest.mark.parametrize("catch_up", ["latest", "none"])
def test_catch_up_after_every_beat_was_down(redis_db: redis.Redis, redis_server: RedisServer,
                                            catch_up: str) -> None:
    clock = ManualClock(START)
    schedule = {"tick": {"task": "t.tick", "schedule": 10.0},
                "report": {"task": "t.report", "schedule": crontab(minute="*/5")}}
    before = run_then_stop(redis_server, clock, schedule, 12)
    # A first start (12:00:00.3): the 12:00:00 slots came before it and are not sent.
    assert sent_slots(before) == {"2024-05-01T12:00:10Z": 1}

    clock.advance(17 * 60 + 3)  # every beat down: 12:00:12 -> 12:17:15 (scheduled since 12:00:00.3)
    after = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule,
                                            singleton_beat_catch_up=catch_up))
    for _ in range(10):
        after.tick()
    at_start = sent_slots(after)
    if catch_up == "latest":  # the latest missed slot of each entry, once
        assert at_start == {"2024-05-01T12:17:10Z": 1, "2024-05-01T12:15:00Z": 1}
    else:
        assert at_start == {}
    run_ticks([after], clock, 10, 0.25)
    assert sent_slots(after)["2024-05-01T12:17:20Z"] == 1


def test_restarted_beat_does_not_resend_the_current_slot(redis_db: redis.Redis,
                                                         redis_server: RedisServer) -> None:
    clock = ManualClock(START)
    schedule = {"hourly": {"task": "t.h", "schedule": crontab(minute=0)}}
    already_scheduled(redis_server.client(LOCK_DB), schedule)
    first = run_then_stop(redis_server, clock, schedule, 5)
    assert sent_slots(first) == {"2024-05-01T12:00:00Z": 1}
    clock.advance(40 * 60)
    again = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule))
    run_ticks([again], clock, 5, 0.25)
    assert again.sent == []


def test_first_sight_sends_nothing_that_came_before_it(redis_db: redis.Redis,
                                                       redis_server: RedisServer) -> None:
    """A beat at 12:59 with entries no beat had scheduled: their slots of 03:00, 04:00 and
    12:00 are not sent (Celery's own scheduler sends none either); the next ones are."""
    clock = ManualClock(utc(2024, 5, 1, 12, 59, 50))
    schedule = {"nightly": {"task": "t.n", "schedule": crontab(minute=0, hour=3)},
                "cleanup": {"task": "t.c", "schedule": crontab(minute=0, hour=4)},
                "hourly": {"task": "t.h", "schedule": 3600.0}}
    beat = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule))
    run_ticks([beat], clock, 5, 0.25)
    assert beat.sent == []
    run_ticks([beat], clock, 10, 0.25)  # 13:00 comes due while it runs
    assert sent_slots(beat) == {"2024-05-01T13:00:00Z": 1}
    # Since when each entry is scheduled, for the beats that start later.
    records = redis_server.client(LOCK_DB)
    for name in schedule:
        assert float(records.get(entry_record_key("singleton", name))) == utc(2024, 5, 1, 12, 59, 50).timestamp()
        assert 7 * 86400 * 1000 < records.pttl(entry_record_key("singleton", name)) <= (7 * 86400 + 3600) * 1000


def test_an_entry_added_later_has_missed_nothing(redis_db: redis.Redis, redis_server: RedisServer,
                                                 tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Beats ran ``hourly`` since 11:00 and stopped at 11:30; at 12:30 a beat starts with
    ``hourly`` and a new ``report`` (crontab 12:00): only ``hourly``'s missed 12:00 is sent."""
    clock = ManualClock(utc(2024, 5, 1, 11, 0, 10))
    hourly = {"hourly": {"task": "t.h", "schedule": 3600.0}}
    first = RecordingSingletonScheduler(app=scheduler_app(redis_server, clock, hourly),
                                        schedule_filename=str(tmp_path / "beat"))
    run_ticks([first], clock, 5, 0.5)
    first.close()
    clock.advance(90 * 60)
    both = {**hourly, "report": {"task": "t.r", "schedule": crontab(minute=0, hour=12)}}
    again = RecordingSingletonScheduler(app=scheduler_app(redis_server, clock, both),
                                        schedule_filename=str(tmp_path / "beat"))
    request.addfinalizer(again.close)
    run_ticks([again], clock, 5, 0.5)
    assert [(s["task"], s["slot"]) for s in again.sent] == [("t.h", "2024-05-01T12:00:00Z")]


def _put_first(beat: Any, name: str) -> None:
    """Put the heap event of entry ``name`` before the others (a hair earlier)."""
    heap = beat._heap
    earliest = min(event[0] for event in heap)
    for index, event in enumerate(heap):
        if event[2].name == name:
            heap[index] = event._replace(time=earliest - 0.001)
    heapq.heapify(heap)


@pytest.mark.parametrize("first", ["old", "new"])
def test_redis_down_at_start_decides_when_it_is_back(redis_db: redis.Redis, redis_server: RedisServer,
                                                     make_redis: Callable[..., RedisServer],
                                                     caplog: pytest.LogCaptureFixture, first: str) -> None:
    """A node restart: every beat and the claims Redis (with persistence) were down, and the
    beat comes up first. It cannot tell a missed slot from one before the entry, so it waits
    for Redis: then the entry scheduled before gets its missed 12:00, the new one does not.

    Both entries wait in the heap at the same time, in either order: "new", decided not due
    after all, must not hold "old" back until 12:05 (as Celery before 5.7 left an entry
    that is not due on top of its heap, celery/celery#7649)."""
    caplog.set_level(logging.INFO, logger="celery_singleton_beat")
    claims = make_redis("--appendonly", "yes")
    schedule = {"old": {"task": "t.old", "schedule": crontab(minute="*/5")},
                "new": {"task": "t.new", "schedule": crontab(minute="*/5")}}
    already_scheduled(claims.client(0), {"old": schedule["old"]}, since=utc(2024, 5, 1, 11))
    claims.stop()
    clock = ManualClock(utc(2024, 5, 1, 12, 3))
    beat = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule,
                                                singleton_redis_url=claims.url(0),
                                                singleton_redis_options={"socket_timeout": 1}))
    run_ticks([beat], clock, 2, 0.25)
    assert beat.sent == []  # fail closed: nothing can be claimed

    claims.start()
    assert claims.client(0).exists(entry_record_key("singleton", "old"))  # kept across the restart
    wait_for(lambda: claims.client(0).info("persistence")["loading"] == 0, timeout=10,
             message="the append-only file loaded")
    _put_first(beat, first)

    def ticked() -> bool:
        # The beat holds the entry back for its Redis back-off (up to 30 s, on its clock):
        # the clock moves as fast as real time here, so 60 s of this stays before 12:05.
        run_ticks([beat], clock, 0.05, 0.05)
        return bool(beat.sent)

    wait_for(ticked, timeout=60, interval=0.05, message="the missed slot decided once Redis answers")
    run_ticks([beat], clock, 2, 0.25)
    assert [(s["task"], s["slot"]) for s in beat.sent] == [("t.old", "2024-05-01T12:00:00Z")]
    assert any("new: slot 2024-05-01T12:00:00Z came before the entry was scheduled" in r.getMessage()
               for r in caplog.records)


def test_running_beats_write_back_a_record_redis_lost(redis_db: redis.Redis,
                                                      redis_server: RedisServer) -> None:
    """Renewal (every hour) rewrites a lost record with the time the beat knows, and the
    record's TTL is the catch-up window plus an hour."""
    clock = ManualClock(START)
    beat = RecordingScheduler(app=scheduler_app(redis_server, clock, EVERY_SECOND,
                                                singleton_beat_catch_up_window=100))
    run_ticks([beat], clock, 2, 0.25)
    records = redis_server.client(LOCK_DB)
    key = entry_record_key("singleton", "tick")
    assert 100_000 < records.pttl(key) <= 3_700_000
    records.delete(key)
    beat._records_due = 0.0  # an hour later
    run_ticks([beat], clock, 1, 0.25)
    assert float(records.get(key)) == START.timestamp()

def test_records_are_renewed_a_batch_per_tick(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """2,500 entries: the hourly renewal writes at most 1,000 records per tick, so that a
    large schedule does not hold a due slot up; three ticks renew them all."""
    clock = ManualClock(START)
    schedule = {f"e{i}": {"task": "t.e", "schedule": 3600.0, "args": [i]} for i in range(2500)}
    beat = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule))
    beat.tick()  # start-up: every record written at once
    records = redis_server.client(LOCK_DB)
    assert len(records.keys("singleton:{beat:e*}:scheduled")) == 2500
    # The records lost, not the server emptied: FLUSHDB would also delete the record of
    # the server serving the lock data, and the next connection's check would open a
    # recovery window that later tests of this process find open (their beats claim nothing).
    records.delete(*records.keys("singleton:{beat:e*}:scheduled"))
    beat._records_due = 0.0  # an hour later
    written = []
    for _ in range(3):
        beat.tick()
        written.append(len(records.keys("singleton:{beat:e*}:scheduled")))
    assert written == [1000, 2000, 2500]


# ----------------------------------------------------------------- catch-up "none" and others' unsent claims

class BrokerDown(RecordingScheduler):
    """Wins its claims but cannot publish: hands each slot back (``released``)."""

    def send_task(self, *args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker unreachable")


def test_beat_started_after_a_slot_with_catch_up_none_takes_over_its_hand_back(
        redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """A slot another beat claimed and handed back is not a missed slot: a beat
    started 10 s later with catch-up "none" sends it (nobody else would)."""
    clock = ManualClock(START)
    schedule = {"minutely": {"task": "t.m", "schedule": 60.0}}
    already_scheduled(redis_server.client(LOCK_DB), schedule)
    failing = BrokerDown(app=scheduler_app(redis_server, clock, schedule))
    failing.tick()
    [key] = redis_server.client(LOCK_DB).keys("singleton:{beat:minutely}:[0-9]*")
    assert json.loads(redis_server.client(LOCK_DB).get(key))["state"] == "released"
    clock.advance(10)
    late = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule,
                                                singleton_beat_catch_up="none"))
    run_ticks([late], clock, 1, 0.25)
    assert sent_slots(late) == {"2024-05-01T12:00:00Z": 1}


def test_beat_started_after_a_slot_with_catch_up_none_takes_over_a_dead_beats_claim(
        redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """The winner claimed two slots in one round trip, sent (and marked) one and died:
    a beat started later with catch-up "none" sends the other once its pending lease ends."""
    clock = ManualClock(START)
    schedule = {"a": {"task": "t.a", "schedule": 60.0}, "b": {"task": "t.b", "schedule": 60.0}}
    conf = {"singleton_beat_pending_lease": 0.5}
    already_scheduled(redis_server.client(LOCK_DB), schedule)
    dead = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule, **conf))
    assert dead.tick() == 0  # one sent, the other claimed ahead
    dead._mark_sent()  # the sent one is marked; then the beat is killed
    [unsent] = list(dead._prefetched)
    clock.advance(10)
    late = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule,
                                                singleton_beat_catch_up="none", **conf))
    wait_for(lambda: late.tick() >= 0 and late.sent, timeout=10,
             message="the late beat to take the dead beat's claim over")
    assert [(s["task"], s["slot"]) for s in late.sent] == [(f"t.{unsent}", "2024-05-01T12:00:00Z")]
    assert sent_slots(dead, late) == {"2024-05-01T12:00:00Z": 2}  # a and b, once each


def test_beat_started_just_before_another_claims_the_slot_with_catch_up_none(
        redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """Started just after the slot's instant, before the other beat's claim existed: the
    late beat looks at the claim when the slot's first pending lease is over, so the
    other's hand-back is still sent."""
    clock = ManualClock(START)
    schedule = {"minutely": {"task": "t.m", "schedule": 60.0}}
    conf = {"singleton_beat_pending_lease": 0.5}
    already_scheduled(redis_server.client(LOCK_DB), schedule)
    late = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule,
                                                singleton_beat_catch_up="none", **conf))
    late.populate_heap()  # its start-up, before any claim exists
    failing = BrokerDown(app=scheduler_app(redis_server, clock, schedule, **conf))
    failing.tick()  # wins, cannot publish, hands the slot back
    wait_for(lambda: late.tick() >= 0 and late.sent, timeout=10,
             message="the late beat to take the hand-back over")
    assert sent_slots(late) == {"2024-05-01T12:00:00Z": 1}


class KilledAfterPublish(RecordingScheduler):
    """Publishes the slots it wins and never marks them sent: killed just after the publish."""

    def _mark_sent(self) -> None:
        pass


def test_beat_started_in_a_recovery_window_watches_a_claim_made_as_it_closes(
        redis_db: redis.Redis, redis_server: RedisServer, claims_server: RedisServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A beat started after the slot (catch-up "none") looks at the slot's claim while the
    claims Redis has a recovery window open: the look is put off to the window's end. The
    other beat claims the slot as the window closes, publishes and is killed. The late beat
    looks at the claim one pending lease after the window closed (the claims held back by
    the window are made as it closes), so it takes the slot over.

    The order is forced: the test opens and closes the window as the late beat sees it
    (``window_left``; the server itself has none), and the late beat's put-off look runs
    before the other beat's claim. Before the fix that look ran as the window closed,
    found no claim and was dropped: the slot was never sent. Seen as a real-beat test
    timing out waiting for "took over" on a loaded machine (the second beat came up just
    after the first slot, inside the window of a new claims Redis).
    """
    clock = ManualClock(START + timedelta(seconds=1))  # the slot's first lease is over: looked at at once
    schedule = {"minutely": {"task": "t.m", "schedule": 60.0}}
    conf = {"singleton_beat_pending_lease": 0.5, "singleton_redis_url": claims_server.url(0)}
    already_scheduled(claims_server.client(0), schedule)
    late = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule,
                                                singleton_beat_catch_up="none", **conf))
    window = {"open": True}
    # While open, a put-off look comes due again at the next tick (a microsecond on).
    monkeypatch.setattr(late.claims, "window_left", lambda: 1e-6 if window["open"] else 0.0)
    late.tick()  # start-up: the look comes due and is put off by the window
    window["open"] = False
    late.tick()  # the put-off look: no claim yet
    dead = KilledAfterPublish(app=scheduler_app(redis_server, clock, schedule, **conf))
    dead.tick()  # the missed slot (catch-up "latest"): claimed and published, never marked
    assert sent_slots(dead) == {"2024-05-01T12:00:00Z": 1}
    [key] = claims_server.client(0).keys("singleton:{beat:minutely}:[0-9]*")
    assert json.loads(claims_server.client(0).get(key))["state"] == "pending"
    wait_for(lambda: late.tick() >= 0 and late.sent, timeout=10, interval=0.05,
             message="the late beat to take the dead beat's claim over")
    assert sent_slots(late) == {"2024-05-01T12:00:00Z": 1}


def test_catch_up_none_still_skips_a_slot_nobody_claimed(redis_db: redis.Redis,
                                                         redis_server: RedisServer) -> None:
    clock = ManualClock(START + timedelta(seconds=10))
    schedule = {"minutely": {"task": "t.m", "schedule": 60.0}}
    already_scheduled(redis_server.client(LOCK_DB), schedule)  # a missed slot, not a first sight
    late = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule,
                                                singleton_beat_catch_up="none"))
    run_ticks([late], clock, 2, 0.25)
    assert late.sent == []
    assert redis_server.client(LOCK_DB).keys("singleton:{beat:minutely}:[0-9]*") == []


# ----------------------------------------------------------------- what is written and sent

def test_claims_history_counters_and_headers(redis_db: redis.Redis,
                                             redis_server: RedisServer) -> None:
    clock = ManualClock(START)
    schedule = {"tick": {"task": "t.tick", "schedule": 30.0, "args": [1],
                         "options": {"queue": "q1", "headers": {"h": "v"}}}}
    already_scheduled(redis_server.client(LOCK_DB), schedule, prefix="app7")
    mark_in_use(redis_server.client(LOCK_DB), "app7")  # a prefix in use (no first-deploy window)
    app = scheduler_app(redis_server, clock, schedule, singleton_key_prefix="app7",
                   singleton_beat_claim_margin=15)
    winner = RecordingScheduler(app=app)
    loser = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule,
                                            singleton_key_prefix="app7",
                                            singleton_beat_claim_margin=15))
    run_ticks([winner, loser], clock, 1, 0.25)
    assert len(winner.sent) == 1 and loser.sent == []

    sent = winner.sent[0]
    assert sent["args"] == [1]
    assert sent["options"]["queue"] == "q1"
    key = slot_key("app7", "tick", utc(2024, 5, 1, 12))
    headers = dict(sent["options"]["headers"])
    headers.pop("celery_beat_task", None)  # Celery's own mark (5.7 and later)
    assert headers == {"h": "v", SLOT_HEADER: "2024-05-01T12:00:00Z",
                       INSTANCE_HEADER: winner.instance_id, CLAIM_HEADER: key, ENTRY_HEADER: "tick"}
    # One task id per slot, whichever beat sends it.
    assert sent["options"]["task_id"] == slot_task_id(key)
    assert "singleton" not in sent["options"]
    # The entry's own options are left as they were.
    assert winner.schedule["tick"].options == {"queue": "q1", "headers": {"h": "v"}}

    claims = redis_server.client(LOCK_DB)
    value = json.loads(claims.get(key))
    assert value["instance"] == winner.instance_id
    assert value["state"] in ("pending", "sent")
    assert 30_000 < claims.pttl(key) <= 45_000  # period + margin
    history = read_history(claims, "app7")
    assert history == [{"entry": "tick", "key": key, "task": "t.tick",
                        "slot": "2024-05-01T12:00:00Z", "winner": winner.instance_id,
                        "at": value["at"]}]
    assert claims.hgetall(stats_key("app7")) == {b"won": b"1", b"lost": b"1"}
    assert claims.hgetall(beat_stats_key("app7", "tick")) == {b"won": b"1", b"lost": b"1"}
    assert claims.pttl(stats_key("app7")) > 0  # counters expire when no longer updated


def test_the_record_rides_in_the_claims_round_trip(redis_db: redis.Redis,
                                                   redis_server: RedisServer) -> None:
    """History and counters are written by a script in the claims' own pipeline, from each
    beat's second round (its first learns whether the server takes ``SET NX GET``); a
    server that does not have the script yet gets the record in a round trip of its own,
    and the script for the next round. Both write the same records and counts."""
    claims = redis_server.client(LOCK_DB)
    claims.script_flush()
    clock = ManualClock(START)
    already_scheduled(claims, EVERY_SECOND)
    apart: list[str] = []  # rounds recorded in a round trip of their own, by beat

    class Spy(RecordingScheduler):
        def _record(self, won: Any, lost: Any, taken: Any, at: float) -> None:
            apart.append(self.instance_id)
            super()._record(won, lost, taken, at)

    beats = [Spy(app=scheduler_app(redis_server, clock, EVERY_SECOND)) for _ in range(2)]
    run_ticks(beats, clock, 4, 0.25)
    slots = assert_contiguous_once(sent_slots(*beats), timedelta(seconds=1))
    assert len(slots) >= 4
    # Each beat's first round; then the first round that carried the script met NOSCRIPT
    # (beats tick in turn: the first beat's second round) and loaded it; none after.
    assert apart == [beats[0].instance_id, beats[1].instance_id, beats[0].instance_id]
    history = read_history(claims, "singleton", 100)
    winners = {sent["slot"]: beat.instance_id for beat in beats for sent in beat.sent}
    assert [(r["slot"], r["winner"], r["entry"], r["task"]) for r in history] == [
        (slot, winners[slot], "tick", "t.tick") for slot in reversed(slots)]
    for record in history:
        assert json.loads(claims.get(record["key"]))["at"] == record["at"]
    counts = {b"won": str(len(slots)).encode(), b"lost": str(len(slots)).encode()}
    assert claims.hgetall(stats_key("singleton")) == counts
    assert claims.hgetall(beat_stats_key("singleton", "tick")) == counts
    assert claims.pttl(beat_stats_key("singleton", "tick")) > 0  # set when its fields were created


def test_a_server_that_refuses_set_nx_get_counts_each_claim_once(redis_db: redis.Redis,
                                                                   redis_server: RedisServer) -> None:
    """Redis < 7 answers ``SET ... NX ... GET`` with a syntax error, in the pipeline that
    carries the round's claims: the round goes again with ``SET NX`` and ``GET``. Nothing
    of the refused round is recorded (a record riding along would have counted every
    claim of it as lost); the counters count each slot once, won by one beat, lost by the other."""
    claims = redis_server.client(LOCK_DB)
    clock = ManualClock(START)
    already_scheduled(claims, EVERY_SECOND)

    class OldRedis(RecordingScheduler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            store, add_sets = self.claims, self.claims._add_sets

            def old_sets(pipe: Any, batch: Any, value: str) -> None:
                if not store.use_set_get:
                    return add_sets(pipe, batch, value)
                for claim in batch:  # the server itself refuses it, as Redis 6.2 refuses NX with GET
                    pipe.execute_command("SET", claim.key, value, "NX", "PX", store.ttl_ms(claim.slot), "GET", "X")

            store._add_sets = old_sets  # type: ignore[method-assign]

    beats = [OldRedis(app=scheduler_app(redis_server, clock, EVERY_SECOND)) for _ in range(2)]
    run_ticks(beats, clock, 4, 0.25)
    slots = assert_contiguous_once(sent_slots(*beats), timedelta(seconds=1))
    assert not any(beat.claims.use_set_get for beat in beats)
    counts = {b"won": str(len(slots)).encode(), b"lost": str(len(slots)).encode()}
    assert claims.hgetall(stats_key("singleton")) == counts
    assert claims.hgetall(beat_stats_key("singleton", "tick")) == counts
    assert [r["slot"] for r in read_history(claims, "singleton", 100)] == list(reversed(slots))


def test_history_is_capped(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    clock = ManualClock(START)
    beat = RecordingScheduler(app=scheduler_app(redis_server, clock, EVERY_SECOND))
    beat.history_size = 5
    run_ticks([beat], clock, 12, 0.5)
    claims = redis_server.client(LOCK_DB)
    assert claims.llen(history_key("singleton")) == 5
    assert [r["slot"] for r in read_history(claims, "singleton", 2)] == [
        "2024-05-01T12:00:11Z", "2024-05-01T12:00:10Z"]


def test_opt_out_and_args_in_the_key(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    clock = ManualClock(START)
    schedule = {
        "plain": {"task": "t.plain", "schedule": 5.0, "options": {"singleton": False}},
        "sync-a": {"task": "t.sync", "schedule": 5.0, "args": ["a"],
                   "options": {"singleton": {"key": "sync", "include_args": True}}},
        "sync-b": {"task": "t.sync", "schedule": 5.0, "args": ["b"],
                   "options": {"singleton": {"key": "sync", "include_args": True}}},
    }
    already_scheduled(redis_server.client(LOCK_DB), schedule)
    beats = [RecordingScheduler(app=scheduler_app(redis_server, clock, schedule)) for _ in range(2)]
    run_ticks(beats, clock, 16, 0.25)

    opted_out = [s for beat in beats for s in beat.sent if s["task"] == "t.plain"]
    assert len(opted_out) >= 5  # every beat sends it, like plain Celery
    assert all(s["slot"] is None and "singleton" not in s["options"] for s in opted_out)
    sync = [(s["args"][0], s["slot"]) for beat in beats for s in beat.sent if s["task"] == "t.sync"]
    assert sorted(sync) == sorted((arg, slot) for arg in "ab" for slot in labels(
        utc(2024, 5, 1, 12), 4, timedelta(seconds=5)))
    keys = {k.decode() for k in redis_server.client(LOCK_DB).keys("singleton:{beat:sync:*}:[0-9]*")}
    assert len({k.split("}")[0] for k in keys}) == 2  # one key family per argument list


# ----------------------------------------------------------------- Redis trouble

@pytest.fixture
def claims_server(make_redis: Callable[..., RedisServer]) -> RedisServer:
    """A redis-server of its own for slot claims, so a test can stop it; in use already
    (its server record written: a new Redis would cost the first claims a recovery window)."""
    server = make_redis()
    mark_in_use(server.client(0))
    return server


def test_redis_down_fails_closed_logs_and_recovers(redis_db: redis.Redis, claims_server: RedisServer,
                                                   redis_server: RedisServer,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="celery_singleton_beat")
    clock = ManualClock(START)
    schedule = {"tick": {"task": "t.tick", "schedule": 1.0},
                "plain": {"task": "t.plain", "schedule": 1.0, "options": {"singleton": False}}}
    beat = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule,
                                           singleton_redis_url=claims_server.url(0),
                                           singleton_redis_options={"socket_timeout": 1}))
    run_ticks([beat], clock, 3, 0.25)
    # A first start at 12:00:00.3: from the first slot after it.
    assert sent_slots(beat, task="t.tick") == {f"2024-05-01T12:00:0{i}Z": 1 for i in range(1, 4)}

    plain_before = len([s for s in beat.sent if s["task"] == "t.plain"])
    claims_server.stop()
    run_ticks([beat], clock, 3, 0.25)  # 12:00:04 - 12:00:06: cannot claim
    assert len(sent_slots(beat, task="t.tick")) == 3  # fail closed: nothing more sent
    during = [s for s in beat.sent if s["task"] == "t.plain"][plain_before:]
    assert len(during) == 3, "the opted-out entry is sent every second of the outage, unclaimed"
    assert all(s["slot"] is None for s in during)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("tick: slot 2024-05-01T12:00:04Z NOT sent" in m for m in warnings), warnings
    assert any("unavailable" in m for m in warnings)

    claims_server.start()  # same port; every old claim is gone
    wait_for(lambda: not beat.breaker.is_open(), timeout=10, interval=0.01,
             message="the scheduler's (test-sized) Redis back-off to end")
    # Back without its data: the beat writes back its claims, and claims nothing new
    # during the recovery window (other beats may be writing back theirs).
    run_ticks([beat], clock, 1, 0.25)  # 12:00:07
    assert len(sent_slots(beat, task="t.tick")) == 3
    assert any("waits: the lock Redis's recovery window" in r.getMessage() for r in caplog.records)
    assert claims_server.client(0).exists("singleton:{beat:tick}:2024-05-01T12:00:03Z"), "written back"
    window = beat.claims.window_left()
    wait_for(lambda: beat.claims.window_left() == 0, timeout=10, interval=0.05, message="the recovery window")
    run_ticks([beat], clock, window + 3, 0.25)  # the entry waited that long (this clock is manual)
    counts = sent_slots(beat, task="t.tick")
    assert all(n == 1 for n in counts.values())
    assert {"2024-05-01T12:00:12Z", "2024-05-01T12:00:13Z"} <= set(counts)
    assert any("is back" in r.getMessage() for r in caplog.records)


def test_redis_down_fail_open_sends_unclaimed(redis_db: redis.Redis, claims_server: RedisServer,
                                              redis_server: RedisServer) -> None:
    clock = ManualClock(START)
    beat = RecordingScheduler(app=scheduler_app(redis_server, clock, EVERY_SECOND,
                                           singleton_redis_url=claims_server.url(0),
                                           singleton_beat_fail_open=True))
    claims_server.stop()
    run_ticks([beat], clock, 3, 0.25)
    # 12:00:00 came before the beat started, and Redis cannot tell whether it was missed:
    # not sent. Every later slot is sent unclaimed.
    assert sent_slots(beat) == {f"2024-05-01T12:00:0{i}Z": 1 for i in range(1, 4)}


def test_bad_configuration_fails_at_start(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    clock = ManualClock(START)
    with pytest.raises(ImproperlyConfigured, match="singleton_beat_catch_up"):
        RecordingScheduler(app=scheduler_app(redis_server, clock, EVERY_SECOND,
                                        singleton_beat_catch_up="all"))
    with pytest.raises(ImproperlyConfigured, match="unknown setting"):
        RecordingScheduler(app=scheduler_app(redis_server, clock, EVERY_SECOND,
                                        singleton_beat_failopen=True))
    with pytest.raises(ImproperlyConfigured, match="Redis URL"):
        RecordingScheduler(app=scheduler_app(redis_server, clock, EVERY_SECOND,
                                        singleton_redis_url="http://localhost:6379/0"))
    with pytest.raises(ImproperlyConfigured, match=r"'bad'.*include_args"):
        RecordingScheduler(app=scheduler_app(redis_server, clock, {
            "bad": {"task": "t", "schedule": 1.0, "options": {"singleton": {"include_args": 1}}}}))
    with pytest.raises(ImproperlyConfigured, match=r"'zero'.*positive"):
        RecordingScheduler(app=scheduler_app(redis_server, clock, {"zero": {"task": "t", "schedule": 0}}))


# ----------------------------------------------------------------- many entries at once

def test_many_due_entries_are_claimed_in_batches(redis_db: redis.Redis,
                                                 redis_server: RedisServer) -> None:
    clock = ManualClock(START)
    schedule = {f"e{i}": {"task": "t.e", "schedule": 60.0, "args": [i]} for i in range(2500)}
    already_scheduled(redis_server.client(LOCK_DB), schedule)

    class Counting(RecordingScheduler):
        pipelines = 0

        def _claim_many(self, batch: Any) -> None:
            type(self).pipelines += 1
            super()._claim_many(batch)

    # The pending lease runs on the real clock: a beat whose 2,500 sends take longer than
    # it (a loaded machine) has its last unmarked slots taken over and sent again, as
    # documented. This test is about batching, so the lease outlasts any machine's ticks.
    beats = [Counting(app=scheduler_app(redis_server, clock, schedule, singleton_beat_pending_lease=PENDING_LEASE))
             for _ in range(2)]
    run_ticks(beats, clock, 1, 0.5)
    counts = sent_slots(*beats)
    assert counts == {"2024-05-01T12:00:00Z": 2500}
    assert sorted(s["args"][0] for beat in beats for s in beat.sent) == list(range(2500))
    assert Counting.pipelines == 6  # 2 beats x ceil(2500 / 1000) round trips


class CreepingClock(ManualClock):
    """A manual clock that also moves a microsecond each time it is read, as a real one
    does: the entries made due together get heap times of their own (no ties)."""

    def now(self) -> datetime:
        self.value += timedelta(microseconds=1)
        return self.value


def test_slots_claimed_ahead_are_the_ones_sent_next(redis_db: redis.Redis,
                                                    redis_server: RedisServer) -> None:
    """A burst larger than a batch, with the heap times of a real clock: each batch claims
    the entries the heap hands out next, so the next batch is claimed once the previous one
    was sent; not at the first send that was not among those claimed ahead, which claimed
    most of a large burst in its first ticks and left those claims pending while the rest
    of the burst went out (past the pending lease, for the other beats to take over)."""
    clock = CreepingClock(START)
    schedule = {f"e{i}": {"task": "t.e", "schedule": 60.0, "args": [i]} for i in range(2500)}
    already_scheduled(redis_server.client(LOCK_DB), schedule)
    claimed: list[list[str]] = []
    sent_before: list[int] = []  # slots sent when each batch was claimed

    class Counting(RecordingScheduler):
        def _claim_many(self, batch: Any) -> None:
            claimed.append([claim.name for claim, _ in batch])
            sent_before.append(len(self.sent))
            super()._claim_many(batch)

    beat = Counting(app=scheduler_app(redis_server, clock, schedule))
    sent: list[str] = []
    while beat.tick() <= 0:
        sent.append(f"e{beat.sent[-1]['args'][0]}")
    assert sorted(sent) == sorted(schedule)
    assert [len(batch) for batch in claimed] == [1000, 1000, 500]
    assert sent_before == [0, 1000, 2000]
    # Each batch is the next stretch of the sends, in the order they were sent.
    assert [name for batch in claimed for name in batch] == sent


def test_sent_marks_go_out_in_multi_key_calls(redis_db: redis.Redis,
                                             redis_server: RedisServer) -> None:
    """2,500 slots sent by one beat: each claim ends ``sent``, and the marks are not one
    script call each (a Lua call costs Redis ~30k instructions of set-up alone)."""
    clock = ManualClock(START)
    schedule = {f"e{i}": {"task": "t.e", "schedule": 60.0, "args": [i]} for i in range(2500)}
    claims = redis_server.client(LOCK_DB)
    already_scheduled(claims, schedule)

    def evalsha_calls() -> int:
        return int(claims.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    before = evalsha_calls()
    beat = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule))
    run_ticks([beat], clock, 1, 0.5)
    beat.close()  # marks what is left
    assert sent_slots(beat) == {"2024-05-01T12:00:00Z": 2500}
    keys = claims.keys("singleton:{beat:e*}:[0-9]*")
    assert len(keys) == 2500
    assert {json.loads(value)["state"] for value in claims.mget(keys)} == {"sent"}
    assert evalsha_calls() - before < 100  # 2,500 before: one per mark


def test_claims_won_ahead_are_given_back_when_not_sent(redis_db: redis.Redis,
                                                       redis_server: RedisServer) -> None:
    clock = ManualClock(START)
    schedule = {"a": {"task": "t.a", "schedule": 60.0}, "b": {"task": "t.b", "schedule": 60.0}}
    claims = redis_server.client(LOCK_DB)
    already_scheduled(claims, schedule)
    beat = RecordingScheduler(app=scheduler_app(redis_server, clock, schedule))
    assert beat.tick() == 0  # one entry sent, the other claimed ahead
    assert len(claims.keys("singleton:{beat:*}:[0-9]*")) == 2
    pending = next(name for name in ("a", "b") if name in beat._prefetched)
    beat.schedule.pop(pending)  # removed before its turn
    wait_for(lambda: beat.tick() > 0, timeout=5)
    assert [s["task"] for s in beat.sent] == [f"t.{'ab'.replace(pending, '')}"]
    [key] = claims.keys(f"singleton:{{beat:{pending}}}:[0-9]*")
    assert json.loads(claims.get(key))["state"] == "released"  # handed back: others may send it


def test_claim_is_given_back_when_publishing_fails(redis_db: redis.Redis,
                                                   redis_server: RedisServer) -> None:
    """A slot won but not published (broker down) does not stay claimed."""
    clock = ManualClock(START)
    already_scheduled(redis_server.client(LOCK_DB), EVERY_SECOND)
    beat = BrokerDown(app=scheduler_app(redis_server, clock, EVERY_SECOND))
    beat.tick()  # Celery logs the failed publish; beat goes on
    [key] = redis_server.client(LOCK_DB).keys("singleton:{beat:tick}:[0-9]*")
    assert json.loads(redis_server.client(LOCK_DB).get(key))["state"] == "released"
    late = RecordingScheduler(app=scheduler_app(redis_server, clock, EVERY_SECOND))
    late.tick()
    assert sent_slots(late) == {"2024-05-01T12:00:00Z": 1}


class FlakyBroker(RecordingScheduler):
    """Publishes fail while ``broker_down`` is set; ``attempts`` counts every publish tried.

    With ``stall`` (the beat's frozen monotonic clock), the second and third publishes
    (the burst's, of three slots) come after the back-off of the slots handed back before
    them ran out: a burst whose publishes are slow (a loaded machine), forced."""

    broker_down = False
    stall: BeatMonotonic | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.attempts = 0
        super().__init__(*args, **kwargs)

    def send_task(self, *args: Any, **kwargs: Any) -> Any:
        watched = self.handover._watched
        if self.stall is not None and watched and 0 < self.attempts < 3:
            self.stall.advance(min(w.due for w in watched) - self.stall.value)
        self.attempts += 1
        if self.broker_down:
            raise ConnectionError("broker unreachable")
        return super().send_task(*args, **kwargs)


@pytest.mark.parametrize("slow_burst", [False, True], ids=["burst", "slow-burst"])
def test_a_beat_sends_the_slots_it_handed_back_once_the_broker_is_back(
        redis_db: redis.Redis, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
        slow_burst: bool) -> None:
    """A lone beat whose publishes fail hands its slots back and keeps them: while the
    broker is down one publish is tried per back-off round (not one per slot), and once
    it answers every slot is sent, once.

    The slow burst publishes each slot after the back-off of those handed back before it
    ran out: the back-off counts from the latest failed publish, so no hand-back is
    tried again in the burst (it was, right after a publish that found the broker down:
    4 attempts for 3 slots, seen on a loaded CI machine).

    The beat's monotonic clock is frozen and moved by the test: a back-off that ran out
    while the burst ticked (a loaded machine) rightly tries one publish more, which this
    test would have counted against the burst."""
    monotonic = BeatMonotonic()
    monotonic.install(monkeypatch)
    clock = ManualClock(START)
    schedule = {name: {"task": f"t.{name}", "schedule": 60.0} for name in "abc"}
    already_scheduled(redis_server.client(LOCK_DB), schedule)  # a running deployment: the slots are due
    beat = FlakyBroker(app=scheduler_app(redis_server, clock, schedule,
                                         singleton_beat_pending_lease=0.1))
    beat.broker_down = True
    beat.stall = monotonic if slow_burst else None
    while beat.tick() <= 0:  # the burst: each slot claimed, its publish refused
        pass
    beat.stall = None
    claims = redis_server.client(LOCK_DB)
    keys = claims.keys("singleton:{beat:*}:[0-9]*")  # slot claims, not the entries' :scheduled records
    assert len(keys) == 3 and beat.attempts == 3
    assert {json.loads(value)["state"] for value in claims.mget(keys)} == {"released"}

    retries = list(beat.handover._watched)
    assert len(retries) == 3 and all(w.retry for w in retries)
    assert len({w.due for w in retries}) == 1, "one back-off round for every hand-back"
    monotonic.advance(retries[0].due - monotonic.value)  # every hand-back due again
    beat.tick()
    assert beat.attempts == 4, "one publish tried in a round that found the broker down"
    assert beat.handover.publish_failures == 4
    assert {json.loads(value)["state"] for value in claims.mget(keys)} == {"released"}

    beat.broker_down = False
    wake = beat.handover.next_wake(monotonic.value)
    assert wake is not None
    monotonic.advance(wake)  # the next round
    beat.tick()
    assert sent_slots(beat) == {"2024-05-01T12:00:00Z": 3}
    assert sorted(s["task"] for s in beat.sent) == ["t.a", "t.b", "t.c"]
    beat.close()  # marks them sent
    assert {json.loads(value)["state"] for value in claims.mget(keys)} == {"sent"}


def test_redis_without_set_nx_get_falls_back_to_plain_set_nx(redis_db: redis.Redis,
                                                             redis_server: RedisServer) -> None:
    """Redis < 7 rejects SET NX GET: the scheduler switches to SET NX once and carries on."""
    clock = ManualClock(START)

    class OldRedis(RecordingScheduler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            store, plain_set = self.claims, self.claims._set

            def old_set(*set_args: Any) -> Any:
                if store.use_set_get:
                    raise redis.ResponseError("ERR syntax error")
                return plain_set(*set_args)

            store._set = old_set  # type: ignore[method-assign]

    beats = [OldRedis(app=scheduler_app(redis_server, clock, EVERY_SECOND)) for _ in range(2)]
    run_ticks(beats, clock, 3, 0.25)
    assert_contiguous_once(sent_slots(*beats), timedelta(seconds=1))
    assert not any(beat.claims.use_set_get for beat in beats)
