"""Liveness keys, and the take-over of locks whose holder is provably dead (real Redis).

Dead = the holder's liveness key is gone **and** its lock missed its renewals
**and** stays unrenewed while the contender watches (``TAKEOVER_WAIT``). Each
test below removes one piece of that evidence and checks the lock stays.
"""

from __future__ import annotations

import json
import re
import signal
import time
from typing import Any

import pytest
import redis

from celery_singleton_beat import LockLost
from celery_singleton_beat.lease import liveness
from celery_singleton_beat.lease import lock as lock_module
from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.lease.keeper import LeaseKeeper
from celery_singleton_beat.lease.spec import TAKEOVER_WAIT
from celery_singleton_beat.task.run import HeldRun

from .support import LOCK_DB, CeleryProcess, RedisServer, start_worker, wait_for
from .support.keeps_lock import live_key_of
from .support.locking import renew, take_lock
from .support.processes import wait_until_stopped

PREFIX = "singleton"
KEY = "singleton:{t:" + "0" * 64 + "}"


def take(client: redis.Redis, task_id: str, *, boot: str, live: bool = True, **extra: Any) -> Any:
    extra.setdefault("liveness_ttl", 0.3)  # renewed every 0.1 s: a missed renewal shows at once
    return take_lock(client, KEY, 30, task="t", task_id=task_id, boot=boot, live=live, liveness_prefix=PREFIX,
                     **extra)


def wait_until_renewals_missed(client: redis.Redis) -> None:
    """Until the lock's TTL shows more than two missed renewal intervals."""
    holder = read_holder(client, KEY)
    assert holder is not None and holder.every is not None and holder.ttl is not None
    wait_for(lambda: holder.ttl * 1000 - client.pttl(KEY) > 2 * holder.every * 1000 + 50, timeout=5,
             message="the lock's renewals to be overdue")


def test_heartbeat_writes_a_key_with_its_ttl_and_marks_the_process(redis_db: redis.Redis) -> None:
    beat = liveness.Heartbeat(redis_db, PREFIX, 3.0, "w@h").start()
    try:
        key = liveness.live_key(PREFIX, liveness.boot_id())
        assert json.loads(redis_db.get(key))["node"] == "w@h"
        assert 0 < redis_db.pttl(key) <= 3000
        assert liveness.publishes_liveness()
        assert liveness.is_alive(redis_db, PREFIX, "another-boot") is False
        redis_db.set(liveness.live_key(PREFIX, "another-boot"), "{}", px=3000)
        assert liveness.is_alive(redis_db, PREFIX, "another-boot") is True
    finally:
        beat.stop()
        liveness._publishing = False  # this test process is no worker


def test_lock_of_a_dead_incarnation_is_taken_over_after_the_watch(redis_db: redis.Redis) -> None:
    first = take(redis_db, "a", boot="dead-boot")
    assert first.acquired
    wait_until_renewals_missed(redis_db)  # nobody renews: the process tree is gone
    started = time.monotonic()
    second = take(redis_db, "b", boot="other")
    assert second.acquired, "no liveness key for dead-boot and no renewal: its lock is free"
    assert time.monotonic() - started >= TAKEOVER_WAIT, "watched before taking it"
    assert second.taken_over is not None and second.taken_over.task_id == "a"
    assert read_holder(redis_db, KEY).task_id == "b"
    assert second.lease.fence > first.lease.fence
    assert first.lease.release() is False, "the dead run's late release spares the new holder"


def test_ensure_held_never_vouches_past_a_take_over(redis_db: redis.Redis) -> None:
    """A worker's run whose whole process stopped (no renewal, no liveness key): another
    worker takes its lock over after two missed renewals and the watch. From then on the
    stopped run's ``ensure_held()`` must raise. With ``lock_ttl`` 6 s and a liveness TTL
    of 20 s the take-over (2 x 2 s + 1 s) comes before the lease's end and before a
    recovery window's bound (20 / 3 + 1.5 s): only the take-over bound protects it."""
    def take_k(task_id: str, boot: str) -> Any:
        return take_lock(redis_db, KEY, 6.0, task="t", task_id=task_id, boot=boot, live=True,
                         liveness_prefix=PREFIX, liveness_ttl=20.0)

    lease = take_k("a", "stopped").lease
    assert lease is not None
    run = HeldRun(lease, None)  # never kept: no renewal, the process is stopped
    run.ensure_held()
    taker = wait_for(lambda: take_k("b", "other").lease, timeout=20, message="the stopped run's lock taken over")
    assert read_holder(redis_db, KEY).raw == taker.value
    with pytest.raises(LockLost, match="not renewed"):
        run.ensure_held()


