"""tasks_app with tasks that watch their lease from other ways of starting a run
(tests/test_adversary_lost_report.py): a run that adopted its publish-time claim, a
retried run (the same task id again) and a call nested in a run (``self(...)``)."""

from __future__ import annotations

import time

from celery_singleton_beat import SingletonTask

from .tasks_app import app, records

__all__ = ["app", "claimed_watch", "nested_watch", "retried_watch"]


def _watch(task: SingletonTask, key: str, seconds: float) -> str:
    """Record the run's id under ``running:<key>``, wait until its lease is reported lost
    (or ``seconds`` pass), record ``outcome:<key>``, then wait for ``retaken:<key>``."""
    r = records()
    r.set(f"running:{key}", task.request.id)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not task.singleton_run.lost:
        time.sleep(0.02)
    outcome = "LockLost" if task.singleton_run.lost else "held"
    r.set(f"outcome:{key}", outcome)
    until = time.monotonic() + seconds
    while time.monotonic() < until and not r.exists(f"retaken:{key}"):
        time.sleep(0.02)
    return outcome


@app.task(bind=True, base=SingletonTask, lock_ttl=0.6, lock_mode="until_executed", unique_on=["key"])
def claimed_watch(self: SingletonTask, key: str, seconds: float) -> str:
    return _watch(self, key, seconds)


@app.task(bind=True, base=SingletonTask, lock_ttl=0.6, unique_on=["key"], max_retries=1)
def retried_watch(self: SingletonTask, key: str, seconds: float) -> str:
    if not self.request.retries:
        raise self.retry(countdown=0.1)
    return _watch(self, key, seconds)


@app.task(bind=True, base=SingletonTask, lock_ttl=0.6, unique_on=["key"])
def nested_watch(self: SingletonTask, key: str, seconds: float, inner: bool = False) -> str:
    if not inner:
        return self(f"{key}-inner", seconds, inner=True)  # type: ignore[no-any-return]
    return _watch(self, key, seconds)
