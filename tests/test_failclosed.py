"""Endings the pool and fail-closed retries must get right (issue 11, items 4-6).

Each test runs a real worker of ``tests.apps.failclosed_app`` on a queue of
its own:

* a hard time limit frees the lock only once the pool child is gone, also
  when the body ignores billiard's SIGTERM and runs until the SIGKILL;
* a fail-closed retry (``retry(max_retries=sys.maxsize)``) does not leave its
  cap on the shared task object, where ``autoretry_for`` would read it;
* in publish-time modes a fail-closed retry is re-published under the task's
  own claim, so it runs once Redis is back instead of being rejected.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest
import redis

from celery_singleton_beat.config import clear_settings_cache
from celery_singleton_beat.recovery.lock_redis import reset_clients

from .support import RedisServer, start_worker, wait_for
from .support.processes import process_state
from .support.tasks import lock_keys, runs

APP = "tests.apps.failclosed_app"


@pytest.fixture
def fc_app(redis_db: redis.Redis, redis_server: RedisServer) -> Iterator[ModuleType]:
    """``tests.apps.failclosed_app`` on the session's (emptied) server; its lock Redis
    is put back to the default after the test."""
    os.environ["CSB_TEST_REDIS"] = base = f"redis://127.0.0.1:{redis_server.port}"
    from .apps import failclosed_app

    assert base == failclosed_app.BASE, "failclosed_app was imported for another server"
    yield failclosed_app
    failclosed_app.app.conf.singleton_redis_url = f"{base}/2"
    clear_settings_cache()
    reset_clients()


def running(pid: int) -> bool:
    """True while ``pid`` can still execute code: it exists and is not a zombie."""
    return process_state(pid) not in (None, "Z", "X")


def test_hard_time_limit_frees_the_lock_only_after_the_child_is_gone(
    fc_app: ModuleType, redis_server: RedisServer, locks: redis.Redis, records: redis.Redis
) -> None:
    """The body ignores SIGTERM: billiard reports TimeLimitExceeded, sends SIGTERM
    (ignored), then SIGKILL. Until the child has exited its body may still act on
    the work, so the lock must stand for as long as the child runs."""
    worker = start_worker(redis_server, APP, "fc-limit", concurrency=1, extra=["-Q", "fc-limit"])
    result = fc_app.stubborn.apply_async(("k-limit",), queue="fc-limit")
    pid = int(wait_for(lambda: records.get("pid:k-limit"), timeout=30, message="the body running"))
    [key] = lock_keys(locks)
    assert locks.pttl(key) > 20_000, "the lock would outlive this test's waits on its own"

    checks = 0

    def child_gone() -> bool:
        nonlocal checks
        if not running(pid):
            return True
        # The lock is read first: gone while the child still runs (read after) is a window
        # in which a new holder could start next to the old body.
        if not locks.exists(key) and running(pid):
            raise AssertionError(f"the lock {key} was freed while pool child {pid} still ran")
        checks += 1
        return False

    wait_for(child_gone, timeout=60, interval=0, message=f"pool child {pid} to be killed")
    worker.wait_for_line(f"Hard time limit (1.5s) exceeded for {APP}.stubborn[{result.id}]")
    worker.wait_for_line(f"pid:{pid} exited with 'signal 9 (SIGKILL)'")  # SIGTERM was ignored
    assert checks > 0
    wait_for(lambda: not locks.exists(key), timeout=10, interval=0.01,
             message="the lock freed once the child exited (well before its 30 s TTL)")


def test_autoretry_honours_max_retries_after_a_fail_closed_retry(
    fc_app: ModuleType, redis_server: RedisServer, make_redis: Callable[..., RedisServer],
    records: redis.Redis,
) -> None:
    """A solo worker is one process: whatever a fail-closed retry leaves on the task
    object is what the next run of that task sees."""
    lock_server = make_redis(start=False)  # the lock Redis is down when the first run starts
    worker = start_worker(redis_server, APP, "fc-auto", pool="solo", concurrency=1,
                          env={"CSB_LOCK_REDIS": lock_server.url()}, extra=["-Q", "fc-auto"])
    first = fc_app.flaky.apply_async(("k-ok", False), queue="fc-auto")
    worker.wait_for_line(f"flaky[{first.id}] not started, Redis unavailable")
    lock_server.start()
    assert first.get(timeout=30) == "k-ok"

    failing = fc_app.flaky.apply_async(("k-fail", True), queue="fc-auto")
    # Stop as soon as it ran more often than it may: with the leak it would retry forever.
    wait_for(lambda: failing.ready() or len(runs(records, "k-fail")) > 3, timeout=60,
             message="the failing task to end or to run a 4th time")
    assert [run["retries"] for run in runs(records, "k-fail")] == [0, 1, 2], "1 run + max_retries=2"
    with pytest.raises(ValueError, match="k-fail fails"):
        failing.get(timeout=10)


@pytest.mark.parametrize("task_name", ["claimed_once", "claimed_until_start"])
def test_publish_time_mode_fail_closed_retry_runs_once_redis_is_back(
    task_name: str, fc_app: ModuleType, redis_server: RedisServer,
    make_redis: Callable[..., RedisServer], records: redis.Redis,
) -> None:
    """Published (and claimed) while the lock Redis is up; it is down when the run
    starts. The fail-closed retry is the task's own re-publish: it must not need a
    new claim (Redis is down), or Celery rejects it and the task is lost."""
    lock_server = make_redis()
    fc_app.app.conf.singleton_redis_url = lock_server.url()
    clear_settings_cache()
    reset_clients()
    queue = f"fc-{task_name}"
    result = getattr(fc_app, task_name).apply_async(("k-claim",), queue=queue)  # no worker yet
    lock_server.stop()

    worker = start_worker(redis_server, APP, queue, concurrency=1,
                          env={"CSB_LOCK_REDIS": lock_server.url()}, extra=["-Q", queue])
    worker.wait_for_line(f"{task_name}[{result.id}] not started, Redis unavailable")
    assert runs(records, "k-claim") == [], "never runs without its lock"
    lock_server.start()
    assert result.get(timeout=30) == "k-claim"
    assert [run["task_id"] for run in runs(records, "k-claim")] == [result.id], "ran exactly once"
