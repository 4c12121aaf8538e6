"""A worker's check of a beat slot message waits for the lock Redis in the main loop.

The worker looks at every message carrying a beat slot claim before it accepts it
(:mod:`celery_singleton_beat.task.slot_delivery`), in Celery's main loop: the loop
that also hands messages to the pool, reads the pool's results and sends the
acknowledgements of ``acks_late`` runs (a threads pool's runs schedule theirs on
that loop). A lock Redis that does not answer (writes paused, another client's
script, a stalled connection) holds the whole loop for the lock connection's
socket timeout. In a chaos run (standalone, seed 3, task 6b810a8d) an ``acks_late``
run on a threads worker ended while the lock Redis was paused: its release went
unanswered, and its acknowledgement waited behind the check of a retried beat slot
message the loop had just taken; the worker was SIGKILLed 0.55 s later, so the
message came back without a done marker and ran a second time.

This test shows the stall and fails on today's code (``xfail``, strict): taking the
check off the main loop is the fix still to make. Real worker of
``tests.apps.order_app``, broker and results on the session's redis-server, the
locks on a redis-server of the test's own whose writes it pauses. The lock
connections' socket timeout is long (120 s), so a loop that waits for the lock Redis
is still waiting when the test gives up.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from uuid import uuid4

import pytest

from celery_singleton_beat.task.slot_delivery import CLAIM_HEADER, ENTRY_HEADER, INSTANCE_HEADER, SLOT_HEADER

from .support import RedisServer, start_worker

APP = "tests.apps.order_app"
#: The lock connections' socket timeout in the worker: longer than any wait below.
SOCKET_TIMEOUT = 120.0


@pytest.mark.xfail(strict=True, reason="the beat slot check runs in the worker's main loop and waits for the "
                                       "lock Redis there (holding back acks_late acknowledgements)")
def test_checking_a_slot_message_while_the_lock_redis_takes_no_writes_does_not_stall_the_worker(
    order: ModuleType, redis_server: RedisServer, make_redis: Callable[..., RedisServer],
) -> None:
    """With the lock Redis's writes paused, a beat slot message arrives, then a plain task
    sent after it must run and return: the main loop goes on (it hands the task to the
    pool and reads its result, as it sends acknowledgements)."""
    lock_server = make_redis()
    start_worker(redis_server, APP, "slot-check", concurrency=2,
                          env={"CSB_LOCK_REDIS": lock_server.url(2),
                               "CSB_LOCK_SOCKET_TIMEOUT": str(SOCKET_TIMEOUT)})
    assert order.plain.delay("before").get(timeout=30) == "before"
    admin = lock_server.client()
    admin.execute_command("CLIENT", "PAUSE", int(SOCKET_TIMEOUT * 2000), "WRITE")
    try:
        slot = "2026-12-03T00:45:26Z"
        headers = {CLAIM_HEADER: f"csb:{{beat:own-2s}}:{slot}", INSTANCE_HEADER: "vm:1:abcdef",
                   SLOT_HEADER: slot, ENTRY_HEADER: "own-2s"}
        # The slot check is a script (a write): it waits while writes are paused.
        order.app.send_task(f"{APP}.plain", ("slot",), task_id=str(uuid4()), headers=headers)
        after = order.plain.delay("after the slot message")
        assert after.get(timeout=30) == "after the slot message", "the main loop went on while writes were paused"
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
