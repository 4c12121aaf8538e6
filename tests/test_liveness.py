"""Liveness keys and take-over of locks held by dead worker incarnations (real Redis)."""

from __future__ import annotations

import json

import redis

from celery_singleton_beat import liveness
from celery_singleton_beat.lock import acquire, done_key, fence_key, read_holder
from celery_singleton_beat.scripts import ACQUIRE

PREFIX = "singleton"
KEY = "singleton:{t:" + "0" * 64 + "}"


def take(client: redis.Redis, task_id: str, *, boot: str, live: bool = True, **extra: object):
    return acquire(client, KEY, 30, task="t", task_id=task_id, boot=boot, live=live,
                   liveness_prefix=PREFIX, **extra)


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


def test_lock_of_a_dead_incarnation_is_taken_over(redis_db: redis.Redis) -> None:
    first = take(redis_db, "a", boot="dead-boot")
    assert first.acquired
    second = take(redis_db, "b", boot="other")
    assert second.acquired, "no liveness key for dead-boot: its lock is free"
    assert second.taken_over is not None and second.taken_over.task_id == "a"
    assert read_holder(redis_db, KEY).task_id == "b"
    assert second.lease.fence > first.lease.fence
    assert first.lease.release() is False, "the dead run's late release spares the new holder"


def test_lock_of_a_live_incarnation_is_never_taken_over(redis_db: redis.Redis) -> None:
    redis_db.set(liveness.live_key(PREFIX, "live-boot"), "{}", px=30_000)
    assert take(redis_db, "a", boot="live-boot").acquired
    second = take(redis_db, "b", boot="other")
    assert not second.acquired and second.holder.task_id == "a"


def test_locks_without_liveness_and_claims_wait_for_their_ttl(redis_db: redis.Redis) -> None:
    """An eager run in a web process (no liveness key) and a publish-time claim are not workers."""
    assert take(redis_db, "eager", boot="web", live=False).acquired
    assert not take(redis_db, "b", boot="other").acquired
    redis_db.delete(KEY)
    assert take(redis_db, "queued", boot="publisher", live=False, claim=True).acquired
    assert not take(redis_db, "b", boot="other").acquired


def test_a_replayed_acquire_recognises_its_own_attempt(redis_db: redis.Redis) -> None:
    """RedisCluster (and redis-py retries) may send the same script call twice after a lost reply."""
    args = ['{"v":1,"token":"abc","task_id":"a"', 30_000, 60_000, "", "acquired", "skipped", "", "",
            "a", 1000]
    keys = [KEY, fence_key(KEY), done_key(KEY, "a")]
    first = ACQUIRE(redis_db, keys, args)
    replay = ACQUIRE(redis_db, keys, args)
    assert first[0] == 1 and replay[0] == 1, "the replay is the same acquisition, not a conflict"
    assert replay[1] == first[1] and int(replay[2]) == int(first[2])


def test_done_marker_ends_a_later_copy_and_spares_retries(redis_db: redis.Redis) -> None:
    run = take(redis_db, "a", boot="b1")
    assert run.lease.release(done_ttl=60)
    assert redis_db.pttl(done_key(KEY, "a")) > 0
    copy = take(redis_db, "a", boot="b2", check_done=True)
    assert copy.completed and not copy.acquired
    other = take(redis_db, "z", boot="b2", check_done=True)
    assert other.acquired, "another task id is not affected by a's marker"


def test_release_can_leave_a_claim_for_a_retry(redis_db: redis.Redis) -> None:
    run = take(redis_db, "a", boot="b1")
    assert run.lease.release(claim_ttl=5)
    holder = read_holder(redis_db, KEY)
    assert holder.task_id == "a" and holder.claim and not holder.live
    assert 0 < redis_db.pttl(KEY) <= 5000
    assert take(redis_db, "a", boot="b2", adopt_claim_of="a").acquired
