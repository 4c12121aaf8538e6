"""Exactly once where Celery really runs: acks_late redelivery, dead pods, node names.

Real worker processes (``tests.apps.delivery_app``, every task ``acks_late``)
on the session's redis-server as broker (RabbitMQ for one test: the session's
node, started only for it); a whole worker (main process and pool) is
SIGKILLed as when a pod or VM dies.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_singleton_beat import TaskSkipped
from celery_singleton_beat.config import clear_settings_cache
from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.recovery.lock_redis import reset_clients

from .support import LOCK_DB, RECORD_DB, CeleryProcess, RedisServer, start_worker, wait_for
from .support.keyspace import keyspace_events
from .support.tasks import lock_keys

APP = "tests.apps.delivery_app"


def load_app(redis_server: RedisServer, **env: str) -> ModuleType:
    """``tests.apps.delivery_app`` bound to the session's server (re-imported per test)."""
    import importlib
    import sys

    os.environ["CSB_TEST_REDIS"] = f"redis://127.0.0.1:{redis_server.port}"
    for name, value in env.items():
        os.environ[name] = value
    sys.modules.pop("tests.apps.delivery_app", None)
    clear_settings_cache()
    reset_clients()
    return importlib.import_module("tests.apps.delivery_app")


def entries(records: redis.Redis, name: str) -> list[dict[str, Any]]:
    return [json.loads(item) for item in records.lrange(name, 0, -1)]


def worker(redis_server: RedisServer, processes: list[CeleryProcess], name: str, env: dict[str, str],
           *, concurrency: int = 1, pool: str = "prefork") -> CeleryProcess:
    process = start_worker(redis_server, APP, name, pool=pool, concurrency=concurrency, env=env)
    processes.append(process)
    return process


def test_whole_worker_killed_mid_run_the_redelivered_task_completes_once_on_another_node(
    redis_server: RedisServer, processes: list[CeleryProcess], delivery_env: dict[str, str]
) -> None:
    """Redis broker, visibility timeout 3 s: the copy arrives on a worker with another node name."""
    delivery_env.update(CSB_VISIBILITY="3")
    app = load_app(redis_server, **delivery_env)
    records = redis_server.client(RECORD_DB)
    first = worker(redis_server, processes, "pod-a", delivery_env)
    records.set("hold:k", "1")  # the run lasts until its pod dies, however slow the machine
    result = app.slow.delay("k", 0)
    wait_for(lambda: entries(records, "started:k"), timeout=30, message="the run started on pod-a")
    first.kill_group()  # the pod dies: main process and pool child
    records.delete("inflight:k", "hold:k")  # the dead run never counts itself out

    # Started after the kill: its restore of unacknowledged messages must not
    # hand it the copy while pod-a still lives.
    survivor = worker(redis_server, processes, "pod-b", delivery_env)
    assert_completed_once_on_survivor(redis_server, result, survivor)


def test_whole_worker_killed_mid_run_on_rabbitmq_the_redelivered_task_completes_once_on_another_node(
    redis_server: RedisServer, rabbitmq: str, processes: list[CeleryProcess], delivery_env: dict[str, str]
) -> None:
    """RabbitMQ broker: the copy is redelivered the moment the dead worker's connection drops.

    pod-b already runs, so the copy reaches it at once, while the dead run's
    lock and (for up to ``singleton_liveness_ttl``) its liveness key are still
    there: it must neither run beside a live original nor be dropped as a
    duplicate of itself, and runs once the dead incarnation's key lapsed.
    """
    delivery_env.update(CSB_BROKER=rabbitmq)
    app = load_app(redis_server, **delivery_env)
    records = redis_server.client(RECORD_DB)
    first = worker(redis_server, processes, "pod-a", delivery_env)
    records.set("hold:k", "1")  # pod-a's run lasts until the kill, however long pod-b takes to start
    result = app.slow.delay("k", 0)
    wait_for(lambda: entries(records, "started:k"), timeout=30, message="the run started on pod-a")
    survivor = worker(redis_server, processes, "pod-b", delivery_env)
    first.kill_group()  # the pod dies: main process and pool child
    killed = time.time()
    records.delete("inflight:k", "hold:k")  # the dead run never counts itself out

    assert_completed_once_on_survivor(redis_server, result, survivor)
    restarted = entries(records, "started:k")[1]["start"]
    print(f"\nRabbitMQ, whole worker SIGKILLed: the copy ran again {restarted - killed:.2f}s after the kill "
          f"(singleton_liveness_ttl 2 s)")


def assert_completed_once_on_survivor(redis_server: RedisServer, result: Any, survivor: CeleryProcess) -> None:
    """The task killed on pod-a completed once, on pod-b, which took over the dead run's lock."""
    records = redis_server.client(RECORD_DB)
    assert result.get(timeout=60).startswith("pod-b@"), "the task completed, on the surviving node"
    completed = entries(records, "runs:k")
    assert len(completed) == 1, f"exactly one completed run, got {completed}"
    assert [e["node"].split("@")[0] for e in entries(records, "started:k")] == ["pod-a", "pod-b"]
    assert records.get("overlap:k") is None
    line = survivor.wait_for_line("took over", timeout=5)
    assert result.id in line and "pod-a" in line, f"pod-b took over the dead run's lock: {line}"
    assert redis_server.client(LOCK_DB).keys("singleton:{*}") == [], "the lock was released"


