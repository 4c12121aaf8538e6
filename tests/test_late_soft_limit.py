"""A soft time limit that reaches a pool process after its run ended is dropped.

The worker's main process sends a pool process ``SIGUSR1`` when a run passes its
soft time limit; when the timer fires late, the signal arrives after the run
ended, and billiard's handler raised the exception in the pool's own code: in the
middle of writing a result to the main process (whose warm shutdown then waited
for ever for the rest of that message) or while waiting for the next job (the
pool process died). A chaos run showed both (a worker that never exited its warm
shutdown). Each test here: one real prefork worker with one pool process, on a
queue of its own, runs acknowledged late (so the test can see when the main
process has taken a run's result: its message is acknowledged then).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from types import ModuleType

import pytest
import redis

from .support import BROKER_DB, CeleryProcess, RedisServer, wait_for
from .support.processes import module_worker
from .support.tasks import clear_runs

APP = "tests.apps.tasks_app"
QUEUE = "late-soft-limit"
#: kombu's Redis transport: the hash of delivered, unacknowledged messages.
UNACKED = "unacked"


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer) -> Iterator[CeleryProcess]:
    redis_server.flushall()
    yield from module_worker(redis_server, APP, "late", concurrency=1, extra=["-Q", QUEUE],
                             env={"CSB_ACKS_LATE": "1"})


@pytest.fixture
def tasks_app(worker: CeleryProcess, redis_server: RedisServer) -> ModuleType:
    return clear_runs(redis_server)


def ran_and_was_taken(tasks_app: ModuleType, redis_server: RedisServer) -> int:
    """Run ``pid_of`` and wait until the main process took its result (the message is
    acknowledged when it does): the pool process has left Celery's tracer for good."""
    pid = tasks_app.pid_of.apply_async(queue=QUEUE).get(timeout=30)
    broker = redis_server.client(BROKER_DB)
    wait_for(lambda: broker.hlen(UNACKED) == 0, timeout=30, message="the run's message acknowledged")
    return int(pid)


def test_a_soft_time_limit_after_the_run_ended_leaves_the_pool_process_alive(
    tasks_app: ModuleType, redis_server: RedisServer, worker: CeleryProcess
) -> None:
    pid = ran_and_was_taken(tasks_app, redis_server)
    os.kill(pid, signal.SIGUSR1)  # what the main process sends when a run's soft limit fires late
    assert ran_and_was_taken(tasks_app, redis_server) == pid, "the same pool process runs the next run"
    assert "Pool process" not in worker.output()
    worker.wait_for_line("reached this pool process after its run had ended: dropped")


def test_a_soft_time_limit_during_a_run_still_stops_it(
    tasks_app: ModuleType, redis_server: RedisServer, records: redis.Redis
) -> None:
    result = tasks_app.until_soft_limit.apply_async(("k",), queue=QUEUE)
    wait_for(lambda: records.get("running:k"), timeout=30, message="the run started")
    # Celery's documented way to raise SoftTimeLimitExceeded in a running task.
    tasks_app.app.control.revoke(result.id, terminate=True, signal="SIGUSR1")
    assert result.get(timeout=30) == "stopped by its soft time limit"
