"""Beat tests: real ``celery beat`` processes with run records, and in-process schedulers
driven by a clock moved by hand (sends recorded instead of published)."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from celery import Celery
from celery.beat import Scheduler
from celery.result import AsyncResult
from celery.utils import uuid

from celery_singleton_beat.beat import SingletonScheduler, SingletonSchedulerMixin, entry_record_key, entry_spec

from .owners import Owner, owning
from .processes import CeleryProcess, child_env, start_worker
from .servers import LOCK_DB, RECORD_DB, RedisServer, flushdb, queue_drained
from .slots import UTC, expected_slots, parse_slot, slot_floor
from .waiting import wait_for

__all__ = [
    "BEAT_APP",
    "RUNS_KEY",
    "BeatMonotonic",
    "ClockApp",
    "ManualClock",
    "RecordingScheduler",
    "RecordingSingletonScheduler",
    "SendRecorder",
    "already_scheduled",
    "assert_once_per_slot",
    "assert_stopped_cleanly",
    "beat_app",
    "claims_of",
    "drain_worker",
    "logged_sends",
    "pause",
    "paused_beat",
    "read_runs",
    "run_ticks",
    "runs_by_slot",
    "runs_of",
    "sent_slots",
    "slot_counts",
    "start_beat",
    "start_beat_pair",
    "wait_between_sends",
    "wait_for_slot",
    "worker_idle",
]

BEAT_APP = "tests.apps.beat_app"
#: The record database list where ``tests.apps.beat_app.record`` appends each execution.
RUNS_KEY = "beat:runs"


# ----------------------------------------------------------------- real processes

def start_beat(redis_server: RedisServer, workdir: Path, name: str, schedule: dict[str, Any], *,
               settings: dict[str, Any] | None = None, clock: dict[str, Any] | None = None,
               scheduler: str = "singleton", wait: bool = True,
               env: dict[str, str] | None = None, schedule_file: Path | None = None) -> CeleryProcess:
    """Start ``celery beat -S <scheduler>`` with its own schedule file; wait until it starts.

    ``schedule``, ``settings``, ``clock`` and the hooks ``env`` may set are described
    in ``tests/apps/beat_app.py``. The schedule file is ``workdir/<name>-schedule``
    unless ``schedule_file`` says where.
    """
    env = child_env(
        redis_server,
        CSB_BEAT_SCHEDULE=json.dumps(schedule),
        CSB_BEAT_SETTINGS=json.dumps(settings or {}),
        CSB_CLOCK=json.dumps(clock or {}),
        **(env or {}),
    )
    beat = CeleryProcess(
        ["-A", BEAT_APP, "beat", "-S", scheduler, "-s", str(schedule_file or workdir / f"{name}-schedule"),
         "-l", "info"],
        env, name=f"beat-{name}",
    ).start()
    if wait:
        beat.wait_for_log("beat: Starting...", timeout=60)
    return beat


def assert_stopped_cleanly(beat: CeleryProcess, timeout: float = 30.0) -> None:
    """``beat`` (signalled to stop) exits, with code 0 and no error or traceback logged."""
    wait_for(lambda: beat.process is not None and beat.process.poll() is not None, timeout=timeout,
             message=f"{beat.name} to exit after its signal")
    log = beat.output()
    assert "ERROR/" not in log and "Traceback" not in log, beat.tail(40)
    assert beat.returncode == 0, beat.tail(40)


def start_beat_pair(redis_server: RedisServer, workdir: Path, schedule: dict[str, Any],
                    settings: dict[str, Any], env: dict[str, str], period: float) -> list[CeleryProcess]:
    """Two beats ``a`` and ``b`` (``env``: e.g. a :func:`pause` hook), both ticking before
    the next slot of a ``period`` entry comes.

    A beat skips the slots due before its scheduler started (catch-up none), so a
    beat that comes up just after a slot never watches it: if the other beat won
    that slot alone and then stops mid-burst, nobody takes its hand-backs over (a
    test race, seen as a 60 s timeout). Both are started just after a slot
    boundary, with most of a period to come up before the next slot.
    """
    wait_for(lambda: time.time() % period < 0.25, timeout=period + 5, interval=0.01,
             message="a slot boundary")
    beats = []
    for name in ("a", "b"):
        beats.append(CeleryProcess(
            ["-A", BEAT_APP, "beat", "-S", "singleton", "-s", str(workdir / f"{name}-schedule"),
             "-l", "info"],
            child_env(redis_server, CSB_BEAT_SCHEDULE=json.dumps(schedule),
                      CSB_BEAT_SETTINGS=json.dumps(settings), **env),
            name=f"beat-{name}",
        ).start())
    for beat in beats:
        beat.wait_for_log("singleton scheduler", timeout=60)
    return beats


def pause(marker: str, at: int, when: str, entry: str | None = None, hold: str | None = None) -> dict[str, str]:
    """The ``CSB_PAUSE`` environment of ``tests/apps/beat_app.py``: block the first beat
    that reaches its ``at``-th publish (of ``entry`` only, if given), ``when`` = before/after;
    with ``hold``, the other beats' publishes of the entry wait while that record exists."""
    spec: dict[str, Any] = {"at": at, "when": when, "marker": marker}
    if entry is not None:
        spec["entry"] = entry
    if hold is not None:
        spec["hold"] = hold
    return {"CSB_PAUSE": json.dumps(spec)}


