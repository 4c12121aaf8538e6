"""The Celery app of ``tests/test_failclosed.py``: hard time limits and fail-closed retries.

Configured from the environment like the other test apps: ``CSB_TEST_REDIS``
(broker db 0, results db 1, records db 3), ``CSB_LOCK_REDIS`` (the locks:
default the test Redis, db 2; the tests give a separate redis-server they stop
and start), ``CSB_BACKOFF_MAX`` (``singleton_retry_backoff_max``).

Every run appends ``{"task_id", "retries", "pid"}`` to ``runs:<key>`` in the
record database.
"""

from __future__ import annotations

import json
import os
import signal
import time

from celery import Celery

from celery_singleton_beat import SingletonTask

from .records import record_client

BASE = os.environ.get("CSB_TEST_REDIS", "redis://127.0.0.1:6379")

app = Celery("failclosed_app", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    singleton_redis_url=os.environ.get("CSB_LOCK_REDIS", f"{BASE}/2"),
    singleton_lock_ttl=30.0,
    singleton_retry_backoff_max=float(os.environ.get("CSB_BACKOFF_MAX", "0.5")),
    singleton_redis_options={"socket_timeout": 1.0, "socket_connect_timeout": 1.0},
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    worker_hijack_root_logger=True,
)


def record_run(task: SingletonTask, key: str) -> None:
    record_client(BASE).rpush(f"runs:{key}", json.dumps(
        {"task_id": task.request.id, "retries": task.request.retries, "pid": os.getpid()}))


@app.task(bind=True, base=SingletonTask, unique_on=["key"], time_limit=1.5)
def stubborn(self: SingletonTask, key: str) -> None:
    """Ignores SIGTERM, so only billiard's SIGKILL after the hard time limit ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record_client(BASE).set(f"pid:{key}", os.getpid())  # after SIG_IGN: the test may rely on it
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.01)


@app.task(bind=True, base=SingletonTask, unique_on=["key"], autoretry_for=(ValueError,),
          max_retries=2, default_retry_delay=0.1)
def flaky(self: SingletonTask, key: str, fail: bool) -> str:
    """Raises ValueError when ``fail``: autoretry_for retries it twice, then FAILURE."""
    record_run(self, key)
    if fail:
        raise ValueError(f"{key} fails")
    return key


@app.task(bind=True, base=SingletonTask, unique_on=["key"], lock_mode="until_executed")
def claimed_once(self: SingletonTask, key: str) -> str:
    record_run(self, key)
    return key


@app.task(bind=True, base=SingletonTask, unique_on=["key"], lock_mode="until_executing")
def claimed_until_start(self: SingletonTask, key: str) -> str:
    record_run(self, key)
    return key