def test_copy_of_a_live_original_waits_and_the_original_result_stands(
    redis_server: RedisServer, processes: list[CeleryProcess], delivery_env: dict[str, str]
) -> None:
    """The visibility timeout (2 s) ends while the original (held) still runs: the copy arrives.

    The copy (redelivered by the broker, then re-published to wait) never writes
    the lock key, not even once the original completed: Redis' keyspace events
    show one ``set``, the original's.
    """
    delivery_env.update(CSB_VISIBILITY="2")
    app = load_app(redis_server, **delivery_env)
    records = redis_server.client(RECORD_DB)
    locks = redis_server.client(LOCK_DB)
    with keyspace_events(locks, "singleton:{tests.apps.delivery_app.strict:*") as events:
        copy_of_a_live_original(redis_server, processes, delivery_env, app)
        written = events()
    [key] = {key for key, _ in written if ":done:" not in key}
    assert [event for name, event in written if name == key].count("set") == 1, written
    assert len(entries(records, "runs:k")) == 1


def copy_of_a_live_original(redis_server: RedisServer, processes: list[CeleryProcess],
                            delivery_env: dict[str, str], app: ModuleType) -> CeleryProcess:
    """Run the key on ``orig`` until its copy reached ``copy`` and waits (the run is held, not
    timed: starting a worker can take longer than a fixed run on a loaded machine); the
    worker ``copy``."""
    records = redis_server.client(RECORD_DB)
    orig = worker(redis_server, processes, "orig", delivery_env)
    records.set("hold:k", "1")
    result = app.strict.delay("k", 0)  # on_conflict="raise": a wrong duplicate would store FAILURE
    wait_for(lambda: entries(records, "started:k"), timeout=30, message="the original started")
    copy_worker = worker(redis_server, processes, "copy", delivery_env)

    seen: set[str] = set()

    def finished() -> bool:
        state = result.state
        seen.add(state)
        return state == "SUCCESS"

    wait_for(lambda: "already running on" in copy_worker.output() and not finished(), timeout=60,
             interval=0.02, message="the copy to wait for its running original")
    records.delete("hold:k")
    wait_for(finished, timeout=60, interval=0.02, message="the original's SUCCESS")
    assert seen <= {"PENDING", "STARTED", "SUCCESS"}, f"the copy overwrote the original's state: {seen}"
    assert result.get(timeout=5).startswith("orig@"), "the original's result stands"
    assert len(entries(records, "started:k")) == 1, "the copy never ran the body"
    # Once the original completed, the waiting copy ends without running, on whichever
    # worker its re-published message reaches (``orig`` is idle again by then).
    wait_for(lambda: any(f"[{result.id}] already completed" in each.output() for each in (orig, copy_worker)),
             timeout=30, message="the waiting copy to end as already completed")
    assert len(entries(records, "runs:k")) == 1
    return copy_worker


def test_live_workers_with_one_node_name_never_free_each_others_locks(
    redis_server: RedisServer, processes: list[CeleryProcess], delivery_env: dict[str, str]
) -> None:
    """A Deployment with a fixed ``-n``: replica 2 restarts while replica 1 runs a task."""
    app = load_app(redis_server, **delivery_env)
    records = redis_server.client(RECORD_DB)
    locks = redis_server.client(LOCK_DB)
    worker(redis_server, processes, "same", delivery_env)
    records.set("hold:k", "1")  # runs until the test is done with it (not for a fixed time)
    running = app.slow.delay("k", 0)
    wait_for(lambda: entries(records, "started:k"), timeout=30, message="replica 1 runs the task")
    [key] = lock_keys(locks)

    second = worker(redis_server, processes, "same", delivery_env)
    second.kill_group()
    worker(redis_server, processes, "same", delivery_env)  # replica 2 again, same name

    holder = read_holder(locks, key)
    assert holder is not None and holder.task_id == running.id, "replica 1's live lock survived"
    duplicate = app.slow.delay("k", 0)
    with pytest.raises(TaskSkipped):
        duplicate.get(timeout=30)
    records.delete("hold:k")
    assert running.get(timeout=30).startswith("same@")
    assert records.get("overlap:k") is None
    assert len(entries(records, "runs:k")) == 1


