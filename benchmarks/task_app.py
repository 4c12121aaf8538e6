"""The app the task-overhead benchmark's worker runs: plain and singleton no-op tasks.

Each task bumps one counter in the record Redis and stamps the first start and
the last end, so throughput is measured inside the worker, publishing excluded.
Results are ignored (``task_ignore_result``) except by the ``*_result`` tasks,
which store theirs in the broker's redis-server (db 2): a SingletonTask whose
result is stored waits for its release's reply before Celery stores the result.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery, Task

from celery_singleton_beat import SingletonTask

BROKER = os.environ["BENCH_BROKER"]
LOCKS = os.environ["BENCH_LOCKS"]

app = Celery("bench", broker=f"{BROKER}/0", backend=f"{BROKER}/2")
app.conf.update(
    singleton_redis_url=f"{LOCKS}/0",
    task_ignore_result=True,
    worker_prefetch_multiplier=64,
    broker_connection_retry_on_startup=True,
)
_records = None


def stamp(target: int) -> None:
    global _records
    if _records is None:
        _records = redis.Redis.from_url(f"{BROKER}/3")
    done = _records.incr("done")
    if done == 1:
        _records.set("first", time.perf_counter())
    if done == target:
        _records.set("last", time.perf_counter())


@app.task(base=Task)
def plain(i: int, target: int) -> None:
    stamp(target)


@app.task(base=SingletonTask)
def singleton(i: int, target: int) -> None:
    stamp(target)


@app.task(base=Task, ignore_result=False)
def plain_result(i: int, target: int) -> None:
    stamp(target)


@app.task(base=SingletonTask, ignore_result=False)
def singleton_result(i: int, target: int) -> None:
    stamp(target)


@app.task(base=SingletonTask, lock_mode="until_executed")
def singleton_until_executed(i: int, target: int) -> None:
    stamp(target)
