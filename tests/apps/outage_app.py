"""The Celery app of ``tests/test_outage_at_acquire.py``: a run that meets a Redis outage at its acquire.

Configured from the environment (each test gives its own servers):

* ``CSB_OUTAGE_BROKER``: broker (db 0) and results (db 1); the redis-server that
  goes down when the lock Redis is the broker, the session's otherwise.
* ``CSB_LOCK_REDIS``: the locks (a redis-server the test stops or makes refuse writes).
* ``CSB_TEST_REDIS``: the session's redis-server; run records in db 3. It never goes
  down, so a run is recorded even while the other server is out.
* ``CSB_VISIBILITY_TIMEOUT``: the broker's visibility timeout (kombu's default, 1 h, if unset).
* ``CSB_SOFT_TIME_LIMIT``: ``task_soft_time_limit`` in seconds (none if unset).
* ``CSB_BACKOFF_MAX``: ``singleton_retry_backoff_max`` (0.5 s if unset).
* ``CSB_GATE``: a directory. Before a run's ``__call__`` (``task_prerun``, so before
  its acquire) the process running it writes ``waiting-<task id>`` there (holding its
  pid) and blocks until
  ``open`` exists: the test starts the outage in between. Files, not Redis: the
  Redis the gate would use may be the one about to go down.

Every run appends ``{"task_id", "retries"}`` to ``runs:<key>`` in the record database.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery, signals

from celery_singleton_beat import SingletonTask

from .records import record_client

BASE = os.environ.get("CSB_TEST_REDIS", "redis://127.0.0.1:6379")
BROKER = os.environ.get("CSB_OUTAGE_BROKER", BASE)
GATE = Path(os.environ.get("CSB_GATE", "/nonexistent"))

app = Celery("outage_app", broker=f"{BROKER}/0", backend=f"{BROKER}/1")
app.conf.update(
    singleton_redis_url=os.environ.get("CSB_LOCK_REDIS", f"{BROKER}/2"),
    singleton_lock_ttl=30.0,
    # back within a second of the outage's end
    singleton_retry_backoff_max=float(os.environ.get("CSB_BACKOFF_MAX", "0.5")),
    singleton_redis_options={"socket_timeout": 1.0, "socket_connect_timeout": 1.0},
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    worker_hijack_root_logger=True,
)
if os.environ.get("CSB_SOFT_TIME_LIMIT"):
    app.conf.task_soft_time_limit = float(os.environ["CSB_SOFT_TIME_LIMIT"])
if os.environ.get("CSB_VISIBILITY_TIMEOUT"):
    # A delivery that could not be acknowledged comes back after this many seconds
    # (kombu sweeps every second here instead of every 100 s).
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["CSB_VISIBILITY_TIMEOUT"]),
        "unacked_restore_interval": 1, "unacked_restore_throttle": 1}


@signals.task_prerun.connect
def wait_at_the_gate(task_id: str | None = None, **_: Any) -> None:
    """Hold the run just before its ``__call__`` until the test opens the gate (at most 60 s)."""
    if not GATE.is_dir():
        return
    written = GATE / f".waiting-{task_id}"
    written.write_text(str(os.getpid()))
    written.rename(GATE / f"waiting-{task_id}")  # whole when the test sees it
    deadline = time.monotonic() + 60
    while not (GATE / "open").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def record_run(task: SingletonTask, key: str) -> str:
    record_client(BASE).rpush(f"runs:{key}", json.dumps(
        {"task_id": task.request.id, "retries": task.request.retries}))
    return key


@app.task(bind=True, base=SingletonTask, unique_on=["key"])
def job(self: SingletonTask, key: str) -> str:
    """Acknowledged when the worker takes it (Celery's default)."""
    return record_run(self, key)


@app.task(bind=True, base=SingletonTask, unique_on=["key"], acks_late=True)
def job_late(self: SingletonTask, key: str) -> str:
    """Acknowledged when it ends (``acks_late``)."""
    return record_run(self, key)

