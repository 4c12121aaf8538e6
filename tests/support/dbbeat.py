"""django-celery-beat tests: rows written with the ORM, in-process database schedulers,
real beats on a SQLite file, and the checks of their runs (``tests/test_django_beat.py``).

Django must be configured before these helpers touch the ORM (the tests'
``django_db`` fixture does it); the models are imported inside the helpers.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from .beat import SendRecorder, beat_app, runs_of, slot_counts
from .processes import CeleryProcess, child_env
from .servers import LOCK_DB, RedisServer, queue_drained
from .skips import importorskip
from .slots import UTC, expected_slots, parse_slot
from .stalls import StallWindow, unexplained_errors
from .waiting import wait_for

__all__ = [
    "DJANGO_APP",
    "QUEUE",
    "SCHEDULER",
    "TASK",
    "add_entry",
    "all_running",
    "assert_follows_edit",
    "assert_no_errors",
    "assert_took_part",
    "clear_schedule",
    "django_db",
    "recording_scheduler",
    "runs_of",
    "sent_names",
    "set_every",
    "start_db_beat",
    "stop_and_drain",
]

@pytest.fixture(scope="module")
def django_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file; Django in this process is configured on it (once)."""
    importorskip("django_celery_beat")
    import django
    from django.conf import settings
    from django.core.management import call_command

    from ..apps.django_settings import settings_for

    if settings.configured:
        path = Path(settings.DATABASES["default"]["NAME"])
    else:
        path = tmp_path_factory.mktemp("django") / "beat.sqlite3"
        settings.configure(**settings_for(str(path)))
        django.setup()
    call_command("migrate", verbosity=0)
    # WAL lets the beats read while the test (or another beat) writes; it stays set in the file.
    with sqlite3.connect(path) as connection:
        connection.execute("PRAGMA journal_mode=WAL")
    return path


SCHEDULER = "celery_singleton_beat.contrib.django:SingletonDatabaseScheduler"
DJANGO_APP = "tests.apps.django_beat_app"
TASK = "tests.apps.beat_app.record"  # run by the worker of tests.apps.beat_app
QUEUE = "beat-tests"


def clear_schedule() -> None:
    """No entries and no change marker: each test writes its own rows."""
    from django_celery_beat.models import (
        CrontabSchedule,
        IntervalSchedule,
        PeriodicTask,
        PeriodicTasks,
    )

    for model in (PeriodicTask, IntervalSchedule, CrontabSchedule, PeriodicTasks):
        model.objects.all().delete()


