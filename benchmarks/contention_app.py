"""The app of the contention benchmark: one plain and one singleton task on few keys.

``task_prerun`` and ``task_postrun`` bracket Celery's call of the task; the body
stamps its own start and end. (body start - prerun) + (postrun - body end) is
the time spent around the body: for a SingletonTask, mostly acquire and release.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task
from celery.signals import task_postrun, task_prerun

from celery_singleton_beat import SingletonTask

BROKER = os.environ["BENCH_BROKER"]
app = Celery("contention", broker=f"{BROKER}/0")
app.conf.update(singleton_redis_url=f"{BROKER}/2", task_ignore_result=True,
                worker_prefetch_multiplier=1, broker_connection_retry_on_startup=True)

_records: redis.Redis | None = None
_stamps: dict[str, dict[str, float]] = {}
BODY_SECONDS = 0.005


def records() -> redis.Redis:
    global _records
    if _records is None or _records.connection_pool.pid != os.getpid():
        _records = redis.Redis.from_url(f"{BROKER}/3")
    return _records


def body(task: Task, key: str) -> None:
    stamps = _stamps.setdefault(task.request.id, {})
    stamps["body_start"] = time.perf_counter()
    r = records()
    if r.incr(f"inflight:{task.name}:{key}") > 1:
        r.incr(f"overlap:{task.name}")
    time.sleep(BODY_SECONDS)
    r.decr(f"inflight:{task.name}:{key}")
    r.incr(f"runs:{task.name}")
    stamps["body_end"] = time.perf_counter()


@app.task(bind=True, base=Task)
def plain(self: Task, key: str) -> None:
    body(self, key)


@app.task(bind=True, base=SingletonTask)
def singleton(self: Task, key: str) -> None:
    body(self, key)


@task_prerun.connect
def _prerun(task_id: str, **_: Any) -> None:
    _stamps[task_id] = {"prerun": time.perf_counter()}


@task_postrun.connect
def _postrun(task_id: str, task: Task, state: str | None = None, **_: Any) -> None:
    stamps = _stamps.pop(task_id, {})
    end = time.perf_counter()
    r = records()
    r.incr(f"done:{task.name}")
    if "body_start" in stamps:
        around = (stamps["body_start"] - stamps["prerun"]) + (end - stamps["body_end"])
        r.rpush(f"around:{task.name}", json.dumps(around))
