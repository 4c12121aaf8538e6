"""Adversarial review of the keeper's per-round caches (the lease's renewal request built once
per server spelling, the keeper's own client and its kind found once per lock client and
round, gevent's and eventlet's original thread functions looked up once), against real
redis-servers.

Attacks, and what they found:

1. A server restarted as another version on the same port (Valkey 9.1, then Redis 7.0, then
   Valkey 9.1 again, each empty), six leases of six TTLs renewed together, in RESP2 and RESP3:
   HELD. The batch built for Valkey's native ``SET IFEQ`` reaches Redis 7.0 (the request is
   spelt before the new connection tells what the server is), is refused there as a whole
   (``syntax error``), sent again in Lua, and every lock put back with its own value and TTL;
   from then the portable spelling stays (a refusal is taken as lasting), also back on Valkey.
   ``test_a_server_restarted_as_another_version_renews_each_lease_with_its_own_value_and_ttl``.
2. One round over two servers (two clients), one of them killed: HELD. The dead server's
   leases are retried before they end and not reported lost; the live server's are renewed
   in their own request. ``test_a_round_over_two_servers_judges_each_on_its_own_when_one_dies``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import redis

from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.server import server_of
from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer, skip_or_fail
from .support.owners import register

#: Distinct TTLs: a renewal sent with another lease's TTL (another lease's cached request) shows.
TTLS = [30.0, 60.0, 40.0, 45.0, 50.0, 35.0]


def valkey_server_binary() -> str:
    """``$VALKEY_SERVER``, else the Valkey 9.1 that ``make bench`` installs (``$BENCH_SERVERS``)."""
    configured = os.environ.get("VALKEY_SERVER")
    if configured:
        return configured
    from benchmarks.servers import _packaged_binary

    located = _packaged_binary("valkey-9.1")
    if located is None:
        skip_or_fail("no Valkey 9.1: set VALKEY_SERVER, or BENCH_SERVERS after `make bench` installed it")
    return located[0]


def take(client: redis.Redis, prefix: str, ttls: list[float]) -> list[Lease]:
    leases = []
    for n, ttl in enumerate(ttls):
        lease = acquire(client, f"singleton:{prefix}:{n}", LockSpec(task="adv", ttl=ttl), f"run-{n}").lease
        assert lease is not None
        leases.append(lease)
    return leases


def assert_each_its_own(direct: redis.Redis, leases: list[Lease], ttls: list[float]) -> None:
    for n, lease in enumerate(leases):
        assert direct.get(lease.key) == lease.value.encode(), f"lease {n} holds its own value"
        assert 0 < direct.pttl(lease.key) <= ttls[n] * 1000, f"lease {n} renewed to its own TTL"


# -------------------------------------------------------------------- 1. another version


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_server_restarted_as_another_version_renews_each_lease_with_its_own_value_and_ttl(
        protocol: int) -> None:
    """Valkey 9.1 (native ``SET IFEQ`` renewals), restarted empty as Redis 7.0 on the same port
    (Lua only), then as Valkey 9.1 again: each round renews (or puts back) every lease with its
    own value and TTL, none lost."""
    port = RedisServer(name="swap-probe").port
    valkey = register(RedisServer(name="swap-valkey", port=port, binary=valkey_server_binary()))
    plain = register(RedisServer(name="swap-redis", port=port))
    client = redis.Redis(port=port, protocol=protocol, socket_timeout=10)
    try:
        valkey.start()
        mark_in_use(valkey.client())
        leases = take(client, f"swap{protocol}", TTLS)
        keeper = LeaseKeeper()
        kept = [KeptLease(lease, None) for lease in leases]
        keeper._renew_batch(kept)
        info = server_of(client).info
        assert info is not None and info.set_ifeq, "Valkey 9.1: renewed natively"
        assert_each_its_own(valkey.client(), leases, TTLS)

        for down, up in ((valkey, plain), (plain, valkey)):
            epoch = server_of(client).epoch
            down.kill()
            up.start()
            keeper._renew_batch(kept)
            assert server_of(client).epoch > epoch, "the restart was found"
            assert not any(k.lost for k in kept), [k.lost_reason for k in kept]
            assert_each_its_own(up.client(), leases, TTLS)
            keeper._renew_batch(kept)  # and renewed after the put-back, in the new spelling
            assert not any(k.lost for k in kept), [k.lost_reason for k in kept]
            assert_each_its_own(up.client(), leases, TTLS)
    finally:
        client.close()
        for server in (valkey, plain):
            server.close()


# -------------------------------------------------------------------- 2. two servers


def test_a_round_over_two_servers_judges_each_on_its_own_when_one_dies(
        make_redis: Callable[..., RedisServer]) -> None:
    """Three leases on each of two servers, renewed in one round; the first server is killed
    before it: its leases are retried (not lost), the second's renewed."""
    first, second = make_redis(), make_redis()
    for server in (first, second):
        mark_in_use(server.client())
    one, two = first.client(), second.client()
    ones, twos = take(one, "first", TTLS[:3]), take(two, "second", TTLS[3:])
    keeper = LeaseKeeper()
    kept = [KeptLease(lease, None) for pair in zip(ones, twos, strict=True) for lease in pair]
    first.kill()
    retries = dict(keeper._renew_batch(kept))
    assert keeper.batches == 2, "one request per server"
    assert not any(k.lost for k in kept)
    for k in kept:
        at = retries[k]
        assert at is not None
        if k.lease in ones:
            assert k.renewals == 0 and at <= k.lease.valid_until, "retried before its end"
        else:
            assert k.renewals == 1
    assert_each_its_own(second.client(), twos, TTLS[3:])