def add_entry(name: str, every: int, period: str = "seconds", **fields: Any) -> Any:
    """A ``PeriodicTask`` running the recording task every ``every`` ``period`` (own interval row)."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    interval = IntervalSchedule.objects.create(every=every, period=period)
    return PeriodicTask.objects.create(name=name, task=TASK, interval=interval,
                                       args=json.dumps([name]), **fields)


def set_every(name: str, every: int, period: str = "seconds") -> None:
    """Edit the entry's interval row, as the admin's interval form does (``post_save`` marks the change)."""
    from django_celery_beat.models import PeriodicTask

    interval = PeriodicTask.objects.get(name=name).interval
    interval.every = every
    interval.period = period
    interval.save()


def recording_scheduler(redis_server: RedisServer, **conf: Any) -> Any:
    """A ``SingletonDatabaseScheduler`` that records sends; real time, claims in the test Redis."""
    from celery_singleton_beat.contrib.django import SingletonDatabaseScheduler

    class Recording(SendRecorder, SingletonDatabaseScheduler):
        pass

    app = beat_app(None, {}, redis_server.url(LOCK_DB), **conf)
    return Recording(app=app)


def sent_names(scheduler: Any) -> list[str]:
    return [sent["args"][0] for sent in scheduler.sent]


def start_db_beat(redis_server: RedisServer, database: Path, name: str) -> CeleryProcess:
    """``celery beat -S ...:SingletonDatabaseScheduler`` on ``database``; waits until its
    scheduler has read the database (a row edited after this returns is a change it sees)."""
    env = child_env(redis_server, CSB_DJANGO_DB=str(database),
                    DJANGO_SETTINGS_MODULE="tests.apps.django_settings")
    beat = CeleryProcess(["-A", DJANGO_APP, "beat", "-S", SCHEDULER, "-l", "info"], env,
                         name=f"dbbeat-{name}").start()
    beat.wait_for_log("beat: singleton scheduler", timeout=60)
    return beat


def all_running(processes: list[CeleryProcess]) -> Callable[[], bool]:
    def check() -> bool:
        for process in processes:
            process.check_running()
        return True

    return check


def stop_and_drain(redis_server: RedisServer, beats: list[CeleryProcess]) -> float:
    """Stop the beats, wait until the worker ran every message; the time they stopped."""
    stopped = time.time()
    for beat in beats:
        beat.stop()
    broker = redis_server.client(0)
    wait_for(lambda: queue_drained(broker, QUEUE),
             timeout=60, message="the worker to drain the queue")
    return stopped


def assert_no_errors(beats: list[CeleryProcess], stalls: StallWindow | None = None) -> None:
    """No beat logged an error: no failed database write ("database is locked"), no
    failed claim, no traceback: the beats share the database without fighting over it.

    ``stalls``: the beats are workers (``-B``), whose heartbeat logs its liveness key found
    expired after the machine froze past its TTL; that line alone is excused when the test
    process itself froze as long (:func:`.stalls.unexplained_errors`)."""
    for beat in beats:
        log = beat.output()
        bad = [line for line in log.splitlines() if "Traceback" in line] + unexplained_errors(log, stalls, "ERROR/")
        assert not bad, f"{beat.name} logged errors: {bad[:5]}"


def assert_took_part(beats: list[CeleryProcess], entry: str, minimum: int) -> None:
    """Every beat decided (won or skipped) at least ``minimum`` slots of ``entry``: all active."""
    for beat in beats:
        decisions = beat.output().count(f"beat: {entry}: slot ")
        assert decisions >= minimum, f"{beat.name} decided {decisions} slot(s) of {entry}"


def assert_follows_edit(runs: list[dict[str, Any]], entry: str, old: int, new: int,
                        edited: float, settled: float, until: datetime) -> None:
    """Slots of ``entry`` whose interval went from ``old`` to ``new`` seconds at ``edited``.

    One run per slot; every slot on the old grid up to the edit (one period
    before it), every slot on the new grid after it; nothing but new-grid slots
    once every beat had re-read the database (``settled``).
    """
    counts = slot_counts(runs, entry)
    duplicates = {slot: n for slot, n in counts.items() if n > 1}
    assert not duplicates, f"{entry}: slots executed more than once: {duplicates}"
    slots = sorted(parse_slot(label) for label in counts)
    stamps = [slot.timestamp() for slot in slots]
    assert all(at % old == 0 or at % new == 0 for at in stamps), f"{entry}: off-grid slots {stamps}"
    before = [slot for slot in slots if slot.timestamp() <= edited - old]
    assert before, f"{entry}: no run before the edit"
    missing = set(expected_slots(before[0], before[-1], timedelta(seconds=old))) - set(before)
    assert not missing, f"{entry}: old-grid slots never executed: {sorted(missing)}"
    first_new = datetime.fromtimestamp((edited // new + 1) * new, UTC)
    wanted = expected_slots(first_new, until, timedelta(seconds=new))
    missing = set(wanted) - set(slots)
    assert not missing, f"{entry}: new-grid slots never executed: {sorted(missing)}"
    late = [at for at in stamps if at > settled and at % new != 0]
    assert not late, f"{entry}: old-grid slots after every beat re-read: {late}"
    assert len(wanted) >= 3
