"""Beat tests: real ``celery beat`` processes with run records, and in-process schedulers
driven by a clock moved by hand (sends recorded instead of published)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from celery import Celery
from celery.beat import Scheduler
from celery.result import AsyncResult
from celery.utils import uuid

from celery_singleton_beat.beat import SingletonScheduler, SingletonSchedulerMixin, entry_record_key, entry_spec

from .processes import CeleryProcess, child_env
from .servers import RECORD_DB, RedisServer
from .slots import expected_slots, parse_slot
from .waiting import wait_for

__all__ = [
    "BEAT_APP", "RUNS_KEY", "ClockApp", "ManualClock", "RecordingScheduler",
    "RecordingSingletonScheduler", "SendRecorder", "already_scheduled", "assert_once_per_slot",
    "beat_app", "read_runs",
    "run_ticks", "sent_slots", "slot_counts", "start_beat", "wait_for_slot",
]

BEAT_APP = "tests.apps.beat_app"
#: The record database list where ``tests.apps.beat_app.record`` appends each execution.
RUNS_KEY = "beat:runs"


# ----------------------------------------------------------------- real processes

def start_beat(redis_server: RedisServer, workdir: Path, name: str, schedule: dict[str, Any], *,
               settings: dict[str, Any] | None = None, clock: dict[str, float] | None = None,
               scheduler: str = "singleton", wait: bool = True) -> CeleryProcess:
    """Start ``celery beat -S <scheduler>`` with its own schedule file; wait until it starts.

    ``schedule``, ``settings`` and ``clock`` are described in ``tests/apps/beat_app.py``.
    """
    env = child_env(
        redis_server,
        CSB_BEAT_SCHEDULE=json.dumps(schedule),
        CSB_BEAT_SETTINGS=json.dumps(settings or {}),
        CSB_CLOCK=json.dumps(clock or {}),
    )
    beat = CeleryProcess(
        ["-A", BEAT_APP, "beat", "-S", scheduler, "-s", str(workdir / f"{name}-schedule"),
         "-l", "info"],
        env, name=f"beat-{name}",
    ).start()
    if wait:
        beat.wait_for_log("beat: Starting...", timeout=60)
    return beat


def read_runs(redis_server: RedisServer) -> list[dict[str, Any]]:
    """Every execution recorded by the worker so far, in order."""
    client = redis_server.client(RECORD_DB)
    return [json.loads(raw) for raw in client.lrange(RUNS_KEY, 0, -1)]


def slot_counts(runs: Iterable[dict[str, Any]], entry: str | None = None) -> Counter[str]:
    """How many executions each slot got."""
    return Counter(run["slot"] for run in runs if entry is None or run["entry"] == entry)


def wait_for_slot(redis_server: RedisServer, at: datetime, timeout: float = 30.0) -> None:
    """Wait until the worker recorded a run for slot ``at`` or a later one."""
    wait_for(lambda: any(parse_slot(run["slot"]) >= at for run in read_runs(redis_server)
                         if run["slot"]), timeout=timeout, message=f"a run for slot {at} or later")


def assert_once_per_slot(runs: list[dict[str, Any]], entry: str, period: timedelta,
                         until: datetime) -> list[datetime]:
    """Each slot of ``entry`` ran exactly once and none is missing up to ``until``."""
    counts = slot_counts(runs, entry)
    assert None not in counts, f"a run without a slot header: {runs}"
    duplicates = {slot: n for slot, n in counts.items() if n > 1}
    assert not duplicates, f"slots executed more than once: {duplicates}"
    slots = sorted(parse_slot(label) for label in counts)
    assert slots, "no run recorded"
    wanted = expected_slots(slots[0], until, period)
    missing = sorted(set(wanted) - set(slots))
    assert not missing, f"slots never executed: {[s.isoformat() for s in missing]}"
    return slots


# ----------------------------------------------------------------- in-process schedulers

class ManualClock:
    """A clock tests move by hand."""

    def __init__(self, start: datetime) -> None:
        self.value = start

    def now(self) -> datetime:
        return self.value

    def advance(self, seconds: float) -> None:
        self.value += timedelta(seconds=seconds)


class ClockApp(Celery):
    """An app whose ``now()`` reads a clock object (what beat reads time through)."""

    clock: Any = None

    def now(self) -> datetime:
        if self.clock is None:
            return super().now()
        return self.clock.now().astimezone(self.timezone)


class SendRecorder:
    """Records what a scheduler sends instead of publishing it (no broker needed)."""

    producer = None  # no broker connection: send_task below records instead
    redis_retry_min = 0.05
    redis_retry_max = 0.2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[dict[str, Any]] = []
        super().__init__(*args, **kwargs)

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> AsyncResult:
        self.sent.append({"task": name, "args": args, "kwargs": kwargs, "options": options,
                          "slot": options.get("headers", {}).get("singleton_beat_slot")})
        # As Celery's send_task: Celery before 5.4 reads the result's id after each send.
        return AsyncResult(options.get("task_id") or uuid(), app=self.app)


class RecordingScheduler(SendRecorder, SingletonSchedulerMixin, Scheduler):
    """The mixin on Celery's plain in-memory ``Scheduler``."""


class RecordingSingletonScheduler(SendRecorder, SingletonScheduler):
    """``SingletonScheduler`` (shelve-backed) with recorded sends."""


def beat_app(clock: Any, schedule: dict[str, Any], claims_url: str, **conf: Any) -> ClockApp:
    """An app for in-process schedulers: ``clock``, ``schedule``, slot claims in ``claims_url``.

    It is made current: entries read back from a shelve file lose their app and
    fall back to the current one (as in a real beat, where it is the beat's app).
    Sends are recorded by the schedulers above, so the broker is never used.
    """
    app = ClockApp("beat-unit", set_as_current=False)
    app.clock = clock
    app.conf.update({"broker_url": "memory://", "singleton_redis_url": claims_url,
                     "beat_schedule": schedule, "result_expires": None, **conf})
    app.set_current()
    return app


def run_ticks(schedulers: Iterable[Any], clock: ManualClock, seconds: float, step: float) -> None:
    """Drive schedulers like beat's loop would, while the clock advances by ``step``."""
    schedulers = list(schedulers)
    end = clock.value + timedelta(seconds=seconds)
    while clock.value < end:
        for scheduler in schedulers:
            for _ in range(100_000):
                if scheduler.tick() > 0:
                    break
        clock.advance(step)


def already_scheduled(client: Any, schedule: dict[str, Any], prefix: str = "singleton",
                      since: datetime | None = None) -> None:
    """Record the singleton entries of ``schedule`` as scheduled since ``since`` (default:
    the epoch), as if beats had run them all along: a beat that starts then treats their
    latest slot as missed (``singleton_beat_catch_up``), not as a first sight.
    ``client``: the Redis of the slot claims."""
    for name, options in schedule.items():
        entry = type("Entry", (), {"name": name, "options": options.get("options"),
                                   "args": options.get("args"), "kwargs": options.get("kwargs")})()
        spec = entry_spec(entry)
        if spec is not None:
            at = since.timestamp() if since is not None else 0.0
            client.set(entry_record_key(prefix, spec.name), f"{at:.3f}", px=86_400_000)


def sent_slots(*schedulers: Any, task: str | None = None) -> Counter[str]:
    """How many times each slot was sent, over ``schedulers`` (only ``task``'s if given)."""
    return Counter(sent["slot"] for scheduler in schedulers for sent in scheduler.sent
                   if task is None or sent["task"] == task)
