"""A Redis outage that starts just before a run's acquire never drops the run (issue 21, point 1).

Fail closed, a run whose lock Redis cannot be asked is published again with a
back-off. When the lock Redis is also the broker, that publish fails on the same
dead server, and Celery turns the failure into ``Reject(requeue=False)``: the
message was gone for good (FAILURE or PENDING forever without ``acks_late``,
unacknowledged until the visibility timeout with it). Now the run waits in the
worker and asks for its lock again: it executes once when Redis is back.

Each test: a real worker of ``tests.apps.outage_app`` and a redis-server of its
own for the locks (``--appendonly yes``: the queue survives a restart), which is
also the broker and the result store when ``lock_is_broker``; run records go to
the session's redis-server, which stays up. The run is held at a gate just
before its ``__call__``; the outage starts; the gate opens (the acquire meets the
outage); ~3 s later the server is back. The run must have executed exactly once,
end SUCCESS with its value, and never have been rejected.

Outages: ``restart`` (SIGTERM, then the same server starts again from its AOF;
connections are refused meanwhile) and ``refused-writes`` (``maxmemory`` 1 byte
with ``noeviction``: every write answers "OOM command not allowed", reads work).
All four combinations of lock Redis = broker or not and ``acks_late`` or not, on
prefork; refused writes on a lock Redis that is the broker also on threads and gevent.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from celery import Celery, states

from .support import RedisServer, soak, wait_for
from .support.outages import Held, Outage, dropped, hold_at_the_gate, open_the_gate, wait_for_output
from .support.tasks import runs

#: How long the outage lasts, counted from its start.
OUTAGE_SECONDS = 3.0
#: The broker's visibility timeout in the tests' workers (tests/support/outages.py): an
#: unacknowledged delivery comes back after it.
VISIBILITY_TIMEOUT = 10.0


def run_through_an_outage(
    kind: str, lock_is_broker: bool, task: str, pool: str, *, redis_server: RedisServer,
    make_redis: Callable[..., RedisServer], records: redis.Redis, client_apps: list[Celery], gate: Path,
) -> Held:
    """Publish one run, start the outage just before its acquire, end it ~3 s later;
    return once the run ended (or was dropped).

    When the run's delivery cannot be acknowledged (:func:`redelivered`), a standby
    worker is started once the outage is over, for the copy that comes back.
    """
    lock_server = make_redis("--appendonly", "yes", "--maxmemory-policy", "noeviction")
    held = hold_at_the_gate(task, pool, redis_server=redis_server, lock_server=lock_server,
                            broker=lock_server if lock_is_broker else redis_server, client_apps=client_apps,
                            gate=gate)
    outage = Outage(kind, lock_server)
    outage.begin()
    open_the_gate(held)

    def not_run_and_not_dropped() -> bool:
        assert runs(records, "k") == [], "the run executed without its lock"
        assert not dropped(held.worker), f"the run was dropped: {held.worker.tail(20)}"
        return True

    soak(OUTAGE_SECONDS, check=not_run_and_not_dropped, what=f"the {kind} outage")
    outage.end()
    if redelivered(kind, lock_is_broker, task):
        held.standby(redis_server)
    wait_for(lambda: dropped(held.worker) or held.result.state in states.READY_STATES, timeout=VISIBILITY_TIMEOUT + 60,
             message="the run to end once Redis is back")
    return held


def redelivered(kind: str, lock_is_broker: bool, task: str) -> bool:
    """Whether the run's delivery cannot be acknowledged: ``acks_late``, and the broker
    restarted under it. Then either the run waits in its worker and executes once Redis
    is back, and its acknowledgement is lost with the connection: the message comes back
    after the visibility timeout and must end without running (the done marker); or
    kombu 5.7's consumer exits on that broker restart ("Unrecoverable error:
    AttributeError ... 'hostname'", while restoring the unacknowledged message; a plain
    Celery ``acks_late`` task does the same), the worker stops, and the waiting run gives
    its message back (a worker that stops does not wait for Redis): it comes back after
    the visibility timeout and runs on the standby."""
    return kind == "restart" and lock_is_broker and task == "job_late"


def check_ran_once(ran: Held, redelivered: bool, redis_server: RedisServer, records: redis.Redis) -> None:
    """Executed once, SUCCESS, never rejected; in the end no copy of its message is left
    in the queue or unacknowledged, and none ran a second time."""
    assert not dropped(ran.worker), f"the run was dropped: {ran.worker.tail(20)}"
    assert ran.result.get(timeout=10) == "k"
    assert ran.result.state == states.SUCCESS
    assert [run["task_id"] for run in runs(records, "k")] == [ran.result.id], "executed once"
    if redelivered and not ran.log_of(f"[{ran.result.id}] gives its message back to the broker (the worker is "
                                      "shutting down)"):
        wait_for_output(ran.workers, f"[{ran.result.id}] already completed; this delivery of the "
                        "same message ends without running", timeout=VISIBILITY_TIMEOUT + 30)
    with ran.broker.client(0) as queue:  # kombu's Redis transport: the queue and the unacked messages
        wait_for(lambda: queue.llen("celery") == 0 and queue.hlen("unacked") == 0, timeout=10,
                 message="every delivery of the message acknowledged, no copy left in the queue")
    assert [run["task_id"] for run in runs(records, "k")] == [ran.result.id], "executed exactly once"
    assert ran.result.state == states.SUCCESS


@pytest.mark.parametrize("task", ["job", "job_late"], ids=["acked-early", "acks_late"])
@pytest.mark.parametrize("lock_is_broker", [True, False], ids=["lock-is-broker", "lock-separate"])
@pytest.mark.parametrize("kind", ["restart", "refused-writes"])
def test_an_outage_at_the_acquire_delays_the_run_and_never_drops_it(
    kind: str, lock_is_broker: bool, task: str, redis_server: RedisServer, redis_db: redis.Redis,
    make_redis: Callable[..., RedisServer], records: redis.Redis, client_apps: list[Celery], tmp_path: Path,
) -> None:
    """Prefork: the run executes once when Redis is back, whoever else lives on that server."""
    ran = run_through_an_outage(
        kind, lock_is_broker, task, "prefork", redis_server=redis_server, make_redis=make_redis,
        records=records, client_apps=client_apps, gate=tmp_path)
    check_ran_once(ran, redelivered(kind, lock_is_broker, task), redis_server, records)


@pytest.mark.parametrize("task", ["job", "job_late"], ids=["acked-early", "acks_late"])
@pytest.mark.parametrize("pool", ["threads", "gevent"])
def test_refused_writes_at_the_acquire_never_drop_the_run_on_other_pools(
    pool: str, task: str, redis_server: RedisServer, redis_db: redis.Redis,
    make_redis: Callable[..., RedisServer], records: redis.Redis, client_apps: list[Celery], tmp_path: Path,
) -> None:
    """threads and gevent (the run waits in the pool's thread or greenlet): the lock Redis
    is the broker and refuses writes (a refused write is not retried by kombu's publish,
    whatever the pool: a restart can outlast that retry or not)."""
    ran = run_through_an_outage(
        "refused-writes", True, task, pool, redis_server=redis_server, make_redis=make_redis,
        records=records, client_apps=client_apps, gate=tmp_path)
    check_ran_once(ran, redelivered("refused-writes", True, task), redis_server, records)
