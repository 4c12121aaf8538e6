"""Attacks on a renewal that finds its own lock on a promoted replica (see
``test_adversary_renewal_epoch`` for snapshots), against real redis-servers.

Open break (``xfail(strict=True, raises=AssertionError)``):

* ``test_a_promoted_replica_with_the_holders_lock``: the replica replicated ``a``'s lock
  and was promoted before ``b``'s take-over on the old primary; ``a``, stopped past the
  take-over, reaches the promoted replica and renews the copy of its lock there.

Held (each asserts it reached the path it names):

* ``test_a_live_holder_across_a_failover_of_its_cluster_shard``: the keeper's renewal,
  moved to the promoted replica, finds the lock there and is recorded under the promotion.
* ``test_a_live_holder_across_a_sentinel_failover_that_replicated_its_lock``: the keeper's
  renewal reaches the promoted replica, finds the lock, and the run keeps it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from redis.crc import key_slot

from celery_singleton_beat.connection.client import redis_from_url
from celery_singleton_beat.lease.keeper import LeaseKeeper
from celery_singleton_beat.recovery.server import LockServer, server_of
from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer, wait_for
from .support.breaks import documented_break
from .support.locking import renew
from .support.topologies import fail_over_shard, start_cluster, start_sentinels, wait_for_new_primary
from .test_adversary_putback import KEY, Switch, breaks, process, reached, spec, take_over, vouched
from .test_adversary_renewal_epoch import PutBacks, take


@breaks("a stopped holder renews a promoted replica's copy of its lock after a take-over on the old primary")
def test_a_promoted_replica_with_the_holders_lock(make_redis: Callable[..., RedisServer]) -> None:
    """``a`` takes ``k`` on the primary and the replica copies it; the replica is promoted
    while the old primary goes on; ``a`` stops, ``b`` takes ``k`` over on the old primary.
    ``a``'s process then reaches the promoted replica: its lock is there and its renewal
    extends it, while ``b`` vouches for ``k`` (its next renewal, on the promoted replica,
    finds ``a``'s value and is told lost). Fix: as for a snapshot holding the stopped
    holder's lock (``test_adversary_renewal_epoch``)."""
    old = make_redis()
    mark_in_use(old.client())
    address = Switch(old.port)
    a, b = process(address.port), process(address.port)
    held = take(a, KEY, spec("a-boot"), "a", "a took k")
    replica = make_redis("--replicaof", "127.0.0.1", str(old.port))
    wait_for(lambda: replica.client().get(KEY) == held.value.encode(), timeout=20, message="the replica has a's lock")
    replica.client().replicaof("NO", "ONE")
    taker = take_over(b, spec("b-boot"))
    address.switch(replica.port)
    renewed = renew(held)
    reached(server_of(a).epoch == 1 and replica.client().get(KEY) == held.value.encode(),
            "a's renewal reached the promoted replica, which holds a's lock")
    reached(vouched(taker) and taker.fence > held.fence, "b, the higher fence, still vouches for k")
    with documented_break():
        assert not renewed, "a renewed a promoted replica's copy of its lock after b's take-over"


@pytest.mark.timeout(180)
def test_a_live_holder_across_a_failover_of_its_cluster_shard(make_redis: Callable[..., RedisServer]) -> None:
    """Redis Cluster, 3 primaries with a replica each. ``a`` holds ``k``, kept by the keeper
    thread (liveness 1.5 s); its shard fails over (``CLUSTER FAILOVER``: the replica has the
    lock). The keeper's renewal is moved to the promoted replica, whose check grows the
    epoch: the renewal finds the lock there, is recorded under the promotion, and the run
    keeps its lock (no put-back)."""
    cluster = start_cluster(primaries=3, replicas=1)
    try:
        for node in cluster.primaries():
            mark_in_use(node)
        a = redis_from_url(cluster.url)
        a.csb_server = LockServer("singleton", 1.5)  # type: ignore[union-attr]
        held = take(a, KEY, spec("a-boot"), "a", "a took k")
        put_backs = PutBacks(held)
        keeper = LeaseKeeper()
        kept = keeper.keep(held)
        try:
            wait_for(lambda: kept.renewals >= 1, timeout=10, message="a renewal")
            _, new = fail_over_shard(cluster, key_slot(KEY.encode()))
            wait_for(lambda: kept.lost or held.epoch >= 1, timeout=30,
                     message="the keeper's outcome on the promoted replica")
            reached(server_of(a).epoch == 1 and held.epoch == 1, "a renewal was recorded under the promotion")
            assert not kept.lost, f"a live run lost its lock in a Cluster shard's failover: {kept.lost_reason}"
            assert put_backs.count == 0, "the renewal found the promoted replica's copy: nothing to put back"
            assert new.client().get(KEY) == held.value.encode()
        finally:
            keeper.forget(kept)
    finally:
        cluster.stop()


@pytest.mark.timeout(180)
def test_a_live_holder_across_a_sentinel_failover_that_replicated_its_lock() -> None:
    """Sentinel: a primary, a replica, three sentinels. ``a`` (liveness 1.5 s) holds ``k``, kept
    by the keeper thread; the replica copies it. The primary is killed; the sentinels promote
    the replica within seconds, the keeper retrying meanwhile. The renewal that reaches the
    promoted replica grows the epoch and finds the lock there (no put-back): the run is never
    told lost and ends with its lock on the new primary."""
    group = start_sentinels(down_after_ms=1000)
    try:
        host, port = group.master_address()
        a = group.lock_client()
        held = take(a, KEY, spec("a-boot"), "a", "a took k")
        put_backs = PutBacks(held)
        keeper = LeaseKeeper()
        kept = keeper.keep(held)
        try:
            replica = next(s for s in group.servers[:2] if s.port != port)
            wait_for(lambda: replica.client().get(KEY) == held.value.encode(), timeout=20,
                     message="the replica has a's lock")
            wait_for(lambda: kept.renewals >= 1, timeout=10, message="a renewal")
            group.server_on(port).kill()
            wait_for_new_primary(group, (host, port))
            wait_for(lambda: kept.lost or held.epoch >= 1, timeout=30,
                     message="the keeper's outcome on the new primary")
            reached(server_of(a).epoch >= 1 and held.epoch >= 1, "a renewal was recorded under the promotion")
            assert not kept.lost, f"a live run lost its lock in a Sentinel failover: {kept.lost_reason}"
            assert put_backs.count == 0, "the renewal found the promoted replica's copy: nothing to put back"
            assert replica.client().get(KEY) == held.value.encode()
        finally:
            keeper.forget(kept)
    finally:
        group.stop()
