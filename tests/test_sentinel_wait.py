"""A lock request that waited for a recovery window is written to the primary the
sentinels name after the wait, not to the one its connection reached before it.

An acquire borrows a connection (the pool asks the sentinels for the primary), the
connection's check may find a recovery window, and the acquire waits for it before it
writes: seconds, in which Sentinel can fail over. A primary failed over from while it
was paused, or restarted during its own failover, still takes writes until the
sentinels turn it into a replica (about ten seconds later). An acquire written there
after its wait ran beside a run that took the same key on the promoted primary (the
Sentinel chaos runs of 2026-12-03, twice: both processes waited for the same window,
then each took the key on another primary).

The wait here is the test's own: it fails the group over and makes the former primary
take writes again, deterministically, where the library would sleep.
"""

from __future__ import annotations

import pytest
import redis

from celery_singleton_beat.connection.client import redis_from_url
from celery_singleton_beat.recovery.server import LockServer
from celery_singleton_beat.recovery.window import mark_in_use
from harness.sentinel import master_address

from .support import wait_for
from .support.locking import take_lock
from .support.topologies import MASTER_NAME, start_sentinels, wait_for_new_primary

KEY = "singleton:{sentinel-wait:k}"


@pytest.mark.timeout(180)
def test_an_acquire_that_waited_for_a_window_goes_to_the_primary_named_after_the_wait() -> None:
    group = start_sentinels(down_after_ms=1000)
    try:
        old = group.master_address()
        with redis.Redis(host=old[0], port=old[1], socket_timeout=5) as primary:
            mark_in_use(primary)
        client = redis_from_url(group.url)
        server = LockServer("singleton", 1.5)
        client.csb_server = server  # type: ignore[union-attr]
        client.ping()  # the pool's connection to the current primary, checked
        waits: list[tuple[str, int]] = []

        def fail_over_while_waiting() -> float:
            """The window's wait: the sentinels promote the replica, and the former primary
            takes writes again (as one back from a pause does, until it is made a replica)."""
            if waits:
                return 0.0
            group.sentinel().execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
            wait_for_new_primary(group, old)
            wait_for(lambda: {master_address(group.sentinel(i)) for i in range(len(group.sentinel_ports))}
                     == {group.master_address()}, timeout=30, message="every sentinel names the new primary")
            with redis.Redis(host=old[0], port=old[1], socket_timeout=5) as former:
                former.execute_command("REPLICAOF", "NO", "ONE")
            waits.append(group.master_address())
            return 2.0

        server.pause = fail_over_while_waiting  # type: ignore[method-assign]
        taken = take_lock(client, KEY, 30.0, task="sentinel-wait", task_id="after-the-wait")
        assert waits, "the acquire waited (the failover happened inside its wait)"
        assert taken.lease is not None, f"the key was free: {taken.holder}"
        new = waits[0]
        with redis.Redis(host=new[0], port=new[1], socket_timeout=5) as promoted, \
                redis.Redis(host=old[0], port=old[1], socket_timeout=5) as former:
            on_former = former.get(KEY)
            assert promoted.get(KEY) == taken.lease.value.encode(), \
                f"the lock is on the primary the sentinels named after the wait (on the former one: {on_former!r})"
    finally:
        group.stop()

