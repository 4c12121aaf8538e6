"""Every way a run can end releases its lock; conflicts and publish-time modes.

Two workers serve the whole module: ``shared_worker`` (prefork, 2 processes,
the default queue) and ``single_worker`` (prefork, 1 process, queue
``single``: a second message provably waits in the queue while the first
runs). Each test starts with no lock and no records (the workers' liveness
keys stay); the broker database is left to the workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
from billiard.exceptions import WorkerLostError
from celery import states
from celery.exceptions import TimeLimitExceeded
from celery.exceptions import TimeoutError as CeleryTimeoutError

from celery_singleton_beat import DuplicateTaskError, SingletonKeyError

from .support import CeleryProcess, RedisServer, start_worker, wait_for
from .support.keyspace import Write, keyspace_writes
from .support.processes import module_worker
from .support.tasks import clear_runs, lock_keys, runs, started

APP = "tests.apps.tasks_app"
SINGLE = "single"  # the queue of single_worker
REMAPPED = "remapped"  # the queue of remapped_worker


@pytest.fixture(scope="module")
def shared_worker(redis_server: RedisServer) -> Iterator[CeleryProcess]:
    """The module's prefork worker with 2 processes on the default queue."""
    redis_server.flushall()
    yield from module_worker(redis_server, APP, "endings", concurrency=2, env={"CSB_BACKOFF_MAX": "1"})


@pytest.fixture(scope="module")
def single_worker(redis_server: RedisServer, shared_worker: CeleryProcess) -> Iterator[CeleryProcess]:
    """A prefork worker with one process on queue ``single``, one message at a time."""
    yield from module_worker(redis_server, APP, "single", concurrency=1,
                             extra=["-Q", SINGLE, "--prefetch-multiplier", "1"])


@pytest.fixture
def tasks_app(shared_worker: CeleryProcess, redis_server: RedisServer) -> ModuleType:
    """``tests.apps.tasks_app`` for this module's workers: locks and records emptied."""
    return clear_runs(redis_server)


def test_success_releases(tasks_app: ModuleType, locks: redis.Redis) -> None:
    assert tasks_app.ending.delay("k", "return").get(timeout=30) == "return"
    assert lock_keys(locks) == []


def test_failure_releases(tasks_app: ModuleType, locks: redis.Redis) -> None:
    with pytest.raises(ValueError, match="boom"):
        tasks_app.ending.delay("k", "fail").get(timeout=30)
    assert lock_keys(locks) == []


def test_retry_releases_during_the_countdown_and_the_retry_runs(
    tasks_app: ModuleType, locks: redis.Redis, records: redis.Redis
) -> None:
    result = tasks_app.ending.delay("k", "retry", 2.0)  # the retry waits 2 s in the queue
    wait_for(lambda: runs(records, "k"), timeout=30, message="the first run started")

    def free_while_the_retry_waits() -> bool:
        free = lock_keys(locks) == []
        # Read after the lock: one run recorded means the retry had not started yet.
        return free and len(runs(records, "k")) == 1

    # Well within the lock's 30 s TTL: freed by the retry, not by expiry.
    wait_for(free_while_the_retry_waits, timeout=10, interval=0.02,
             message="the lock free during the retry's countdown")
    assert result.get(timeout=30) == "retry"
    assert [run["retries"] for run in runs(records, "k")] == [0, 1]
    assert lock_keys(locks) == []


def test_ignore_releases(tasks_app: ModuleType, locks: redis.Redis, records: redis.Redis) -> None:
    tasks_app.ending.delay("k", "ignore")
    wait_for(lambda: runs(records, "k"), timeout=30)
    wait_for(lambda: lock_keys(locks) == [], timeout=10, message="lock released after Ignore")


def test_reject_releases(tasks_app: ModuleType, locks: redis.Redis, records: redis.Redis) -> None:
    tasks_app.ending.delay("k", "reject")
    wait_for(lambda: runs(records, "k"), timeout=30)
    wait_for(lambda: lock_keys(locks) == [], timeout=10, message="lock released after Reject")


