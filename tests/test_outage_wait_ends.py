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

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, states

from .support import RedisServer, soak, wait_for
from .support.outages import Held, Outage, hold_at_the_gate, open_the_gate
from .support.tasks import runs

#: The time limit of the runs that meet a time limit, in seconds.
LIMIT = 6.0
#: What a worker logs when a time limit ends a run.
TIME_LIMIT_ENDS = ("SoftTimeLimitExceeded", "Hard time limit", "TimeLimitExceeded")
#: What a waiting acks_late run logs when it gives its message back.
GIVEN_BACK = "gives its message back"
#: What a waiting run acknowledged at its start logs when it must end without running.
ENDS_UNRUN = "ends without running (LockUnavailable)"
#: The broker's visibility timeout in these workers (tests/support/outages.py).
VISIBILITY_TIMEOUT = 10.0


def lock_server_and_broker(make_redis: Callable[..., RedisServer]) -> RedisServer:
    """The lock Redis that is also the broker and result store (its queue survives a restart)."""
    return make_redis("--appendonly", "yes", "--maxmemory-policy", "noeviction")


def ran_once_after(held: Held, redis_server: RedisServer, records: redis.Redis) -> None:
    """The message given back runs once, SUCCESS, once Redis is back (on the first worker
    if it still runs, or on a standby: a worker whose broker restarted may have exited)."""
    held.standby(redis_server)
    assert held.result.get(timeout=VISIBILITY_TIMEOUT + 30) == "k"
    assert held.result.state == states.SUCCESS
    assert [run["task_id"] for run in runs(records, "k")] == [held.result.id], "executed once"


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


#: task, pool, how the limit is set (send_task options / worker environment), what happens.
TIME_LIMITS = [
    pytest.param("job_late", "prefork", {"env": {"CSB_SOFT_TIME_LIMIT": str(LIMIT)}}, GIVEN_BACK,
                 id="acks_late-prefork-soft-app-setting"),
    pytest.param("job_late", "prefork", {"options": {"time_limit": LIMIT}}, GIVEN_BACK,
                 id="acks_late-prefork-hard-message"),
    pytest.param("job_late", "gevent", {"options": {"time_limit": LIMIT}}, GIVEN_BACK,
                 id="acks_late-gevent-hard-message"),
    pytest.param("job", "prefork", {"options": {"soft_time_limit": LIMIT}}, ENDS_UNRUN,
                 id="acked-early-prefork-soft-message"),
    pytest.param("job", "threads", {"options": {"time_limit": LIMIT / 3}}, None,
                 id="acked-early-threads-no-limits"),
]


@pytest.mark.parametrize(("task", "pool", "limit", "ending"), TIME_LIMITS)
def test_a_time_limit_never_ends_the_wait_for_redis(
    task: str, pool: str, limit: dict[str, Any], ending: str | None, redis_server: RedisServer,
    redis_db: redis.Redis, make_redis: Callable[..., RedisServer], records: redis.Redis,
    client_apps: list[Celery], tmp_path: Path,
) -> None:
    """The lock Redis is the broker and stays down longer than the run's time limit.

    Where the pool enforces the limit (prefork: soft and hard; gevent: hard), the wait
    ends before it: an ``acks_late`` run gives its message back and runs once Redis is
    back; a run acknowledged at its start ends without running. The threads pool
    enforces no time limit: the run waits and executes once Redis is back.
    """
    server = lock_server_and_broker(make_redis)
    held = hold_at_the_gate(task, pool, redis_server=redis_server, lock_server=server, broker=server,
                            client_apps=client_apps, gate=tmp_path, **limit)
    outage = Outage("restart", server)
    outage.begin()
    open_the_gate(held)
    endings = [line for line in (*TIME_LIMIT_ENDS, GIVEN_BACK, ENDS_UNRUN)]
    if ending is None:
        def still_waiting() -> bool:
            assert not any(held.log_of(line) for line in endings), f"the wait ended: {held.worker.tail(20)}"
            return True

        soak(LIMIT, check=still_waiting, what="the outage, twice as long as the time limit")
    else:
        wait_for(lambda: any(held.log_of(line) for line in endings), timeout=LIMIT + 30,
                 message="the wait to end")
        assert not any(held.log_of(line) for line in TIME_LIMIT_ENDS), \
            f"the time limit ended the wait: {held.worker.tail(30)}"
        assert held.log_of(ending), held.worker.tail(30)
    assert runs(records, "k") == [], "never runs without its lock"

    outage.end()
    if ending == ENDS_UNRUN:
        assert held.log_of(f"[{held.result.id}] {ENDS_UNRUN}")
        assert runs(records, "k") == []
    else:
        ran_once_after(held, redis_server, records)


@pytest.mark.parametrize(("task", "pool"), [
    pytest.param("job_late", "prefork", id="acks_late-prefork"),
    pytest.param("job_late", "threads", id="acks_late-threads"),
    pytest.param("job_late", "gevent", id="acks_late-gevent"),
    pytest.param("job", "prefork", id="acked-early-prefork"),
])
def test_a_warm_shutdown_ends_the_wait_for_redis(
    task: str, pool: str, redis_server: RedisServer, redis_db: redis.Redis,
    make_redis: Callable[..., RedisServer], records: redis.Redis, client_apps: list[Celery], tmp_path: Path,
) -> None:
    """The lock Redis is the broker and is down; the worker is told to shut down warm
    (SIGTERM). The waiting run notices: the worker exits while Redis is still down. An
    ``acks_late`` run's message is given back and runs once Redis is back; a run
    acknowledged at its start ends without running."""
    server = lock_server_and_broker(make_redis)
    held = hold_at_the_gate(task, pool, redis_server=redis_server, lock_server=server, broker=server,
                            client_apps=client_apps, gate=tmp_path)
    outage = Outage("restart", server)
    outage.begin()
    open_the_gate(held)

    held.worker.terminate()
    wait_for(lambda: not held.worker.running, timeout=30,
             message=f"the worker to end its warm shutdown while Redis is down: {held.worker.tail(10)}")
    assert held.log_of(GIVEN_BACK if task == "job_late" else f"[{held.result.id}] {ENDS_UNRUN}"), \
        held.worker.tail(30)
    assert runs(records, "k") == [], "never runs without its lock"

    outage.end()
    if task == "job_late":
        ran_once_after(held, redis_server, records)
