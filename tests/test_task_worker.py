"""SingletonTask with real worker processes on a real redis-server."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from types import ModuleType

import redis

from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.lease.liveness import live_key
from celery_singleton_beat.task.keys import task_stats_key

from .support import LOCK_DB, RedisServer, start_worker, wait_for
from .support.locking import take_lock
from .support.tasks import (
    EventCapture,
    check_one_run_at_a_time,
    lock_keys,
    runs,
    skipped,
    started,
    submit_spread,
)

APP = "tests.apps.tasks_app"


def test_one_key_never_overlaps_while_distinct_keys_all_run(
    tasks: ModuleType, redis_server: RedisServer, records: redis.Redis, locks: redis.Redis,
) -> None:
    """200 submissions of one key from 4 threads onto 2 workers x 4 processes
    (every pool kind, one worker each: tests/test_pools.py)."""
    for name in ("w1", "w2"):
        start_worker(redis_server, APP, name, concurrency=4)
    began = time.monotonic()
    distinct = {f"k{i}": [tasks.work.delay(f"k{i}", 0.2)] for i in range(8)}
    hot = submit_spread(tasks.work, ["hot"], 200)
    check_one_run_at_a_time(records, locks, tasks.work.name, {**hot, **distinct}, since=began)
    for key, [result] in distinct.items():
        assert result.state == "SUCCESS" and len(runs(records, key)) == 1, f"distinct key {key} ran once"


def test_skipped_duplicate_is_logged_stored_and_sent_as_an_event(
    tasks: ModuleType, redis_server: RedisServer, records: redis.Redis,
) -> None:
    worker = start_worker(redis_server, APP, "w1", concurrency=2)
    records.set("hold:k", "1")  # the holder runs until the duplicate was skipped
    with EventCapture(tasks.app, "task-skipped") as capture:
        holder = tasks.work.delay("k")
        wait_for(lambda: started(records, "k"), timeout=30, message="holder running")
        duplicate = tasks.work.delay("k")
        wait_for(lambda: skipped(duplicate), timeout=30, message="the duplicate stored as skipped")
        event = capture.wait()
    assert duplicate.result.holder_task_id == holder.id
    assert duplicate.result.key.startswith("singleton:{tests.apps.tasks_app.work:")
    assert event["uuid"] == duplicate.id
    assert event["holder_task_id"] == holder.id and event["key"] == duplicate.result.key
    worker.wait_for_log(f"skipped: duplicate of task {holder.id}")
    # Celery's own trace line for any run that ends with Ignore (README: the name on each surface).
    worker.wait_for_log(f"Task tests.apps.tasks_app.work[{duplicate.id}] ignored")
    records.delete("hold:k")
    assert holder.get(timeout=30) == "k"


def test_sigkill_of_the_pool_child_frees_its_lock(
    tasks: ModuleType, redis_server: RedisServer, records: redis.Redis, locks: redis.Redis,
) -> None:
    worker = start_worker(redis_server, APP, "w1", concurrency=2)
    result = tasks.work.delay("k", 60)
    run = wait_for(lambda: started(records, "k"), timeout=30, message="run started")[0]
    [key] = lock_keys(locks)
    os.kill(run["pid"], signal.SIGKILL)
    worker.wait_for_line(f"work[{result.id}]", "freed its lock", key, timeout=10)
    assert lock_keys(locks) == []
    again = tasks.work.delay("k", 0.0)
    assert again.get(timeout=30) == "k", "the key runs again"


def test_the_lock_of_a_killed_worker_is_taken_over_by_the_next_run(
    tasks: ModuleType, redis_server: RedisServer, records: redis.Redis, locks: redis.Redis,
) -> None:
    """A worker SIGKILLed with its pool (a lost pod): once its liveness key is gone,
    the next run of the key takes the lock over, long before the lock's TTL."""
    liveness = {"CSB_LIVENESS_TTL": "2"}
    first = start_worker(redis_server, APP, "w1", concurrency=2, env=liveness)
    tasks.work.delay("k", 60)
    wait_for(lambda: started(records, "k"), timeout=30, message="run started")
    first.kill_group()  # the whole node dies: nobody releases
    [key] = lock_keys(locks)
    dead = read_holder(locks, key)
    assert dead is not None and dead.node.startswith("w1@")
    assert locks.pttl(key) > 20_000, "the lock's own TTL (30 s) is not what frees it"
    restarted = start_worker(redis_server, APP, "w1", concurrency=2, env=liveness)
    wait_for(lambda: not locks.exists(live_key("singleton", dead.boot)), timeout=30,
             message="the dead incarnation's liveness key (2 s) to expire")
    again = tasks.work.delay("k", 0.0)
    assert again.get(timeout=30) == "k"
    restarted.wait_for_line(f"work[{again.id}] took over {key}", "whose worker is gone")
    assert lock_keys(locks) == []