def test_pool_child_exit_mid_run_releases(tasks_app: ModuleType, locks: redis.Redis,
                                          shared_worker: CeleryProcess) -> None:
    result = tasks_app.ending.delay("k-exit", "exit")
    with pytest.raises(WorkerLostError):
        result.get(timeout=30)
    shared_worker.wait_for_line(f"ending[{result.id}]", "(WorkerLostError); freed its lock")
    assert lock_keys(locks) == []


@pytest.fixture(scope="module")
def remapped_worker(redis_server: RedisServer, shared_worker: CeleryProcess) -> Iterator[CeleryProcess]:
    """A prefork worker on queue ``remapped`` with ``REMAP_SIGTERM=SIGQUIT`` (the setting
    Celery documents for Heroku and Kubernetes)."""
    yield from module_worker(redis_server, APP, "remapped", concurrency=1, extra=["-Q", REMAPPED],
                             env={"REMAP_SIGTERM": "SIGQUIT"})


@pytest.fixture
def worker_of(request: pytest.FixtureRequest) -> Callable[[str], CeleryProcess]:
    """The module's worker serving ``queue`` (started when first asked for)."""
    return lambda queue: request.getfixturevalue("remapped_worker" if queue == REMAPPED else "shared_worker")


def end_and_release(redis_server: RedisServer) -> Any:
    """Record, in the server's own order, the lock writes (database 2) and the writes of
    task states (database 1, the result backend) while inside."""
    return keyspace_writes(redis_server.client(0), {1: "celery-task-meta-*", 2: "singleton:{*"})


def recorded_after_the_lock_was_freed(writes: list[Write], key: str, result_id: str) -> bool:
    """The lock ``key``'s delete comes before the first write of ``result_id``'s state."""
    order = [(db, event) for db, name, event in writes if name in (key, f"celery-task-meta-{result_id}")]
    assert (2, "del") in order and (1, "set") in order, order
    return order.index((2, "del")) < order.index((1, "set"))


@pytest.mark.parametrize("queue", [None, REMAPPED], ids=["default", "remap-sigterm-sigquit"])
def test_hard_time_limit_releases_before_its_failure_is_recorded(
    queue: str | None, tasks_app: ModuleType, locks: redis.Redis, records: redis.Redis,
    redis_server: RedisServer, worker_of: Callable[[str | None], CeleryProcess],
) -> None:
    """Freed once the child is stopped (billiard's SIGTERM ends the body, whose ``finally``
    releases; else the main process frees it after SIGKILL): seconds, not the 30 s TTL.

    Celery records a hard time limit's ``FAILURE`` in the main process, before billiard
    stops the child; a caller who saw it and submitted the key again must find the key
    free: Redis' own record shows the lock deleted before the result is written.
    """
    worker = worker_of(queue)
    with end_and_release(redis_server) as writes:
        result = tasks_app.hard_limited.apply_async(("k",), queue=queue)
        wait_for(lambda: records.get("running:k"), timeout=30)
        [key] = lock_keys(locks)
        assert locks.pttl(key) > 20_000, "the lock would outlive this test's waits on its own"
        with pytest.raises(TimeLimitExceeded):
            result.get(timeout=30)
        assert lock_keys(locks) == [], "free when the caller sees the end"
        assert recorded_after_the_lock_was_freed(writes(), key, result.id), writes()
    worker.wait_for_line(f"Hard time limit (1.5s) exceeded for tests.apps.tasks_app.hard_limited[{result.id}]")
    assert f"hard_limited[{result.id}] lost its lock" not in worker.output()


@pytest.mark.parametrize(("queue", "signal"), [(None, "SIGKILL"), (None, None), (REMAPPED, None)],
                         ids=["sigkill", "default-sigterm", "remap-sigterm-default-sigquit"])
