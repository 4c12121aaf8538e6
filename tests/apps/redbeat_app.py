"""Celery app of beats on RedBeat's keys: ours (``SingletonRedBeatScheduler``) or RedBeat's own.

Beats run ``-S celery_singleton_beat.contrib.redbeat:SingletonRedBeatScheduler``
or ``-S redbeat.RedBeatScheduler``; the entries are created by the test through
RedBeat's API. Their task is ``tests.apps.beat_app.record``, sent by name to the
``beat-tests`` queue, where the worker of ``tests.apps.beat_app`` records each run
with its slot, and with the time the beat sent it (header ``csb_sent_at``, set
here for every publish: RedBeat's own sends have no slot).

* ``CSB_TEST_REDIS``: base URL of the test redis-server (broker db 0; RedBeat's
  keys and the slot claims share db 2, each under its own prefix).
* ``CSB_BEAT_SETTINGS``: JSON of extra ``app.conf`` settings (``redbeat_key_prefix``).

``beat_max_loop_interval`` is 1 s: our beats see a change made through RedBeat's
API within a second, and RedBeat's own lock times out after 5 s (5 x the loop).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery, signals

BASE = os.environ.get("CSB_TEST_REDIS", "redis://127.0.0.1:6379")

app = Celery("redbeat_app", broker=f"{BASE}/0")
app.conf.update(
    singleton_redis_url=f"{BASE}/2",
    redbeat_redis_url=f"{BASE}/2",
    beat_max_loop_interval=1,
    broker_connection_retry_on_startup=True,
    task_default_queue="beat-tests",
)
app.conf.update(json.loads(os.environ.get("CSB_BEAT_SETTINGS") or "{}"))


@signals.before_task_publish.connect
def _stamp(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is not None:
        headers["csb_sent_at"] = time.time()
