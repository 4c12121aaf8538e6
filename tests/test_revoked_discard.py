"""A worker that discards a revoked message never waits for the lock Redis to do it.

Celery discards a revoked (or expired) message in the worker's main loop, the loop
that also hands messages to the pool, reads the pool's results and sends the
acknowledgements of ``acks_late`` runs. The library frees the discarded message's
publish-time claims then; done there, a lock Redis that did not answer (writes
paused, another client's script) held the whole loop for a socket timeout. In a
chaos run (standalone, seed 3) an ``acks_late`` run ended while the lock Redis's
writes were paused: its release went unanswered and its acknowledgement waited
behind such a discard; the worker was SIGKILLed 0.8 s later, so the message came
back without a done marker and ran a second time.

Real worker of ``tests.apps.order_app``, broker and results on the session's
redis-server, the locks on a redis-server of the test's own whose writes it
pauses (``CLIENT PAUSE WRITE``: reads are answered, writes and scripts wait). The
lock connections' socket timeout is long (120 s), so a loop that waited for the
lock Redis would still be waiting when the test gives up.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from uuid import uuid4

from .support import RedisServer, start_worker

APP = "tests.apps.order_app"
#: The lock connections' socket timeout in the worker: longer than any wait below.
SOCKET_TIMEOUT = 120.0


def test_discarding_a_revoked_message_while_the_lock_redis_takes_no_writes_does_not_stall_the_worker(
    order: ModuleType, redis_server: RedisServer, make_redis: Callable[..., RedisServer],
) -> None:
    """With the lock Redis's writes paused, a revoked message is discarded, then a plain
    task sent after it runs and returns: the main loop went on (it hands the task to the
    pool and reads its result). Once writes resume, the worker runs a singleton task."""
    lock_server = make_redis()
    worker = start_worker(redis_server, APP, "discards", concurrency=2,
                          env={"CSB_LOCK_REDIS": lock_server.url(2),
                               "CSB_LOCK_SOCKET_TIMEOUT": str(SOCKET_TIMEOUT)})
    revoked_id = str(uuid4())
    order.app.control.revoke(revoked_id)
    worker.wait_for_line("Tasks flagged as revoked", revoked_id, timeout=30)
    admin = lock_server.client()
    admin.execute_command("CLIENT", "PAUSE", int(SOCKET_TIMEOUT * 2000), "WRITE")
    try:
        # send_task: no publish-time claim written by the test itself (writes are paused).
        order.app.send_task(f"{APP}.step", ("k",), task_id=revoked_id)
        worker.wait_for_line("Discarding revoked task", revoked_id, timeout=30)
        after = order.plain.delay("after the discard")
        assert after.get(timeout=30) == "after the discard", "the main loop went on while writes were paused"
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    assert order.step.delay("k2", note="once writes resume").get(timeout=30) == "k2"
