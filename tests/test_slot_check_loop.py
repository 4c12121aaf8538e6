"""A worker's check of a beat slot message runs off its main loop.

The worker looks at every message carrying a beat slot claim before it accepts it
(:mod:`celery_singleton_beat.task.slot_delivery`). That check used to run in Celery's
main loop: the loop that also hands messages to the pool, reads the pool's results and
sends the acknowledgements of ``acks_late`` runs (a threads pool's runs schedule theirs
on that loop). A lock Redis that does not answer (writes paused, another client's
script, a stalled connection) held the whole loop for the lock connection's socket
timeout. In a chaos run (standalone, seed 3, task 6b810a8d) an ``acks_late`` run on a
threads worker ended while the lock Redis was paused: its release went unanswered, and
its acknowledgement waited behind the check of a retried beat slot message the loop had
just taken; the worker was SIGKILLed 0.55 s later, so the message came back without a
done marker and ran a second time.

The first test showed the stall (a strict ``xfail`` on the code that checked in the
loop); the check now runs on a thread of the worker connection's own and its outcome
comes back to the loop. The other tests pin what that must keep: slot messages run in
the order they arrived, a connection that goes while a check is under way leaves the
message to the broker (it runs once, on the new connection), and messages waiting for
their check do not take the prefetch place of other tasks. Each of them, except the
variant with the lock Redis stopped (a refused connection never blocked the loop), failed
on the old code: the loop waited for the lock Redis, so the plain task sent after the slot
messages never came back.

Real workers of ``tests.apps.order_app``, broker and results on the session's
redis-server, the locks on a redis-server of the test's own whose writes it pauses (the
slot check is a script: a write). The lock connections' socket timeout is long (120 s),
so a loop that waits for the lock Redis is still waiting when the test gives up.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from uuid import uuid4

import pytest
import redis

from celery_singleton_beat.task.slot_delivery import CLAIM_HEADER, ENTRY_HEADER, INSTANCE_HEADER, SLOT_HEADER

from .support import RECORD_DB, CeleryProcess, RedisServer, queue_drained, soak, start_worker, wait_for

APP = "tests.apps.order_app"
#: The lock connections' socket timeout in the worker: longer than any wait below.
SOCKET_TIMEOUT = 120.0
#: The queue of order_app's tasks.
QUEUE = "celery"
HOLDING = "holding the message until Redis answers (fail closed)"
HELD_BEHIND = "waits for Redis behind"


def lock_worker(redis_server: RedisServer, lock_server: RedisServer, name: str, concurrency: int,
                **settings: object) -> CeleryProcess:
    """A prefork worker of order_app (prefetch multiplier 1) whose locks are on ``lock_server``."""
    env = {"CSB_LOCK_REDIS": lock_server.url(2), "CSB_LOCK_SOCKET_TIMEOUT": str(SOCKET_TIMEOUT)}
    if settings:
        env["CSB_ORDER_SETTINGS"] = json.dumps(settings)
    return start_worker(redis_server, APP, name, concurrency=concurrency, env=env)


def send_slot(order: ModuleType, key: str, note: str) -> str:
    """Send a beat slot message (a slot of its own, from one beat) of ``noted(key, note)``."""
    entry, slot = f"e-{uuid4().hex[:8]}", "2026-12-03T00:45:26Z"
    headers = {CLAIM_HEADER: f"csb:{{beat:{entry}}}:{slot}", INSTANCE_HEADER: "vm:1:abcdef",
               SLOT_HEADER: slot, ENTRY_HEADER: entry}
    task_id = str(uuid4())
    order.app.send_task(f"{APP}.noted", (key, note), task_id=task_id, headers=headers)
    return task_id


def noted(redis_server: RedisServer, key: str) -> list[str]:
    """The notes of ``key``'s runs, in run order."""
    return [raw.decode() for raw in redis_server.client(RECORD_DB).lrange(f"noted:{key}", 0, -1)]


@contextmanager
def writes_paused(server: RedisServer) -> Iterator[None]:
    """The lock Redis takes no writes (reads are answered) while the block runs."""
    admin = server.client()
    admin.execute_command("CLIENT", "PAUSE", int(SOCKET_TIMEOUT * 2000), "WRITE")
    try:
        yield
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")


def plain_runs(order: ModuleType, note: str) -> None:
    """A plain task sent now runs and returns: the worker's main loop goes on."""
    assert order.plain.delay(note).get(timeout=30) == note, "the main loop went on"


def test_checking_a_slot_message_while_the_lock_redis_takes_no_writes_does_not_stall_the_worker(
    order: ModuleType, redis_server: RedisServer, make_redis: Callable[..., RedisServer],
) -> None:
    """With the lock Redis's writes paused, a beat slot message arrives, then a plain task
    sent after it must run and return: the main loop goes on (it hands the task to the
    pool and reads its result, as it sends acknowledgements). Failed on the old code
    (strict ``xfail`` until the check left the loop)."""
    lock_server = make_redis()
    lock_worker(redis_server, lock_server, "slot-check", concurrency=2)
    plain_runs(order, "before")
    with writes_paused(lock_server):
        key = uuid4().hex
        send_slot(order, key, "slot")
        plain_runs(order, "after the slot message")
        assert noted(redis_server, key) == [], "the slot message waits for its check"
    wait_for(lambda: noted(redis_server, key) == ["slot"], timeout=30, message="the slot message to run")