def test_revoke_with_terminate_releases_before_its_revoke_is_recorded(
    queue: str | None, signal: str | None, tasks_app: ModuleType, locks: redis.Redis, records: redis.Redis,
    redis_server: RedisServer, worker_of: Callable[[str | None], CeleryProcess], single_worker: CeleryProcess,
) -> None:
    """The main process frees the lock of the killed child at once, not the lock's 30 s
    TTL, and says so. Celery records ``REVOKED`` as the signal is sent, and every other
    worker that receives the revoke (``single_worker`` here, which does not run it)
    records it too; here it is recorded once the child is gone and its lock free (Redis'
    own order), so a caller who saw it and submitted the key again runs."""
    worker = worker_of(queue)
    with end_and_release(redis_server) as writes:
        result = tasks_app.work.apply_async(("k-revoke", 60), queue=queue)
        wait_for(lambda: started(records, "k-revoke"), timeout=30)
        [key] = lock_keys(locks)
        assert locks.pttl(key) > 20_000, "the lock would outlive this test's waits on its own"
        result.revoke(terminate=True, signal=signal)
        wait_for(lambda: result.state == states.REVOKED, timeout=10, message="the revoke recorded")
        assert lock_keys(locks) == [], "free when the caller sees the end"
        assert recorded_after_the_lock_was_freed(writes(), key, result.id), writes()
    worker.wait_for_line(f"work[{result.id}]", "freed its lock", key, timeout=10)
    assert tasks_app.work.apply_async(("k-revoke", 0), queue=queue).get(timeout=30) == "k-revoke"


def test_a_terminate_signal_the_run_survives_leaves_its_own_end_recorded(
    tasks_app: ModuleType, records: redis.Redis, remapped_worker: CeleryProcess, single_worker: CeleryProcess,
) -> None:
    """With ``REMAP_SIGTERM=SIGQUIT`` pool children ignore SIGTERM: ``revoke(terminate=True,
    signal="SIGTERM")`` does not end the run. Nothing records ``REVOKED`` for it (Celery
    would, while it runs on): it completes under its lock and its ``SUCCESS`` stands."""
    result = tasks_app.work.apply_async(("k-survives", 3), queue=REMAPPED)
    wait_for(lambda: started(records, "k-survives"), timeout=30)
    result.revoke(terminate=True, signal="SIGTERM")
    remapped_worker.wait_for_line(f"Terminating {result.id} (")  # (15), or (Signals.SIGTERM) on Python 3.10
    assert result.state == states.PENDING, "nothing recorded while the run goes on"
    assert result.get(timeout=30) == "k-survives"
    assert result.state == states.SUCCESS


def test_on_conflict_raise_fails_with_the_holder(tasks_app: ModuleType, records: redis.Redis) -> None:
    records.set("hold:k", "1")  # the holder runs until the duplicate was refused
    holder = tasks_app.strict.delay("k")
    wait_for(lambda: started(records, "k"), timeout=30)
    duplicate = tasks_app.strict.delay("k")
    with pytest.raises(DuplicateTaskError) as info:
        duplicate.get(timeout=30)
    assert info.value.holder_task_id == holder.id
    records.delete("hold:k")
    assert holder.get(timeout=30) == "k"


def test_on_conflict_retry_runs_after_the_holder(tasks_app: ModuleType, records: redis.Redis) -> None:
    holder = tasks_app.patient.delay("k", 1.5)
    wait_for(lambda: started(records, "k"), timeout=30)
    waiting = tasks_app.patient.delay("k")
    assert waiting.get(timeout=60) == "k"
    assert holder.get(timeout=30) == "k"
    first, second = runs(records, "k")
    assert first["task_id"] == holder.id and second["task_id"] == waiting.id
    assert second["start"] >= first["end"], "the retried run waited for the holder"


def occupy(tasks_app: ModuleType, records: redis.Redis) -> Callable[[], None]:
    """Keep single_worker's one process busy; returns what lets it go."""
    records.set("hold:busy", "1")
    tasks_app.work.apply_async(("busy",), queue=SINGLE)
    wait_for(lambda: started(records, "busy"), timeout=30, message="single_worker busy")
    return lambda: records.delete("hold:busy")


