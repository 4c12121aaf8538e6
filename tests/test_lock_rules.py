"""The rules a take-over rests on, each checked by its own assertion.

A lock is taken over only from a holder that is provably dead: its liveness key is
gone **and** the lock missed its renewals **and** it stays unrenewed while the
contender watches. A holder vouches for its lease (``ensure_held()``) only until the
earliest moment such a take-over could happen. Break either rule alone and the test
named after it fails on its own assertion (a live holder taken over; a run vouching
for a lock another holds), not on a timeout.
"""

from __future__ import annotations

import time

import pytest
import redis

from celery_singleton_beat.exceptions import LockLost
from celery_singleton_beat.lease.holder import done_key
from celery_singleton_beat.lease.keeper import LeaseKeeper
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.task.run import HeldRun

from .support import LOCK_DB, RedisServer, wait_for

KEY = "singleton:{rules:k}"


def worker_spec(boot: str, liveness_ttl: float = 10.0) -> LockSpec:
    """A worker's run lock (liveness published by ``boot``; take-overs allowed)."""
    return LockSpec(task="rules", ttl=30.0, boot=boot, live=True, liveness_ttl=liveness_ttl,
                    liveness_prefix="singleton")


@pytest.fixture
def locks(redis_db: redis.Redis, redis_server: RedisServer) -> redis.Redis:
    return redis_server.client(LOCK_DB)


def test_a_renewing_holder_whose_liveness_key_is_gone_is_never_taken_over(locks: redis.Redis) -> None:
    """The holder's liveness key never exists (deleted, evicted, lost in a failover, its
    main process stalled) but its keeper renews every 3.3 s (default liveness TTL):
    a contender trying all along never gets the lock."""
    holder = acquire(locks, KEY, worker_spec("holder-boot"), "holder").lease
    assert holder is not None
    keeper = LeaseKeeper()
    kept = keeper.keep(holder)
    assert not locks.exists("singleton:live:holder-boot")
    contender = worker_spec("contender-boot")
    tries = 0
    try:
        while kept.renewals < 2:  # two renewals: well past one missed interval
            result = acquire(locks, KEY, contender, f"contender-{tries}")
            tries += 1
            assert not result.acquired, f"a renewing holder was taken over after {kept.renewals} renewal(s)"
            assert result.holder is not None and result.holder.task_id == "holder"
            time.sleep(0.05)
    finally:
        keeper.forget(kept)
    assert tries > 10 and not kept.lost


def test_ensure_held_stops_vouching_before_a_take_over_can_happen(locks: redis.Redis) -> None:
    """The holder stops renewing (paused) and its liveness key is gone: a contender takes
    the lock over once the renewals are provably missed. At that moment, and already
    before it, the paused run's ``ensure_held()`` refuses."""
    spec = worker_spec("paused-boot", liveness_ttl=3.0)  # renewals every 1 s, take-over after ~3 s
    lease = acquire(locks, KEY, spec, "paused").lease
    assert lease is not None
    keeper = LeaseKeeper()
    run = keeper.keep_entry(HeldRun(lease, None))
    assert run.ensure_held() == lease.fence
    keeper.forget(run)  # no renewal from now on: the process is paused
    contender = worker_spec("contender-boot", liveness_ttl=3.0)
    taken = []

    def taken_over() -> bool:
        result = acquire(locks, KEY, contender, "contender")
        if result.acquired:
            taken.append(result)
        return bool(taken)

    wait_for(taken_over, timeout=20, interval=0.05, message="the contender to take the paused holder's lock over")
    assert taken[0].taken_over is not None and taken[0].taken_over.task_id == "paused"
    with pytest.raises(LockLost):
        run.ensure_held()
    assert not run.held


def test_a_release_sent_again_after_an_earlier_copy_ran_is_no_loss_and_leaves_the_done_marker(
    locks: redis.Redis,
) -> None:
    """A release whose reply was lost may have run: the keeper's next sending then finds the
    lock gone. That is not reported as a lost lock, and the done marker is written anyway
    (a copy of an ``acks_late`` message delivered later must find it)."""
    lease = acquire(locks, KEY, worker_spec("holder-boot"), "holder").lease
    assert lease is not None
    assert lease.release() is True  # the first sending ran; its reply never reached the run
    assert lease.release(again=True) is None, "gone after an earlier sending: unknown, not lost"
    keeper = LeaseKeeper()
    pending = keeper.retry_release(lease, done_ttl=60.0)
    wait_for(lambda: not pending.active, timeout=10, message="the keeper sending the release again")
    assert pending.attempts == 1
    assert locks.exists(done_key(KEY, "holder")), "the done marker written by the release sent again"
    assert not keeper.pending_releases


def test_a_release_sent_again_never_deletes_a_later_holders_lock(locks: redis.Redis) -> None:
    """Between the lost reply and the keeper's sending, the key was freed and taken by
    another run: the compare-and-delete leaves that run's lock alone."""
    lease = acquire(locks, KEY, worker_spec("holder-boot"), "holder").lease
    assert lease is not None and lease.release() is True
    later = acquire(locks, KEY, worker_spec("later-boot"), "later").lease
    assert later is not None
    keeper = LeaseKeeper()
    pending = keeper.retry_release(lease, done_ttl=None)
    wait_for(lambda: not pending.active, timeout=10, message="the keeper sending the release again")
    assert later.renew_once().name == "RENEWED", "the later run still holds its lock"
