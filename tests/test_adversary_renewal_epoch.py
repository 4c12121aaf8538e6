"""Attacks on the renewal under a grown epoch (``Lease.settle_renewal``), against real
redis-servers, by a reviewer who did not write it.

The rule: a renewal that finds the lease's own value on a server where the process's epoch
grew since the lease was last confirmed passes the put-back's timing rule
(``Lease.may_put_back``), else the lease deletes its lock (compare-and-delete) and the
renewal counts as finding it gone (the keeper then puts back, puts back late as the window
closes, or reports the loss). A "process" is a client with a ``LockServer`` memory of its
own (``test_adversary_putback.process``); leases are renewed as the keeper does.

Open breaks (``xfail(strict=True, raises=AssertionError)``: the assertion is the promise; a
scenario not reached fails through ``pytest.fail``):

* ``test_the_taker_renews_first_after_a_snapshot``: the commit's own scenario with the
  realistic order: the taker ``b`` is live and renews at once when its process notices the
  restart, before the paused ``a`` resumes. ``b`` finds ``a``'s value (held by another) and
  is told lost; ``a`` then gives the copy up and, no one having put a lock back, puts its
  own back as the window closes: the lower fence holds the key after the higher one
  vouched for it.
* ``test_a_taker_that_ended_before_a_snapshot_restart``: ``b`` took ``a``'s lock over and
  its run ended before the crash; the server comes back from a snapshot holding ``a``'s
  lock. ``a`` gives the copy up, then puts its lock back as the window closes: the lower
  fence passes ``ensure_held()`` after the higher one's run (an empty restart does the same:
  the late put-back cannot tell a slow restart from a take-over).
* ``test_a_renewal_on_the_old_primary_after_a_promotion_was_noticed[before the renewal]``:
  a live holder's renewal answered by the old primary, sent after another thread of its
  process reached the promoted replica, is recorded under the grown epoch: once the process
  follows to the replica, which never had the lock, it may not put it back (older than the
  commit: the epoch is the process's, not that of the connection that answered).
* ``test_a_failover_of_another_cluster_shard``: another shard's failover (losing nothing)
  grows the process's epoch; a holder paused past a take-over's reach, which no one took
  over, finds its own value on a shard that lost nothing and gives it up; once the window
  has closed its run is told lost (before the commit it renewed). Same root as
  ``test_adversary_putback``'s H: the epoch and the loss are the process's, not the shard's.
* ``test_a_renewal_late_in_the_window_after_a_slow_snapshot_restart``: after a restart
  slower than a take-over's reach from a snapshot holding the lock (or a Sentinel failover
  as slow, the promoted replica holding every lock), a live holder whose keeper reaches
  the lock in the window's last half second finds it intact, gives it up and is told lost
  (before the commit it kept it). A process holding thousands of leases loses many of them.

Broke and fixed (each failed before its fix):

* ``test_a_renewal_on_the_old_primary_after_a_promotion_was_noticed[during the renewal]``
  and ``test_a_batch_whose_refusal_notices_a_second_restart``: a renewal that passed the
  rule was recorded under the epoch read after its reply (the commit's change), so a loss
  another connection noticed while it was on its way (another thread's; the delete of a
  refused lease of the same batch) counted as before it: the live holder could not put its
  lock back after that loss. It is recorded under the epoch read before its request again.
* ``test_a_late_put_back_while_the_taker_still_vouches``: the late put-back comes
  ``LATE_PUT_BACK`` before the window closes, while the grace of a taker that renewed right
  before the crash (and is late renewing again) still ran: both passed ``ensure_held()``.
  The commit routes snapshot restarts to this path; an empty restart reached it before.
  ``LockSpec.grace`` now ends ``LATE_PUT_BACK`` before the window a restart right after the
  renewal would open.

Held (each asserts it reached the path it names; failovers of a replica, Sentinel and
Cluster in ``test_adversary_renewal_failover``):

* ``test_a_live_holder_keeps_its_lock_across_a_snapshot_restart``: the renewal that notices
  the restart (its own new connection) is judged, passes, and is confirmed under the epoch
  read before its request; the next one is judged again and recorded in the new epoch.
* ``test_a_live_holder_across_a_slow_snapshot_restart_puts_its_lock_back_late``: a 3 s
  restart (liveness 1.5 s) dates the loss past ``put_back_until``: the live holder gives the
  snapshot's copy up, then puts it back as the window closes, never told lost; another
  process's acquisition during the window waits and finds the key held.
* ``test_a_batch_judges_each_lease_on_its_own``: one lease refused in a batch under a grown
  epoch, the other renewed; the refused one's delete touches only its own key.
* ``test_a_release_on_refusal_that_fails_is_retried``: the server dies between the renewal and
  its delete: the keeper retries; the next renewal, after another snapshot restart, gives the
  copy up.
* ``test_the_release_on_refusal_deletes_only_its_own_value``: the key changed between the
  renewal and its delete: the delete compares, the other value stays.
* ``test_the_keepers_own_client_judges_a_snapshot_renewal``: greenlet pools: the restart seen
  on the main thread's connection decides the keeper's own client's renewal.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from redis.crc import key_slot

from celery_singleton_beat import native
from celery_singleton_beat.connection.client import redis_from_url
from celery_singleton_beat.lease.batches import renew_many
from celery_singleton_beat.lease.commands import Renewal, look_request
from celery_singleton_beat.lease.executor import execute
from celery_singleton_beat.lease.keeper import KeptLease, Later, LeaseKeeper
from celery_singleton_beat.lease.lease import LATE_PUT_BACK, Lease
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery import lock_redis
from celery_singleton_beat.recovery.server import LockServer, server_of
from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer, soak, wait_for
from .support.locking import renew
from .support.topologies import cluster_shard, fail_over_shard, start_cluster
from .test_adversary_putback import (
    KEY,
    OTHER,
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


class Judged:
    """Records each time ``lease``'s renewal was judged under a grown epoch, and the verdict."""

    def __init__(self, lease: Lease, before: Callable[[], Any] | None = None) -> None:
        self.verdicts: list[bool] = []
        judge = lease._renewed_through_loss

        def recorded(via: Any) -> bool:
            if before is not None:
                before()
            verdict = judge(via)
            self.verdicts.append(verdict)
            return verdict

        lease._renewed_through_loss = recorded  # type: ignore[method-assign]


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
    the recovery window (:class:`.keeper.Later`); True if the lease holds in the end."""
    outcome = keeper._settle(kept, kept.lease.renew_once(), None)
    if isinstance(outcome, Later):
        at = outcome.at
        wait_for(lambda: time.monotonic() >= at, timeout=30, interval=0.01, message="the late put-back's time")
        outcome = keeper._settle(kept, kept.lease.renew_once(), None)
    return outcome is True


# ---------------------------------------------------------------------------- broke


@breaks("the live taker renews first and is told lost by the snapshot's copy; the stopped holder then puts back late")
def test_the_taker_renews_first_after_a_snapshot(make_redis: Callable[..., RedisServer]) -> None:
    """An RDB snapshot is taken while ``a`` holds ``k``; ``a`` stops, ``b`` takes ``k`` over
    (higher fence); the server crashes and comes back from the snapshot: ``a``'s lock. ``b``
    is live: its keeper renews every lease as soon as its process notices the loss, while
    ``a`` is still stopped. ``b`` finds ``a``'s value, held by another: its run is told lost.
    ``a`` resumes: the copy is given up (the commit's rule), the keeper then finds nothing
    and, no holder having put a lock back, ``a`` puts its own back as the window closes and
    vouches for ``k`` with the lower fence. Fix: a renewal under a grown epoch that finds
    another's value, where the lease itself passes the timing rule, must not be a loss
    when that value is the one it took over (its fence is lower: it needs the fence in the
    value, or the taken-over value remembered by the lease) -- replace it instead."""
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
    reached(server_of(b).epoch == 1, "b's process noticed the restart first")
    judged = Judged(held)
    a_holds = late_put_back(keeper, kept_a)
    reached(judged.verdicts == [False], "a's renewal found its copy and gave it up")
    assert b_kept or not a_holds, (f"a (fence {held.fence}) holds k again after b (fence {taker.fence}) "
                                   "vouched for it: b was told lost by the snapshot's copy of a's lock")


@breaks("the stopped holder puts its lock back late after the taker's run ended: the lower fence after the higher")
def test_a_taker_that_ended_before_a_snapshot_restart(make_redis: Callable[..., RedisServer]) -> None:
    """``a`` takes ``k``; a snapshot is taken; ``a`` stops; ``b`` takes ``k`` over and its run
    ends (released). The server crashes and comes back from the snapshot: ``a``'s lock.
    ``a`` resumes: its renewal is judged (refused: confirmed too long before the loss), the
    copy deleted; no one puts a lock back, so ``a`` does as the window closes and vouches
    for ``k`` with fence 1 after ``b``'s run with fence 2. (Restarting empty instead gives
    the same: the late put-back is what lets a live holder survive a slow restart, and it
    cannot tell one from a take-over.) Fix: needs a way to know a take-over happened (a
    fence counter, or the take-over's mark, that survives the loss in another store)."""
    server = make_redis()
    mark_in_use(server.client())
    a, b, direct = process(server.port), process(server.port), server.client()
    held = take(a, KEY, spec("a-boot"), "a", "a took k")
    direct.save()
    taker = take_over(b, spec("b-boot"))
    reached(taker.fence > held.fence and taker.release(), "b's run (the higher fence) ended")
    server.restart()
    reached(direct.get(KEY) == held.value.encode(), "the snapshot brought a's lock back")
    judged = Judged(held)
    kept = KeptLease(held, None)
    holds = late_put_back(LeaseKeeper(), kept)
    reached(judged.verdicts == [False], "a's renewal found its copy and gave it up")
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
    primary, which finds ``k`` there: the rule passes and the lease is confirmed under the
    new epoch (since the commit also when the promotion was noticed during the request;
    before it only when noticed before). Once ``a``'s process follows the address to the
    promoted replica, ``k`` is gone and the lease, confirmed "after" the loss, may neither
    put it back nor put it back late: a live holder is told lost in a plain failover.
    Fix: the epoch a renewal is confirmed under must be that of the connection that
    answered it (per connection, or per server run id), not the process's latest."""
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
    reached(keeper._settle(kept, held.renew_once(), None) is True and server_of(a).epoch == 1
            and old.client().get(KEY) == held.value.encode(),
            "the old primary renewed k after a's process noticed the promotion")
    address.switch(replica.port)
    assert late_put_back(keeper, kept), "a live holder lost its lock in a failover"
    assert replica.client().get(KEY) == held.value.encode()


def test_a_batch_whose_refusal_notices_a_second_restart(make_redis: Callable[..., RedisServer]) -> None:
    """Two leases of one process renewed in one request after a snapshot restart: ``k``, last
    confirmed past a take-over's reach, is refused; the other, just taken, is renewed. The
    server restarts again, empty, as ``k``'s copy is being given up: the delete's new
    connection notices it (epoch 2). The other lease's reply came from the server before
    that restart, yet it is then judged and confirmed under epoch 2, "after" the second
    loss: its renewal finds its lock gone and it may not put it back, nor late: a live
    holder told lost. (Its parent commit confirmed it under the batch's epoch, and put it
    back.)"""
    server = make_redis()
    mark_in_use(server.client())
    a, direct = process(server.port), server.client()
    old = take(a, KEY, spec("a-boot"), "a", "a took k")
    wait_for(lambda: time.monotonic() > old.put_back_until, timeout=10, interval=0.01,
             message="k past a take-over's reach")
    fresh = take(a, OTHER, spec("a-boot"), "a2", "a took the other key")
    direct.save()
    server.restart()

    def restart_empty() -> None:
        if server_of(a).epoch == 1:
            with contextlib.closing(server.client()) as admin:
                admin.flushall()
                admin.save()
            server.restart()

    Judged(old, before=restart_empty)
    outcomes = renew_many(a, [old, fresh])
    reached(outcomes == [Renewal.GONE, Renewal.RENEWED] and server_of(a).epoch == 2,
            "the batch renewed the other lease; k's delete noticed a second restart")
    reached(direct.get(OTHER) is None, "the second restart lost the other lease's lock")
    assert late_put_back(LeaseKeeper(), KeptLease(fresh, None)), "a live holder lost its lock in a restart"
    assert direct.get(OTHER) == fresh.value.encode()


@breaks("another Cluster shard's failover makes a holder give up a lock its own shard never lost")
@pytest.mark.timeout(180)
def test_a_failover_of_another_cluster_shard(make_redis: Callable[..., RedisServer]) -> None:
    """Redis Cluster, 3 primaries with a replica each. ``a`` takes ``k`` on shard 1 and stops
    past a take-over's reach; no one takes it over. Shard 2 fails over (``CLUSTER FAILOVER``:
    nothing lost); another thread of ``a``'s process reaches it: the epoch grows, the loss
    dated now. The window closes; ``a`` resumes: its renewal finds its own value on shard 1,
    which lost nothing and still has the very lock ``a`` wrote, and is refused (the epoch
    and the loss are the process's, not the shard's): the lock is deleted and, the window
    closed, ``a``'s run is told lost. Before the commit it renewed. Fix: epoch and
    ``lost_by`` per server record (shard), as for ``test_adversary_putback``'s H."""
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
        reached(server_of(a).epoch == 1, "a's process found shard 2 failed over")
        wait_for(lambda: not server_of(a).recovery().open, timeout=30, message="the window closed")
        reached(cluster_shard(cluster, key_slot(KEY.encode()))[0] is home, "k's shard did not fail over")
        judged = Judged(held)
        renewed = renew(held)
        reached(judged.verdicts == [False], "a's renewal on its shard was judged under the grown epoch")
        assert renewed, "a gave up a lock its shard never lost, which no one had taken over"
    finally:
        cluster.stop()


@breaks("a live holder renewing late in the window gives up the lock it found intact, and is told lost")
def test_a_renewal_late_in_the_window_after_a_slow_snapshot_restart(make_redis: Callable[..., RedisServer]) -> None:
    """Liveness 1.5 s. The server crashes and is back from a snapshot holding ``a``'s lock after
    ``a``'s ``put_back_until`` (a slow restart, as in a Sentinel failover slower than a
    take-over's reach: the promoted replica has every lock). ``a``'s process notices at
    once, but its keeper gets to ``k`` only in the window's last half second (busy: thousands
    of leases, each put back by a request of its own, or a GIL-bound task), still inside
    the window, as every live holder must. The renewal finds the lock intact, is refused,
    deletes it, and it is then too late for the late put-back: the run is told lost. Before
    the commit it renewed the lock it found. (Measured with one process holding 3,000 leases
    across a 3 s restart from a snapshot holding all of them, another process acquiring
    every key once the window let it: 113, 952, 3,000 and 3,000 leases lost in four runs on
    this busy machine; none on the parent commit.) Fix: not small: a copy that cannot be
    vouched for must go for the taker to put its lock back, and a put-back after the
    delete cannot know whether the taker is still to come."""
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
    reached(server_of(a).epoch == 1 and window.open, "a's process noticed the restart")
    wait_for(lambda: time.monotonic() >= window.until - 0.4, timeout=30, interval=0.01,
             message="the window's last half second")
    judged = Judged(held)
    kept = KeptLease(held, None)
    keeper = LeaseKeeper()
    renewed = keeper._settle(kept, held.renew_once(), None)
    reached(judged.verdicts == [False] and server_of(a).recovery().open,
            "a's renewal, inside the window, found its lock intact and was refused")
    assert renewed is True, "a live holder renewing within the window lost the lock it found intact"


@pytest.mark.parametrize("data", ["from a snapshot with a's lock", "empty"])
def test_a_late_put_back_while_the_taker_still_vouches(make_redis: Callable[..., RedisServer], data: str) -> None:
    """``a`` takes ``k`` and stops; ``b`` takes it over and renews; the server crashes right
    after and comes back (from a snapshot holding ``a``'s lock, given up by ``a``'s renewal
    since the commit; or empty, as before it). ``a``'s process notices at once; ``b``'s
    keeper is late (a pause shorter than its grace). ``a`` puts its lock back as the window
    closes, ``LATE_PUT_BACK`` (0.5 s) before its end, while ``b``'s grace, which counts on no
    other holder before the window of a restart right after its renewal has closed, still
    ran: ``ensure_held()`` passed for both. Fixed: ``LockSpec.grace`` is at most the window
    less ``LATE_PUT_BACK``."""
    server = make_redis()
    mark_in_use(server.client())
    a, b, direct = process(server.port), process(server.port), server.client()
    held = take(a, KEY, spec("a-boot"), "a", "a took k")
    if data != "empty":
        direct.save()
    taker = take_over(b, spec("b-boot"))
    reached(renew(taker), "b renewed")
    server.restart()
    kept = KeptLease(held, None)
    keeper = LeaseKeeper()
    outcome = keeper._settle(kept, held.renew_once(), None)
    reached(isinstance(outcome, Later), "a's put-back waits for the end of the window")
    reached(server_of(a).lost_by < taker.confirmed_at + LATE_PUT_BACK,
            "the restart came within LATE_PUT_BACK of b's renewal")
    assert isinstance(outcome, Later)
    at = outcome.at
    wait_for(lambda: time.monotonic() >= at, timeout=30, interval=0.01, message="the late put-back's time")
    put_back = keeper._settle(kept, held.renew_once(), None) is True
    reached(put_back, "a put its lock back as the window closes")
    assert not (vouched(held) and vouched(taker)), (f"a (fence {held.fence}) and b (fence {taker.fence}) both "
                                                    "pass ensure_held()")


# ---------------------------------------------------------------------------- held


def test_a_live_holder_keeps_its_lock_across_a_snapshot_restart(make_redis: Callable[..., RedisServer]) -> None:
    """A live holder's lock is in the snapshot; the server restarts quickly from it. The keeper
    thread's renewal is the first request on the new server: its own new connection notices
    the restart (the epoch read before the request is 0, after it 1), the rule is asked and
    passes; the lease is confirmed under the new epoch, never told lost."""
    server = make_redis()
    mark_in_use(server.client())
    a, direct = process(server.port), server.client()
    held = take(a, KEY, spec("a-boot"), "a", "a took k")
    direct.save()
    judged = Judged(held)
    keeper = LeaseKeeper()
    kept = keeper.keep(held)
    try:
        wait_for(lambda: kept.renewals >= 1, timeout=10, message="a renewal")
        server.restart()
        reached(server_of(a).epoch == 0, "no request of a's process reached the new server yet")
        wait_for(lambda: judged.verdicts or kept.lost, timeout=10, message="a renewal judged under the new epoch")
        reached(server_of(a).epoch == 1, "the keeper's renewal noticed the restart")
        assert judged.verdicts == [True], "a live holder's renewal from the snapshot was refused"
        assert not kept.lost and held.epoch == 0, "confirmed under the epoch read before its request"
        renewals = kept.renewals
        wait_for(lambda: kept.renewals > renewals + 2 or kept.lost, timeout=10, message="later renewals")
        assert not kept.lost and judged.verdicts == [True, True] and held.epoch == 1, \
            "the next renewal, sent under the new epoch, is judged once more and recorded in it; later ones are plain"
        assert direct.get(KEY) == held.value.encode()
    finally:
        keeper.forget(kept)


def test_a_live_holder_across_a_slow_snapshot_restart_puts_its_lock_back_late(
        make_redis: Callable[..., RedisServer]) -> None:
    """Liveness 1.5 s: renewals every 0.5 s, a take-over possible 2 s after one. The snapshot
    holds the live holder's lock; the server crashes just before a renewal and is back from
    the snapshot 3 s later: the loss is dated by the new server's start, past
    ``put_back_until``. Before the commit the renewal found its value and kept it; now it
    gives the copy up and puts it back as the window closes. The run is never told lost, and
    another process acquiring meanwhile waits for the window and finds the key held; at no
    moment do both vouch."""
    server = make_redis()
    mark_in_use(server.client())
    a, b, direct = process(server.port), process(server.port), server.client()
    held = take(a, KEY, spec("a-boot", ttl=60.0), "a", "a took k")
    judged = Judged(held)
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
        wait_for(lambda: kept.lost or held.confirmed_at > last + 3, timeout=20, message="the keeper's outcome")
        thread.join(30)
        reached(server_of(a).epoch == 1 and server_of(a).lost_by >= last + held.spec.takeover_after,
                "the loss was dated past a's put_back_until")
        reached(judged.verdicts[:1] == [False], "the renewal found the snapshot's copy and gave it up")
        assert not kept.lost, f"a live run lost its lock in a slow restart from a snapshot: {kept.lost_reason}"
        assert other == [None], "another process acquired k while the live holder put it back"
        assert direct.get(KEY) == held.value.encode()
    finally:
        keeper.forget(kept)


def test_a_batch_judges_each_lease_on_its_own(make_redis: Callable[..., RedisServer]) -> None:
    """Two leases of one process, renewed in one request after a snapshot restart: ``k``
    was last confirmed past a take-over's reach of the restart (its holder stopped), the
    other just now. ``k``'s copy is given up (deleted); the other is renewed under the new
    epoch, its key untouched."""
    server = make_redis()
    mark_in_use(server.client())
    a, direct = process(server.port), server.client()
    old = take(a, KEY, spec("a-boot"), "a", "a took k")
    wait_for(lambda: time.monotonic() > old.put_back_until, timeout=10, interval=0.01,
             message="k past a take-over's reach")
    fresh = take(a, OTHER, spec("a-boot"), "a2", "a took the other key")
    direct.save()
    server.restart()
    outcomes = renew_many(a, [old, fresh])
    reached(server_of(a).epoch == 1, "the batch noticed the restart")
    assert outcomes == [Renewal.GONE, Renewal.RENEWED]
    assert direct.get(KEY) is None, "k's copy was given up"
    assert direct.get(OTHER) == fresh.value.encode() and fresh.epoch == 0 and vouched(fresh), \
        "the other lease is renewed, under the epoch read before the batch"


def test_a_release_on_refusal_that_fails_is_retried(make_redis: Callable[..., RedisServer]) -> None:
    """The snapshot holds ``a``'s lock, taken over by ``b``; after the restart ``a``'s renewal
    finds it and is refused, and the server dies before the delete: ``settle_renewal`` raises,
    the keeper schedules a retry (not a loss). The server comes back from the same snapshot;
    the retried renewal is refused again and deletes the copy; ``b`` (default liveness: a
    take-over's reach of 7.7 s, longer than the two restarts) puts its lock back."""
    server = make_redis()
    mark_in_use(server.client())
    a, b, direct = process(server.port), process(server.port, 10.0), server.client()
    held = take(a, KEY, spec("a-boot"), "a", "a took k")
    direct.save()
    taker = take_over(b, spec("b-boot", 10.0))
    server.restart()
    crashes = [server.kill]
    judged = Judged(held, before=lambda: crashes and crashes.pop()())
    keeper = LeaseKeeper()
    kept = KeptLease(held, None)
    again = keeper._renew(kept, via=a)
    reached(not server.running and not judged.verdicts, "the server died between the renewal and its delete")
    assert again is not None and not kept.lost, "a failed delete is retried, not a loss"
    server.start()
    keeper._renew(kept, via=a)
    reached(judged.verdicts == [False] and server_of(a).epoch == 2, "the retry found the copy again and gave it up")
    assert direct.get(KEY) is None and not vouched(held)
    assert renew(taker) and direct.get(KEY) == taker.value.encode(), "b puts its own lock back"


def test_the_release_on_refusal_deletes_only_its_own_value(make_redis: Callable[..., RedisServer]) -> None:
    """Between ``a``'s refused renewal and its delete the key changes (written by hand here):
    the delete compares the whole value and leaves the other one."""
    server = make_redis()
    mark_in_use(server.client())
    a, b, direct = process(server.port), process(server.port), server.client()
    held = take(a, KEY, spec("a-boot"), "a", "a took k")
    direct.save()
    taker = take_over(b, spec("b-boot"))
    server.restart()
    judged = Judged(held, before=lambda: direct.set(KEY, taker.value, px=30000))
    assert not renew(held)
    reached(judged.verdicts == [False], "a's renewal was refused")
    assert direct.get(KEY) == taker.value.encode(), "a's delete removed a value not its own"


def test_the_keepers_own_client_judges_a_snapshot_renewal(
        make_redis: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch) -> None:
    """Greenlet pools: the keeper renews through a client of its own. The main thread's
    connection notices the snapshot restart first; the keeper's client, connecting after,
    finds nothing new, yet its renewal is judged (the memory is shared) and refused."""
    monkeypatch.setattr(native, "green", lambda: True)
    server = make_redis()
    mark_in_use(server.client())
    a, b, direct = process(server.port), process(server.port), server.client()
    held = take(a, KEY, spec("a-boot"), "a", "a took k")
    direct.save()
    taker = take_over(b, spec("b-boot"))
    server.restart()
    with contextlib.closing(lock_redis.thread_client(a)) as own:
        reached(own is not a, "the keeper has a client of its own")
        execute(a, OTHER, lambda info: look_request(OTHER))
        reached(server_of(a).epoch == 1, "the main thread's connection found the data lost")
        judged = Judged(held)
        assert not LeaseKeeper().renew(KeptLease(held, None), own)
        reached(judged.verdicts == [False], "the keeper's client's renewal was judged")
    assert direct.get(KEY) is None
    assert late_put_back(LeaseKeeper(), KeptLease(taker, None)) and direct.get(KEY) == taker.value.encode(), \
        "b puts its own lock back (at once, or as the window closes on a slow machine)"
