"""The app of the killed-pool-child benchmark: one singleton task that stamps its runs.

Every pool process stamps when it is ready (``worker_process_init``) and every
run stamps its start and pid in the record database, so the benchmark can tell
when the key ran again after a pool child was SIGKILLed. Log lines carry
``%(created)`` so the main process's own steps (child exit noticed, lock freed)
can be timed against the kill.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals

from celery_singleton_beat import SingletonTask

BROKER = os.environ["BENCH_BROKER"]
app = Celery("child_kill", broker=f"{BROKER}/0")
app.conf.update(
    singleton_redis_url=f"{BROKER}/2",
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_log_format="%(created).6f [%(levelname)s/%(processName)s] %(message)s",
    worker_task_log_format="%(created).6f [%(levelname)s/%(processName)s] %(task_name)s[%(task_id)s]: %(message)s",
)

_records: redis.Redis | None = None


def records() -> redis.Redis:
    global _records
    if _records is None or _records.connection_pool.pid != os.getpid():
        _records = redis.Redis.from_url(f"{BROKER}/3")
    return _records


@signals.worker_process_init.connect
def _child_ready(**_: Any) -> None:
    records().rpush("child_ready", json.dumps({"pid": os.getpid(), "t": time.time()}))


@app.task(bind=True, base=SingletonTask, lock_ttl=300)
def hold(self: SingletonTask, key: str, seconds: float) -> None:
    """Holds ``key`` for ``seconds`` (the first run is killed long before it ends)."""
    records().rpush(f"start:{key}", json.dumps({"pid": os.getpid(), "t": time.time(), "id": self.request.id}))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)