def test_a_holder_that_renews_keeps_its_lock_without_its_liveness_key(redis_db: redis.Redis) -> None:
    """The liveness key deleted (an operator, FLUSHDB, eviction, a failover that lost it) or
    not rewritten (the worker's main process stalled) while the run renews: not dead."""
    holder = take(redis_db, "a", boot="stalled-main")
    keeper = LeaseKeeper()
    kept = keeper.keep(holder.lease)
    try:
        wait_for(lambda: kept.renewals >= 2, timeout=5, message="the holder renewing")
        assert not liveness.is_alive(redis_db, PREFIX, "stalled-main"), "its liveness key is gone"
        for i in range(3):
            assert not take(redis_db, f"b{i}", boot="other").acquired
        assert read_holder(redis_db, KEY).task_id == "a" and not kept.lost
    finally:
        keeper.forget(kept)


def test_a_holder_that_renews_while_watched_keeps_its_lock(redis_db: redis.Redis,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """After an outage every lock is overdue and liveness keys may have lapsed; a live holder
    renews as soon as Redis answers again, within the contender's watch."""
    holder = take(redis_db, "a", boot="cut-off")
    wait_until_renewals_missed(redis_db)  # Redis did not answer the holder for a while
    real_sleep = time.sleep
    watched: list[float] = []

    def sleep(seconds: float) -> None:  # the contender's watch: the holder is back meanwhile
        watched.append(seconds)
        assert renew(holder.lease)
        real_sleep(seconds)

    monkeypatch.setattr(lock_module.time, "sleep", sleep)
    assert not take(redis_db, "b", boot="other").acquired
    assert watched == [TAKEOVER_WAIT], "the contender did watch the overdue lock"
    assert read_holder(redis_db, KEY).task_id == "a"


def test_lock_of_a_live_incarnation_is_never_taken_over(redis_db: redis.Redis) -> None:
    redis_db.set(liveness.live_key(PREFIX, "live-boot"), "{}", px=30_000)
    assert take(redis_db, "a", boot="live-boot").acquired
    wait_until_renewals_missed(redis_db)
    second = take(redis_db, "b", boot="other")
    assert not second.acquired and second.holder.task_id == "a"


def test_locks_without_liveness_and_claims_wait_for_their_ttl(redis_db: redis.Redis) -> None:
    """An eager run in a web process (no liveness key) and a publish-time claim are not workers."""
    assert take(redis_db, "eager", boot="web", live=False).acquired
    assert not take(redis_db, "b", boot="other").acquired
    redis_db.delete(KEY)
    assert take(redis_db, "queued", boot="publisher", live=False, claim=True).acquired
    assert not take(redis_db, "b", boot="other").acquired


def test_a_lock_of_an_older_release_is_taken_over_on_its_liveness_key_and_the_watch(
        redis_db: redis.Redis) -> None:
    """Values written before 0.3 say neither their lease nor their renewal interval: a
    missing liveness key and no renewal during the watch decide, as before."""
    old = ('{"v":1,"token":"t","task":"t","task_id":"old","node":"n@h","pid":1,"boot":"gone",'
           '"at":1.0,"claim":false,"live":true,"fence":7}')
    redis_db.set(KEY, old, px=30_000)
    taken = take(redis_db, "new", boot="other")
    assert taken.acquired and taken.taken_over is not None and taken.taken_over.fence == 7


def test_a_worker_paused_past_its_liveness_ttl_logs_how_long_it_went_unrenewed(
        redis_server: RedisServer, names: str, processes: list[CeleryProcess]) -> None:
    """A worker's main process stopped (SIGSTOP: a paused VM, a starved machine) until its
    liveness key (TTL 1 s) expired, then resumed: its heartbeat logs the key found expired
    with the seconds since its last successful renewal, at least the TTL and at least the
    time it was stopped: what tells a reader the worker was paused, not Redis at fault."""
    settings = {"singleton_liveness_ttl": 1.0}
    worker = start_worker(redis_server, "tests.apps.adversary_slots_app", f"paused-{names}", concurrency=1,
                          env={"CSB_ADV_QUEUE": f"paused-{names}", "CSB_ADV_SETTINGS": json.dumps(settings)})
    processes.append(worker)
    key, locks = live_key_of(worker), redis_server.client(LOCK_DB)
    wait_for(lambda: locks.exists(key), timeout=10, message="the worker's liveness key")
    worker.signal(signal.SIGSTOP)
    try:
        wait_until_stopped(worker.pid)
        stopped = time.monotonic()  # its last renewal was sent before this
        wait_for(lambda: not locks.exists(key), timeout=30, message="the liveness key to expire")
        resumed = time.monotonic()  # before SIGCONT: its next write comes after this
    finally:
        worker.signal(signal.SIGCONT)
    line = worker.wait_for_line("liveness key", "had expired", timeout=30)
    found = re.search(r"liveness key (\S+) had expired \(last renewed ([\d.]+) s ago, TTL ([\d.]+) s\): "
                      r"this worker counted as dead", line)
    assert found and found[1] == key, line
    ago, ttl = float(found[2]), float(found[3])
    assert ttl == 1.0 and ago >= ttl, line
    assert ago + 0.05 >= resumed - stopped, f"stopped {resumed - stopped:.2f} s: {line}"  # 0.05: %.1f rounding
    wait_for(lambda: locks.exists(key), timeout=10, message="the liveness key written again")
