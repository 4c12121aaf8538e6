"""The keeper renews the leases due together in one request per server, each lease judged
on its own reply (real redis-server).

* ``test_leases_renewed_together_are_each_judged_on_their_own_reply``: six leases in one
  request; one lock was taken by another holder, one deleted: those two are lost, alone;
  the four others are renewed.
* ``test_the_keeper_renews_many_leases_in_shared_requests``: fifty leases kept at once by
  the keeper's thread are renewed in requests that each carry several of them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec

from .support import wait_for
from .support.locking import renew_round


@pytest.fixture
def locks(redis_db: redis.Redis) -> Iterator[redis.Redis]:
    yield redis_db


def take(client: redis.Redis, count: int, ttl: float) -> list[Lease]:
    leases = []
    for n in range(count):
        lease = acquire(client, f"singleton:{{batch:{n}}}", LockSpec(task="batch", ttl=ttl), f"run-{n}").lease
        assert lease is not None
        leases.append(lease)
    return leases


def test_leases_renewed_together_are_each_judged_on_their_own_reply(locks: redis.Redis) -> None:
    leases = take(locks, 6, ttl=30.0)
    for lease in leases:
        locks.pexpire(lease.key, 5_000)  # a renewal puts it back to 30 s
    locks.set(leases[1].key, "another holder's value", keepttl=True)
    locks.delete(leases[2].key)
    keeper = LeaseKeeper()
    kept = [KeptLease(lease, None) for lease in leases]

    renew_round(keeper, kept)

    assert keeper.batches == 1, "the six renewals went out in one request"
    assert [k.lost for k in kept] == [False, True, True, False, False, False]
    assert "taken by another holder" in (kept[1].lost_reason or "")
    for k in (kept[0], *kept[3:]):
        assert k.renewals == 1 and locks.get(k.lease.key) == k.lease.value.encode()
        assert locks.pttl(k.lease.key) > 5_000, "renewed to its full TTL"
    assert locks.get(leases[1].key) == b"another holder's value", "another holder's lock is left alone"


def test_the_keeper_renews_many_leases_in_shared_requests(locks: redis.Redis) -> None:
    leases = take(locks, 50, ttl=3.0)  # renewed every second
    keeper = LeaseKeeper()
    kept = [keeper.keep(lease) for lease in leases]
    try:
        wait_for(lambda: all(k.renewals >= 2 for k in kept), timeout=60, message="every lease renewed twice")
        assert not any(k.lost for k in kept)
        assert 0 < keeper.batches < sum(k.renewals for k in kept) / 2, \
            "renewals shared their requests (a request of several leases carries at least two)"
    finally:
        for k in kept:
            keeper.forget(k)
