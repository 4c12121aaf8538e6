"""The task-test apps and what their runs record (``tests/apps``)."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import redis
from celery import states
from celery.result import AsyncResult

from celery_singleton_beat import TaskSkipped
from celery_singleton_beat.config import clear_settings_cache
from celery_singleton_beat.recovery.lock_redis import reset_clients

from .servers import LOCK_DB, RECORD_DB, RedisServer
from .waiting import wait_for

__all__ = [
    "EventCapture", "OverlapFigures", "check_one_run_at_a_time", "clear_runs", "load_ops_app",
    "load_tasks_app", "lock_keys", "runs", "settled", "skipped", "started", "submit_spread",
]


def _point_apps_at(redis_server: RedisServer) -> str:
    os.environ["CSB_TEST_REDIS"] = base = f"redis://127.0.0.1:{redis_server.port}"
    return base


def load_tasks_app(redis_server: RedisServer) -> ModuleType:
    """``tests.apps.tasks_app``, which reads the server's address at import time."""
    base = _point_apps_at(redis_server)
    from ..apps import tasks_app

    assert base == tasks_app.BASE, "tasks_app was imported for another server"
    return tasks_app


def load_ops_app(redis_server: RedisServer) -> ModuleType:
    """``tests.apps.ops_app`` (the CLI and Flower tests' app) on the session's server."""
    base = _point_apps_at(redis_server)
    from ..apps import ops_app

    assert base == ops_app.BASE, "ops_app was imported for another server"
    return ops_app


def clear_runs(redis_server: RedisServer) -> ModuleType:
    """Empty the record database and the locks (not the workers' liveness keys) between
    tests that share running workers; ``tests.apps.tasks_app`` with fresh clients.

    Liveness keys stay: without its key until its next heartbeat, a worker would
    count as dead and another worker could take over its running locks. So does the
    record of the server serving the lock data (see ``servers.server_records``).
    """
    redis_server.client(RECORD_DB).flushdb()
    locks = redis_server.client(LOCK_DB)
    stale = [k for k in locks.scan_iter() if not k.startswith(b"singleton:live:") and k != b"singleton:server"]
    if stale:
        locks.delete(*stale)
    clear_settings_cache()
    reset_clients()
    return load_tasks_app(redis_server)


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


def skipped(result: AsyncResult) -> bool:
    """The run was skipped as a duplicate (stored as REVOKED with TaskSkipped)."""
    return result.state == "REVOKED" and isinstance(result.result, TaskSkipped)


def submit_spread(task: Any, keys: list[str], total: int, *, threads: int = 4, seconds: float = 0.02,
                  **options: Any) -> dict[str, list[AsyncResult]]:
    """Publish ``total`` calls ``task(key, seconds, note=i)`` from ``threads`` threads at once,
    round-robin over ``keys``: every key is submitted again and again while its
    earlier copies are queued or running. The results, by key."""
    by_key: dict[str, list[AsyncResult]] = {key: [] for key in keys}
    guard = threading.Lock()

    def submit(first: int) -> None:
        for i in range(first, total, threads):
            key = keys[i % len(keys)]
            result = task.apply_async((key, seconds), {"note": str(i)}, **options)
            with guard:
                by_key[key].append(result)

    workers = [threading.Thread(target=submit, args=(n,)) for n in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return by_key


@dataclass(frozen=True)
class OverlapFigures:
    """What :func:`check_one_run_at_a_time` found: totals over every key, and the most
    runs of one key ever in flight at once (``peak``)."""

    submissions: int
    runs: int
    skips: int
    peak: int
    seconds: float

    def __str__(self) -> str:
        return (f"{self.submissions} submissions, {self.runs} runs, {self.skips} skips, "
                f"max {self.peak} run(s) of one key at once, {self.seconds:.1f}s")


def check_one_run_at_a_time(records: redis.Redis, locks: redis.Redis, task_name: str,
                            by_key: dict[str, list[AsyncResult]], *, since: float,
                            timeout: float = 120) -> OverlapFigures:
    """Wait until every submission of ``by_key`` ended, then assert that runs of one key
    never overlapped, that each submission either ran (SUCCESS) or was a visible skip,
    that the lock counters agree, and that no lock remains.

    Runs are the ``tests.apps.tasks_app.record_run`` records; ``by_key`` must hold
    every submission of ``task_name`` since the lock database was last emptied.
    ``since`` is the monotonic time the submissions began (for the figures).
    """
    every = [result for results in by_key.values() for result in results]
    wait_for(lambda: settled(every), timeout=timeout, message=f"all {len(every)} submissions settled")
    seconds = time.monotonic() - since
    total_runs = 0
    for key, results in by_key.items():
        completed = runs(records, key)
        assert records.get(f"overlap:{key}") is None, f"two runs of {key} overlapped"
        assert records.zscore("peak", key) == 1, f"runs of {key} in flight at once: {records.zscore('peak', key)}"
        assert sum(r.state == "SUCCESS" for r in results) == len(completed) >= 1, f"every run of {key} succeeded"
        assert sum(skipped(r) for r in results) == len(results) - len(completed), \
            f"every other submission of {key} is a visible skip"
        spans = sorted((run["start"], run["end"]) for run in completed)
        assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans)), \
            f"runs of {key} overlapped in time"
        total_runs += len(completed)
    assert lock_keys(locks) == [], "every lock was released"
    counts = counts_when(locks, task_name, lambda c: c.get("acquired") == c.get("released") == total_runs
                         and c.get("skipped", 0) == len(every) - total_runs)
    assert "lost" not in counts and "reclaimed" not in counts, counts
    return OverlapFigures(len(every), total_runs, len(every) - total_runs,
                          int(max(records.zscore("peak", key) or 0 for key in by_key)), seconds)


def task_counts(locks: redis.Redis, task_name: str) -> dict[str, int]:
    """The lock counters of ``task_name`` (acquired, released, skipped, renewed, lost, ...)."""
    return {k.decode(): int(v) for k, v in locks.hgetall(f"singleton:{{stats}}:task:{task_name}").items()}


def counts_when(locks: redis.Redis, task_name: str, check: Callable[[dict[str, int]], bool],
                timeout: float = 15.0) -> dict[str, int]:
    """The counters of ``task_name`` once ``check`` holds for them (workers write their counts
    in batches, within a second); fails with the last counts seen."""
    seen: list[dict[str, int]] = [{}]

    def done() -> bool:
        seen[0] = task_counts(locks, task_name)
        return check(seen[0])

    try:
        wait_for(done, timeout=timeout, message=f"the counters of {task_name}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {seen[0]}") from None
    return seen[0]


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

    def __enter__(self) -> EventCapture:
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
        except Exception as exc:
            self._error = exc
            self._ready.set()

    def wait(self, timeout: float = 30) -> dict[str, Any]:
        if not self._got.wait(timeout):
            raise AssertionError(f"no {self.event_type} event within {timeout}s"
                                 + (f" (capture failed: {self._error!r})" if self._error else ""))
        return self.events[0]
