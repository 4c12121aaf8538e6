"""A release that gets no answer is sent again until it runs.

A run's release (compare-and-delete of its lock, plus the done marker of an
``acks_late`` run) can meet a lock Redis that does not run it: ``-BUSY`` while
another client's script runs, writes paused past the socket timeout, a cut
connection. Sent once and given up on, the lock stayed until its TTL (every later
run of the key skipped meanwhile) and the done marker was never written, so a copy
of the message delivered again (its acknowledgement lost with a broker restart or
a worker crash) ran the completed task a second time. The release is idempotent
(it deletes only this run's own value; the marker is this task id's), so the
process's keeper sends it again until it runs or the lease it belonged to would
have expired.

A real worker of ``tests.apps.order_app``: broker, results and records on the
session's redis-server, locks on a redis-server of their own, which another
client's script keeps busy while the run ends.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from types import ModuleType

import redis

from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.lease.holder import done_key
from celery_singleton_beat.lease.keeper import LeaseKeeper
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec

from .support import RedisServer, start_worker, wait_for

APP = "tests.apps.order_app"



def test_a_release_answered_busy_runs_once_the_server_answers(
    order: ModuleType, redis_server: RedisServer, make_redis: Callable[..., RedisServer],
    records: redis.Redis, busy_script: Callable[[RedisServer], Callable[[], None]],
) -> None:
    """An ``acks_late`` run ends while the lock Redis answers ``-BUSY``: its result reaches
    the caller, and once the script is killed the lock is freed and the done marker
    written, long before the lock's TTL (30 s) would have freed it. A copy of the same
    message delivered again (as after a lost acknowledgement) then ends without running."""
    lock_server = make_redis()
    locks = lock_server.client()
    worker = start_worker(redis_server, APP, "w", concurrency=1, env={"CSB_LOCK_REDIS": lock_server.url(0)})
    records.set("hold:k", "1")
    result = order.late.apply_async(("k",), {"note": "run"})
    wait_for(lambda: records.get("running:k"), timeout=30, message="the run holding its lock")
    key = order.late.singleton_key(("k",), {})
    holder = read_holder(locks, key)
    assert holder is not None and holder.task_id == result.id

    kill = busy_script(lock_server)
    records.delete("hold:k")
    assert result.get(timeout=30) == "k", "the run's result reached its caller"
    wait_for(lambda: "BUSY" in worker.output(), timeout=30, message="the release answered -BUSY")
    assert locks_busy_then_free(locks, key, kill, result.id)

    order.late.apply_async(("k",), {"note": "copy"}, task_id=result.id)  # the same message again
    assert order.step.apply_async(("after",)).get(timeout=30) == "after"  # one process, in order: the copy is behind
    runs = [json.loads(item)["note"] for item in records.lrange("runs:k", 0, -1)]
    assert runs == ["run"], "the copy of the completed run did not run"


def locks_busy_then_free(locks: redis.Redis, key: str, kill: Callable[[], None], task_id: str) -> bool:
    """Kill the script, then wait for the release to run: the lock gone, the done marker there."""
    kill()
    wait_for(lambda: locks.exists(done_key(key, task_id)), timeout=20,
             message="the done marker written once the lock Redis answers (never, if the release is not sent again)")
    assert not locks.exists(key), "the lock freed by the same release"
    return True


# -- the keeper's side, in this process


def busy_lease(make_redis: Callable[..., RedisServer], ttl: float) -> tuple[RedisServer, redis.Redis, Lease]:
    """A lease of ``ttl`` seconds taken in this process on a redis-server of its own."""
    server = make_redis()
    locks = server.client()
    lease = acquire(locks, "singleton:{retry:k}", LockSpec(task="retry", ttl=ttl), "run-1").lease
    assert lease is not None
    return server, locks, lease


def test_the_done_marker_is_still_sent_after_the_lease_ended(
    make_redis: Callable[..., RedisServer], busy_script: Callable[[RedisServer], Callable[[], None]],
) -> None:
    """Redis stays busy past the end of the run's lease (1 s): the lock expires by itself,
    but the done marker is still owed to a copy of the message delivered later, so the
    keeper goes on sending the release, and writes the marker once Redis answers. It
    sends it once per lease, however many times it is handed over."""
    server, locks, lease = busy_lease(make_redis, ttl=1.0)
    kill = busy_script(server)
    keeper = LeaseKeeper()
    pending = keeper.retry_release(lease, done_ttl=60.0)
    assert keeper.retry_release(lease, done_ttl=60.0) is pending, "one pending release per lease"
    wait_for(lambda: time.monotonic() > lease.valid_until and pending.attempts >= 3, timeout=20,
             message="the lease over, the release refused -BUSY several times")
    assert pending.active, "still sent again after the lease ended (its done marker is owed)"
    kill()
    wait_for(lambda: not pending.active, timeout=20, message="the release sent once Redis answers")
    assert locks.exists(done_key("singleton:{retry:k}", "run-1")), "the done marker written"
    assert not keeper.pending_releases


def test_a_process_that_ends_keeps_sending_its_pending_release_for_a_few_seconds(
    make_redis: Callable[..., RedisServer], busy_script: Callable[[RedisServer], Callable[[], None]],
) -> None:
    """A pool process ends (``worker_process_shutdown``) right after a release answered
    ``-BUSY``: its last sending is not a single attempt, but tries until Redis answers,
    for a few seconds at most (here Redis answers once the script is killed, after the
    second attempt)."""
    server, locks, lease = busy_lease(make_redis, ttl=30.0)
    kill = busy_script(server)
    keeper = LeaseKeeper()
    pending = keeper.retry_release(lease, done_ttl=60.0)
    ending = threading.Thread(target=keeper.send_pending_releases, kwargs={"patience": 30.0})
    ending.start()
    wait_for(lambda: pending.attempts >= 2, timeout=20, message="the ending process sending it again")
    kill()
    ending.join(30)
    assert not ending.is_alive() and not pending.active
    assert locks.exists(done_key("singleton:{retry:k}", "run-1")), "the done marker written before the end"
    assert not locks.exists("singleton:{retry:k}"), "the lock freed"
