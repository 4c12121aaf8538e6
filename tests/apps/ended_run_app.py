"""tasks_app with a task whose body leaves a thread running past the run's end
(tests/test_adversary_ended_run.py): the thread asks the run, once its lock is gone from
Redis, whether it still vouches for it."""

from __future__ import annotations

import threading
import time

import redis

from celery_singleton_beat import LockLost, SingletonRun, SingletonTask

from .tasks_app import app, records

__all__ = ["app", "outlived"]


def _after_the_end(run: SingletonRun, key: str, seconds: float) -> None:
    """Wait until the run's lock is gone from Redis (at most ``seconds``), then record what
    the run says: ``outcome:<key>`` = ``<held>|<ensure_held's reason, or "passed">``."""
    lock = redis.Redis.from_url(str(app.conf.singleton_redis_url))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and lock.exists(run.key):
        time.sleep(0.01)
    held = run.held
    try:
        run.ensure_held()
        reason = "passed"
    except LockLost as exc:
        reason = exc.reason
    records().set(f"outcome:{key}", f"{held}|{reason}|{'gone' if not lock.exists(run.key) else 'there'}")
    lock.close()


@app.task(bind=True, base=SingletonTask, unique_on=["key"])
def outlived(self: SingletonTask, key: str, seconds: float) -> str:
    run = self.singleton_run
    records().set(f"during:{key}", f"{run.held}|{run.ensure_held() == run.fence}")
    threading.Thread(target=_after_the_end, args=(run, key, seconds),
                     name="outlives-its-run", daemon=True).start()
    return key
