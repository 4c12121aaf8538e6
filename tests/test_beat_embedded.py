"""Beat inside every worker: ``celery worker -B --scheduler singleton``.

* three real workers, each with its embedded singleton beat: one send per
  slot, every worker's beat takes part, and one worker SIGKILLed loses no slot;
* ``-S singleton`` on ``celery worker`` (there ``-S`` is ``--statedb``) is
  refused at start with one line and exit code 78, and leaves no state file;
* a worker whose embedded beat runs another scheduler while singleton beats
  claim slots in the same Redis says so when it starts.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals

from celery_singleton_beat.beat.embedded import _check_worker as check_worker
from celery_singleton_beat.beat.embedded import names_this_library, singleton_beats_here
from celery_singleton_beat.beat.records import REFRESH
from celery_singleton_beat.task.slot_delivery import SlotDeliveryStep

from .support import (
    LOCK_DB,
    CeleryProcess,
    RedisServer,
    child_env,
    run_command,
    soak,
    wait_for,
)
from .support.beat import (
    BEAT_APP,
    ManualClock,
    RecordingScheduler,
    already_scheduled,
    assert_once_per_slot,
    beat_app,
    fresh_beat_state,
    logged_sends,
    module_beat_worker,
    runs_of,
    wait_between_sends,
)
from .support.dbbeat import all_running, assert_no_errors, assert_took_part, stop_and_drain
from .support.slots import parse_slot, slot_floor, utc
from .support.stalls import StallWindow

#: Queue the embedded-beat workers consume: none of the slot messages (see the three-worker test).
IDLE_QUEUE = "embedded-idle"


def start_beat_workers(redis_server: RedisServer, workdir: Path, names: list[str], schedule: dict[str, Any],
                       beat: list[str], settings: dict[str, Any] | None = None) -> list[CeleryProcess]:
    """``celery worker -B <beat...>`` per name (own schedule file), started together; returns
    once each is ready and its embedded beat started."""
    env = child_env(redis_server, CSB_BEAT_SCHEDULE=json.dumps(schedule),
                    CSB_BEAT_SETTINGS=json.dumps(settings or {}))
    workers = [CeleryProcess(
        ["-A", BEAT_APP, "worker", "-P", "solo", "-n", f"{name}@%h", "-l", "info", "-Q", IDLE_QUEUE,
         "--without-gossip", "--without-mingle", "--without-heartbeat",
         "-B", "-s", str(workdir / f"{name}-schedule"), *beat], env, name=f"embedded-{name}").start()
        for name in names]
    for worker in workers:
        worker.wait_for_log("ready.", timeout=60)
        worker.wait_for_log("beat: Starting...", timeout=60)
    return workers


@pytest.fixture(scope="module")
def slot_worker(redis_server: RedisServer) -> Iterator[CeleryProcess]:
    yield from module_beat_worker(redis_server, "embedded")


# ----------------------------------------------------------------- -S on a worker


@pytest.mark.parametrize("value", ["singleton", "celery_singleton_beat.SingletonScheduler"])
def test_dash_s_singleton_on_a_worker_is_refused(redis_server: RedisServer, tmp_path: Path, value: str) -> None:
    """``celery worker -B -S singleton`` would run Celery's own scheduler in every worker (and
    write a state file named ``singleton``): the worker stops at start, exit code 78, one line
    naming ``--scheduler singleton``."""
    done = run_command([sys.executable, "-m", "celery", "-A", BEAT_APP, "worker", "-B", "-S", value, "-l", "info"],
                       timeout=60, cwd=tmp_path, env=child_env(redis_server), capture_output=True, text=True)
    assert done.returncode == 78, done.stderr[-2000:]
    refusals = [line for line in done.stderr.splitlines() if "refuses to start" in line]
    assert len(refusals) == 1, done.stderr[-2000:]
    assert f"-S/--statedb {value!r}" in refusals[0]
    assert "`celery worker -B --scheduler singleton`" in refusals[0]
    assert list(tmp_path.iterdir()) == []  # no state file


def test_the_scheduler_names_of_this_library() -> None:
    from celery.beat import PersistentScheduler

    from celery_singleton_beat import SingletonScheduler

    assert names_this_library("singleton")
    assert names_this_library("celery_singleton_beat.beat:SingletonScheduler")
    assert names_this_library("celery_singleton_beat.contrib.redbeat:SingletonRedBeatScheduler")
    assert names_this_library(SingletonScheduler)
    assert not names_this_library("celery.beat:PersistentScheduler")
    assert not names_this_library(PersistentScheduler)
    assert not names_this_library("/var/lib/celery/worker-state")
    assert not names_this_library(None)


def test_a_worker_embedding_the_singleton_beat_gets_the_slot_check() -> None:
    """``-B --scheduler singleton`` named on the command line only (not in ``beat_scheduler``):
    the worker still gets the step that drops a second delivery of a slot.

    The embedded-beat receiver is called alone: the library's other ``worker_init``
    receiver installs the step for any app with a singleton task, and a new app in
    this process gets every shared task the other tests' apps declared."""
    app = Celery("embedded-step", set_as_current=False)
    assert SlotDeliveryStep not in app.steps["consumer"]
    worker = type("WorkController", (), {})()  # what worker_init receivers read of Celery's
    worker.app, worker.statedb, worker.hostname, worker.scheduler = app, None, "w@h", "singleton"
    worker.options = {"beat": False}
    check_worker(sender=worker)
    assert SlotDeliveryStep not in app.steps["consumer"]  # no embedded beat
    worker.options["beat"] = True
    check_worker(sender=worker)
    assert SlotDeliveryStep in app.steps["consumer"]
    assert check_worker in [receiver() for _, receiver in signals.worker_init.receivers], "connected"