def test_slot_messages_run_in_the_order_they_came_when_the_first_check_waits(
    order: ModuleType, redis_server: RedisServer, make_redis: Callable[..., RedisServer],
) -> None:
    """Two slot messages reach a worker whose lock Redis takes no writes: the first one's
    check waits, the second waits behind it (no check of its own before its turn), and a
    plain task sent after both runs meanwhile (one pool process, prefetch 1). Once writes
    are back, both run, first then second."""
    lock_server = make_redis()
    lock_worker(redis_server, lock_server, "slot-order", concurrency=1)
    plain_runs(order, "before")
    key = uuid4().hex
    with writes_paused(lock_server):
        send_slot(order, key, "first")
        send_slot(order, key, "second")
        plain_runs(order, "after the slot messages")
        assert redis_server.client(0).llen(QUEUE) == 0, "both slot messages are with the worker"
        assert noted(redis_server, key) == []
    wait_for(lambda: len(noted(redis_server, key)) == 2, timeout=30, message="both slot messages to run")
    assert noted(redis_server, key) == ["first", "second"]


@pytest.mark.parametrize("outage", ["writes-paused", "stopped"])
def test_slot_messages_waiting_for_their_check_leave_the_prefetch_place_to_other_tasks(
    order: ModuleType, redis_server: RedisServer, make_redis: Callable[..., RedisServer], outage: str,
) -> None:
    """A worker with one pool process and prefetch multiplier 1 (a prefetch count of 1)
    receives three slot messages it cannot check yet, then plain tasks: each plain task
    runs, as the waiting slot messages are counted outside the prefetch limit. The lock
    Redis takes no writes (the first check waits) or is stopped (each message is held, fail
    closed, and checked again after a back-off). When it is back, the three run in order."""
    lock_server = make_redis()
    worker = lock_worker(redis_server, lock_server, f"slot-prefetch-{outage}", concurrency=1)
    plain_runs(order, "before")
    key = uuid4().hex
    notes = ["first", "second", "third"]
    with writes_paused(lock_server) if outage == "writes-paused" else _stopped(lock_server):
        for note in notes:
            send_slot(order, key, note)
        for number in range(3):
            plain_runs(order, f"plain {number}")
        if outage == "stopped":
            wait_for(lambda: sum(1 for line in worker.output().splitlines()
                                 if HOLDING in line or HELD_BEHIND in line) == len(notes),
                     timeout=30, message="every slot message held")
        assert noted(redis_server, key) == []
    wait_for(lambda: len(noted(redis_server, key)) == len(notes), timeout=60, message="the slot messages to run")
    assert noted(redis_server, key) == notes


@contextmanager
def _stopped(server: RedisServer) -> Iterator[None]:
    server.stop()
    try:
        yield
    finally:
        server.start()


def test_a_slot_message_whose_check_is_under_way_when_the_connection_goes_runs_once(
    order: ModuleType, redis_server: RedisServer, make_redis: Callable[..., RedisServer],
) -> None:
    """The worker's broker connection is cut while the check of a slot message waits for
    the lock Redis (writes paused). The worker reconnects: the connection's gate is closed,
    and the message, unacknowledged, is the broker's again (kombu restores it as the old
    channel closes) and comes back on the new connection, whose check waits too. When
    writes are back, the old check's answer neither runs nor acknowledges anything: the
    message runs once, from the new connection's check, and the queue is left drained."""
    lock_server = make_redis()
    name = f"slot-gate-{uuid4().hex[:8]}"
    worker = lock_worker(redis_server, lock_server, "slot-gate", concurrency=1,
                         broker_transport_options={"client_name": name})
    plain_runs(order, "before")
    key = uuid4().hex
    broker = redis_server.client(0)
    with writes_paused(lock_server):
        send_slot(order, key, "slot")
        plain_runs(order, "after the slot message")  # the loop took the slot message and went on
        assert drop_broker_connection(broker, name) == 1
        worker.wait_for_log("Connection to broker lost", timeout=30)
        worker.wait_for_line("1 beat slot message(s) held for the slot check are left to the broker", timeout=30)
        plain_runs(order, "after the reconnection")
        wait_for(lambda: broker.llen(QUEUE) == 0, timeout=30, message="the slot message back with the worker")
        assert noted(redis_server, key) == []
    wait_for(lambda: noted(redis_server, key) == ["slot"], timeout=30, message="the slot message to run")
    wait_for(lambda: queue_drained(broker, QUEUE), timeout=30, message="the queue drained")
    soak(2, check=lambda: noted(redis_server, key) == ["slot"], what="one run")


def drop_broker_connection(broker: redis.Redis, name: str) -> int:
    """Kill the worker's consuming broker connection (named ``name``) while it is blocked in its
    ``BRPOP`` (``b`` among the client's flags). One killed between two ``BRPOP`` (its last
    command still reads ``brpop``) is replaced by redis-py at the next one without the worker
    noticing: no reconnection, and the test would wait for one in vain."""
    def blocked() -> list[dict[str, str]]:
        return [client for client in broker.client_list()
                if client.get("name") == name and client.get("cmd") == "brpop" and "b" in client.get("flags", "")]

    consuming = wait_for(blocked, timeout=30, message="the worker blocked in its BRPOP")
    for client in consuming:
        broker.client_kill_filter(_id=client["id"])
    return len(consuming)