def test_a_dead_pods_lock_is_taken_over_by_a_worker_with_another_name(
    redis_server: RedisServer, processes: list[CeleryProcess], delivery_env: dict[str, str]
) -> None:
    """The pod comes back under a new name; its dead run's lock frees with its liveness key."""
    app = load_app(redis_server, **delivery_env)
    records = redis_server.client(RECORD_DB)
    locks = redis_server.client(LOCK_DB)
    first = worker(redis_server, processes, "old-pod", delivery_env)
    app.slow.delay("k", 60)
    wait_for(lambda: entries(records, "started:k"), timeout=30, message="the run started")
    [key] = lock_keys(locks)
    dead_holder = read_holder(locks, key)
    first.kill_group()
    records.delete("inflight:k")  # the dead run never counts itself out
    new = worker(redis_server, processes, "new-pod", delivery_env)

    def a_new_run_succeeds() -> bool:
        attempt = app.slow.delay("k", 0)
        wait_for(lambda: attempt.ready(), timeout=30, message="the attempt ended")
        return attempt.successful()

    # Without liveness the dead run's lock would hold for lock_ttl; the wait here is longer,
    # so the take-over line is what tells the two apart.
    wait_for(a_new_run_succeeds, timeout=60, interval=0.2, message="a run of k on new-pod")
    line = new.wait_for_line("took over", timeout=5)
    assert dead_holder.task_id in line and "old-pod" in line
    assert records.get("overlap:k") is None


def test_a_copy_the_broker_alone_marks_as_redelivered_never_takes_the_completed_runs_key(
    redis_server: RedisServer, processes: list[CeleryProcess], delivery_env: dict[str, str]
) -> None:
    """A copy of a completed acks_late message that only the broker marks as a copy
    (kombu's restore: ``redelivered`` set, no ``singleton_copy`` header, which only the
    library's re-publish adds) ends without running and never writes the lock key: Redis'
    keyspace events show one ``set``, the original's. The copy is the original's own
    payload, read from kombu's ``unacked`` hash while it ran and pushed back once it
    completed, as kombu's restore does when it reads the message just before the ack.
    With the broker's flag ignored (the header alone counting) the copy took the key for
    a round trip (``set``, then ``del``) and a caller who had seen the result and sent the
    key again could be skipped."""
    app = load_app(redis_server, **delivery_env)
    records = redis_server.client(RECORD_DB)
    locks = redis_server.client(LOCK_DB)
    broker = redis_server.client(0)
    with keyspace_events(locks, "singleton:{tests.apps.delivery_app.strict:*") as events:
        copy_worker = worker(redis_server, processes, "bcopy", delivery_env)
        records.set("hold:b", "1")
        result = app.strict.delay("b", 0)
        wait_for(lambda: entries(records, "started:b"), timeout=30, message="the run started")
        [raw] = [raw for raw in broker.hvals("unacked") if result.id.encode() in raw]
        message, _exchange, routing_key = json.loads(raw)
        assert "singleton_copy" not in message["headers"]
        records.delete("hold:b")
        assert result.get(timeout=60).startswith("bcopy@")
        wait_for(lambda: not broker.hvals("unacked"), timeout=30, message="the run's acknowledgement")
        message["headers"]["redelivered"] = True
        message["properties"]["delivery_info"]["redelivered"] = True
        broker.lpush(routing_key, json.dumps(message))
        copy_worker.wait_for_line(result.id, "already completed", timeout=30)
        written = events()
    [key] = {key for key, _ in written if ":done:" not in key}
    assert [event for name, event in written if name == key].count("set") == 1, written
    assert len(entries(records, "runs:b")) == 1


def test_a_skip_whose_result_cannot_be_stored_is_decided_again(
    redis_server: RedisServer, processes: list[CeleryProcess], delivery_env: dict[str, str],
    make_redis: Callable[..., RedisServer],
) -> None:
    """A duplicate is rightly skipped (its holder runs) while the result backend is down: its
    ``REVOKED`` cannot be written. The delivery is not acknowledged as if it had been: the
    message is published again after a back-off and decided again, so once the backend
    answers the skip is stored and the caller's ``.get()`` ends with ``TaskSkipped``.
    Before, the worker logged "could not record its skip", acknowledged the message, and the
    caller waited for ever (no state was ever stored)."""
    backend = make_redis()
    delivery_env.update(CSB_BACKEND=backend.url(1))
    app = load_app(redis_server, **delivery_env)
    records = redis_server.client(RECORD_DB)
    skipper = worker(redis_server, processes, "skipper", delivery_env, concurrency=2)
    records.set("hold:s", "1")
    app.slow.delay("s", 0)
    wait_for(lambda: entries(records, "started:s"), timeout=30, message="the holder started")
    # Published before the backend stops (a client's send subscribes to its result), and run
    # once it has stopped: an ETA the worker holds.
    duplicate = app.slow.apply_async(("s", 0), countdown=2)
    backend.stop()
    skipper.wait_for_line(duplicate.id, "could not record its skip", timeout=30)
    backend.start()
    wait_for(lambda: duplicate.state == "REVOKED", timeout=60, message="the skip stored once the backend answers")
    with pytest.raises(TaskSkipped):
        duplicate.get(timeout=5)
    records.delete("hold:s")
    assert len(entries(records, "started:s")) == 1, "the duplicate never ran"