# ----------------------------------------------------------------- a foreign embedded beat


def test_singleton_beats_are_found_by_their_records_or_their_latest_claim(
        redis_db: Any, redis_server: RedisServer) -> None:
    """Nothing found in an empty Redis; an entry a singleton beat schedules (its record renewed
    within the hour) is named; a claim won within the hour is found without a shared entry."""
    locks = redis_server.client(LOCK_DB)
    window = 7 * 86400.0
    assert singleton_beats_here(locks, "singleton", window, ["report"]) is None
    clock = ManualClock(utc(2030, 1, 1, 12, 0, 1))
    schedule = {"report": {"task": "proj.report", "schedule": 60.0}}
    app = beat_app(clock, schedule, redis_server.url(LOCK_DB))
    already_scheduled(locks, schedule)
    scheduler = RecordingScheduler(app=app)
    try:
        while scheduler.tick() <= 0:
            pass
    finally:
        scheduler.close()
    assert [sent["slot"] for sent in scheduler.sent] == ["2030-01-01T12:00:00Z"]
    found = singleton_beats_here(locks, "singleton", window, ["report", "other"])
    assert found == "schedule report too"
    found = singleton_beats_here(locks, "singleton", window, ["other"])
    assert found is not None and "latest: report 2030-01-01T12:00:00Z won by" in found
    assert singleton_beats_here(locks, "other-prefix", window, ["report"]) is None
    # A record older than an hour (no singleton beat renewed it): not evidence by itself.
    locks.pexpire("singleton:{beat:report}:scheduled", round((window + REFRESH.total_seconds()) * 1000) - 3_700_000)
    locks.delete("singleton:{beat}:history")
    assert singleton_beats_here(locks, "singleton", window, ["report"]) is None


