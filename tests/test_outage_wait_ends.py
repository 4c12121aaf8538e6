"""A run that waits in the worker for its lock Redis always ends, and its message is not lost.

Fail closed, a run whose lock Redis cannot be asked is published again with a
back-off; when that publish fails too (the lock Redis is the broker, or the
broker is down as well), the run waits in the worker and asks again. That wait:

* tries the publish again at every attempt: once the broker takes it, the run
  ends ``RETRY`` and waits in the queue, not in a pool slot;
* ends before the run's time limit (soft or hard, where the pool enforces it)
  instead of being ended by it as a ``FAILURE`` whose message is acknowledged;
* ends when the worker shuts down warm, instead of holding the shutdown until
  Redis answers.

When the wait ends that way, an ``acks_late`` run gives its message back
(``Reject(requeue=True)``: back in the queue, or, while the broker cannot take
it, redelivered after the visibility timeout) and runs once Redis is back; a run
acknowledged when it started (Celery's default) has no message left to give
back and ends ``FAILURE`` with ``LockUnavailable``, without running.

Each test: real workers of ``tests.apps.outage_app`` (``tests/support/outages.py``),
the run held at a gate just before its acquire while the outage begins.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, states

from .support import RedisServer, soak, wait_for
from .support.outages import Held, Outage, Unanswered, hold_at_the_gate, open_the_gate
from .support.tasks import runs

#: The time limit of the runs that meet a time limit, in seconds.
LIMIT = 6.0
#: What a worker logs when a time limit ends a run.
TIME_LIMIT_ENDS = ("SoftTimeLimitExceeded", "Hard time limit", "TimeLimitExceeded")
#: What a waiting acks_late run logs when it gives its message back.
GIVEN_BACK = "gives its message back to the broker"
#: What a waiting run acknowledged at its start logs when it must end without running.
ENDS_UNRUN = "ends without running (LockUnavailable)"
#: What kombu logs when the broker does not take a message back (and the worker lives on).
REFUSED_BACK = "Couldn't reject"
#: The broker's visibility timeout in these workers (tests/support/outages.py).
VISIBILITY_TIMEOUT = 10.0


def lock_server_and_broker(make_redis: Callable[..., RedisServer]) -> RedisServer:
    """The lock Redis that is also the broker and result store (its queue survives a restart)."""
    return make_redis("--appendonly", "yes", "--maxmemory-policy", "noeviction")


def ran_once_after(held: Held, redis_server: RedisServer, records: redis.Redis) -> None:
    """The message given back runs once, SUCCESS, once Redis is back (on the first worker
    if it still runs, or on a standby: a worker whose broker restarted may have exited).

    The standby is a prefork worker whatever the pool under test: a message the broker
    could not take back waits in kombu's unacknowledged set, and kombu 5.7's consumer
    without an event loop (a gevent worker) was not seen to restore it (16 s past the
    visibility timeout); prefork workers do.
    """
    held.standby(redis_server, pool="prefork")
    assert held.result.get(timeout=VISIBILITY_TIMEOUT + 30) == "k"
    assert held.result.state == states.SUCCESS
    assert [run["task_id"] for run in runs(records, "k")] == [held.result.id], "executed once"


def lines_about(held: Held) -> list[str]:
    """The lines the workers logged about the held run (a tail can be all traceback)."""
    return [line for worker in held.workers for line in worker.output().splitlines() if held.result.id in line]


def refused_back_and_lives_on(held: Held) -> None:
    """The broker refuses writes, so it refuses the message given back: kombu logs that
    ("Couldn't reject"), the message stays unacknowledged, and the worker consumes on."""
    wait_for(lambda: held.log_of(REFUSED_BACK) or not held.worker.running, timeout=30,
             message="the broker's answer to the message given back")
    held.worker.check_running()


def test_the_retry_is_published_again_at_every_attempt(
    redis_server: RedisServer, redis_db: redis.Redis, make_redis: Callable[..., RedisServer],
    records: redis.Redis, client_apps: list[Celery], tmp_path: Path,
) -> None:
    """The lock Redis is down and the broker refuses writes: the run waits in the worker.
    The broker takes writes again while the lock Redis is still down: the next attempt
    publishes the retry (``RETRY``), and the run executes once the lock Redis is back."""
    lock_server = make_redis("--appendonly", "yes")
    broker = make_redis("--maxmemory-policy", "noeviction")
    held = hold_at_the_gate("job", "prefork", redis_server=redis_server, lock_server=lock_server,
                            broker=broker, client_apps=client_apps, gate=tmp_path)
    lock_down, broker_full = Outage("restart", lock_server), Outage("refused-writes", broker)
    lock_down.begin()
    broker_full.begin()
    open_the_gate(held)
    held.worker.wait_for_line(f"[{held.result.id}] could not be published again either")

    broker_full.end()
    wait_for(lambda: held.result.state == states.RETRY, timeout=30,
             message="the retry published by a later attempt while the lock Redis is still down")
    assert runs(records, "k") == [], "never runs without its lock"
    lock_down.end()
    assert held.result.get(timeout=30) == "k"
    assert [run["task_id"] for run in runs(records, "k")] == [held.result.id], "executed once"


#: task, pool, how the limit is set (send_task options / worker environment), the outage,
#: seconds the run is held at the gate once the outage began (they count towards its
#: limit), what happens. The lock Redis is the broker: ``restart`` (stopped) or
#: ``refused-writes`` (an acks_late run's broker restart makes kombu 5.7's consumer exit,
#: and the worker stop: see tests/test_outage_at_acquire.py; refused writes keep it
#: consuming, so the time limit, not a shutdown, is what the wait meets).
NEAR = "its time limit (6s) is near"
#: Why the wait ends when the pool's soft limit strikes while it waits.
STRUCK = "its soft time limit struck"
TIME_LIMITS = [
    pytest.param("job_late", "prefork", {"env": {"CSB_SOFT_TIME_LIMIT": str(LIMIT)}}, "refused-writes", 0.0,
                 GIVEN_BACK, NEAR, id="acks_late-prefork-soft-app-setting"),
    pytest.param("job_late", "prefork", {"options": {"time_limit": LIMIT}}, "refused-writes", 0.0, GIVEN_BACK,
                 NEAR, id="acks_late-prefork-hard-message"),
    # gevent counts the limit from when the worker accepted the run (before the task-started
    # event and task_prerun): 4 of its 6 s go by at the gate, the wait must know it.
    pytest.param("job_late", "gevent", {"options": {"time_limit": LIMIT}}, "refused-writes", LIMIT * 2 / 3,
                 GIVEN_BACK, NEAR, id="acks_late-gevent-hard-message-late-start"),
    pytest.param("job", "prefork", {"options": {"soft_time_limit": LIMIT}}, "restart", 0.0, ENDS_UNRUN, NEAR,
                 id="acked-early-prefork-soft-message"),
    pytest.param("job", "threads", {"options": {"time_limit": LIMIT / 3}}, "restart", 0.0, None, None,
                 id="acked-early-threads-no-limits"),
]


@pytest.mark.parametrize(("task", "pool", "limit", "kind", "held_for", "ending", "why"), TIME_LIMITS)
def test_a_time_limit_never_ends_the_wait_for_redis(
    task: str, pool: str, limit: dict[str, Any], kind: str, held_for: float, ending: str | None,
    why: str | None, redis_server: RedisServer, redis_db: redis.Redis, make_redis: Callable[..., RedisServer],
    records: redis.Redis, client_apps: list[Celery], tmp_path: Path,
) -> None:
    """The lock Redis is the broker and is out for longer than the run's time limit.

    Where the pool enforces the limit (prefork: soft and hard; gevent: hard), the wait
    ends before it: an ``acks_late`` run gives its message back and runs once Redis is
    back; a run acknowledged at its start ends without running. The threads pool
    enforces no time limit: the run waits and executes once Redis is back.
    """
    server = lock_server_and_broker(make_redis)
    held = hold_at_the_gate(task, pool, redis_server=redis_server, lock_server=server, broker=server,
                            client_apps=client_apps, gate=tmp_path, **limit)
    outage = Outage(kind, server)
    outage.begin()
    if held_for:
        soak(held_for, check=lambda: runs(records, "k") == [], what="the run held at the gate")
    open_the_gate(held)
    endings = [*TIME_LIMIT_ENDS, GIVEN_BACK, ENDS_UNRUN]
    if ending is None:
        def still_waiting() -> bool:
            assert not any(held.log_of(line) for line in endings), f"the wait ended: {held.worker.tail(20)}"
            return True

        soak(LIMIT, check=still_waiting, what="the outage, three times the time limit")
    else:
        wait_for(lambda: any(held.log_of(line) for line in endings), timeout=LIMIT + 30,
                 message="the wait to end")
        assert not any(held.log_of(line) for line in TIME_LIMIT_ENDS), \
            f"the time limit ended the wait: {held.worker.tail(30)}"
        assert held.log_of(f"[{held.result.id}] {ending}"), held.worker.tail(30)
        assert held.log_of(why), f"ended for another reason: {lines_about(held)}"
        if kind == "refused-writes":
            refused_back_and_lives_on(held)
    assert runs(records, "k") == [], "never runs without its lock"

    outage.end()
    if ending == ENDS_UNRUN:
        assert runs(records, "k") == []
    else:
        ran_once_after(held, redis_server, records)


def test_a_soft_limit_that_strikes_during_the_wait_ends_it_the_same_way(
    redis_server: RedisServer, redis_db: redis.Redis, make_redis: Callable[..., RedisServer],
    records: redis.Redis, client_apps: list[Celery], tmp_path: Path,
) -> None:
    """A prefork pool child cannot see when the worker accepted its run, so time that went
    by before the acquire (``task_prerun`` handlers, a busy pool) is unseen: the pool's
    soft limit may strike while the run waits for Redis, before the wait's own deadline.
    The wait then ends as it would have at its deadline: the ``acks_late`` run gives its
    message back (no ``FAILURE``, nothing acknowledged) and runs once Redis is back.

    The strike is delivered as billiard's timer delivers it (``SIGUSR1`` to the pool
    child) once the wait has begun; the run's soft limit (60 s) is far off, so the
    wait's own deadline cannot end it first, whatever the machine's load.
    """
    server = lock_server_and_broker(make_redis)
    held = hold_at_the_gate("job_late", "prefork", redis_server=redis_server, lock_server=server, broker=server,
                            client_apps=client_apps, gate=tmp_path, options={"soft_time_limit": LIMIT * 10})
    outage = Outage("refused-writes", server)
    outage.begin()
    open_the_gate(held)
    held.worker.wait_for_line(f"[{held.result.id}] could not be published again either")
    os.kill(held.runner, signal.SIGUSR1)

    wait_for(lambda: any(held.log_of(line) for line in (*TIME_LIMIT_ENDS, GIVEN_BACK)), timeout=30,
             message="the wait to end")
    assert not any(held.log_of(line) for line in TIME_LIMIT_ENDS), \
        f"the time limit ended the wait: {held.worker.tail(30)}"
    assert held.log_of(f"[{held.result.id}] {GIVEN_BACK} ({STRUCK})"), held.worker.tail(30)
    refused_back_and_lives_on(held)
    assert runs(records, "k") == [], "never runs without its lock"

    outage.end()
    ran_once_after(held, redis_server, records)


def test_the_wait_leaves_room_for_one_more_attempt_before_the_limit(
    redis_server: RedisServer, redis_db: redis.Redis, make_redis: Callable[..., RedisServer],
    records: redis.Redis, client_apps: list[Celery], tmp_path: Path,
) -> None:
    """An attempt that takes a while (a lock Redis whose host does not answer: each connect
    times out after the app's 1 s) must be over before the hard time limit: the wait ends
    while there is still room for one (the lock client's connect + read timeouts), not at
    the limit itself, where the pool would kill the run in the middle of an attempt. The
    broker is another server, refusing writes (the retry cannot be published)."""
    unanswered = Unanswered().start()
    broker = make_redis("--maxmemory-policy", "noeviction")
    held = hold_at_the_gate("job_late", "prefork", redis_server=redis_server, lock_server=unanswered,
                            broker=broker, client_apps=client_apps, gate=tmp_path,
                            options={"time_limit": LIMIT})
    Outage("refused-writes", broker).begin()
    open_the_gate(held)
    wait_for(lambda: any(held.log_of(line) for line in (*TIME_LIMIT_ENDS, GIVEN_BACK)), timeout=LIMIT + 30,
             message="the wait to end")
    assert not any(held.log_of(line) for line in TIME_LIMIT_ENDS), \
        f"the time limit ended the wait: {held.worker.tail(30)}"
    assert held.log_of(f"[{held.result.id}] {GIVEN_BACK} (its time limit (6s) is near)"), held.worker.tail(30)
    assert held.log_of("Timeout connecting to server"), "the attempts waited for the connect timeout"
    refused_back_and_lives_on(held)


@pytest.mark.parametrize(("task", "pool", "kind", "stop"), [
    pytest.param("job_late", "prefork", "refused-writes", "sigterm", id="acks_late-prefork-sigterm"),
    pytest.param("job_late", "threads", "refused-writes", "sigterm", id="acks_late-threads-sigterm"),
    pytest.param("job_late", "gevent", "refused-writes", "sigterm", id="acks_late-gevent-sigterm"),
    pytest.param("job_late", "solo", "refused-writes", "sigterm", id="acks_late-solo-sigterm"),
    pytest.param("job_late", "prefork", "refused-writes", "control", id="acks_late-prefork-control-shutdown"),
    pytest.param("job", "prefork", "restart", "sigterm", id="acked-early-prefork-sigterm"),
])
def test_a_warm_shutdown_ends_the_wait_for_redis(
    task: str, pool: str, kind: str, stop: str, redis_server: RedisServer, redis_db: redis.Redis,
    make_redis: Callable[..., RedisServer], records: redis.Redis, client_apps: list[Celery], tmp_path: Path,
) -> None:
    """The lock Redis is the broker and is out; the worker is told to stop warm (SIGTERM to
    its main process, or ``celery control shutdown``: no signal in the worker). The waiting
    run notices, in the middle of its back-off: the worker exits while Redis is still out.
    An ``acks_late`` run's message is given back and runs once Redis is back; a run
    acknowledged at its start ends without running.

    The run was retried ten times already and the back-off may reach an hour: its pause
    between two attempts lasts 512 to 1024 s, which the stop must not wait out.
    """
    server = lock_server_and_broker(make_redis)
    held = hold_at_the_gate(task, pool, redis_server=redis_server, lock_server=server, broker=server,
                            client_apps=client_apps, gate=tmp_path, options={"retries": 10},
                            env={"CSB_BACKOFF_MAX": "3600"})
    outage = Outage(kind, server)
    outage.begin()
    open_the_gate(held)

    held.worker.wait_for_line(f"[{held.result.id}] could not be published again either")
    if stop == "sigterm":
        held.worker.terminate()
    else:
        control = Celery("outage-control", broker=f"redis://127.0.0.1:{server.port}/0")
        client_apps.append(control)
        control.control.shutdown(destination=[held.worker.name + "@" + socket.gethostname()])
    wait_for(lambda: not held.worker.running, timeout=30,
             message="the worker to end its warm shutdown while Redis is out")
    assert held.log_of(f"[{held.result.id}] {GIVEN_BACK if task == 'job_late' else ENDS_UNRUN}"), \
        held.worker.tail(30)
    assert held.log_of("the worker is shutting down"), held.worker.tail(30)
    assert runs(records, "k") == [], "never runs without its lock"

    outage.end()
    if task == "job_late":
        ran_once_after(held, redis_server, records)
