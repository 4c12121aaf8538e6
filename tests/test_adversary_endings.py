"""Adversarial review of the ends the worker's main process records
(``task/request.py``: ``SingletonRequest``; ``task/worker.py``: ``_guard_revoke``).

The promise attacked (docs/guarantees.md, "Every ending frees the lock" and "A run's end
is ordered"): ``revoke(terminate=True)`` stores ``REVOKED`` once the run's child has
exited and its lock is freed; a hard time limit's ``FAILURE`` likewise; a release that
gets no answer is sent again. The module's workers: ``runner`` (prefork, one process,
the default queue, ``acks_late``: it runs the attacked runs), ``bystander`` (prefork, one process, its
own queue: it receives every broadcast control command), and, for the tests that need
them, a worker with a lock Redis of its own, a gevent worker.

To make the order deterministic, the runner's main process is paused (SIGSTOP: a busy
or slow worker) while the bystander answers a command: whatever the bystander writes
then is written before the runner could have freed anything.

Breaks it found, each fixed (each test failed on the code it reviewed):

* the ``terminate`` control command (``celery control terminate SIGKILL <id>``) calls
  Celery's module-level ``control.revoke`` directly, not the guarded
  ``Panel.data["revoke"]``: every worker that does not run the task stores ``REVOKED``
  at once, while the run still holds its lock;
* ``revoke(terminate=True)`` reaching a worker that holds a reserved copy of the running
  message (an ``acks_late`` redelivery, a re-publish with the same id) does "what Celery
  does": it stores ``REVOKED`` at once, while the original still holds its lock
  elsewhere (the guard spares such copies only without ``terminate``);
* the main process's release on behalf of a lost child (terminate, hard time limit) is
  tried once: answered ``-BUSY`` it is logged and never sent again, the end is stored,
  and the lock stays until its TTL (now sent again until Redis answers; the end is
  still stored meanwhile: the main loop does not wait for an unanswering Redis);
* gevent: the pool reports ``id(greenlet)`` as ``worker_pid``, which ``SingletonRequest``
  takes for a pool child's pid: a hard time limit raises ``OverflowError`` in
  ``on_timeout`` (``os.getpgid`` of the id) and its ``FAILURE`` is never stored; a
  ``revoke(terminate=True)`` kills the greenlet but its ``REVOKED`` is never stored.
  Stock Celery stores both; callers' ``get()`` never returns.

Held (kept): the guarded ``revoke(terminate=True)`` with a paused runner, also for a list
of ids running on two workers; a terminated ``acks_late`` + ``reject_on_worker_lost``
run is acknowledged, not requeued.
"""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import states

from celery_singleton_beat.recovery.window import mark_in_use

from .support import CeleryProcess, Owner, RedisServer, owning, register, start_worker, wait_for
from .support.processes import module_worker
from .support.tasks import clear_runs, lock_keys, started
from .test_task_endings import end_and_release, recorded_after_the_lock_was_freed

APP = "tests.apps.tasks_app"
OTHER = "adv-endings-other"  # the bystander's queue


@pytest.fixture(scope="module")
def runner(redis_server: RedisServer) -> Iterator[CeleryProcess]:
    """The worker that runs the attacked runs: prefork, one process, the default queue,
    ``task_acks_late`` and ``task_reject_on_worker_lost``."""
    redis_server.flushall()
    yield from module_worker(redis_server, APP, "adv-runner", concurrency=1, env={"CSB_ACKS_LATE": "1"})


@pytest.fixture(scope="module")
def bystander(redis_server: RedisServer, runner: CeleryProcess) -> Iterator[CeleryProcess]:
    """Another worker of the same app on its own queue: it gets every control command."""
    yield from module_worker(redis_server, APP, "adv-bystander", concurrency=1, extra=["-Q", OTHER])


@pytest.fixture
def tasks_app(runner: CeleryProcess, bystander: CeleryProcess, redis_server: RedisServer) -> ModuleType:
    """``tests.apps.tasks_app`` for this module's workers: locks and records emptied."""
    return clear_runs(redis_server)


