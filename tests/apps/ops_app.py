"""The Celery app of the operations tests (``celery singleton ...`` and Flower).

Same layout as the other test apps on the test redis-server (``CSB_TEST_REDIS``):
broker db 0, results db 1, locks db 2, run records db 3. ``CSB_OPS_SETTINGS``
(JSON) overrides ``app.conf``, e.g. to point the locks at another server or
to plant a bad setting for ``doctor``.

Runs hold their lock until the test lets them go (``go:<key>`` in the record
database), so a test decides when a run ends instead of guessing a duration.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

from celery_singleton_beat import SingletonTask

BASE = os.environ.get("CSB_TEST_REDIS", "redis://127.0.0.1:6379")

app = Celery("ops_app", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    singleton_redis_url=f"{BASE}/2",
    singleton_lock_ttl=30.0,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    worker_hijack_root_logger=True,
)
app.conf.update(json.loads(os.environ.get("CSB_OPS_SETTINGS") or "{}"))


@app.task(bind=True, base=SingletonTask, unique_on=["key"], lock_ttl=3.0)
def hold(self: SingletonTask, key: str, note: str = "") -> str:
    """Hold the lock of ``key`` until the test sets ``go:<key>`` (at most 60 s).

    The 3 s lease is renewed every second while the run waits, so a lock
    deleted under it is noticed and reported (``task-lock-lost``).
    """
    with redis.Redis.from_url(f"{BASE}/3") as r:
        r.set(f"running:{key}", self.request.id)
        deadline = time.monotonic() + 60
        while not r.exists(f"go:{key}") and time.monotonic() < deadline:
            time.sleep(0.02)
    return key


@app.task(bind=True, base=SingletonTask, unique_on=["key"], lock_mode="until_executed")
def publish_once(self: SingletonTask, key: str) -> str:
    """Claimed at publish: a queued message holds its key (kind ``claim``)."""
    return key


@app.task(bind=True, base=SingletonTask, unique_on=["key"], lock_mode="until_executing")
def publish_queued(self: SingletonTask, key: str) -> str:
    """Claimed at publish under ``<lock key>:queued`` until its run starts (kind ``queued``)."""
    return key


@app.task(bind=True, base=SingletonTask, unique_on=["key"], lock_mode="until_executed", lock_ttl=3.0)
def hold_claimed(self: SingletonTask, key: str) -> str:
    """Claimed at publish, then held by its run until the test sets ``go:<key>`` (at most 60 s):
    a running lock that began as a claim."""
    with redis.Redis.from_url(f"{BASE}/3") as r:
        r.set(f"running:{key}", self.request.id)
        deadline = time.monotonic() + 60
        while not r.exists(f"go:{key}") and time.monotonic() < deadline:
            time.sleep(0.02)
    return key


@app.task(bind=True, base=SingletonTask, unique_on=["key"], ignore_result=True)
def brief(self: SingletonTask, key: str) -> None:
    """Returns at once, its result not stored: on a worker without task events nobody sees
    its end, so its release's reply is read later (with the next acquire, or by the
    channel's flusher thread). Adds ``key`` to the set ``brief`` of the record database."""
    with redis.Redis.from_url(f"{BASE}/3") as r:
        r.sadd("brief", key)