def paused_beat(redis_server: RedisServer, beats: list[CeleryProcess], marker: str) -> CeleryProcess:
    """The beat that blocked in the :func:`pause` hook (waits for it)."""
    records = redis_server.client(RECORD_DB)
    wait_for(lambda: records.get(marker) is not None, timeout=60,
             message="a beat to reach the pause point")
    pid = int(records.get(marker))
    return next(beat for beat in beats if beat.pid == pid)


def claims_of(redis_server: RedisServer, entry: str, db: int = LOCK_DB) -> dict[str, dict[str, Any]]:
    """The slot claims of ``entry`` alive now: ``{slot label: claim value}``."""
    client = redis_server.client(db)
    claims = {}
    for key in client.scan_iter(f"singleton:{{beat:{entry}}}:[0-9]*"):  # slots, not the :scheduled record
        raw = client.get(key)
        if raw is not None:
            claims[key.decode().rsplit("}:", 1)[1]] = json.loads(raw)
    return claims


def read_runs(redis_server: RedisServer) -> list[dict[str, Any]]:
    """Every execution recorded by the worker so far, in order."""
    client = redis_server.client(RECORD_DB)
    return [json.loads(raw) for raw in client.lrange(RUNS_KEY, 0, -1)]


def runs_of(redis_server: RedisServer, entry: str) -> list[dict[str, Any]]:
    """The recorded executions of ``entry``, in order."""
    return [run for run in read_runs(redis_server) if run["entry"] == entry]


def wait_between_sends(redis_server: RedisServer, entry: str, every: float, period: float, low: float,
                       high: float, timeout: float = 30.0) -> float:
    """Wait until the wall clock is in ``[low, high)`` modulo ``period`` *and* the run of
    ``entry``'s current slot (``every`` seconds) is recorded; return the epoch time seen.

    A beat killed then dies between two sends of ``entry``, not in one. The clock alone
    does not say so: on a busy machine a send can come half a period late, and a beat
    killed after its "won by ..., sending" and before its publish is taken over by
    another, which logs a second send of the slot."""
    def between() -> float | None:
        now = time.time()
        if not low <= now % period < high:
            return None
        current = slot_floor(now, every)
        done = any(run["slot"] and parse_slot(run["slot"]) >= current for run in runs_of(redis_server, entry))
        return now if done else None

    seen: float = wait_for(between, timeout=timeout, interval=0.005,
                           message=f"a moment in [{low}, {high}) modulo {period} with {entry}'s current slot run")
    return seen


def runs_by_slot(redis_server: RedisServer, prefix: str) -> dict[str, dict[str, int]]:
    """``{slot label: {entry: executions}}`` of the entries named ``prefix*``."""
    table: dict[str, dict[str, int]] = {}
    for run in read_runs(redis_server):
        if run["entry"].startswith(prefix):
            per_entry = table.setdefault(run["slot"], {})
            per_entry[run["entry"]] = per_entry.get(run["entry"], 0) + 1
    return table


