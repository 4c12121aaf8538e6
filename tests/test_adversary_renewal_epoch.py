"""Attacks on a renewal that finds its own lock on a server that may hold an older copy of the
data (an RDB snapshot, a promoted replica), against real redis-servers, by a reviewer who
did not write it.

A renewal compares the whole value and extends the lock when it finds the lease's own
value, whatever the server lost since the lease was last confirmed; it is recorded under
the epoch the process had when it was sent. A rule that held such a renewal to the
put-back's timing rule (else the lock was given up) was tried and removed: the taker,
live, usually renews first and was told lost all the same, and live holders lost their
locks after restarts and failovers slower than a take-over's reach. A "process" is a
client with a ``LockServer`` memory of its own (``test_adversary_putback.process``);
leases are renewed as the keeper does.

Open breaks (``xfail(strict=True, raises=AssertionError)``: the assertion is the promise; a
scenario not reached fails through ``pytest.fail``; a promoted replica's copy is in
``test_adversary_renewal_failover``):

* ``test_the_taker_renews_first_after_a_snapshot``: ``a`` stops, ``b`` takes its lock over,
  the server comes back from a snapshot holding ``a``'s lock. ``b`` is live and renews at
  once: it finds ``a``'s value (held by another) and is told lost; ``a`` resumes and renews
  its copy: the lower fence holds the key after the higher one vouched for it.
* ``test_a_taker_that_ended_before_a_snapshot_restart``: ``b`` took ``a``'s lock over and its
  run ended before the crash; the snapshot brings ``a``'s lock back and ``a`` renews it: the
  lower fence passes ``ensure_held()`` after the higher one's run.
* ``test_a_renewal_on_the_old_primary_after_a_promotion_was_noticed[before the renewal]``:
  a live holder's renewal answered by the old primary, sent after another thread of its
  process reached the promoted replica, is recorded under the grown epoch: once the process
  follows to the replica, which never had the lock, it may not put it back (the epoch is
  the process's, not that of the connection that answered).

Broke and fixed (each failed before its fix):

* ``test_a_late_put_back_while_the_taker_still_vouches``: the late put-back comes
  ``LATE_PUT_BACK`` before the window closes, while the grace of a taker that renewed right
  before the crash (and is late renewing again) still ran: both passed ``ensure_held()``.
  ``LockSpec.grace`` now ends ``LATE_PUT_BACK`` before the window a restart right after the
  renewal would open.

Held (each asserts it reached the path it names; failovers of a replica, Sentinel and
Cluster in ``test_adversary_renewal_failover``):

* ``test_a_renewal_on_the_old_primary_after_a_promotion_was_noticed[during the renewal]``:
  a loss another thread notices while the renewal is on its way does not date it.
* ``test_a_live_holder_keeps_its_lock_across_a_snapshot_restart``: the keeper's renewal
  notices the restart and renews the snapshot's copy; later ones are recorded in the new
  epoch.
* ``test_a_live_holder_keeps_its_lock_across_a_slow_snapshot_restart``: a 3 s restart
  (liveness 1.5 s) dates the loss past ``put_back_until``; the renewal finds the lock
  intact and keeps it within the window, never told lost; another process's acquisition
  during the window waits and finds the key held.
* ``test_a_renewal_late_in_the_window_after_a_slow_snapshot_restart``: the same, reached
  only in the window's last half second (a keeper busy with thousands of leases).
* ``test_a_failover_of_another_cluster_shard``: another shard's failover grows the
  process's epoch; a holder paused past a take-over's reach renews its lock on its own
  shard, which lost nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from redis.crc import key_slot

from celery_singleton_beat.connection.client import redis_from_url
from celery_singleton_beat.lease.commands import look_request
from celery_singleton_beat.lease.executor import execute
from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper
from celery_singleton_beat.lease.kept import Later
from celery_singleton_beat.lease.lease import LATE_PUT_BACK, Lease
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.server import LockServer, server_of
from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer, soak, wait_for
from .support.breaks import documented_break
from .support.locking import renew
from .support.topologies import cluster_shard, fail_over_shard, start_cluster
from .test_adversary_putback import (
    KEY,
    Switch,
    breaks,
    in_another_thread,
    process,
    promoted_replica,
    reached,
    spec,
    take_over,
    vouched,
)


def take(client: Any, key: str, lock: LockSpec, task_id: str, what: str) -> Lease:
    """Acquire ``key`` for ``task_id``; the scenario is not reached if it is not won."""
    lease = acquire(client, key, lock, task_id).lease
    if lease is None:
        pytest.fail(f"scenario not reached: {what}")
    return lease


def held_now(kept: KeptLease) -> bool:
    """What ``ensure_held()`` checks on a kept lease."""
    return not kept.lost and vouched(kept.lease)


def late_put_back(keeper: LeaseKeeper, kept: KeptLease) -> bool:
    """Renew ``kept`` as the keeper's thread does, waiting for a put-back deferred to the end of
    the recovery window (:class:`.kept.Later`); True if the lease holds in the end."""
    outcome = keeper.renewer.settle(kept, kept.lease.renew_once(), None)
    if isinstance(outcome, Later):
        at = outcome.at
        wait_for(lambda: time.monotonic() >= at, timeout=30, interval=0.01, message="the late put-back's time")
        outcome = keeper.renewer.settle(kept, kept.lease.renew_once(), None)
    return outcome is True


class PutBacks:
    """Records each put-back of ``lease`` (the keeper's write of a lock the server lost)."""

    def __init__(self, lease: Lease) -> None:
        self.count = 0
        write = lease.put_back

        def recorded(*args: Any, **kwargs: Any) -> bool:
            self.count += 1
            return write(*args, **kwargs)

        lease.put_back = recorded  # type: ignore[method-assign]


# ---------------------------------------------------------------------------- broke


@breaks("a stopped holder renews a snapshot's copy of its lock after a take-over; the live taker, "
        "renewing first, finds that copy and is told lost")
def test_the_taker_renews_first_after_a_snapshot(make_redis: Callable[..., RedisServer]) -> None:
    """An RDB snapshot is taken while ``a`` holds ``k``; ``a`` stops, ``b`` takes ``k`` over
    (higher fence); the server crashes and comes back from the snapshot: ``a``'s lock. ``b``
    is live: its keeper renews every lease as soon as its process notices the loss, while
    ``a`` is still stopped. ``b`` finds ``a``'s value, held by another: its run is told lost.
    ``a`` resumes: its renewal finds its own value and extends it, and ``a`` vouches for
    ``k`` with the lower fence. Fix: a renewal under a grown epoch that finds another's
    value, where that value is the one the taker took over, must not be a loss (it needs
    the fence in the value, or the taken-over value remembered by the lease) -- replace it
    instead; and a stopped holder must not renew a copy it cannot vouch for up to the loss
    (giving it up alone was tried: it cost live holders their locks in slow restarts)."""
    server = make_redis()
    mark_in_use(server.client())
    a, b, direct = process(server.port), process(server.port), server.client()
    keeper = LeaseKeeper()
    held = take(a, KEY, spec("a-boot"), "a", "a took k")
    direct.save()
    taker = take_over(b, spec("b-boot"))
    server.restart()
    reached(direct.get(KEY) == held.value.encode(), "the snapshot brought a's lock back")
    kept_a, kept_b = KeptLease(held, None), KeptLease(taker, None)
    b_kept = keeper.renew(kept_b)
    reached(server_of(b).epoch == 1 and server_of(a).epoch == 0, "b's process noticed the restart first")
    a_holds = late_put_back(keeper, kept_a)
    reached(server_of(a).epoch == 1 and direct.get(KEY) == held.value.encode(),
            "a's renewal found the restart and its own value")
    with documented_break():
        assert b_kept or not a_holds, (f"a (fence {held.fence}) holds k again after b (fence {taker.fence}) "
                                       "vouched for it: b was told lost by the snapshot's copy of a's lock")


@breaks("a stopped holder renews a snapshot's copy of its lock after the taker's run ended: "
        "the lower fence after the higher")
def test_a_taker_that_ended_before_a_snapshot_restart(make_redis: Callable[..., RedisServer]) -> None:
    """``a`` takes ``k``; a snapshot is taken; ``a`` stops; ``b`` takes ``k`` over and its run
    ends (released). The server crashes and comes back from the snapshot: ``a``'s lock.
    ``a`` resumes: its renewal finds its own value and extends it, and ``a`` vouches for
    ``k`` with fence 1 after ``b``'s run with fence 2. (Giving the copy up would not be
    enough: ``a`` would then put its lock back as the window closes, as after an empty
    restart, the late put-back being what lets a live holder survive a slow restart.)
    Fix: needs a way to know a take-over happened (a fence counter, or the take-over's
    mark, that survives the loss in another store)."""
    server = make_redis()
    mark_in_use(server.client())
    a, b, direct = process(server.port), process(server.port), server.client()
    held = take(a, KEY, spec("a-boot"), "a", "a took k")
    direct.save()
    taker = take_over(b, spec("b-boot"))
    reached(taker.fence > held.fence and taker.release(), "b's run (the higher fence) ended")
    server.restart()
    reached(direct.get(KEY) == held.value.encode(), "the snapshot brought a's lock back")
    kept = KeptLease(held, None)
    holds = late_put_back(LeaseKeeper(), kept)
    reached(server_of(a).epoch == 1, "a's renewal found the restart")
    with documented_break():
        assert not (holds and held_now(kept)), (f"a (fence {held.fence}) vouches for k after b's run (fence "
                                                f"{taker.fence}) ended")


@pytest.mark.parametrize("noticed", [
    "during the renewal",
    pytest.param("before the renewal", marks=breaks(
        "a renewal answered by the old primary is recorded under the epoch another connection's promotion raised")),
])
def test_a_renewal_on_the_old_primary_after_a_promotion_was_noticed(
        make_redis: Callable[..., RedisServer], noticed: str) -> None:
    """A replica is promoted while the old primary goes on taking writes (its sentinels have
    not demoted it yet). ``a`` is live and holds ``k`` on the old primary, taken after the
    promotion (the replica never had it). Another thread of ``a``'s process reaches the
    promoted replica: the epoch grows. ``a``'s keeper renews on its connection to the old
    primary, which finds ``k`` there. Noticed during the request, the promotion does not
    date the renewal (recorded under the epoch read before it): once ``a``'s process follows
    the address to the promoted replica, ``a`` puts its lock back. Noticed before it, the
    renewal is recorded under the new epoch, "after" the loss, and ``a`` may neither put it
    back nor put it back late: a live holder is told lost in a plain failover. Fix: the
    epoch a renewal is confirmed under must be that of the connection that answered it
    (per connection, or per server run id), not the process's latest."""
    old, replica = promoted_replica(make_redis)
    address = Switch(old.port)
    a = process(address.port)
    held = take(a, KEY, spec("a-boot"), "a", "a took k on the old primary")
    execute(a, KEY, lambda info: look_request(KEY), pooled=True)  # a pooled connection to the old primary

    def other_thread_follows() -> None:
        address.upstream_port = replica.port
        in_another_thread(a)

    if noticed == "before the renewal":
        other_thread_follows()
    else:
        build = held.renewal_request

        def noticing(info: Any) -> Any:
            if server_of(a).epoch == 0:
                other_thread_follows()
            return build(info)

        held.renewal_request = noticing  # type: ignore[method-assign]
    kept = KeptLease(held, None)
    keeper = LeaseKeeper()
    reached(keeper.renewer.settle(kept, held.renew_once(), None) is True and server_of(a).epoch == 1
            and old.client().get(KEY) == held.value.encode(),
            "the old primary renewed k after a's process noticed the promotion")
    address.switch(replica.port)
    with documented_break():  # "before the renewal"
        assert late_put_back(keeper, kept), "a live holder lost its lock in a failover"
        assert replica.client().get(KEY) == held.value.encode()




@pytest.mark.parametrize("data", ["from a snapshot without k", "empty"])
def test_a_late_put_back_while_the_taker_still_vouches(make_redis: Callable[..., RedisServer], data: str) -> None:
    """``a`` takes ``k`` and stops; ``b`` takes it over and renews; the server crashes right
    after and comes back without ``k`` (from a snapshot taken before ``a`` took it, or
    empty). ``a``'s process notices at once; ``b``'s keeper is late (a pause shorter than
    its grace). ``a`` puts its lock back as the window closes, ``LATE_PUT_BACK`` (0.5 s)
    before its end, while ``b``'s grace, which counted on no other holder before the window
    of a restart right after its renewal had closed, still ran: ``ensure_held()`` passed for
    both. Fixed: ``LockSpec.grace`` is at most the window less ``LATE_PUT_BACK``."""
    server = make_redis()
    mark_in_use(server.client())
    a, b, direct = process(server.port), process(server.port), server.client()
    if data != "empty":
        direct.save()
    held = take(a, KEY, spec("a-boot"), "a", "a took k")
    taker = take_over(b, spec("b-boot"))
    reached(renew(taker), "b renewed")
    server.restart()
    reached(direct.get(KEY) is None and (data == "empty") == (direct.dbsize() == 0),
            f"the server came back {data}")
    kept = KeptLease(held, None)
    keeper = LeaseKeeper()
    outcome = keeper.renewer.settle(kept, held.renew_once(), None)
    reached(isinstance(outcome, Later), "a's put-back waits for the end of the window")
    reached(server_of(a).lost_by < taker.confirmed_at + LATE_PUT_BACK,
            "the restart came within LATE_PUT_BACK of b's renewal")
    assert isinstance(outcome, Later)
    at = outcome.at
    wait_for(lambda: time.monotonic() >= at, timeout=30, interval=0.01, message="the late put-back's time")
    put_back = keeper.renewer.settle(kept, held.renew_once(), None) is True
    reached(put_back, "a put its lock back as the window closes")
    assert not (vouched(held) and vouched(taker)), (f"a (fence {held.fence}) and b (fence {taker.fence}) both "
                                                    "pass ensure_held()")


# ---------------------------------------------------------------------------- held


def test_a_live_holder_keeps_its_lock_across_a_snapshot_restart(make_redis: Callable[..., RedisServer]) -> None:
    """A live holder's lock is in the snapshot; the server restarts quickly from it. The keeper
    thread's renewals find the lock there and extend it: the process notices the restart,
    a renewal is recorded in the new epoch, no put-back is needed, never told lost."""
    server = make_redis()
    mark_in_use(server.client())
    a, direct = process(server.port), server.client()
    held = take(a, KEY, spec("a-boot"), "a", "a took k")
    direct.save()
    put_backs = PutBacks(held)
    keeper = LeaseKeeper()
    kept = keeper.keep(held)
    try:
        wait_for(lambda: kept.renewals >= 1, timeout=10, message="a renewal")
        server.restart()
        wait_for(lambda: held.epoch == 1 or kept.lost, timeout=10, message="a renewal recorded in the new epoch")
        reached(server_of(a).epoch == 1, "the keeper's renewals noticed the restart")
        renewals = kept.renewals
        wait_for(lambda: kept.renewals > renewals + 2 or kept.lost, timeout=10, message="later renewals")
        assert not kept.lost, f"a live run lost its lock in a snapshot restart: {kept.lost_reason}"
        assert put_backs.count == 0, "the renewal found the snapshot's copy: nothing to put back"
        assert direct.get(KEY) == held.value.encode()
    finally:
        keeper.forget(kept)


def test_a_live_holder_keeps_its_lock_across_a_slow_snapshot_restart(
        make_redis: Callable[..., RedisServer]) -> None:
    """Liveness 1.5 s: renewals every 0.5 s, a take-over possible 2 s after one. The snapshot
    holds the live holder's lock; the server crashes just before a renewal and is back from
    the snapshot 3 s later: the loss is dated by the new server's start, past
    ``put_back_until``. The keeper's renewal finds the lock intact and extends it (no
    put-back, at once or late); the run is never told lost, and another process acquiring
    meanwhile waits for the window and finds the key held. (A rule that gave such a copy up
    unless the lease could vouch for it up to the loss made this holder put it back as the
    window closed, and a busy keeper lose it.)"""
    server = make_redis()
    mark_in_use(server.client())
    a, b, direct = process(server.port), process(server.port), server.client()
    held = take(a, KEY, spec("a-boot", ttl=60.0), "a", "a took k")
    put_backs = PutBacks(held)
    keeper = LeaseKeeper()
    kept = keeper.keep(held)
    other: list[Lease | None] = []
    try:
        wait_for(lambda: kept.renewals >= 1, timeout=10, message="a renewal")
        direct.save()
        last = held.confirmed_at
        wait_for(lambda: time.monotonic() > last + held.renew_every - 0.1, timeout=10, message="the next renewal near")
        server.kill()
        soak(3.0, check=lambda: not kept.lost, what="the downtime")
        server.start()
        thread = threading.Thread(target=lambda: other.append(acquire(b, KEY, spec("b-boot"), "b").lease))
        thread.start()
        wait_for(lambda: kept.lost or held.epoch == 1, timeout=20, message="a renewal in the new epoch")
        thread.join(30)
        reached(server_of(a).epoch == 1 and server_of(a).lost_by >= last + held.spec.takeover_after,
                "the loss was dated past a's put_back_until")
        assert not kept.lost, f"a live run lost its lock in a slow restart from a snapshot: {kept.lost_reason}"
        assert put_backs.count == 0, "the renewal found the snapshot's copy and kept it: nothing to put back"
        assert other == [None], "another process acquired k while the live holder kept it"
        assert direct.get(KEY) == held.value.encode()
    finally:
        keeper.forget(kept)


def test_a_renewal_late_in_the_window_after_a_slow_snapshot_restart(make_redis: Callable[..., RedisServer]) -> None:
    """Liveness 1.5 s. The server crashes and is back from a snapshot holding ``a``'s lock after
    ``a``'s ``put_back_until`` (a slow restart, as in a Sentinel failover slower than a
    take-over's reach: the promoted replica has every lock). ``a``'s process notices at
    once, but its keeper gets to ``k`` only in the window's last half second (busy: thousands
    of leases, or a GIL-bound task), still inside the window, as every live holder must.
    The renewal finds the lock intact and extends it. (A rule that gave such a copy up
    unless the lease could vouch for it up to the loss lost it here, too late for the late
    put-back: 113 to 3,000 of 3,000 leases across a 3 s restart, measured; none without.)"""
    server = make_redis()
    mark_in_use(server.client())
    a, direct = process(server.port), server.client()
    held = take(a, KEY, spec("a-boot", ttl=60.0), "a", "a took k")
    direct.save()
    server.kill()
    wait_for(lambda: time.monotonic() > held.put_back_until, timeout=10, interval=0.01,
             message="the downtime past a's put_back_until")
    server.start()
    in_another_thread(a)
    window = server_of(a).recovery()
    reached(server_of(a).epoch == 1 and window.open and server_of(a).lost_by >= held.put_back_until,
            "a's process noticed the restart, dated past a's put_back_until")
    wait_for(lambda: time.monotonic() >= window.until - 0.4, timeout=30, interval=0.01,
             message="the window's last half second")
    put_backs = PutBacks(held)
    kept = KeptLease(held, None)
    renewed = LeaseKeeper().renewer.settle(kept, held.renew_once(), None)
    reached(server_of(a).recovery().open, "a's renewal came inside the window")
    assert renewed is True, "a live holder renewing within the window lost the lock it found intact"
    assert put_backs.count == 0 and held.epoch == 1 and direct.get(KEY) == held.value.encode(), \
        "the renewal extended the lock it found"


@pytest.mark.timeout(180)
def test_a_failover_of_another_cluster_shard(make_redis: Callable[..., RedisServer]) -> None:
    """Redis Cluster, 3 primaries with a replica each. ``a`` takes ``k`` on shard 1 and stops
    past a take-over's reach; no one takes it over. Shard 2 fails over (``CLUSTER FAILOVER``:
    nothing lost); another thread of ``a``'s process reaches it: the epoch grows, the loss
    dated now. The window closes; ``a`` resumes: its renewal finds its own value on shard 1,
    which lost nothing, and extends it (the epoch and the loss are the process's, not the
    shard's: a rule judging such a renewal by them gave this lock up)."""
    cluster = start_cluster(primaries=3, replicas=1)
    try:
        for node in cluster.primaries():
            mark_in_use(node)
        a = redis_from_url(cluster.url)
        a.csb_server = LockServer("singleton", 1.5)  # type: ignore[union-attr]
        home, _ = cluster_shard(cluster, key_slot(KEY.encode()))
        other = next(key for key in (f"singleton:{{o{i}}}" for i in range(100))
                     if cluster_shard(cluster, key_slot(key.encode()))[0] is not home)
        execute(a, other, lambda info: look_request(other))
        held = take(a, KEY, spec("a-boot"), "a", "a took k on its shard")
        wait_for(lambda: time.monotonic() > held.put_back_until, timeout=10, interval=0.01,
                 message="k past a take-over's reach")
        fail_over_shard(cluster, key_slot(other.encode()))
        in_another_thread(a, other)
        reached(server_of(a).epoch == 1 and server_of(a).lost_by >= held.put_back_until,
                "a's process found shard 2 failed over, past a's put_back_until")
        wait_for(lambda: not server_of(a).recovery().open, timeout=30, message="the window closed")
        reached(cluster_shard(cluster, key_slot(KEY.encode()))[0] is home, "k's shard did not fail over")
        put_backs = PutBacks(held)
        renewed = renew(held)
        assert renewed, "a gave up a lock its shard never lost, which no one had taken over"
        assert put_backs.count == 0 and held.epoch == 1 and home.client().get(KEY) == held.value.encode(), \
            "the renewal extended the lock on its shard, recorded under the grown epoch"
    finally:
        cluster.stop()
