"""SingletonTask with real worker processes on a real redis-server."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from types import ModuleType

import redis
from celery.result import AsyncResult

from celery_singleton_beat.lock import acquire, read_holder

from .support import CeleryProcess, RedisServer, start_worker, wait_for
from .taskfixtures import EventCapture, backend, lock_keys, locks, records, runs, started, tasks  # noqa: F401

APP = "tests.apps.tasks_app"


def settled(results: list[AsyncResult]) -> bool:
    return all(r.state in ("SUCCESS", "REVOKED", "FAILURE") for r in results)


def test_one_key_never_overlaps_while_distinct_keys_all_run(
    tasks: ModuleType, redis_server: RedisServer, processes: list[CeleryProcess], records: redis.Redis,
    locks: redis.Redis,
) -> None:
    """200 submissions of one key from 4 threads onto 2 workers x 4 processes."""
    for name in ("w1", "w2"):
        processes.append(start_worker(redis_server, APP, name, concurrency=4))
    hot: list[AsyncResult] = []
    guard = threading.Lock()

    def submit() -> None:
        for i in range(50):
            result = tasks.work.delay("hot", 0.02, note=str(i))
            with guard:
                hot.append(result)

    threads = [threading.Thread(target=submit) for _ in range(4)]
    for thread in threads:
        thread.start()
    distinct = [tasks.work.delay(f"k{i}", 0.2) for i in range(8)]
    for thread in threads:
        thread.join()

    wait_for(lambda: settled(hot + distinct), timeout=120, message="all 208 tasks settled")
    assert len(hot) == 200
    states = [r.state for r in hot]
    completed = runs(records, "hot")
    assert records.get("overlap:hot") is None, "two runs of one key overlapped"
    assert states.count("SUCCESS") == len(completed) >= 1
    assert states.count("REVOKED") == 200 - len(completed), "every other submission is a visible skip"
    spans = sorted((run["start"], run["end"]) for run in completed)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    for i in range(8):
        assert len(runs(records, f"k{i}")) == 1, f"distinct key k{i} ran once"
    assert all(r.state == "SUCCESS" for r in distinct)
    assert lock_keys(locks) == [], "every lock was released"
    counts = {k.decode(): int(v) for k, v in locks.hgetall("singleton:{stats}:task:tests.apps.tasks_app.work").items()}
    assert counts["acquired"] == counts["released"] == len(completed) + 8
    assert counts["skipped"] == 200 - len(completed)


def test_skipped_duplicate_is_logged_stored_and_sent_as_an_event(
    tasks: ModuleType, redis_server: RedisServer, processes: list[CeleryProcess], records: redis.Redis,
) -> None:
    worker = start_worker(redis_server, APP, "w1", concurrency=2)
    processes.append(worker)
    with EventCapture(tasks.app, "task-skipped") as capture:
        holder = tasks.work.delay("k", 3.0)
        wait_for(lambda: started(records, "k"), timeout=30, message="holder running")
        duplicate = tasks.work.delay("k")
        wait_for(lambda: duplicate.state == "REVOKED", timeout=30, message="REVOKED (skipped) state")
        event = capture.wait()
    assert type(duplicate.info).__name__ == "TaskSkipped"
    assert duplicate.info.holder_task_id == holder.id
    assert duplicate.info.key.startswith("singleton:{tests.apps.tasks_app.work:")
    assert event["uuid"] == duplicate.id
    assert event["holder_task_id"] == holder.id and event["key"] == duplicate.info.key
    worker.wait_for_log(f"skipped: duplicate of task {holder.id}")
    assert holder.get(timeout=30) == "k"


def test_sigkill_of_the_pool_child_frees_its_lock(
    tasks: ModuleType, redis_server: RedisServer, processes: list[CeleryProcess], records: redis.Redis,
    locks: redis.Redis,
) -> None:
    worker = start_worker(redis_server, APP, "w1", concurrency=2)
    processes.append(worker)
    tasks.work.delay("k", 60)
    run = wait_for(lambda: started(records, "k"), timeout=30, message="run started")[0]
    assert lock_keys(locks), "the run holds its lock"
    os.kill(run["pid"], signal.SIGKILL)
    wait_for(lambda: lock_keys(locks) == [], timeout=10, message="lock freed by the main process")
    worker.wait_for_log("freed its lock")
    again = tasks.work.delay("k", 0.0)
    assert again.get(timeout=30) == "k", "the key runs again"


def test_worker_killed_and_restarted_its_lock_is_taken_over(
    tasks: ModuleType, redis_server: RedisServer, processes: list[CeleryProcess], records: redis.Redis,
    locks: redis.Redis,
) -> None:
    first = start_worker(redis_server, APP, "w1", concurrency=2)
    processes.append(first)
    tasks.work.delay("k", 60)
    wait_for(lambda: started(records, "k"), timeout=30, message="run started")
    first.kill_group()  # the whole node dies: nobody releases
    [key] = lock_keys(locks)
    assert read_holder(locks, key).node.startswith("w1@")
    restarted = start_worker(redis_server, APP, "w1", concurrency=2)
    processes.append(restarted)

    def a_new_run_succeeds() -> bool:
        attempt = tasks.work.delay("k", 0.0)
        wait_for(lambda: attempt.ready(), timeout=30, message="the attempt ended")
        return attempt.successful()

    wait_for(a_new_run_succeeds, timeout=60, interval=0.2, message="a new run once the dead holder's liveness lapsed")
    restarted.wait_for_line(f"took over {key} from task", "whose worker is gone")


def test_a_lock_of_a_node_that_never_returns_expires_after_its_ttl(
    tasks: ModuleType, redis_server: RedisServer, processes: list[CeleryProcess], records: redis.Redis,
    locks: redis.Redis,
) -> None:
    worker = start_worker(redis_server, APP, "w1", concurrency=1, env={"CSB_LOCK_TTL": "1.5"})
    tasks.work.delay("k", 60)
    wait_for(lambda: started(records, "k"), timeout=30, message="run started")
    worker.kill_group()
    assert lock_keys(locks)
    other = start_worker(redis_server, APP, "w2", concurrency=1)
    processes.append(other)
    wait_for(lambda: lock_keys(locks) == [], timeout=10, message="lock expired")
    assert tasks.work.delay("k", 0.0).get(timeout=30) == "k"


def test_renewal_keeps_the_lock_of_a_run_five_times_longer_than_its_ttl(
    tasks: ModuleType, redis_server: RedisServer, processes: list[CeleryProcess], records: redis.Redis,
) -> None:
    processes.append(start_worker(redis_server, APP, "w1", concurrency=2))
    long = tasks.long_run.delay("k", 5.0)  # lock_ttl=1.0
    wait_for(lambda: records.get("fence:k"), timeout=30, message="run started")
    skipped_at: list[float] = []
    while not long.ready():
        submitted = time.time()
        duplicate = tasks.long_run.delay("k", 0.0)
        wait_for(lambda: duplicate.state in ("REVOKED", "SUCCESS"), timeout=30)
        if duplicate.state == "REVOKED":
            skipped_at.append(submitted)
    assert long.get(timeout=30) == {"lost": False}
    [first, *later] = runs(records, "k")
    assert first["task_id"] == long.id
    assert all(run["start"] >= first["end"] for run in later), "no second run while the first held its lease"
    assert skipped_at and max(skipped_at) - first["start"] > 3 * 1.0, "duplicates skipped after 3 TTLs"
    assert records.get("lost:k") is None


def test_a_deleted_lock_is_reported_lost_and_the_late_release_spares_the_new_holder(
    tasks: ModuleType, redis_server: RedisServer, processes: list[CeleryProcess], records: redis.Redis,
    locks: redis.Redis,
) -> None:
    worker = start_worker(redis_server, APP, "w1", concurrency=2)
    processes.append(worker)
    result = tasks.watch_lease.delay("k", 20.0)
    wait_for(lambda: records.get("running:k"), timeout=30, message="run started")
    [key] = lock_keys(locks)
    with EventCapture(tasks.app, "task-lock-lost") as capture:
        locks.delete(key)  # an operator, an eviction or a failover removes the lock mid-run
        wait_for(lambda: records.get("outcome:k"), timeout=10, message="run told")
        assert records.get("outcome:k") == b"LockLost"
        event = capture.wait()  # sent while the run still waits for "retaken": at detection
    assert event["uuid"] == result.id and event["key"] == key and not result.ready()
    new_holder = acquire(locks, key, 30, task="other", task_id="new-holder")
    assert new_holder.acquired
    records.set("retaken:k", "1")
    assert result.get(timeout=30) == "LockLost"
    assert read_holder(locks, key).task_id == "new-holder", "the late release left the new lock alone"
    worker.wait_for_log("lost its lock")


def test_a_redelivered_copy_of_a_running_task_does_not_run_in_parallel(
    tasks: ModuleType, redis_server: RedisServer, processes: list[CeleryProcess], records: redis.Redis,
) -> None:
    """acks_late redelivery = the same message (same task id) delivered again."""
    for name in ("w1", "w2"):
        processes.append(start_worker(redis_server, APP, name, concurrency=2, env={"CSB_ACKS_LATE": "1"}))
    first = tasks.work.apply_async(("k", 2.0), task_id="same-id")
    wait_for(lambda: started(records, "k"), timeout=30, message="first copy running")
    tasks.work.apply_async(("k", 2.0), task_id="same-id")
    wait_for(lambda: records.get("inflight:k") == b"0" and len(runs(records, "k")) == 1, timeout=30)
    assert first.get(timeout=30) == "k"
    assert records.get("overlap:k") is None and len(started(records, "k")) == 1


def test_a_lock_redis_restart_mid_run_is_reported_as_lock_lost(
    tasks: ModuleType, redis_server: RedisServer, processes: list[CeleryProcess], records: redis.Redis,
) -> None:
    """Redis without persistence restarts: every lock is gone; running holders are told."""
    lock_server = RedisServer().start()
    try:
        worker = start_worker(redis_server, APP, "w1", concurrency=1,
                              env={"CSB_LOCK_REDIS": lock_server.url()}, extra=["-Q", "restart"])
        processes.append(worker)
        result = tasks.watch_lease.apply_async(("k", 20.0), queue="restart")
        wait_for(lambda: records.get("running:k"), timeout=30, message="run started")
        lock_server.restart()
        records.set("retaken:k", "1")
        assert result.get(timeout=30) == "LockLost"
        worker.wait_for_line("lost its lock")
    finally:
        lock_server.stop()
