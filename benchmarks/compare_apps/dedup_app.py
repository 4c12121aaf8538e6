"""The app of ``benchmarks/compare_dedup.py``: one beat entry, one 50 ms task, one variant.

Configured by environment (set by the benchmark for every process it starts):

* ``CMP_REDIS``: base URL of the benchmark's redis-server. Broker on db 0,
  locks on db 1, records on db 2.
* ``CMP_VARIANT``: the task's base class:
  ``plain`` (``celery.Task``), ``celery_singleton`` (``celery_singleton.Singleton``),
  ``celery_once`` (``celery_once.QueueOnce``), ``ours`` (``SingletonTask``),
  ``redbeat`` (``celery.Task``, for beats run with ``-S redbeat.RedBeatScheduler``),
  ``ours_redbeat`` (``SingletonTask``, for beats run with ``SingletonRedBeatScheduler``).
  Each library is used with its default options.
* ``CMP_MAX_LOOP``: ``beat_max_loop_interval`` in seconds (empty: Celery's default).
* ``CMP_INTERVAL`` (seconds, default 1), ``CMP_SLEEP`` (seconds, default 0.05).
* ``CMP_BEAT_ID``: set in beat processes only; every message a beat publishes
  is recorded in the ``pubs`` list and carries the beat's id in a header.

The task records each execution in the ``runs`` list (JSON: start and end
times, task id, the beat that published it).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

import redis
from celery import Celery, Task
from celery.signals import before_task_publish

from benchmarks.compare_apps.bases import task_base

BASE = os.environ["CMP_REDIS"]
VARIANT = os.environ["CMP_VARIANT"]
INTERVAL = float(os.environ.get("CMP_INTERVAL", "1"))
SLEEP = float(os.environ.get("CMP_SLEEP", "0.05"))
BEAT_ID = os.environ.get("CMP_BEAT_ID")
BEAT_HEADER = "cmp_beat"
LOCKS_URL = f"{BASE}/1"


app = Celery("cmp", broker=f"{BASE}/0")
app.conf.update(
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    beat_schedule={
        "tick": {
            "task": "cmp.tick",
            "schedule": timedelta(seconds=INTERVAL),
        },
    },
)

if os.environ.get("CMP_MAX_LOOP"):
    app.conf.beat_max_loop_interval = float(os.environ["CMP_MAX_LOOP"])

base: type[Task] = task_base(app, VARIANT, LOCKS_URL)

_records: redis.Redis | None = None


def records() -> redis.Redis:
    global _records
    if _records is None:
        _records = redis.Redis.from_url(f"{BASE}/2")
    return _records


@before_task_publish.connect
def _record_publish(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    if BEAT_ID is None or headers is None:
        return
    headers[BEAT_HEADER] = BEAT_ID
    records().rpush("pubs", json.dumps({"t": time.time(), "beat": BEAT_ID, "id": headers.get("id")}))


@app.task(base=base, bind=True, name="cmp.tick")
def tick(self: Task) -> None:
    start = time.time()
    time.sleep(SLEEP)
    records().rpush("runs", json.dumps({
        "start": start, "end": time.time(), "id": self.request.id,
        "beat": getattr(self.request, BEAT_HEADER, None),
    }))