@contextmanager
def paused(process: CeleryProcess) -> Iterator[None]:
    """The worker's main process stopped while inside (its pool children run on)."""
    process.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.signal(signal.SIGCONT)


def broadcast_to_the_bystander(tasks_app: ModuleType, command: str, arguments: dict[str, Any]) -> None:
    """Broadcast ``command`` to every worker; return once the bystander has answered it
    (the runner, paused, answers later)."""
    replies = tasks_app.app.control.broadcast(command, arguments=arguments, reply=True, limit=1, timeout=10)
    assert [list(reply) for reply in replies] == [[f"adv-bystander@{socket.gethostname()}"]], replies


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    "revoke",
    pytest.param("terminate"),
])
def test_a_terminate_broadcast_stores_revoked_only_after_the_lock_is_freed(
    command: str, tasks_app: ModuleType, locks: redis.Redis, records: redis.Redis,
    redis_server: RedisServer, runner: CeleryProcess,
) -> None:
    """``result.revoke(terminate=True)`` and ``celery control terminate SIGKILL <id>`` (the
    ``terminate`` control command) are the same request; the bystander, which knows nothing
    of the id, must leave its state alone while the runner has not freed the lock."""
    with end_and_release(redis_server) as writes:
        result = tasks_app.work.apply_async(("k-term", 60))
        wait_for(lambda: started(records, "k-term"), timeout=30, message="the run started")
        [key] = lock_keys(locks)
        arguments: dict[str, Any] = {"task_id": result.id, "signal": "SIGKILL"}
        if command == "revoke":
            arguments["terminate"] = True
        with paused(runner):
            broadcast_to_the_bystander(tasks_app, command, arguments)
            seen_meanwhile = result.state
        wait_for(lambda: result.state == states.REVOKED, timeout=10, message="the revoke recorded")
        wait_for(lambda: lock_keys(locks) == [], timeout=10, message="the run's lock freed")
        assert seen_meanwhile == states.PENDING, "REVOKED stored while the run still held its lock"
        assert recorded_after_the_lock_was_freed(writes(), key, result.id), writes()


@pytest.mark.slow
def test_a_terminate_reaching_a_reserved_copy_stores_revoked_only_after_the_lock_is_freed(
    tasks_app: ModuleType, locks: redis.Redis, records: redis.Redis, redis_server: RedisServer,
    runner: CeleryProcess, bystander: CeleryProcess,
) -> None:
    """The bystander holds a second delivery of the running message (the same task id sent
    again, as an ``acks_late`` redelivery would be), reserved behind a busy run. Without
    ``terminate`` the guard leaves the original's state alone; with it, REVOKED must still
    wait for the runner's free."""
    records.set("hold:busy", "1")
    try:
        with end_and_release(redis_server) as writes:
            result = tasks_app.work.apply_async(("k-orig", 60))
            wait_for(lambda: started(records, "k-orig"), timeout=30, message="the original started")
            [key] = lock_keys(locks)
            tasks_app.work.apply_async(("busy",), queue=OTHER)
            wait_for(lambda: started(records, "busy"), timeout=30, message="the bystander busy")
            tasks_app.work.apply_async(("k-orig", 60), task_id=result.id, queue=OTHER)
            bystander.wait_for_line(f"work[{result.id}] received", timeout=30)
            with paused(runner):
                broadcast_to_the_bystander(tasks_app, "revoke",
                                           {"task_id": result.id, "terminate": True, "signal": "SIGKILL"})
                seen_meanwhile = result.state
            wait_for(lambda: result.state == states.REVOKED, timeout=10, message="the revoke recorded")
            wait_for(lambda: not locks.exists(key), timeout=10, message="the original's lock freed")
            assert seen_meanwhile == states.PENDING, "REVOKED stored while the original still held its lock"
            assert recorded_after_the_lock_was_freed(writes(), key, result.id), writes()
    finally:
        records.delete("hold:busy")


