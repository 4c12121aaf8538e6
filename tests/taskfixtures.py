"""Fixtures shared by the task tests: the test app bound to the session's redis-server."""

from __future__ import annotations

import json
import os
import threading
from types import ModuleType
from typing import Any

import pytest
import redis

from .support import BACKEND_DB, LOCK_DB, RECORD_DB, RedisServer


def load_tasks_app(redis_server: RedisServer) -> ModuleType:
    """``tests.apps.tasks_app``, which reads the server's address at import time."""
    os.environ["CSB_TEST_REDIS"] = f"redis://127.0.0.1:{redis_server.port}"
    from .apps import tasks_app

    assert tasks_app.BASE == os.environ["CSB_TEST_REDIS"], "tasks_app was imported for another server"
    return tasks_app


@pytest.fixture
def tasks(redis_db: redis.Redis, redis_server: RedisServer) -> ModuleType:
    """``tests.apps.tasks_app`` configured for the session's redis-server (clean)."""
    return load_tasks_app(redis_server)


@pytest.fixture
def locks(redis_server: RedisServer) -> redis.Redis:
    return redis_server.client(LOCK_DB)


@pytest.fixture
def records(redis_server: RedisServer) -> redis.Redis:
    return redis_server.client(RECORD_DB)


@pytest.fixture
def backend(redis_server: RedisServer) -> redis.Redis:
    return redis_server.client(BACKEND_DB)


def runs(records: redis.Redis, key: str) -> list[dict[str, Any]]:
    """Completed runs recorded for ``key``, in completion order."""
    return [json.loads(item) for item in records.lrange(f"runs:{key}", 0, -1)]


def started(records: redis.Redis, key: str) -> list[dict[str, Any]]:
    return [json.loads(item) for item in records.lrange(f"started:{key}", 0, -1)]


def lock_keys(locks: redis.Redis) -> list[str]:
    """Run locks and claims currently held (fencing counters and counter hashes excluded)."""
    return sorted(k.decode() for k in locks.scan_iter(match="singleton:{*")
                  if not k.endswith(b":fence") and not k.startswith(b"singleton:{stats}"))


class EventCapture:
    """Collects task events of one type from the broker in a background thread.

    Start it before the events are sent (events are not stored); ``wait``
    returns the first one, or fails after the deadline.
    """

    def __init__(self, app: Any, event_type: str) -> None:
        self.app, self.event_type = app, event_type
        self.events: list[dict[str, Any]] = []
        self._ready = threading.Event()
        self._got = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)

    def __enter__(self) -> "EventCapture":
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *_: Any) -> None:
        self._thread.join(5)

    def _listen(self) -> None:
        with self.app.connection_for_read() as conn:
            def on_event(event: dict[str, Any]) -> None:
                self.events.append(event)
                self._got.set()
                receiver.should_stop = True

            receiver = self.app.events.Receiver(conn, handlers={self.event_type: on_event})
            self._ready.set()
            try:
                receiver.capture(limit=None, timeout=60, wakeup=False)
            except Exception:  # a timeout: wait() reports it
                pass

    def wait(self, timeout: float = 30) -> dict[str, Any]:
        assert self._got.wait(timeout), f"no {self.event_type} event within {timeout}s"
        return self.events[0]
