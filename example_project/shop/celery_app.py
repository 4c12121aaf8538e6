"""The shop's Celery app, configured from environment variables.

Run it like any Celery app; every process (beats and workers alike) uses the
same module::

    celery -A example_project.shop.celery_app worker -l info
    celery -A example_project.shop.celery_app beat -l info     # as many as you like

Environment variables (read once, at import):

``REDIS_URL``
    The shop's Redis, default ``redis://localhost:6379/0``. Everything below
    defaults to it, so one Redis is enough.
``CELERY_BROKER_URL``
    The broker. Celery itself also reads this variable.
``SINGLETON_REDIS_URL``
    Where task locks and beat slot claims live (``singleton_redis_url``).
``SHOP_NAMESPACE``
    Default ``shop``: the queue name and the prefix of every key the app and
    the library write, so that several shops (or demo runs) can share a Redis.
"""

from __future__ import annotations

import os

from celery import Celery

from .schedule import BEAT_SCHEDULE

REDIS_URL = os.environ.get("REDIS_URL") or "redis://localhost:6379/0"
BROKER_URL = os.environ.get("CELERY_BROKER_URL") or REDIS_URL
LOCK_REDIS_URL = os.environ.get("SINGLETON_REDIS_URL") or REDIS_URL
NAMESPACE = os.environ.get("SHOP_NAMESPACE") or "shop"

app = Celery("shop", include=["example_project.shop.tasks"])
app.conf.update(
    broker_url=BROKER_URL,
    broker_connection_retry_on_startup=True,
    task_default_queue=NAMESPACE,
    # Nothing waits for results; the journal records what ran.
    task_ignore_result=True,
    # A worker holds one message per pool process, so a long report does not
    # keep short tasks waiting in its buffer.
    worker_prefetch_multiplier=1,
    # Task events for Flower, without having to pass -E to every worker.
    worker_send_task_events=True,
    task_send_sent_event=True,
    timezone="UTC",
    # -- celery-singleton-beat --------------------------------------------
    # Every beat may run: each schedule slot is claimed in Redis and sent by
    # one beat only. Set here rather than with `beat -S singleton`, so a beat
    # started without the flag cannot send duplicates.
    beat_scheduler="celery_singleton_beat.beat:SingletonScheduler",
    beat_schedule=BEAT_SCHEDULE,
    singleton_redis_url=LOCK_REDIS_URL,
    singleton_key_prefix=f"{NAMESPACE}:singleton",
    # Fail closed (the default, spelled out): without Redis, no task runs
    # unlocked and no slot is sent unclaimed.
    singleton_fail_open=False,
    # A report that waits for the previous one looks again within a second of its end.
    singleton_retry_backoff_max=1.0,
)
