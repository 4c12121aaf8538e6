"""The task-test apps and what their runs record (``tests/apps``)."""

from __future__ import annotations

import json
import os
import threading
import uuid
from types import ModuleType
from typing import Any

import redis
from celery import states
from celery.result import AsyncResult

from .servers import RedisServer

__all__ = ["EventCapture", "load_ops_app", "load_tasks_app", "lock_keys", "runs", "settled", "started"]


def _point_apps_at(redis_server: RedisServer) -> str:
    os.environ["CSB_TEST_REDIS"] = base = f"redis://127.0.0.1:{redis_server.port}"
    return base


def load_tasks_app(redis_server: RedisServer) -> ModuleType:
    """``tests.apps.tasks_app``, which reads the server's address at import time."""
    base = _point_apps_at(redis_server)
    from ..apps import tasks_app

    assert tasks_app.BASE == base, "tasks_app was imported for another server"
    return tasks_app


def load_ops_app(redis_server: RedisServer) -> ModuleType:
    """``tests.apps.ops_app`` (the CLI and Flower tests' app) on the session's server."""
    base = _point_apps_at(redis_server)
    from ..apps import ops_app

    assert ops_app.BASE == base, "ops_app was imported for another server"
    return ops_app


def runs(records: redis.Redis, key: str) -> list[dict[str, Any]]:
    """Completed runs recorded for ``key``, in completion order."""
    return [json.loads(item) for item in records.lrange(f"runs:{key}", 0, -1)]


def started(records: redis.Redis, key: str) -> list[dict[str, Any]]:
    """Runs of ``key`` that started, in start order."""
    return [json.loads(item) for item in records.lrange(f"started:{key}", 0, -1)]


def lock_keys(locks: redis.Redis) -> list[str]:
    """Run locks and claims currently held (fencing counters, done markers of completed
    ``acks_late`` runs and counter hashes excluded)."""
    return sorted(k.decode() for k in locks.scan_iter(match="singleton:{*")
                  if not k.endswith(b":fence") and b"}:done:" not in k
                  and not k.startswith(b"singleton:{stats}"))


def settled(results: list[AsyncResult]) -> bool:
    """Every result is final: SUCCESS, FAILURE or REVOKED (a skipped duplicate)."""
    return all(r.state in states.READY_STATES for r in results)


class EventCapture:
    """Collects task events of one type from the broker in a background thread.

    Events are not stored: only those published after the capture listens are
    seen. On Redis, events go through PUBLISH (a fanout exchange) and the capture
    subscribes only once its consumer loop polls, after the queue is declared and
    bound. So ``with EventCapture(...)`` returns once the capture received a probe
    event of its own (sent again on every turn of its loop until one arrives):
    anything sent inside the block is caught. ``wait`` returns the first event of
    ``event_type``, or fails after the deadline.
    """

    PROBE = "csb-capture-probe"

    def __init__(self, app: Any, event_type: str) -> None:
        self.app, self.event_type = app, event_type
        self.events: list[dict[str, Any]] = []
        self.probe_id = uuid.uuid4().hex
        self._ready = threading.Event()
        self._got = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._listen, daemon=True, name=f"capture-{event_type}")

    def __enter__(self) -> "EventCapture":
        self._thread.start()
        if not self._ready.wait(30):
            raise AssertionError(f"the {self.event_type} capture received nothing within 30s: {self._error!r}")
        if self._error is not None:
            raise AssertionError(f"the {self.event_type} capture failed: {self._error!r}")
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _listen(self) -> None:
        capture = self

        class Receiver(self.app.events.Receiver):  # type: ignore[name-defined, misc]
            def on_iteration(self) -> None:
                if capture._stop.is_set() or capture._got.is_set():
                    self.should_stop = True
                elif not capture._ready.is_set():  # until our own probe comes back
                    with capture.app.events.default_dispatcher() as dispatcher:
                        dispatcher.send(capture.PROBE, uuid=capture.probe_id)

        def on_event(event: dict[str, Any]) -> None:
            self.events.append(event)
            self._got.set()

        def on_other(event: dict[str, Any]) -> None:
            if event.get("type") == self.PROBE and event.get("uuid") == self.probe_id:
                self._ready.set()

        try:
            with self.app.connection_for_read() as conn:
                receiver = Receiver(conn, handlers={self.event_type: on_event, "*": on_other})
                for _ in receiver.consume(safety_interval=0.1, wakeup=False):
                    pass
        except Exception as exc:  # noqa: BLE001 - reported by __enter__ / wait
            self._error = exc
            self._ready.set()

    def wait(self, timeout: float = 30) -> dict[str, Any]:
        if not self._got.wait(timeout):
            raise AssertionError(f"no {self.event_type} event within {timeout}s"
                                 + (f" (capture failed: {self._error!r})" if self._error else ""))
        return self.events[0]