def test_until_executed_returns_the_existing_task_while_queued_or_running(
    tasks_app: ModuleType, records: redis.Redis, locks: redis.Redis, single_worker: CeleryProcess
) -> None:
    release = occupy(tasks_app, records)
    records.set("hold:k", "1")
    first = tasks_app.queued_once.apply_async(("k",), queue=SINGLE)
    # Queued: the only process is busy, the message waits.
    queued = tasks_app.queued_once.apply_async(("k",), queue=SINGLE)
    assert started(records, "k") == [], "still queued"
    assert queued.id == first.id, "while queued, a publish returns the queued task"
    release()
    wait_for(lambda: started(records, "k"), timeout=30, message="the first copy running")
    # Running (held by hold:k until the test lets it go).
    running = tasks_app.queued_once.apply_async(("k",), queue=SINGLE)
    assert running.id == first.id, "while running, a publish returns the running task"
    records.delete("hold:k")
    assert first.get(timeout=30) == "k"
    assert len(runs(records, "k")) == 1
    assert lock_keys(locks) == []
    third = tasks_app.queued_once.apply_async(("k", 0.0), queue=SINGLE)
    assert third.id != first.id and third.get(timeout=30) == "k"


def test_until_executing_allows_one_queued_copy_while_one_runs(
    tasks_app: ModuleType, records: redis.Redis, locks: redis.Redis, single_worker: CeleryProcess
) -> None:
    records.set("hold:k", "1")
    running = tasks_app.queued_until_start.apply_async(("k",), queue=SINGLE)
    wait_for(lambda: started(records, "k"), timeout=30, message="the first copy running")
    queued = tasks_app.queued_until_start.apply_async(("k",), queue=SINGLE)
    assert queued.id != running.id, "the queue claim was handed over when the run started"
    again = tasks_app.queued_until_start.apply_async(("k",), queue=SINGLE)
    assert again.id == queued.id, "one copy queued at most: the publish returns it"
    assert len(started(records, "k")) == 1, "the one process is still busy: the copy is queued"
    records.delete("hold:k")
    assert running.get(timeout=30) == "k"
    assert queued.get(timeout=30) == "k", "the queued copy ran after the first"
    assert [run["task_id"] for run in runs(records, "k")] == [running.id, queued.id]
    wait_for(lambda: lock_keys(locks) == [], timeout=10)
    assert records.get("overlap:k") is None


def test_unencodable_arguments_are_refused_at_publish_with_a_clear_error(
    tasks_app: ModuleType, locks: redis.Redis
) -> None:
    """Publish-time modes compute the key in the caller: a bad value never reaches a queue."""
    with pytest.raises(SingletonKeyError, match=r"queued_once: argument 'key'"):
        tasks_app.queued_once.delay({1, 2})
    assert lock_keys(locks) == []


def test_fail_closed_retries_until_redis_is_back_and_runs_once(
    redis_server: RedisServer, make_redis: Callable[..., RedisServer], tasks_app: ModuleType,
    records: redis.Redis,
) -> None:
    lock_server = make_redis(start=False)  # the lock Redis is down
    worker = start_worker(redis_server, APP, "closed", concurrency=1,
                          env={"CSB_LOCK_REDIS": lock_server.url(), "CSB_BACKOFF_MAX": "0.5"},
                          extra=["-Q", "closed"])
    result = tasks_app.work.apply_async(("k-closed", 0.0), queue="closed")
    worker.wait_for_log("not started, Redis unavailable")
    with pytest.raises(CeleryTimeoutError):
        result.get(timeout=2)
    assert runs(records, "k-closed") == [], "never runs without its lock"
    lock_server.start()
    assert result.get(timeout=30) == "k-closed"
    assert len(runs(records, "k-closed")) == 1


def test_fail_open_runs_without_the_lock_and_says_so(
    redis_server: RedisServer, make_redis: Callable[..., RedisServer], tasks_app: ModuleType,
) -> None:
    lock_server = make_redis(start=False)  # never started
    worker = start_worker(redis_server, APP, "open", concurrency=1,
                          env={"CSB_LOCK_REDIS": lock_server.url(), "CSB_FAIL_OPEN": "1"}, extra=["-Q", "open"])
    assert tasks_app.work.apply_async(("k-open", 0.0), queue="open").get(timeout=30) == "k-open"
    worker.wait_for_log("runs WITHOUT its lock")
