"""``celery_singleton_beat.contrib.django.SingletonDatabaseScheduler`` on a real database.

One SQLite file per module (migrated once), the session's redis-server, and:

* in-process schedulers (sends recorded, real time) for what the subclass adds
  to the mixin: a database change seen mid-burst, an entry given a new
  schedule, an entry that leaves and comes back, the ``singleton`` header;
* three real ``celery beat -S ...:SingletonDatabaseScheduler`` processes on the
  file, entries written with the ORM (as the admin does), and the worker of
  ``tests.apps.beat_app`` recording each run with its slot: one run per slot,
  no gap, while entries are added, re-timed, and a beat is SIGKILLed.

The test process configures Django with ``settings.configure`` (no
``DJANGO_SETTINGS_MODULE`` here, so Celery apps of other tests get no Django
fix-up); the beats use ``tests.apps.django_settings``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from .support import (
    LOCK_DB,
    RECORD_DB,
    CeleryProcess,
    Owner,
    RedisServer,
    importorskip,
    owning,
    soak,
    start_worker,
    wait_for,
    wait_for_phase,
)
from .support.beat import already_scheduled, assert_once_per_slot, read_runs, slot_counts, wait_between_sends
from .support.dbbeat import (
    TASK,
    add_entry,
    all_running,
    assert_follows_edit,
    assert_no_errors,
    assert_took_part,
    clear_schedule,
    recording_scheduler,
    runs_of,
    sent_names,
    set_every,
    start_db_beat,
    stop_and_drain,
)
from .support.extras import assert_needs_extra
from .support.servers import flushdb
from .support.slots import UTC, parse_slot, slot_floor

importorskip("django_celery_beat")


# ----------------------------------------------------------------- database

# ----------------------------------------------------------------- in-process


def test_base_install_does_not_import_django() -> None:
    """The package and its CLI import without Django; the contrib module names the extra."""
    assert_needs_extra("django", ("django", "django_celery_beat"), "django")


def test_a_database_change_in_a_burst_does_not_stall_the_burst(
        django_db: Path, redis_db: Any, redis_server: RedisServer) -> None:
    """Three entries due at once; the database changes after two sends: the next tick sends the third.

    ``DatabaseScheduler`` empties the heap when it re-reads the database; the
    mixin's once-per-burst comparison must not keep that empty heap (the beat
    would send nothing for ``beat_max_loop_interval``).
    """
    from django_celery_beat.models import PeriodicTask

    clear_schedule()
    names = ["hourly-a", "hourly-b", "hourly-c"]
    # Rows beats ran before: with catch-up "latest", the current hour's slot is due at start.
    already_scheduled(redis_server.client(LOCK_DB), {name: {} for name in names})
    for name in names:
        add_entry(name, 1, "hours")
    scheduler = recording_scheduler(redis_server)
    scheduler.claim_batch_size = 1  # no slots claimed ahead: the change is read mid-burst
    try:
        assert scheduler.tick() == 0
        assert scheduler.tick() == 0
        assert len(scheduler.sent) == 2
        task = PeriodicTask.objects.get(name=names[0])
        task.description = "edited while the beat sends a burst"
        task.save()  # marks PeriodicTasks changed: the next tick re-reads the database
        delay = scheduler.tick()
        assert sorted(sent_names(scheduler)) == names, f"tick returned {delay}"
        assert scheduler.tick() > 0  # nothing else is due
        assert len(set(sent["slot"] for sent in scheduler.sent)) == 1
    finally:
        scheduler.close()


def test_no_database_io_between_claims_won_ahead_and_their_send(
        django_db: Path, redis_db: Any, redis_server: RedisServer) -> None:
    """In a burst, the beat claims the other due entries' slots ahead: it writes
    (``last_run_at``) and re-reads the database only once they are sent."""
    from django_celery_beat.models import PeriodicTask

    clear_schedule()
    names = ["burst-a", "burst-b", "burst-c"]
    # Rows beats ran before (the current hour's slot is due at once when read).
    already_scheduled(redis_server.client(LOCK_DB), {name: {} for name in [*names, "saved-mid-burst"]})
    for name in names:
        add_entry(name, 1, "hours")
    scheduler = recording_scheduler(redis_server)
    try:
        assert scheduler.tick() == 0  # one sent, two claimed ahead
        assert len(scheduler.sent) == 1
        assert all(row.total_run_count == 0 for row in PeriodicTask.objects.all())
        add_entry("saved-mid-burst", 1, "hours")
        assert scheduler.tick() == 0
        assert "saved-mid-burst" not in scheduler.schedule  # one slot claimed ahead still unsent
        assert scheduler.tick() == 0
        assert sorted(sent_names(scheduler)) == names
        assert PeriodicTask.objects.get(name=sent_names(scheduler)[-1]).total_run_count == 1
        wait_for(lambda scheduler=scheduler: scheduler.tick() > 0, timeout=10, message="the new row read and sent")
        assert sent_names(scheduler)[-1] == "saved-mid-burst"
    finally:
        scheduler.close()


def test_a_row_saved_while_the_beat_starts_is_picked_up(
        django_db: Path, redis_db: Any, redis_server: RedisServer) -> None:
    """A row saved between the beat's first read of the rows and its first look at the
    change marker (here: while it writes its ``celery.backend_cleanup`` row) is read at
    the next tick, not at the next full read 5 minutes later."""
    from django.db.models.signals import post_save
    from django_celery_beat.models import PeriodicTask

    clear_schedule()
    # Rows beats ran before: each is due as soon as it is read (which is what is checked).
    already_scheduled(redis_server.client(LOCK_DB), {name: {} for name in ["before-start", "during-start"]})
    add_entry("before-start", 1, "hours")

    def save_another_row(sender: Any, instance: Any, **kwargs: Any) -> None:
        if instance.name == "celery.backend_cleanup":
            post_save.disconnect(save_another_row, sender=PeriodicTask)
            add_entry("during-start", 1, "hours")

    post_save.connect(save_another_row, sender=PeriodicTask)
    try:
        scheduler = recording_scheduler(redis_server, result_expires=3600)
    finally:
        post_save.disconnect(save_another_row, sender=PeriodicTask)
    try:
        assert PeriodicTask.objects.filter(name="during-start").exists()
        wait_for(lambda scheduler=scheduler: scheduler.tick() > 0, timeout=10, message="the due entries sent")
        assert "during-start" in scheduler.schedule
        assert sorted(sent_names(scheduler)) == ["before-start", "during-start"]
    finally:
        scheduler.close()


def test_a_change_marked_by_a_clock_behind_is_picked_up(
        django_db: Path, redis_db: Any, redis_server: RedisServer) -> None:
    """A row saved from a machine whose clock is an hour behind: its change marker is
    older than the one the beat saw last, and the row is read all the same."""
    from django.utils import timezone
    from django_celery_beat.models import PeriodicTask, PeriodicTasks

    clear_schedule()
    # Rows beats ran before: each is due as soon as it is read (which is what is checked).
    already_scheduled(redis_server.client(LOCK_DB), {name: {} for name in ["first", "saved-behind"]})
    add_entry("first", 1, "hours")
    scheduler = recording_scheduler(redis_server)
    try:
        wait_for(lambda scheduler=scheduler: scheduler.tick() > 0, timeout=10, message="the first entry sent")
        behind = timezone.now() - timedelta(hours=1)
        add_entry("saved-behind", 1, "hours")
        PeriodicTasks.objects.filter(ident=1).update(last_update=behind)  # what that machine wrote
        wait_for(lambda scheduler=scheduler: scheduler.tick() > 0, timeout=10, message="the due entries sent")
        assert sorted(sent_names(scheduler)) == ["first", "saved-behind"]
        assert PeriodicTask.objects.count() == 2
    finally:
        scheduler.close()


def test_a_new_row_has_missed_nothing(django_db: Path, redis_db: Any, redis_server: RedisServer) -> None:
    """A row no beat had scheduled (added while the beat runs, or before a first start) is
    a first sight: its current slot came before it and is not sent, as with plain
    django-celery-beat; a row beats ran before gets its missed slot (catch-up "latest")."""
    clear_schedule()
    already_scheduled(redis_server.client(LOCK_DB), {"ran-before": {}})
    add_entry("ran-before", 1, "hours")
    add_entry("new-at-start", 1, "hours")
    scheduler = recording_scheduler(redis_server)
    try:
        wait_for(lambda: scheduler.tick() > 0 and "new-at-start" in scheduler.schedule, timeout=10,
                 message="the rows read and the due ones sent")
        add_entry("new-later", 1, "hours")
        wait_for(lambda: scheduler.tick() > 0 and "new-later" in scheduler.schedule, timeout=10,
                 message="the new row read")
        scheduler.tick()
        assert sent_names(scheduler) == ["ran-before"]
    finally:
        scheduler.close()


def test_a_new_interval_is_anchored_on_its_own_multiples(
        django_db: Path, redis_db: Any, redis_server: RedisServer) -> None:
    """An entry sent for its 7 s slot, then set to 1 day: next due at the next 00:00 UTC.

    Without re-anchoring, Celery would count the day from the last 7 s slot
    and the slot would go out hours late.
    """
    clear_schedule()
    add_entry("retimed", 7)
    # Start just after a 7 s boundary: the next 7 s slot must not come due while the
    # test changes the interval (a loaded machine can take seconds for that).
    wait_for_phase(7.0, 0.05, 1.0)
    scheduler = recording_scheduler(redis_server)
    try:
        wait_for(lambda: scheduler.tick() > 0 and scheduler.sent, timeout=10,
                 message="the current 7 s slot sent")
        first = parse_slot(scheduler.sent[0]["slot"])
        assert first.timestamp() % 7 == 0
        set_every("retimed", 1, "days")
        scheduler.tick()  # re-reads the database, rebuilds the heap
        entry = scheduler.schedule["retimed"]
        due, remaining = scheduler.is_due(entry)
        next_midnight = slot_floor(time.time(), 86400) + timedelta(days=1)
        assert not due
        assert abs(time.time() + remaining - next_midnight.timestamp()) < 5
        assert len(scheduler.sent) == 1
    finally:
        scheduler.close()


def test_an_entry_that_comes_back_follows_the_start_up_rule(
        django_db: Path, redis_db: Any, redis_server: RedisServer) -> None:
    """With catch-up "none", an entry disabled across a slot and enabled again does not
    send the slot it missed (a beat started then would not either); the next one goes out."""
    clear_schedule()
    task = add_entry("comes-back", 1)
    scheduler = recording_scheduler(redis_server, singleton_beat_catch_up="none")
    try:
        wait_for(lambda: scheduler.tick() > 0 and scheduler.sent, timeout=10,
                 message="a first slot sent")
        last = parse_slot(scheduler.sent[-1]["slot"])
        task.enabled = False
        task.save()
        scheduler.tick()  # re-read: the entry is gone
        assert "comes-back" not in scheduler.schedule
        sent_count = len(scheduler.sent)
        soak(last.timestamp() + 2.2 - time.time(), what="two slots missed while disabled",
             check=lambda: scheduler.tick() >= 0 and len(scheduler.sent) == sent_count)
        task.enabled = True
        task.save()
        sent_before = len(scheduler.sent)
        scheduler.tick()  # re-read: the entry is back
        assert len(scheduler.sent) == sent_before, scheduler.sent[sent_before:]
        back_at = time.time()
        wait_for(lambda: scheduler.tick() >= 0 and len(scheduler.sent) > sent_before,
                 timeout=10, message="the next slot sent")
        assert parse_slot(scheduler.sent[-1]["slot"]).timestamp() > back_at - 1
    finally:
        scheduler.close()


def test_singleton_option_in_the_task_headers(django_db: Path, redis_db: Any,
                                             redis_server: RedisServer) -> None:
    """``headers={"singleton": false}`` opts a row out of claims: two beats both send it,
    and the option is not a message header; a claimed row is sent by one beat only.

    Both schedulers read the database before either sends (the first one's
    ``last_run_at`` write would otherwise make the row not due for the second).
    """
    from django.utils import timezone
    from django_celery_beat.models import PeriodicTask

    clear_schedule()
    # Unclaimed entries run as in plain django-celery-beat: due one period after last_run_at.
    add_entry("everywhere", 1, "hours", headers=json.dumps({"singleton": False, "team": "ops"}),
              last_run_at=timezone.now() - timedelta(hours=2))
    add_entry("claimed", 1, "hours")
    from_settings = {"from-settings": {"task": TASK, "schedule": 3600.0, "args": ["from-settings"],
                                       "options": {"singleton": {"key": "shared"}}}}
    # Claimed rows beats ran before: the current hour's slot is due at start.
    already_scheduled(redis_server.client(LOCK_DB), {"claimed": {}, **from_settings})
    first = recording_scheduler(redis_server, beat_schedule=from_settings)
    second = recording_scheduler(redis_server)
    try:
        for scheduler in (first, second):
            wait_for(lambda scheduler=scheduler: scheduler.tick() > 0, timeout=10, message="the due entries handled")
        names = sent_names(first) + sent_names(second)
        assert names.count("everywhere") == 2
        assert names.count("claimed") == 1
        # A beat_schedule entry's option is stored in the row it becomes, and claimed by it.
        row = PeriodicTask.objects.get(name="from-settings")
        assert json.loads(row.headers) == {"singleton": {"key": "shared"}}
        assert names.count("from-settings") == 1
        assert redis_server.client(LOCK_DB).keys("singleton:{beat:shared}:[0-9]*")
        for sent in first.sent + second.sent:
            headers = sent["options"]["headers"]
            assert "singleton" not in headers and "singleton" not in sent["options"]
            if sent["args"][0] == "everywhere":
                assert headers["team"] == "ops"
                assert "singleton_beat_slot" not in headers
    finally:
        first.close()
        second.close()


# ----------------------------------------------------------------- real beats


@pytest.fixture(scope="module")
def db_beat_worker(redis_server: RedisServer) -> Iterator[CeleryProcess]:
    """One worker for the module: solo pool, one message at a time."""
    with owning(Owner("django beat worker")) as owner:
        process = start_worker(redis_server, "tests.apps.beat_app",
                               f"djangoworker-{uuid.uuid4().hex[:6]}", pool="solo",
                               concurrency=1, extra=["--prefetch-multiplier", "1"])
    yield process
    owner.close()


@pytest.fixture
def clean(django_db: Path, redis_server: RedisServer, db_beat_worker: CeleryProcess) -> str:
    """Fresh claims, run records and schedule rows; a unique entry-name prefix."""
    db_beat_worker.check_running()
    flushdb(redis_server.client(LOCK_DB))
    redis_server.client(RECORD_DB).flushdb()
    clear_schedule()
    return f"t{uuid.uuid4().hex[:6]}-"


def test_three_beats_on_one_database_run_each_slot_once(
        redis_server: RedisServer, clean: str, django_db: Path,
        processes: list[CeleryProcess]) -> None:
    """Rows every 1 s and 2 s, a third row added while the beats run: one run per slot, no gap."""
    every_second, every_two, added = f"{clean}1s", f"{clean}2s", f"{clean}added"
    add_entry(every_second, 1)
    add_entry(every_two, 2)
    began = time.time()
    for name in ("a", "b", "c"):
        processes.append(start_db_beat(redis_server, django_db, name))
    wait_for(lambda: len(runs_of(redis_server, every_second)) >= 2, timeout=30, message="runs")
    add_entry(added, 1)
    added_at = time.time()
    soak(max(14 - (time.time() - began), added_at + 6 - time.time()),
         check=all_running(processes), what="three beats on one database")
    stopped = stop_and_drain(redis_server, processes)

    runs = read_runs(redis_server)
    for entry, period in ((every_second, 1), (every_two, 2), (added, 1)):
        slots = assert_once_per_slot(runs, entry, timedelta(seconds=period),
                                     slot_floor(stopped - period, period))
        assert all(slot.timestamp() % period == 0 for slot in slots)
    first_added = min(parse_slot(run["slot"]) for run in runs_of(redis_server, added))
    assert first_added <= slot_floor(added_at + 5, 1)  # picked up from the database at once
    assert len(slot_counts(runs, every_second)) >= 10
    assert_took_part(processes, every_second, minimum=6)
    assert_took_part(processes, added, minimum=3)
    assert_no_errors(processes)


def test_an_interval_edited_in_the_database_is_followed_by_every_beat(
        redis_server: RedisServer, clean: str, django_db: Path,
        processes: list[CeleryProcess]) -> None:
    """1 s -> 3 s and 2 s -> 1 s while three beats run: slots move to the new grid, one run each."""
    slower, faster = f"{clean}slower", f"{clean}faster"
    add_entry(slower, 1)
    add_entry(faster, 2)
    for name in ("a", "b", "c"):
        processes.append(start_db_beat(redis_server, django_db, name))
    wait_for(lambda: len(runs_of(redis_server, faster)) >= 3, timeout=30, message="runs")
    wait_for_phase(2.0, 0.4, 0.6)  # between the slots of both grids
    set_every(slower, 3)
    set_every(faster, 1)
    edited = time.time()
    wait_for(lambda: all(f"beat: {slower}: schedule changed" in beat.output()
                         and f"beat: {faster}: schedule changed" in beat.output()
                         for beat in processes),
             timeout=30, message="every beat to re-read the database")
    settled = time.time()
    soak(settled + 13 - time.time(), check=all_running(processes), what="beats on the new grid")
    stopped = stop_and_drain(redis_server, processes)

    runs = read_runs(redis_server)
    assert_follows_edit(runs, slower, 1, 3, edited, settled, slot_floor(stopped - 1.5, 3))
    assert_follows_edit(runs, faster, 2, 1, edited, settled, slot_floor(stopped - 1.5, 1))
    assert_took_part(processes, faster, minimum=5)
    assert_no_errors(processes)


def test_sigkill_of_one_beat_on_a_database_leaves_no_gap(
        redis_server: RedisServer, clean: str, django_db: Path,
        processes: list[CeleryProcess]) -> None:
    """The beat that sent the latest slot is SIGKILLed mid-slot: the others cover every slot."""
    every_second, every_two = f"{clean}1s", f"{clean}2s"
    add_entry(every_second, 1)
    add_entry(every_two, 2)
    for name in ("a", "b", "c"):
        processes.append(start_db_beat(redis_server, django_db, name))
    wait_for(lambda: len(runs_of(redis_server, every_second)) >= 4, timeout=30, message="runs")
    # Half-way after an odd second, when only the 1 s row fires, its send done: no burst
    # is in flight (beats killed mid-burst are test_beat_kills.py's).
    wait_between_sends(redis_server, every_second, 1, 2.0, 1.45, 1.55)
    winner = runs_of(redis_server, every_second)[-1]["instance"]
    victim = next((beat for beat in processes if f":{beat.pid}:" in winner), processes[1])
    victim.kill_group()
    killed_at = time.time()
    survivors = [beat for beat in processes if beat is not victim]
    soak(killed_at + 8 - time.time(), check=all_running(survivors), what="two beats after a kill")
    stopped = stop_and_drain(redis_server, processes)

    runs = read_runs(redis_server)
    for entry, period in ((every_second, 1), (every_two, 2)):
        slots = assert_once_per_slot(runs, entry, timedelta(seconds=period),
                                     slot_floor(stopped - period, period))
        assert slots[0] < datetime.fromtimestamp(killed_at, UTC)
        assert slots[-1] >= slot_floor(killed_at + 6, period)
    after = {run["instance"] for run in runs_of(redis_server, every_second)
             if parse_slot(run["slot"]).timestamp() > killed_at}
    assert after and not any(f":{victim.pid}:" in instance for instance in after)
    assert_took_part(survivors, every_second, minimum=8)
    assert_no_errors(processes)