def test_a_foreign_embedded_beat_beside_singleton_beats_warns_at_start(
        redis_server: RedisServer, slot_worker: CeleryProcess, processes: list[CeleryProcess],
        tmp_path: Path) -> None:
    """A singleton beat runs ``every-second``; a worker started with ``-B`` and Celery's own
    scheduler, with the same entry, logs one warning naming the entry and the fix."""
    prefix = fresh_beat_state(redis_server, slot_worker, "fe")
    entry = f"{prefix}every-second"
    schedule = {entry: {"every": 1}}
    singleton = start_beat_workers(redis_server, tmp_path, ["ours"], schedule, ["--scheduler", "singleton"],
                                   {"beat_scheduler": "celery.beat:PersistentScheduler"})
    processes.extend(singleton)
    wait_for(lambda: f"beat: {entry}: slot" in singleton[0].output(), timeout=30, message="a slot decided")
    foreign = start_beat_workers(redis_server, tmp_path, ["foreign"], schedule, [],
                                 {"beat_scheduler": "celery.beat:PersistentScheduler"})
    processes.extend(foreign)
    line = foreign[0].wait_for_line("WARNING", "embedded beat runs celery.beat.PersistentScheduler", timeout=30)
    assert "while singleton beats schedule " in line and f"{entry} too" in line
    assert "`-B --scheduler singleton`" in line
    assert "embedded beat runs" not in singleton[0].output()


# ----------------------------------------------------------------- three workers, each with a beat


def test_three_workers_with_embedded_singleton_beats_send_each_slot_once_and_survive_a_kill(
        redis_server: RedisServer, slot_worker: CeleryProcess, processes: list[CeleryProcess],
        tmp_path: Path, stalls: StallWindow) -> None:
    """Three ``celery worker -B --scheduler singleton`` (the app's ``beat_scheduler`` is
    Celery's own: the option picks the scheduler), a 1 s entry: one send (in the beats'
    logs) and one run per slot, every
    worker's beat decides slots; the worker whose beat sent the latest slot is SIGKILLed
    half-way between two slots (with its beat): the others send every slot after it.

    The slot messages run on a fourth worker: the kill tests the embedded beats, not the
    redelivery of a message the killed worker had reserved (that is Celery's
    ``visibility_timeout``, the same for every task)."""
    prefix = fresh_beat_state(redis_server, slot_worker, "eb")
    entry = f"{prefix}every-second"
    workers = start_beat_workers(redis_server, tmp_path, ["a", "b", "c"], {entry: {"every": 1}},
                                 ["--scheduler", "singleton"],
                                 {"beat_scheduler": "celery.beat:PersistentScheduler"})
    processes.extend(workers)
    wait_for(lambda: len(runs_of(redis_server, entry)) >= 4,
             timeout=30, message="four runs")
    wait_between_sends(redis_server, entry, 1, 1.0, 0.45, 0.55)  # no send in flight
    winner = runs_of(redis_server, entry)[-1]["instance"]
    victim = next(worker for worker in workers if f"beat: singleton scheduler {winner}" in worker.output())
    victim.kill_group()
    killed_at = time.time()
    survivors = [worker for worker in workers if worker is not victim]
    soak(killed_at + 6 - time.time(), check=all_running(survivors), what="two workers after a kill")
    stopped = stop_and_drain(redis_server, workers)

    runs = runs_of(redis_server, entry)
    until = slot_floor(stopped - 1, 1)  # sent a second before the first stop
    slots = assert_once_per_slot(runs, entry, timedelta(seconds=1), until)
    sends = {slot: n for slot, n in logged_sends(workers, entry).items() if parse_slot(slot) <= until}
    assert set(sends) == {run["slot"] for run in runs if parse_slot(run["slot"]) <= until}
    assert set(sends.values()) == {1}, {slot: n for slot, n in sends.items() if n != 1}
    assert slots[0].timestamp() < killed_at < slots[-1].timestamp() - 4
    after = {run["instance"] for run in runs if parse_slot(run["slot"]).timestamp() > killed_at}
    assert after and winner not in after
    assert_took_part(workers, entry, minimum=1)
    assert_took_part(survivors, entry, minimum=8)
    assert_no_errors(workers, stalls)
