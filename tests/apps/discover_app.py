"""An app whose only task is found by ``autodiscover_tasks`` (lazily, as in Django projects).

Nothing imports ``tests.apps.discovered.tasks`` but the app's loader: a
worker, a beat, or ``celery singleton`` when it loads the app's task modules.
Locks in database 2 of the test server (``CSB_TEST_REDIS``).
"""

from __future__ import annotations

import os

from celery import Celery

BASE = os.environ.get("CSB_TEST_REDIS", "redis://127.0.0.1:6379")

app = Celery("discover_app", broker=f"{BASE}/0")
app.conf.update(singleton_redis_url=f"{BASE}/2")
app.autodiscover_tasks(["tests.apps.discovered"])
