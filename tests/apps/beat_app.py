"""Celery app for beat tests: real beats and a real worker, configured by environment.

* ``CSB_TEST_REDIS``: base URL of the test redis-server (broker db 0, slot
  claims db 2, run records db 3).
* ``CSB_BEAT_SCHEDULE``: JSON ``{name: {"every": seconds | "cron": "m h dom mon dow",
  "args": [...], "options": {...}}}``; every entry runs :func:`record`.
* ``CSB_BEAT_SETTINGS``: JSON of extra ``app.conf`` settings.
* ``CSB_PAUSE``: JSON ``{"at": n, "when": "before" | "after", "marker": key,
  "entry": name}``: a test hook for killing a beat at a chosen moment. The
  first process of the test to reach its ``n``-th publish (counted in this
  process; only of entry ``name`` when given) writes its pid to ``marker``
  (record db, ``SET NX``) and then blocks for good, ``before`` the message is
  published (claimed, not sent) or ``after`` it (sent, not yet marked sent).
  Signals still interrupt the block. With ``"hold": key`` as well, every other
  process's publish of the entry, once ``marker`` names another pid, waits while
  ``key`` exists (record db), after writing its pid to ``<key>:held``: the test
  lets the survivor's take-over go when the world is as it wants it.
* ``CSB_LINGER_DIR``: a folder. At interpreter teardown (after Python stopped running
  its signal handlers, before the process ends) the process writes ``lingering``
  there and waits until ``go`` appears (30 s at most): a test can signal a beat
  that is exiting at exactly that moment.
* ``CSB_FINALIZER_DIR``: a folder. After this process's first publish, still inside the
  beat's tick, an object is dropped whose ``__del__`` writes ``finalizing`` there and
  waits until ``go`` appears (30 s at most): a test can signal a beat while its main
  thread runs a finalizer, as Celery's ``AsyncResult.__del__`` runs after every publish.
  Python ignores an exception that ends a ``__del__`` (it prints ``Exception ignored
  in``): a stop handler's ``SystemExit`` raised there never reaches beat's loop.
* ``CSB_CLOCK``: JSON ``{"offset": s, "speed": x, "anchor": real_epoch, "start": fake_epoch}``:
  this process's clock reads ``start + (real - anchor) * speed + offset``. It
  is the injectable clock for skew and fast-forward tests: Celery's beat reads
  time through ``app.now()`` only. With ``"anchor_file": path`` instead of an
  ``anchor``, the clock stands at ``start`` until that file holds the real epoch to
  run from: a test starts every beat, then lets the clock go for all at once.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import redis
from celery import Celery, signals
from celery.schedules import crontab

from celery_singleton_beat.task.worker import install

BASE = os.environ.get("CSB_TEST_REDIS", "redis://127.0.0.1:6379")
RUNS_KEY = "beat:runs"


class ClockedCelery(Celery):
    """A Celery app whose clock can be offset and sped up (``CSB_CLOCK``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        clock = json.loads(os.environ.get("CSB_CLOCK") or "{}")
        self.clock_offset = float(clock.get("offset", 0.0))
        self.clock_speed = float(clock.get("speed", 1.0))
        self.clock_anchor_file = clock.get("anchor_file")
        self.clock_anchor: float | None = None if self.clock_anchor_file else float(clock.get("anchor", 0.0))
        self.clock_start = float(clock.get("start", self.clock_anchor or 0.0))

    def _anchor(self) -> float | None:
        """The real epoch the clock runs from; None while its ``anchor_file`` is not written."""
        if self.clock_anchor is None:
            try:
                with open(self.clock_anchor_file) as written:  # type: ignore[arg-type]
                    self.clock_anchor = float(written.read())
            except (OSError, ValueError):  # not there yet, or half written
                return None
        return self.clock_anchor

    def now(self) -> datetime:
        real = time.time()
        anchor = self._anchor()
        elapsed = 0.0 if anchor is None else real - anchor
        fake = self.clock_start + elapsed * self.clock_speed + self.clock_offset
        return datetime.fromtimestamp(fake, timezone.utc).astimezone(self.timezone)


app = ClockedCelery("beat_app", broker=f"{BASE}/0")
app.conf.update(
    singleton_redis_url=f"{BASE}/2",
    beat_scheduler="celery_singleton_beat.beat:SingletonScheduler",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    task_default_queue="beat-tests",
)
app.conf.update(json.loads(os.environ.get("CSB_BEAT_SETTINGS") or "{}"))
# A plain-task app: its workers drop a second delivery of a beat slot only with the worker step.
install(app)


def _schedule_from_env() -> dict[str, dict[str, Any]]:
    schedule: dict[str, dict[str, Any]] = {}
    for name, spec in json.loads(os.environ.get("CSB_BEAT_SCHEDULE") or "{}").items():
        if "cron" in spec:
            minute, hour, day_of_month, month_of_year, day_of_week = spec["cron"].split()
            when: Any = crontab(minute, hour, day_of_week, day_of_month, month_of_year)
        else:
            when = timedelta(seconds=float(spec["every"]))
        schedule[name] = {
            "task": "tests.apps.beat_app.record",
            "schedule": when,
            "args": [name, *spec.get("args", [])],
            "options": spec.get("options", {}),
        }
    return schedule


app.conf.beat_schedule = _schedule_from_env()

_records: redis.Redis | None = None


@app.task(bind=True, name="tests.apps.beat_app.record")
def record(self: Any, entry: str, *args: Any) -> None:
    """Record one real execution with the slot and beat instance from the message headers."""
    global _records
    if _records is None:
        _records = redis.Redis.from_url(f"{BASE}/3")
    _records.rpush(RUNS_KEY, json.dumps({
        "entry": entry,
        "args": list(args),
        "slot": getattr(self.request, "singleton_beat_slot", None),
        "instance": getattr(self.request, "singleton_beat_instance", None),
        "task_id": self.request.id,
        "sent_at": getattr(self.request, "csb_sent_at", None),  # set by beats of tests.apps.redbeat_app
        "at": time.time(),
    }))


def _publishes_entry(body: Any, entry: str) -> bool:
    """Whether a published message body (protocol 2: ``(args, kwargs, embed)``) runs ``entry``."""
    try:
        return bool(body[0][0] == entry)
    except (TypeError, IndexError, KeyError):
        return False


def _pause_hook() -> None:
    """Install the ``CSB_PAUSE`` hook (see the module docstring) in this process."""
    pause = json.loads(os.environ.get("CSB_PAUSE") or "{}")
    if not pause:
        return
    counted = {"n": 0}
    records = redis.Redis.from_url(f"{BASE}/3")

    def maybe_pause(body: Any = None, **_: Any) -> None:
        if pause.get("entry") is not None and not _publishes_entry(body, pause["entry"]):
            return
        counted["n"] += 1
        if counted["n"] != int(pause["at"]) or not records.set(pause["marker"], os.getpid(), nx=True):
            return
        while True:  # blocked for good; SIGTERM / SIGKILL still end the process
            time.sleep(0.05)

    signal = signals.before_task_publish if pause.get("when", "before") == "before" \
        else signals.after_task_publish
    signal.connect(maybe_pause, weak=False)
    if pause.get("hold"):
        hold = pause["hold"]

        def maybe_hold(body: Any = None, **_: Any) -> None:
            if pause.get("entry") is not None and not _publishes_entry(body, pause["entry"]):
                return
            winner = records.get(pause["marker"])
            if winner is None or int(winner) == os.getpid() or not records.exists(hold):
                return
            records.set(f"{hold}:held", os.getpid())
            while records.exists(hold):  # signals still end the process
                time.sleep(0.05)

        signals.before_task_publish.connect(maybe_hold, weak=False)


_pause_hook()


class _Linger:
    """The ``CSB_LINGER_DIR`` hook: its ``__del__`` runs when this module's globals are
    cleared at interpreter teardown, after Python reset its signal handlers."""

    def __init__(self, folder: str) -> None:
        # Kept on the instance: module globals may already be gone when __del__ runs.
        self.lingering, self.go = os.path.join(folder, "lingering"), os.path.join(folder, "go")
        self.open, self.exists, self.sleep, self.monotonic = open, os.path.exists, time.sleep, time.monotonic

    def __del__(self) -> None:
        with self.open(self.lingering, "w") as marker:
            marker.write("1")
        deadline = self.monotonic() + 30
        while not self.exists(self.go) and self.monotonic() < deadline:
            self.sleep(0.01)


if os.environ.get("CSB_LINGER_DIR"):
    _linger = _Linger(os.environ["CSB_LINGER_DIR"])


class _HoldInFinalizer:
    """The ``CSB_FINALIZER_DIR`` hook's object: dropped at once, held in its ``__del__``."""

    def __init__(self, folder: str) -> None:
        self.finalizing, self.go = os.path.join(folder, "finalizing"), os.path.join(folder, "go")

    def __del__(self) -> None:
        with open(self.finalizing, "w") as marker:
            marker.write(str(os.getpid()))
        deadline = time.monotonic() + 30
        while not os.path.exists(self.go) and time.monotonic() < deadline:
            time.sleep(0.01)  # a signal's handler runs here, inside the finalizer


def _finalizer_hook() -> None:
    """Install the ``CSB_FINALIZER_DIR`` hook (see the module docstring) in this process."""
    folder = os.environ.get("CSB_FINALIZER_DIR")
    if not folder:
        return
    published = {"n": 0}

    def after_publish(**_: Any) -> None:
        published["n"] += 1
        if published["n"] == 1:
            _HoldInFinalizer(folder)  # no reference kept: its __del__ runs now

    signals.after_task_publish.connect(after_publish, weak=False)


_finalizer_hook()