def test_a_lock_of_a_node_that_never_returns_expires_after_its_ttl(
    tasks: ModuleType, redis_server: RedisServer, records: redis.Redis, locks: redis.Redis,
) -> None:
    """Nobody frees it and nobody needs it: the lock ends by expiring (Redis says
    ``expired``, not ``del``), then the key runs again."""
    locks.config_set("notify-keyspace-events", "Egx")  # generic (del) and expired key events
    events = locks.pubsub(ignore_subscribe_messages=True)
    events.psubscribe(f"__keyevent@{LOCK_DB}__:*")
    try:
        worker = start_worker(redis_server, APP, "w1", concurrency=1, env={"CSB_LOCK_TTL": "3"})
        tasks.work.delay("k", 60)
        wait_for(lambda: started(records, "k"), timeout=30, message="run started")
        [key] = lock_keys(locks)
        worker.kill_group()
        seen: list[tuple[str, str]] = []

        def ended() -> str | None:
            message = events.get_message(timeout=0.1)
            if message is not None and message["data"].decode() == key:
                seen.append((message["channel"].decode().rsplit(":", 1)[1], key))
            return next((kind for kind, _ in seen if kind in ("expired", "del")), None)

        assert wait_for(ended, timeout=30, interval=0, message=f"{key} to end") == "expired", seen
        assert lock_keys(locks) == []
    finally:
        events.close()
        locks.config_set("notify-keyspace-events", "")
    start_worker(redis_server, APP, "w2", concurrency=1)
    assert tasks.work.delay("k", 0.0).get(timeout=30) == "k"


def test_renewal_keeps_the_lock_of_a_run_five_times_longer_than_its_ttl(
    tasks: ModuleType, redis_server: RedisServer, records: redis.Redis,
) -> None:
    start_worker(redis_server, APP, "w1", concurrency=2)
    long = tasks.long_run.delay("k", 5.0)  # lock_ttl=1.0
    wait_for(lambda: records.get("fence:k"), timeout=30, message="run started")
    skipped_at: list[float] = []
    while not long.ready():
        submitted = time.time()
        duplicate = tasks.long_run.delay("k", 0.0)
        wait_for(lambda: duplicate.state in ("REVOKED", "SUCCESS"), timeout=30)  # noqa: B023
        if skipped(duplicate):
            skipped_at.append(submitted)
    assert long.get(timeout=30) == {"lost": False}
    [first, *later] = runs(records, "k")
    assert first["task_id"] == long.id
    assert all(run["start"] >= first["end"] for run in later), "no second run while the first held its lease"
    assert skipped_at and max(skipped_at) - first["start"] > 3 * 1.0, "duplicates skipped after 3 TTLs"
    assert records.get("lost:k") is None