@pytest.mark.slow
def test_a_terminate_of_ids_running_on_two_workers_stores_each_revoked_after_its_own_lock_is_freed(
    tasks_app: ModuleType, locks: redis.Redis, records: redis.Redis, redis_server: RedisServer,
    runner: CeleryProcess,
) -> None:
    """``revoke([a, b], terminate=True)``: ``a`` runs on the (paused) runner, ``b`` on the
    bystander. The bystander terminates ``b`` and stores its ``REVOKED`` once ``b``'s lock
    is free, and leaves ``a`` alone; ``a``'s ``REVOKED`` comes once the runner freed ``a``'s."""
    with end_and_release(redis_server) as writes:
        here = tasks_app.work.apply_async(("k-here", 60))
        there = tasks_app.work.apply_async(("k-there", 60), queue=OTHER)
        wait_for(lambda: started(records, "k-here") and started(records, "k-there"), timeout=30,
                 message="both runs started")
        keys = {tasks_app.work.singleton_key((name,), {}): result
                for name, result in (("k-here", here), ("k-there", there))}
        assert sorted(keys) == lock_keys(locks)
        with paused(runner):
            broadcast_to_the_bystander(tasks_app, "revoke",
                                       {"task_id": [here.id, there.id], "terminate": True, "signal": "SIGKILL"})
            wait_for(lambda: there.state == states.REVOKED, timeout=10, message="the bystander's run revoked")
            assert here.state == states.PENDING, "the paused runner's run left alone"
        wait_for(lambda: here.state == states.REVOKED, timeout=10, message="the runner's run revoked")
        wait_for(lambda: lock_keys(locks) == [], timeout=10, message="both locks freed")
        for key, result in keys.items():
            assert recorded_after_the_lock_was_freed(writes(), key, result.id), writes()


@pytest.mark.slow
@pytest.mark.parametrize("signal_name", ["SIGKILL", None], ids=["sigkill", "default-sigterm"])
def test_a_terminated_acks_late_run_is_acknowledged_not_requeued(
    signal_name: str | None, tasks_app: ModuleType, locks: redis.Redis, records: redis.Redis,
    broker: redis.Redis,
) -> None:
    """With ``acks_late`` and ``reject_on_worker_lost``, a terminated run (its ``REVOKED``
    now stored by the library, after the free) must still be acknowledged, not given back
    to the queue to run again. One process, FIFO: a marker published after the revoke
    completes after any requeued copy would have started."""
    result = tasks_app.work.apply_async(("k-late", 60))
    wait_for(lambda: started(records, "k-late"), timeout=30, message="the run started")
    result.revoke(terminate=True, signal=signal_name)
    wait_for(lambda: result.state == states.REVOKED, timeout=10, message="the revoke recorded")
    wait_for(lambda: result.id not in unacknowledged(broker), timeout=10, message="the message acknowledged")
    assert tasks_app.work.apply_async(("marker", 0)).get(timeout=30) == "marker"
    assert len(started(records, "k-late")) == 1, "the terminated message ran again"
    assert result.state == states.REVOKED
    wait_for(lambda: lock_keys(locks) == [], timeout=10, message="the locks freed")


def unacknowledged(broker: redis.Redis) -> set[str]:
    """Task ids of the messages the Redis transport holds as delivered and not acknowledged."""
    return {json.loads(payload)[0]["headers"]["id"] for payload in broker.hvals("unacked")}


BUSY_QUEUE = "adv-endings-busy"  # the queue of busy_lock_worker


@pytest.fixture(scope="module")
def busy_lock_worker(redis_server: RedisServer) -> Iterator[tuple[RedisServer, CeleryProcess]]:
    """A prefork worker (one process, queue ``BUSY_QUEUE``) whose lock Redis is a server of
    its own, so that a script can keep that server busy while broker and results answer."""
    with owning(Owner("adversary endings busy lock redis")) as owner:
        lock_server = register(RedisServer(name="redis-busy-locks")).start()
        with lock_server.client() as client:
            mark_in_use(client)  # a new Redis of the test's own: no recovery window to wait out
        worker = start_worker(redis_server, APP, "adv-busy", concurrency=1, extra=["-Q", BUSY_QUEUE],
                              env={"CSB_LOCK_REDIS": lock_server.url(0), "CSB_LOCK_TTL": "60"})
    yield lock_server, worker
    owner.close()


