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

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from celery import Celery, states
from celery.result import AsyncResult

from .support import CeleryProcess, RedisServer, soak, start_worker, wait_for
from .support.tasks import runs

APP = "tests.apps.outage_app"
#: How long the outage lasts, counted from its start.
OUTAGE_SECONDS = 3.0
#: The broker's visibility timeout in the tests' workers: an unacknowledged delivery comes back after it.
VISIBILITY_TIMEOUT = 10.0
#: What Celery logs when a run's message is dropped for good.
DROPPED = "reject requeue=False"

_workers = itertools.count()


@dataclass
class Outage:
    """One way the lock Redis stops working, started and ended on purpose."""

    kind: str
    server: RedisServer

    def begin(self) -> None:
        if self.kind == "restart":
            self.server.stop()  # SIGTERM: the AOF is written out, the port kept
            assert not self.server.running
        else:
            with self.server.client() as admin:
                admin.config_set("maxmemory", 1)
                with pytest.raises(redis.exceptions.OutOfMemoryError):
                    admin.set("outage:probe", "1")  # the outage is real: writes are refused

    def end(self) -> None:
        if self.kind == "restart":
            self.server.start()  # same port, same directory: the AOF is loaded
        else:
            with self.server.client() as admin:
                admin.config_set("maxmemory", 0)


@pytest.fixture
def client_apps() -> Iterator[list[Celery]]:
    """Celery apps the test publishes with; closed at its end."""
    made: list[Celery] = []
    yield made
    for app in made:
        app.close()


def dropped(worker: CeleryProcess) -> bool:
    return DROPPED in worker.output()


def wait_for_output(workers: list[CeleryProcess], text: str, timeout: float) -> None:
    """Wait until one of ``workers`` logged ``text``, whether it still runs or not (see
    :class:`Ran`: Celery's consumer may exit on a broker restart, its pool child logs on)."""
    wait_for(lambda: any(text in worker.output() for worker in workers), timeout=timeout,
             message=f"{text!r} in the log of {', '.join(worker.name for worker in workers)}")


@dataclass
class Ran:
    """What a run through an outage left: its worker (and how to start another), its
    result, the broker's server.

    ``redelivered``: the run's delivery cannot be acknowledged (``acks_late``, and the
    broker restarted under it: Celery cannot ack on the lost connection); it comes back
    after the visibility timeout and must end without running (the done marker). On
    that broker restart kombu 5.7's consumer may even exit ("Unrecoverable error:
    AttributeError ... 'hostname'", while restoring the unacknowledged message; a
    plain Celery ``acks_late`` task does the same) while the pool child finishes the
    run: a standby worker then receives the copy.
    """

    worker: CeleryProcess
    result: AsyncResult
    broker: RedisServer
    pool: str
    env: dict[str, str]
    redelivered: bool


def run_through_an_outage(
    kind: str, lock_is_broker: bool, task: str, pool: str, *, redis_server: RedisServer,
    make_redis: Callable[..., RedisServer], records: redis.Redis, client_apps: list[Celery], gate: Path,
) -> Ran:
    """Publish one run, start the outage just before its acquire, end it ~3 s later;
    return once the run ended (or was dropped)."""
    lock_server = make_redis("--appendonly", "yes", "--maxmemory-policy", "noeviction")
    broker = lock_server if lock_is_broker else redis_server
    base = f"redis://127.0.0.1:{broker.port}"
    env = {"CSB_OUTAGE_BROKER": base, "CSB_LOCK_REDIS": lock_server.url(2), "CSB_GATE": str(gate),
           "CSB_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT)}
    worker = start_worker(redis_server, APP, f"outage{next(_workers)}", pool=pool, concurrency=2, env=env)
    worker.wait_for_line("concurrency:", f"2 ({'thread' if pool == 'threads' else pool}", timeout=5)
    # Published without a result backend (Celery's Redis backend would subscribe to the
    # result at once, on the server that goes down); read by polling once it is back.
    publisher = Celery("outage-publisher", broker=f"{base}/0")
    reader = Celery("outage-reader", broker=f"{base}/0", backend=f"{base}/1")
    client_apps.extend([publisher, reader])
    result = reader.AsyncResult(publisher.send_task(f"{APP}.{task}", ("k",)).id)
    wait_for(lambda: (gate / f"waiting-{result.id}").exists(), timeout=30,
             message="the run held at the gate, just before its acquire")
    if task == "job":  # the case: acknowledged before the outage (threads and gevent ack later)
        with broker.client(0) as queue:
            wait_for(lambda: queue.hlen("unacked") == 0, timeout=10, message="Celery's early acknowledgement")

    outage = Outage(kind, lock_server)
    outage.begin()
    (gate / "open").touch()
    wait_for_output([worker], f"[{result.id}] not started, Redis unavailable", timeout=30)

    def not_run_and_not_dropped() -> bool:
        assert runs(records, "k") == [], "the run executed without its lock"
        assert not dropped(worker), f"the run was dropped: {worker.tail(20)}"
        return True

    soak(OUTAGE_SECONDS, check=not_run_and_not_dropped, what=f"the {kind} outage")
    outage.end()
    wait_for(lambda: dropped(worker) or result.state in states.READY_STATES, timeout=60,
             message="the run to end once Redis is back")
    return Ran(worker, result, broker, pool, env,
               redelivered=kind == "restart" and lock_is_broker and task == "job_late")


def check_ran_once(ran: Ran, redis_server: RedisServer, records: redis.Redis) -> None:
    """Executed once, SUCCESS, never rejected; in the end no copy of its message is left
    in the queue or unacknowledged, and none ran a second time."""
    assert not dropped(ran.worker), f"the run was dropped: {ran.worker.tail(20)}"
    assert ran.result.get(timeout=10) == "k"
    assert ran.result.state == states.SUCCESS
    assert [run["task_id"] for run in runs(records, "k")] == [ran.result.id], "executed once"
    if ran.redelivered:
        standby = start_worker(redis_server, APP, f"standby{next(_workers)}", pool=ran.pool, env=ran.env)
        wait_for_output([ran.worker, standby], f"[{ran.result.id}] already completed; this delivery of the "
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
    check_ran_once(ran, redis_server, records)


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
    check_ran_once(ran, redis_server, records)