def test_a_deleted_lock_is_reported_lost_and_the_late_release_spares_the_new_holder(
    tasks: ModuleType, redis_server: RedisServer, records: redis.Redis, locks: redis.Redis,
) -> None:
    worker = start_worker(redis_server, APP, "w1", concurrency=2)
    result = tasks.watch_lease.delay("k", 20.0)
    wait_for(lambda: records.get("running:k"), timeout=30, message="run started")
    [key] = lock_keys(locks)
    with EventCapture(tasks.app, "task-lock-lost") as capture:
        locks.delete(key)  # an operator, an eviction or a failover removes the lock mid-run
        wait_for(lambda: records.get("outcome:k"), timeout=10, message="run told")
        assert records.get("outcome:k") == b"LockLost"
        event = capture.wait()  # sent while the run still waits for "retaken": at detection
    assert event["uuid"] == result.id and event["key"] == key and not result.ready()
    new_holder = take_lock(locks, key, 30, task="other", task_id="new-holder")
    assert new_holder.acquired
    records.set("retaken:k", "1")
    assert result.get(timeout=30) == "LockLost"
    assert read_holder(locks, key).task_id == "new-holder", "the late release left the new lock alone"
    worker.wait_for_log("lost its lock")


def test_a_redelivered_copy_of_a_running_task_does_not_run_in_parallel(
    tasks: ModuleType, redis_server: RedisServer, records: redis.Redis, locks: redis.Redis,
) -> None:
    """acks_late redelivery = the same message (same task id) delivered again.

    The copy provably reaches a worker while the original runs (its worker says
    so), does not run then, and ends without running once the original is done.
    """
    env = {"CSB_ACKS_LATE": "1", "CSB_LIVENESS_TTL": "2"}  # the copy looks again after 1 s
    workers = [start_worker(redis_server, APP, name, concurrency=2, env=env) for name in ("w1", "w2")]
    records.set("hold:k", "1")  # the original runs until the copy has arrived
    first = tasks.work.apply_async(("k",), task_id="same-id")
    wait_for(lambda: started(records, "k"), timeout=30, message="first copy running")
    tasks.work.apply_async(("k",), task_id="same-id")

    def copy_arrived() -> str | None:
        return next((line for worker in workers for line in worker.output().splitlines()
                     if "work[same-id] is already running on" in line), None)

    line = wait_for(copy_arrived, timeout=30, message="the copy received while the original runs")
    assert "another delivery of the same message" in line
    assert len(started(records, "k")) == 1, "the copy did not start a second run"
    records.delete("hold:k")
    assert first.get(timeout=30) == "k"
    wait_for(lambda: any("work[same-id] already completed" in worker.output() for worker in workers),
             timeout=30, message="the copy ended without running once the original was done")
    assert records.get("overlap:k") is None and len(started(records, "k")) == 1
    assert lock_keys(locks) == []


def test_a_lock_database_flushed_mid_run_is_reported_as_lock_lost(
    tasks: ModuleType, redis_server: RedisServer, records: redis.Redis,
    make_redis: Callable[..., RedisServer],
) -> None:
    """FLUSHALL of the lock Redis under connections made before it (no restart): every lock
    is gone, anyone may take them; running holders are told at their next renewal. (A
    process that connects afterwards finds the server record gone too, and opens a
    recovery window: tests/test_recovery_windows.py.)"""
    lock_server = make_redis()
    worker = start_worker(redis_server, APP, "w1", concurrency=1,
                          env={"CSB_LOCK_REDIS": lock_server.url()}, extra=["-Q", "restart"])
    result = tasks.watch_lease.apply_async(("k", 20.0), queue="restart")
    wait_for(lambda: records.get("running:k"), timeout=30, message="run started")
    stats = task_stats_key("singleton", tasks.watch_lease.name)
    wait_for(lambda: lock_server.client().hget(stats, "renewed"), timeout=30,
             message="the lease renewed (its keeper's connection made before the flush)")
    lock_server.client().flushall()
    records.set("retaken:k", "1")
    assert result.get(timeout=30) == "LockLost"
    worker.wait_for_line("lost its lock")