def slot_counts(runs: Iterable[dict[str, Any]], entry: str | None = None) -> Counter[str]:
    """How many executions each slot got."""
    return Counter(run["slot"] for run in runs if entry is None or run["entry"] == entry)


def logged_sends(processes: Iterable[CeleryProcess], entry: str) -> Counter[str]:
    """How many times the beats' logs say each slot of ``entry`` was sent (won and sent, taken
    over, or sent again after a failed publish), over every process, killed ones included."""
    pattern = re.compile(rf"beat: {re.escape(entry)}: slot (\S+) (won by|took over|was handed back)")
    return Counter(match.group(1) for process in processes
                   for match in pattern.finditer(process.output()))


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


class BeatMonotonic:
    """The monotonic clock of the beat package (hand-back back-offs, watches, marks, the
    Redis breaker), stopped and moved by hand: what runs out after a number of seconds
    runs out when the test says, not when a loaded machine lets a tick run late.

    ``install`` puts it in place of the ``time`` module of ``celery_singleton_beat.beat``'s
    modules for one test (the rest of ``time`` is the real one; redis-py keeps real time).
    """

    def __init__(self) -> None:
        self.value = time.monotonic()

    def monotonic(self) -> float:
        return self.value

    def advance(self, seconds: float) -> None:
        self.value += max(seconds, 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def install(self, monkeypatch: Any) -> None:
        modules = [module for name, module in list(sys.modules.items())
                   if name.startswith("celery_singleton_beat.beat.") and getattr(module, "time", None) is time]
        assert modules, "the beat package reads no time module any more"
        for module in modules:
            monkeypatch.setattr(module, "time", self)


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
                          "slot": options.get("headers", {}).get("singleton_beat_slot"), "at": time.time()})
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


_RECEIVED = re.compile(r"Task \S+\[([0-9a-f-]+)\] received")
_ENDED = re.compile(r"Task \S+\[([0-9a-f-]+)\] (?:succeeded|raised|failed|retry|ignored)")


def worker_idle(worker: CeleryProcess) -> bool:
    """Every task ``worker`` received has ended, by its log. An empty queue alone does not
    say so: a task acknowledged early (the default) leaves the broker before it runs."""
    worker.check_running()
    log = worker.output()
    return set(_RECEIVED.findall(log)) <= set(_ENDED.findall(log))


def drain_worker(redis_server: RedisServer, worker: CeleryProcess, queue: str) -> None:
    """Wait until ``worker`` has executed every message of ``queue`` sent so far (Redis broker)."""
    broker = redis_server.client(0)
    wait_for(lambda: queue_drained(broker, queue) and worker_idle(worker),
             timeout=60, message=f"{worker.name} to drain {queue} and finish its tasks")


def module_beat_worker(redis_server: RedisServer, label: str) -> Iterator[CeleryProcess]:
    """Body of a module-scoped fixture: one worker of ``tests.apps.beat_app`` for the module
    (solo pool, one message at a time, in queue order: easy to drain)."""
    with owning(Owner(f"{label} worker")) as owner:
        process = start_worker(redis_server, "tests.apps.beat_app", f"{label}-{uuid()[:6]}",
                               pool="solo", concurrency=1, extra=["--prefetch-multiplier", "1"])
    yield process
    owner.close()


def fresh_beat_state(redis_server: RedisServer, worker: CeleryProcess, prefix: str) -> str:
    """Wipe claims and run records for a test (its module worker still running); return a
    unique entry-name prefix starting with ``prefix``."""
    worker.check_running()
    with redis_server.client(LOCK_DB) as locks:
        flushdb(locks)
    redis_server.client(RECORD_DB).flushdb()
    return f"{prefix}{uuid()[:6]}-"


class RealClock:
    """A beat's clock in real time (tests where real processes run beside the beat)."""

    def now(self) -> datetime:
        return datetime.now(UTC)


def beat_loop(beat: Any, stop: threading.Event, errors: list[str]) -> None:
    """Tick ``beat`` until ``stop`` is set (at most every 50 ms); its errors go to ``errors``."""
    while not stop.is_set():
        try:
            delay = beat.tick()
        except Exception as exc:
            errors.append(repr(exc))
            delay = 0.05
        stop.wait(min(max(delay, 0.0), 0.05))
