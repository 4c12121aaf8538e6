"""The app of ``tests/test_keys_typed.py``: a publish-time claim with typed arguments.

``claimed`` takes its key when it is published (``until_executed``) and its run
adopts that claim only if the key the worker computes from the arguments it
received equals the key the publisher computed. The run returns its key and
the type of the argument it got, so the test sees both sides.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from celery_singleton_beat import SingletonTask

BASE = os.environ.get("CSB_TEST_REDIS", "redis://127.0.0.1:6379")

app = Celery("typed_keys_app", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    singleton_redis_url=f"{BASE}/2",
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    worker_hijack_root_logger=True,
)


@app.task(bind=True, base=SingletonTask, lock_mode="until_executed")
def claimed(self: SingletonTask, value: Any) -> dict[str, str]:
    """The key this run holds and the type of the value it received."""
    assert self.singleton is not None
    return {"key": self.singleton.key, "type": type(value).__name__}
