"""Celery app of a Django project whose schedule is django-celery-beat's database.

Beats run ``-S celery_singleton_beat.contrib.django:SingletonDatabaseScheduler``
on the SQLite file ``CSB_DJANGO_DB`` (see ``django_settings``); entries are rows
the test writes. Their task is ``tests.apps.beat_app.record``, which this app
does not define: the beat sends it by name to the ``beat-tests`` queue, where
the worker of ``tests.apps.beat_app`` records each run with its slot.

* ``CSB_TEST_REDIS``: base URL of the test redis-server (broker db 0, claims db 2).
* ``CSB_BEAT_SETTINGS``: JSON of extra ``app.conf`` settings.
"""

from __future__ import annotations

import json
import os

import django
from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.django_settings")
django.setup()

BASE = os.environ.get("CSB_TEST_REDIS", "redis://127.0.0.1:6379")

app = Celery("django_beat_app", broker=f"{BASE}/0")
app.conf.update(
    singleton_redis_url=f"{BASE}/2",
    beat_scheduler="celery_singleton_beat.contrib.django:SingletonDatabaseScheduler",
    broker_connection_retry_on_startup=True,
    task_default_queue="beat-tests",
)
app.conf.update(json.loads(os.environ.get("CSB_BEAT_SETTINGS") or "{}"))
