"""Celery app of tests/test_adversary_slots.py: a plain task that receives beat slot messages.

The tests publish slot messages themselves (the headers a beat sends: claim key, sending
instance, slot, entry; the slot's task id), so a test controls each copy. Configured by
environment:

* ``CSB_TEST_REDIS``: the test redis-server (broker db 0, claims db 2, records db 3);
* ``CSB_ADV_QUEUE``: the queue the worker consumes;
* ``CSB_ADV_SETTINGS``: JSON of extra ``app.conf`` settings (acks_late, transport options...);
* ``CSB_ADV_RAN_REMEMBERED``: overrides ``slot_delivery.RAN_REMEMBERED`` in the worker.

:func:`work` records each start (``started:<key>``: pid, task id, redelivered
flag) and each end (``ended:<key>``) in the record database, lasts while ``hold:<key>``
exists there (two minutes at most), then ends as its ``mode`` says: ``ok`` returns,
``reject`` raises :class:`celery.exceptions.Reject` without requeue.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Reject

from celery_singleton_beat.task import slot_delivery
from celery_singleton_beat.task.worker import install

BASE = os.environ.get("CSB_TEST_REDIS", "redis://127.0.0.1:6379")

app = Celery("adversary_slots_app", broker=f"{BASE}/0")
app.conf.update(
    singleton_redis_url=f"{BASE}/2",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    task_default_queue=os.environ.get("CSB_ADV_QUEUE", "adversary-slots"),
)
app.conf.update(json.loads(os.environ.get("CSB_ADV_SETTINGS") or "{}"))
install(app)

if os.environ.get("CSB_ADV_RAN_REMEMBERED"):
    slot_delivery.RAN_REMEMBERED = int(os.environ["CSB_ADV_RAN_REMEMBERED"])

_records: redis.Redis | None = None


def records() -> redis.Redis:
    global _records
    if _records is None:
        _records = redis.Redis.from_url(f"{BASE}/3")
    return _records


@app.task(bind=True, name="tests.apps.adversary_slots_app.work")
def work(self: Any, key: str, mode: str = "ok") -> str:
    r = records()
    info = self.request.delivery_info or {}
    r.rpush(f"started:{key}", json.dumps({
        "pid": os.getpid(), "task_id": self.request.id,
        "redelivered": bool(info.get("redelivered")), "at": time.time()}))
    deadline = time.monotonic() + 120
    while r.exists(f"hold:{key}") and time.monotonic() < deadline:
        time.sleep(0.02)
    r.rpush(f"ended:{key}", json.dumps({"pid": os.getpid(), "at": time.time()}))
    if mode == "reject":
        raise Reject("the task discards its message", requeue=False)
    return key
