"""RedBeat tests: entries written through RedBeat's own API, in-process ``SingletonRedBeatScheduler``
instances, real beats (ours and RedBeat's own), and the figures of their runs
(``tests/test_redbeat_beat.py``).

RedBeat's keys and the slot claims share the claims database of the session
server (``LOCK_DB``), each under its own prefix.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from celery import Celery

from .beat import SendRecorder, beat_app
from .processes import CeleryProcess, child_env
from .servers import LOCK_DB, RedisServer

__all__ = [
    "OURS", "PLAIN", "REDBEAT_APP", "SCHEDULER", "TASK", "Figures", "api_app", "create_entry",
    "figures", "logged_at", "meta_of", "recording_scheduler", "set_every", "start_redbeat_beats",
]

SCHEDULER = "celery_singleton_beat.contrib.redbeat:SingletonRedBeatScheduler"
PLAIN_SCHEDULER = "redbeat.RedBeatScheduler"
REDBEAT_APP = "tests.apps.redbeat_app"
TASK = "tests.apps.beat_app.record"  # run by the worker of tests.apps.beat_app
#: RedBeat key prefixes of the two kinds of beats (one Redis, side by side).
OURS, PLAIN = "redbeat:", "plainredbeat:"


def api_app(redis_server: RedisServer, prefix: str = OURS) -> Celery:
    """An app for RedBeat's API in the test process (what a user's code or admin page uses)."""
    app = Celery(f"redbeat-api-{prefix}", set_as_current=False)
    app.conf.update(broker_url="memory://", redbeat_redis_url=redis_server.url(LOCK_DB),
                    redbeat_key_prefix=prefix)
    return app


def create_entry(app: Celery, name: str, every: float, **fields: Any) -> Any:
    """``RedBeatSchedulerEntry(...).save()``: the recording task every ``every`` seconds."""
    from celery.schedules import schedule
    from redbeat import RedBeatSchedulerEntry

    return RedBeatSchedulerEntry(name, TASK, schedule(timedelta(seconds=every)), args=[name], app=app,
                                 **fields).save()


def set_every(app: Celery, name: str, every: float) -> None:
    """Edit an entry's interval through RedBeat's API (load, change, save)."""
    from celery.schedules import schedule
    from redbeat import RedBeatSchedulerEntry

    entry = RedBeatSchedulerEntry.from_key(RedBeatSchedulerEntry.generate_key(app, name), app=app)
    entry.schedule = schedule(timedelta(seconds=every))
    entry.save()


def meta_of(app: Celery, name: str) -> dict[str, Any]:
    """RedBeat's ``meta`` of an entry, decoded by RedBeat, and its score in RedBeat's schedule."""
    from redbeat import RedBeatSchedulerEntry
    from redbeat.schedulers import get_redis

    key = RedBeatSchedulerEntry.generate_key(app, name)
    meta = dict(RedBeatSchedulerEntry.load_meta(key, app=app))
    meta["score"] = get_redis(app).zscore(app.redbeat_conf.schedule_key, key)
    return meta


def recording_scheduler(redis_server: RedisServer, **conf: Any) -> Any:
    """A ``SingletonRedBeatScheduler`` that records sends; real time; RedBeat's keys and the
    claims in the test Redis."""
    from celery_singleton_beat.contrib.redbeat import SingletonRedBeatScheduler

    class Recording(SendRecorder, SingletonRedBeatScheduler):
        schedule_read_interval = 0.0  # every tick reads (the tests tick faster than once a second)

    url = redis_server.url(LOCK_DB)
    app = beat_app(None, {}, url, redbeat_redis_url=url, redbeat_key_prefix=OURS, **conf)
    return Recording(app=app)


def start_redbeat_beats(redis_server: RedisServer, names: list[str], *, plain: bool = False) -> list[CeleryProcess]:
    """Real ``celery beat`` processes on RedBeat's keys, started together: ours, or RedBeat's
    own ``RedBeatScheduler`` (``plain``, under its own prefix). Returns once each ticks
    (RedBeat's own: once each started; its standbys then wait for the lock)."""
    settings = {"redbeat_key_prefix": PLAIN if plain else OURS}
    env = child_env(redis_server, CSB_BEAT_SETTINGS=json.dumps(settings))
    beats = [CeleryProcess(["-A", REDBEAT_APP, "beat", "-S", PLAIN_SCHEDULER if plain else SCHEDULER,
                            "-l", "info"], env, name=f"{'plain' if plain else 'our'}-redbeat-{name}").start()
             for name in names]
    for beat in beats:
        beat.wait_for_log("beat: Starting..." if plain else "beat: singleton scheduler", timeout=60)
    return beats


@dataclass(frozen=True)
class Figures:
    """One entry's sends over a run, counted on its period's grid."""

    sends: int
    slots: int  # grid slots from the first send to the last one
    covered: int  # slots with at least one send
    longest_gap: float  # seconds between two consecutive sends

    @property
    def missed(self) -> int:
        return self.slots - self.covered

    @property
    def per_slot(self) -> float:
        return self.sends / self.covered if self.covered else 0.0

    def row(self, label: str) -> str:
        return (f"{label:<34} {self.sends:>5} {self.slots:>5} {self.per_slot:>8.2f} {self.missed:>6} "
                f"{self.longest_gap:>8.1f}")


def figures(times: list[float], period: float) -> Figures:
    """Sends at ``times`` (epoch seconds: a slot's instant, or when the message was sent) on
    the grid of ``period``: a send covers the slot it falls in."""
    cells = Counter(math.floor(at / period + 1e-6) for at in times)
    first, last = min(cells), max(cells)
    ordered = sorted(times)
    gap = max((b - a for a, b in itertools.pairwise(ordered)), default=0.0)
    return Figures(len(times), last - first + 1, len(cells), gap)


def logged_at(process: CeleryProcess, text: str) -> float:
    """Epoch time of the first line of ``process``'s log containing ``text`` (Celery logs
    ``[YYYY-mm-dd HH:MM:SS,mmm: ...`` in local time)."""
    line = next(line for line in process.output().splitlines() if text in line)
    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def as_epoch(label: str) -> float:
    return datetime.fromisoformat(label.replace("Z", "+00:00")).timestamp()
