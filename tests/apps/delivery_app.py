"""The Celery app of the delivery tests: acks_late redelivery, liveness, canvas, pools.

Configured from the environment so one module serves every scenario:

* ``CSB_TEST_REDIS``: the test redis-server (result backend db 1, records db 3);
* ``CSB_BROKER``: the broker URL (default: the test Redis, db 0; RabbitMQ tests
  pass an ``amqp://`` URL); ``CSB_VISIBILITY``: the Redis transport's
  visibility timeout, restored every second;
* ``CSB_LOCK_REDIS``: Redis of the locks (default: the test Redis, db 2);
* ``CSB_LIVENESS_TTL``: ``singleton_liveness_ttl`` (default 2 s);
* ``CSB_BACKEND``: the result backend URL (default: the test Redis, db 1).

Every run is recorded in the record database: ``started:<key>`` and
``runs:<key>`` lists (task id, node, pid, times) and an in-flight counter whose
value above one is counted in ``overlap:<key>``. A run lasts its ``seconds``,
and for as long as ``hold:<key>`` exists in the record database.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_singleton_beat import SingletonTask

from .records import record_client

BASE = os.environ.get("CSB_TEST_REDIS", "redis://127.0.0.1:6379")

# Tasks are not shared: the module is re-imported per test (load_app), and shared
# tasks of earlier imports would be registered again in every later app.
app = Celery("delivery_app", broker=os.environ.get("CSB_BROKER", f"{BASE}/0"),
             backend=os.environ.get("CSB_BACKEND", f"{BASE}/1"))
app.conf.update(
    singleton_redis_url=os.environ.get("CSB_LOCK_REDIS", f"{BASE}/2"),
    singleton_lock_ttl=float(os.environ.get("CSB_LOCK_TTL", "300")),
    singleton_liveness_ttl=float(os.environ.get("CSB_LIVENESS_TTL", "2")),
    singleton_retry_backoff_max=1.0,
    singleton_redis_options={"socket_timeout": 1.0, "socket_connect_timeout": 1.0},
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("CSB_VISIBILITY", "3600")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    worker_hijack_root_logger=True,
)

def records() -> redis.Redis:
    """Client of the record database (one per process)."""
    return record_client(BASE)


def record_run(task: Any, key: str, seconds: float) -> str:
    """Record a run of ``key`` lasting ``seconds``, and while ``hold:<key>`` exists
    (overlap counted); returns the node."""
    r = records()
    entry = {"task_id": task.request.id, "node": task.request.hostname, "pid": os.getpid(),
             "start": time.time()}
    if r.incr(f"inflight:{key}") > 1:
        r.incr(f"overlap:{key}")
    r.rpush(f"started:{key}", json.dumps(entry))
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or r.exists(f"hold:{key}"):
            time.sleep(0.02)
    finally:
        r.decr(f"inflight:{key}")
    entry["end"] = time.time()
    r.rpush(f"runs:{key}", json.dumps(entry))
    return str(task.request.hostname)


@app.task(shared=False, bind=True, base=SingletonTask, unique_on=["key"])
def slow(self: SingletonTask, key: str, seconds: float = 0.0) -> str:
    """A unit of work on ``key`` (skipped when another run holds it)."""
    return record_run(self, key, seconds)


@app.task(shared=False, bind=True, base=SingletonTask, unique_on=["key"], on_conflict="raise")
def strict(self: SingletonTask, key: str, seconds: float = 0.0) -> str:
    return record_run(self, key, seconds)


@app.task(shared=False, bind=True, base=SingletonTask, unique_on=["key"], on_conflict="retry", max_retries=50)
def patient(self: SingletonTask, key: str, seconds: float = 0.0) -> str:
    return record_run(self, key, seconds)


@app.task(shared=False, bind=True, base=SingletonTask, unique_on=["key"], lock_mode="until_executed",
          on_conflict="retry", max_retries=50)
def patient_once(self: SingletonTask, key: str, seconds: float = 0.0) -> str:
    return record_run(self, key, seconds)


@app.task(shared=False, bind=True, base=SingletonTask, unique_on=["key"], lock_mode="until_executed")
def queued_once(self: SingletonTask, key: str, seconds: float = 0.0) -> str:
    return record_run(self, key, seconds)


@app.task(shared=False, bind=True, base=SingletonTask, unique_on=["key"], lock_mode="until_executing")
def queued_until_start(self: SingletonTask, key: str, seconds: float = 0.0) -> str:
    return record_run(self, key, seconds)


@app.task(shared=False, bind=True, base=SingletonTask, unique_on=["key"], autoretry_for=(ValueError,),
          max_retries=1, default_retry_delay=0.1)
def flaky(self: SingletonTask, key: str, fail: bool) -> str:
    """Fails with ValueError when ``fail``: autoretry_for retries it once, then FAILURE."""
    record_run(self, key, 0.0)
    if fail:
        raise ValueError(f"{key} fails")
    return key


@app.task(shared=False)
def collect(results: list[Any]) -> list[Any]:
    """A chord body."""
    records().rpush("chord-body", json.dumps(results))
    return results


@app.task(shared=False)
def after(value: Any) -> Any:
    """A chain's next step."""
    records().rpush("chain-after", json.dumps(value))
    return value