@pytest.mark.slow
def test_a_release_for_a_lost_child_answered_busy_runs_once_the_server_answers(
    tasks_app: ModuleType, records: redis.Redis,
    busy_lock_worker: tuple[RedisServer, CeleryProcess], busy_script: Callable[[RedisServer], Callable[[], None]],
) -> None:
    """The lock Redis answers ``-BUSY`` (another client's script) when the worker's main
    process frees the lock of a child it stopped at its hard time limit (a terminate or a
    lost child take the same path: ``_release_for_request``). guarantees.md: "A release
    that gets no answer (``-BUSY`` ...) is sent again ... once Redis runs it the key is
    free ... without waiting for ``lock_ttl``", as ``tests/test_release_retry.py`` shows
    for a run's own release. The ``FAILURE`` is stored meanwhile: a caller who saw it and
    submits the key again once Redis answers is skipped as a duplicate of the dead run
    until the lock's TTL (60 s here) frees it."""
    lock_server, worker = busy_lock_worker
    locks = lock_server.client()
    for stale in locks.scan_iter(match="singleton:{*"):
        locks.delete(stale)
    result = tasks_app.hard_limited.apply_async(("k-busy",), queue=BUSY_QUEUE)
    wait_for(lambda: records.get("running:k-busy"), timeout=30, message="the run started")
    [key] = lock_keys(locks)
    kill = busy_script(lock_server)  # before the hard time limit (1.5 s) strikes
    wait_for(lambda: result.state == states.FAILURE, timeout=30, message="the FAILURE recorded")
    worker.wait_for_line(result.id, "could not free", key, timeout=10)
    kill()
    wait_for(lambda: not locks.exists(key), timeout=3,
             message="the lock freed once the lock Redis answers (60 s TTL otherwise)")


GEVENT_QUEUE = "adv-endings-gevent"  # the queue of gevent_worker


@pytest.fixture(scope="module")
def gevent_worker(redis_server: RedisServer, runner: CeleryProcess) -> Iterator[CeleryProcess]:
    """A gevent worker (4 greenlets) on its own queue."""
    yield from module_worker(redis_server, APP, "adv-gevent", pool="gevent", concurrency=4,
                             extra=["-Q", GEVENT_QUEUE])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["hard-time-limit", "revoke-terminate"])
def test_a_gevent_run_ended_by_the_worker_has_its_end_recorded_after_its_release(
    how: str, tasks_app: ModuleType, locks: redis.Redis, records: redis.Redis, redis_server: RedisServer,
    gevent_worker: CeleryProcess,
) -> None:
    """gevent has no pool child: the request class must not change what Celery does there
    (the greenlet's own ``finally`` releases: a hard limit raises ``Timeout`` in it, a
    terminate kills it with ``GreenletExit``), and the end must still be recorded, after
    the release. Stock Celery stores the ``FAILURE`` / ``REVOKED``; with the library the
    state stays ``PENDING`` for ever and a caller's ``get()`` never returns."""
    with end_and_release(redis_server) as writes:
        if how == "hard-time-limit":
            result = tasks_app.hard_limited.apply_async(("k-gevent",), queue=GEVENT_QUEUE)
            wait_for(lambda: records.get("running:k-gevent"), timeout=30, message="the run started")
            expected = states.FAILURE
        else:
            result = tasks_app.work.apply_async(("k-gevent", 60), queue=GEVENT_QUEUE)
            wait_for(lambda: started(records, "k-gevent"), timeout=30, message="the run started")
            expected = states.REVOKED
        [key] = lock_keys(locks)
        if how == "revoke-terminate":
            result.revoke(terminate=True)
        wait_for(lambda: result.state == expected, timeout=4, message=f"the {expected} recorded")
        assert lock_keys(locks) == []
        assert recorded_after_the_lock_was_freed(writes(), key, result.id), writes()
