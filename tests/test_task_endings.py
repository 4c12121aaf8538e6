"""Every way a run can end releases its lock; conflicts and publish-time modes.

One prefork worker serves the whole module; each test starts from empty lock
and record databases.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import redis
from celery.exceptions import TimeoutError as CeleryTimeoutError

from celery_singleton_beat import DuplicateTaskError, SingletonKeyError
from celery_singleton_beat.client import reset_clients
from celery_singleton_beat.config import clear_settings_cache

from .support import LOCK_DB, RECORD_DB, CeleryProcess, RedisServer, start_worker, wait_for
from .taskfixtures import load_tasks_app, lock_keys, locks, records, runs, started  # noqa: F401

APP = "tests.apps.tasks_app"


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer) -> Iterator[CeleryProcess]:
    if redis_server.process is None:
        redis_server.start()
    redis_server.client().flushall()
    process = start_worker(redis_server, APP, "endings", concurrency=2, env={"CSB_BACKOFF_MAX": "1"})
    yield process
    process.stop()


@pytest.fixture
def tasks(worker: CeleryProcess, redis_server: RedisServer) -> ModuleType:
    """The test app, with empty lock and record databases (the broker is left to the worker)."""
    for db in (LOCK_DB, RECORD_DB):
        redis_server.client(db).flushdb()
    clear_settings_cache()
    reset_clients()
    return load_tasks_app(redis_server)


def test_success_releases(tasks: ModuleType, locks: redis.Redis) -> None:
    assert tasks.ending.delay("k", "return").get(timeout=30) == "return"
    assert lock_keys(locks) == []


def test_failure_releases(tasks: ModuleType, locks: redis.Redis) -> None:
    with pytest.raises(ValueError, match="boom"):
        tasks.ending.delay("k", "fail").get(timeout=30)
    assert lock_keys(locks) == []


def test_retry_releases_during_the_countdown_and_the_retry_runs(
    tasks: ModuleType, locks: redis.Redis, records: redis.Redis
) -> None:
    result = tasks.ending.delay("k", "retry")
    assert result.get(timeout=30) == "retry"
    assert [run["retries"] for run in runs(records, "k")] == [0, 1]
    assert lock_keys(locks) == []


def test_ignore_releases(tasks: ModuleType, locks: redis.Redis, records: redis.Redis) -> None:
    tasks.ending.delay("k", "ignore")
    wait_for(lambda: runs(records, "k"), timeout=30)
    wait_for(lambda: lock_keys(locks) == [], timeout=10, message="lock released after Ignore")


def test_reject_releases(tasks: ModuleType, locks: redis.Redis, records: redis.Redis) -> None:
    tasks.ending.delay("k", "reject")
    wait_for(lambda: runs(records, "k"), timeout=30)
    wait_for(lambda: lock_keys(locks) == [], timeout=10, message="lock released after Reject")


def test_pool_child_exit_mid_run_releases(tasks: ModuleType, locks: redis.Redis, worker: CeleryProcess) -> None:
    result = tasks.ending.delay("k-exit", "exit")
    with pytest.raises(Exception):
        result.get(timeout=30)
    wait_for(lambda: lock_keys(locks) == [], timeout=10, message="main process freed the lock")
    worker.wait_for_line(f"ending[{result.id}]", "(WorkerLostError); freed its lock")


def test_hard_time_limit_releases(tasks: ModuleType, locks: redis.Redis, records: redis.Redis,
                                  worker: CeleryProcess) -> None:
    result = tasks.hard_limited.delay("k")
    wait_for(lambda: records.get("running:k"), timeout=30)
    wait_for(lambda: lock_keys(locks) == [], timeout=30, message="lock freed after the hard time limit")
    worker.wait_for_line(f"hard_limited[{result.id}]", "freed its lock")
    # The terminated child knows the main process freed its lock: no false "lost" alarm.
    worker.wait_for_line(f"hard_limited[{result.id}] terminated; its lock")
    assert f"hard_limited[{result.id}] lost its lock" not in worker.output()


def test_revoke_with_terminate_releases(tasks: ModuleType, locks: redis.Redis, records: redis.Redis,
                                        worker: CeleryProcess) -> None:
    result = tasks.work.delay("k-revoke", 60)
    wait_for(lambda: started(records, "k-revoke"), timeout=30)
    assert lock_keys(locks)
    result.revoke(terminate=True, signal="SIGKILL")
    wait_for(lambda: lock_keys(locks) == [], timeout=30, message="lock freed after revoke+terminate")
    assert tasks.work.delay("k-revoke", 0).get(timeout=30) == "k-revoke"


def test_on_conflict_raise_fails_with_the_holder(tasks: ModuleType, records: redis.Redis) -> None:
    holder = tasks.strict.delay("k", 3.0)
    wait_for(lambda: started(records, "k"), timeout=30)
    duplicate = tasks.strict.delay("k")
    with pytest.raises(DuplicateTaskError) as info:
        duplicate.get(timeout=30)
    assert info.value.holder_task_id == holder.id
    assert holder.get(timeout=30) == "k"


def test_on_conflict_retry_runs_after_the_holder(tasks: ModuleType, records: redis.Redis) -> None:
    holder = tasks.patient.delay("k", 1.5)
    wait_for(lambda: started(records, "k"), timeout=30)
    waiting = tasks.patient.delay("k")
    assert waiting.get(timeout=60) == "k"
    assert holder.get(timeout=30) == "k"
    first, second = runs(records, "k")
    assert first["task_id"] == holder.id and second["task_id"] == waiting.id
    assert second["start"] >= first["end"], "the retried run waited for the holder"


def test_until_executed_returns_the_existing_task_while_queued_or_running(
    tasks: ModuleType, records: redis.Redis, locks: redis.Redis
) -> None:
    first = tasks.queued_once.delay("k", 1.0)
    second = tasks.queued_once.delay("k", 1.0)
    assert second.id == first.id, "the second publish returns the first task's result"
    assert first.get(timeout=30) == "k"
    assert len(runs(records, "k")) == 1
    assert lock_keys(locks) == []
    third = tasks.queued_once.delay("k", 0.0)
    assert third.id != first.id and third.get(timeout=30) == "k"


def test_until_executing_allows_one_queued_copy_while_one_runs(
    tasks: ModuleType, records: redis.Redis, locks: redis.Redis
) -> None:
    running = tasks.queued_until_start.delay("k", 2.0)
    wait_for(lambda: started(records, "k"), timeout=30)
    queued = tasks.queued_until_start.delay("k", 0.0)
    assert queued.id != running.id, "the queue claim was handed over when the run started"
    again = tasks.queued_until_start.delay("k", 0.0)
    assert again.id in (queued.id, running.id)
    assert running.get(timeout=30) == "k"
    wait_for(lambda: queued.state in ("SUCCESS", "REVOKED"), timeout=30)
    wait_for(lambda: lock_keys(locks) == [], timeout=10)
    assert records.get("overlap:k") is None


def test_unencodable_arguments_are_refused_at_publish_with_a_clear_error(
    tasks: ModuleType, locks: redis.Redis
) -> None:
    """Publish-time modes compute the key in the caller: a bad value never reaches a queue."""
    with pytest.raises(SingletonKeyError, match=r"queued_once: argument 'key'"):
        tasks.queued_once.delay({1, 2})
    assert lock_keys(locks) == []


def test_fail_closed_retries_until_redis_is_back_and_runs_once(
    redis_server: RedisServer, processes: list[CeleryProcess], tasks: ModuleType, records: redis.Redis
) -> None:
    lock_server = RedisServer()  # not started: the lock Redis is down
    processes.append(start_worker(
        redis_server, APP, "closed", concurrency=1,
        env={"CSB_LOCK_REDIS": lock_server.url(), "CSB_BACKOFF_MAX": "0.5"}, extra=["-Q", "closed"],
    ))
    result = tasks.work.apply_async(("k-closed", 0.0), queue="closed")
    processes[-1].wait_for_log("not started, Redis unavailable")
    with pytest.raises(CeleryTimeoutError):
        result.get(timeout=2)
    assert runs(records, "k-closed") == [], "never runs without its lock"
    lock_server.start()
    try:
        assert result.get(timeout=30) == "k-closed"
        assert len(runs(records, "k-closed")) == 1
    finally:
        lock_server.stop()


def test_fail_open_runs_without_the_lock_and_says_so(
    redis_server: RedisServer, processes: list[CeleryProcess], tasks: ModuleType, records: redis.Redis
) -> None:
    lock_server = RedisServer()  # never started
    worker = start_worker(redis_server, APP, "open", concurrency=1,
                          env={"CSB_LOCK_REDIS": lock_server.url(), "CSB_FAIL_OPEN": "1"}, extra=["-Q", "open"])
    processes.append(worker)
    assert tasks.work.apply_async(("k-open", 0.0), queue="open").get(timeout=30) == "k-open"
    worker.wait_for_log("runs WITHOUT its lock")
