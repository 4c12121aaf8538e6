"""A prefork worker shut down warm exits once its runs have ended, whatever job its pool held.

A warm shutdown (SIGTERM) closes the consumer first, and Celery's prefork pool then
forgets every job whose pool process had not reported taking it up yet (it "will be
delivered again"). A job already written into the process's pipe still runs there;
its result goes unread, since the main process reads results at a shutdown only for
the jobs it still knows. billiard's pool process, before it exits, waits for its main
process to have counted every result it sent, up to 300 looks 0.1 s apart: so the
worker took 30 s more to exit (a Kubernetes pod's whole grace period), its runs long
over. Worse, a result larger than the pipe holds (64 KiB on Linux: the exception
information of a failure or a retry often is) blocks the pool process in its write,
and the worker never exited. The worker step (:mod:`celery_singleton_beat.task.worker`)
lets the pool processes go once nothing reads their results any more, and reads (and
drops) what they still write until they have exited.

The test makes that race certain: the pool process is stopped (SIGSTOP) while a job
is written into its pipe, so it cannot report taking it up; the worker is sent SIGTERM
once the job is there, and the process resumed once the pool's end-of-work sentinel
follows it (so the consumer is closed and the job forgotten). billiard's wait is
made endless in the app (``CSB_ENDLESS_CONSUMED_WAIT``): a worker that relies on it
never exits, which the test's deadline tells from a slow machine.

The pool process is stopped only once the worker itself counts it idle (its remote
control reports no active request): a caller's ``get()`` returns as soon as the result
is stored, before the pool process reports it to its main process, and a pool process
stopped in between stays busy for Celery's fair scheduling, which then never writes it
a job. The test holds that report back (``CSB_HOLD_REPORT``) so the window is always
open, and waits past it on what the worker says.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable
from types import ModuleType

import pytest
import redis
from celery.result import AsyncResult

from .support import CeleryProcess, RedisServer, start_worker, wait_for
from .support.pipes import bytes_waiting
from .support.tasks import lock_keys, runs

APP = "tests.apps.tasks_app"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads pipes through /proc")


def _active(tasks: ModuleType, node: str) -> list[list[object]] | None:
    """The arguments of each request worker ``node`` counts as running (None: no reply)."""
    replies = tasks.app.control.inspect(destination=[node], timeout=5).active()
    if not replies or node not in replies:
        return None
    return [list(request["args"]) for request in replies[node]]


def _forget_a_written_job(tasks: ModuleType, worker: CeleryProcess, node: str, records: redis.Redis,
                          submit: Callable[[], AsyncResult]) -> tuple[int, AsyncResult]:
    """Make the worker's only pool process hold a job its main process forgot; the
    process's pid and the job's result.

    Runs a first job, stops the pool process (SIGSTOP) once the worker counts it idle,
    submits the job (``submit``), sends the worker SIGTERM once the job is in the
    process's pipe, and resumes the process once the pool's end-of-work sentinel
    follows the job (the consumer is closed and the job forgotten).
    """
    records.set("hold-report:first", 1, ex=60)
    assert tasks.work.delay("first").get(timeout=30) == "first"
    child = int(runs(records, "first")[0]["pid"])
    assert _active(tasks, node) == [["first"]], "the result is stored, not yet reported: the pool process is busy"
    records.delete("hold-report:first")
    wait_for(lambda: _active(tasks, node) == [], timeout=30,
             message="the worker to count the run as over (its pool process idle)")
    os.kill(child, signal.SIGSTOP)
    try:
        idle = bytes_waiting(child)
        held = submit()
        written = wait_for(lambda: bytes_waiting(child) > idle and bytes_waiting(child),
                           timeout=30, message="the job written into the stopped pool process's pipe")
        worker.signal(signal.SIGTERM)
        wait_for(lambda: bytes_waiting(child) > written, timeout=30,
                 message="the pool's end-of-work sentinel written after the job (the consumer closed)")
    finally:
        os.kill(child, signal.SIGCONT)
    return child, held


def test_warm_shutdown_exits_though_a_job_written_to_the_pool_was_forgotten(
    tasks: ModuleType, redis_server: RedisServer, records: redis.Redis, locks: redis.Redis,
) -> None:
    worker = start_worker(redis_server, APP, "w1", concurrency=1,
                          env={"CSB_ENDLESS_CONSUMED_WAIT": "1", "CSB_HOLD_REPORT": "1"})
    node = f"w1@{socket.gethostname()}"
    child, held = _forget_a_written_job(tasks, worker, node, records, lambda: tasks.work.delay("held"))
    wait_for(lambda: not worker.running, timeout=60,
             message="the worker to exit once its pool process ran the job it held")
    assert worker.returncode == 0, worker.tail(40)
    assert held.get(timeout=30) == "held", "the job written before the shutdown ran"
    assert [run["pid"] for run in runs(records, "held")] == [child]
    assert lock_keys(locks) == [], "its lock was released"


@pytest.mark.parametrize("how", ["fail", "retry"])
def test_warm_shutdown_exits_though_a_forgotten_job_ends_with_a_result_larger_than_a_pipe(
    tasks: ModuleType, redis_server: RedisServer, records: redis.Redis, locks: redis.Redis, how: str,
) -> None:
    """The forgotten job ends with exception information larger than the pipe to the main
    process holds: the pool process blocks in its write until something reads it."""
    worker = start_worker(redis_server, APP, "w1", concurrency=1,
                          env={"CSB_ENDLESS_CONSUMED_WAIT": "1", "CSB_HOLD_REPORT": "1"})
    node = f"w1@{socket.gethostname()}"
    child, held = _forget_a_written_job(tasks, worker, node, records,
                                        lambda: tasks.fails_large.delay(f"large-{how}", how))
    wait_for(lambda: not worker.running, timeout=60,
             message="the worker to exit once its pool process ran the job it held")
    assert worker.returncode == 0, worker.tail(40)
    wait_for(lambda: held.state == ("RETRY" if how == "retry" else "FAILURE"), timeout=30,
             message="the held job's end stored")
    assert repr(held.result) == "ValueError('large')"
    assert [run["pid"] for run in runs(records, f"large-{how}")] == [child]
    assert lock_keys(locks) == [], "its lock was released"
