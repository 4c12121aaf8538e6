"""Adversarial review of the keeper's many-lease renewal script (``RENEW_MANY``, sent as raw
RESP by :func:`.batches.renew_scripted` where the server has no ``SET ... IFEQ`` and is not a
Cluster) and of the queue entries of leases renewed together (:class:`.kept.Bucket`),
against real redis-servers.

Attacks kept here (each a test), and what they found:

* A run cut short as it began (:meth:`.keeper.LeaseKeeper.abandon`: forgotten, released)
  while the keeper's round had its lease in flight (off the queue), then a data loss the
  round finds: **BROKE, fixed**. ``abandon`` looked for the lease in the queue only; the
  round put the released lock back and the lease stayed kept (renewed for the life of the
  process). Older than the many-lease script (the same on the pipelined path).
  ``test_a_lease_abandoned_while_its_renewal_is_in_flight_is_not_put_back``.
* The process's keeper (the one the data-loss listener moves forward) with a lease whose
  put-back must wait for the end of the recovery window: **BROKE, fixed**. The renewal
  that found the restart also called ``renew_all_soon``, which moved the waiting entry to
  now; judged again before its time, the lease was reported lost ("its turn came too
  late") though a live run held it. Older than the many-lease script.
  ``test_a_late_put_back_survives_the_keepers_own_renew_all_soon``.
* A lock key overwritten with a hash (``WRONGTYPE`` inside the script) among five good
  leases: HELD. The script fails as a whole, the batch goes the pipelined way, the five are
  renewed, the bad one neither confirmed nor reported lost at once (retried until its TTL
  would lapse). ``test_a_wrongtype_key_costs_only_its_own_lease``.
* Keys and values with non-ASCII characters, ``\\r\\n``, a RESP-like ``$5\\r\\n`` and a
  20,000-byte key: HELD (lengths counted in bytes).
  ``test_non_ascii_and_long_keys_are_renewed_by_the_script``.
* ``SCRIPT FLUSH`` between two rounds (``NOSCRIPT`` on the raw ``EVALSHA``): HELD.
  ``test_a_script_flush_between_rounds_loads_the_script_again``.
* 712 leases (more than :data:`.batches.BATCH_MAX`) due at once, three rounds, kept as
  queue entries of leases renewed together: HELD (no request over the maximum, every lease
  renewed each time). ``test_more_than_a_batch_of_leases_in_buckets_are_all_renewed_each_round``.
* Runs released (``releasing``, release, ``forget``) while their queue entry is in flight,
  then a data loss: HELD (the kept ones put back, the released ones not, nothing reported
  lost, nothing vouched). ``test_runs_released_while_their_bucket_is_in_flight_are_not_put_back``.
* A restart that kept some locks, lost others, and gave one to another holder, in one
  script call: HELD (each judged alone; none the script did not renew vouched for).
  ``test_a_mixed_reply_after_a_partial_data_loss_judges_each_lease``.
* A full server (``noeviction``, over ``maxmemory``): HELD (``PEXPIRE`` is not refused).
  ``test_a_full_server_still_renews_through_the_script``.
* Lock clients speaking RESP3, decoding replies, on database 5: HELD.
  ``test_the_script_reply_is_read_whatever_the_clients_options``.
* The keeper's own thread with 200 leases in buckets, 60 runs ending while it renews,
  then a restart: HELD. ``test_the_keepers_thread_with_buckets_through_releases_and_a_data_loss``.
* Sentinel failover (demoted primary answering ``-READONLY``, or killed) with six leases
  renewed together: HELD. ``test_six_leases_across_a_sentinel_failover``.

Not kept: a plain client on a one-node Cluster (``cluster-enabled yes``): the script is
refused ``-CROSSSLOT`` each round and the batch goes the pipelined way (held; one wasted
call per round). ``-BUSY``, a reply cut mid-way and a data loss with an ended run are in
``tests/test_adversary_batches.py`` (scripted path on Redis 7.0).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_singleton_beat.lease import batches
from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper, get_keeper
from celery_singleton_beat.lease.kept import Bucket
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.server import server_of
from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer, wait_for
from .support.locking import renew_round, round_in_flight, take_leases
from .support.topologies import MASTER_NAME, start_sentinels, wait_for_new_primary
from .test_adversary_putback import spec
from .test_adversary_renewal_epoch import PutBacks, take
from .test_adversary_stale import process as stale_process
from .test_adversary_stale import spec as stale_spec

#: The lock of the late put-back's run.
LATE_KEY = "singleton:{scripted:late}"

#: Distinct TTLs: a renewal sent with another lease's TTL shows.
TTLS = [3.0, 30.0, 7.0, 11.0, 19.0, 5.0]


def scripted_only(client: Any) -> None:
    info = server_of(client).info
    if info is not None and info.set_ifeq:
        pytest.skip("the server renews natively (SET IFEQ): the keeper pipelines its renewals there")


def evalsha_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def own_server(make_redis: Callable[..., RedisServer]) -> tuple[RedisServer, redis.Redis]:
    """A redis-server of the test's own, marked in use (no recovery window), and a direct client."""
    server = make_redis()
    direct = server.client()
    mark_in_use(direct)
    return server, direct


def test_a_wrongtype_key_costs_only_its_own_lease(redis_db: redis.Redis) -> None:
    leases = take_leases(redis_db, "wrongtype", TTLS)
    scripted_only(redis_db)
    for lease in leases:
        redis_db.pexpire(lease.key, 2_000)
    bad = leases[2]
    ttl = redis_db.pttl(bad.key)
    redis_db.delete(bad.key)
    redis_db.hset(bad.key, "field", "value")
    redis_db.pexpire(bad.key, ttl)
    before = [lease.confirmed_at for lease in leases]
    keeper = LeaseKeeper()
    kept = [KeptLease(lease, None) for lease in leases]
    keeper._active = len(kept)

    done = dict((id(k), at) for k, at in renew_round(keeper, kept))

    assert not any(k.lost for k in kept), "an error on one key is retried, not a loss"
    assert bad.confirmed_at == before[2] and kept[2].renewals == 0, "the bad key's lease was not confirmed"
    again = done[id(kept[2])]
    assert again is not None and again <= bad.valid_until, "retried before its end"
    for n in (0, 1, 3, 4, 5):
        assert kept[n].renewals == 1 and leases[n].confirmed_at > before[n], f"lease {n} renewed"
        assert 2_000 < redis_db.pttl(leases[n].key) <= TTLS[n] * 1000, f"lease {n} renewed to its own TTL"
    assert redis_db.hget(bad.key, "field") == b"value", "the other key was left alone"


def test_non_ascii_and_long_keys_are_renewed_by_the_script(redis_db: redis.Redis) -> None:
    spec = LockSpec(task="tâche-日本", ttl=9.0)
    names = ["é", "日本語", "a\r\nb", "x" * 20_000, "emoji-\U0001F600", "$5\r\n"]
    leases: list[Lease] = []
    for n, name in enumerate(names):
        lease = acquire(redis_db, f"singleton:{{ü-{n}}}:{name}", spec, f"run-ü-{n}-{name[:30]}").lease
        assert lease is not None
        leases.append(lease)
    scripted_only(redis_db)
    for lease in leases:
        redis_db.pexpire(lease.key, 2_000)
    keeper = LeaseKeeper()
    kept = [KeptLease(lease, None) for lease in leases]
    calls = evalsha_calls(redis_db)

    renew_round(keeper, kept)

    assert evalsha_calls(redis_db) == calls + 1, "the six renewals went out in one script call"
    assert not any(k.lost for k in kept) and all(k.renewals == 1 for k in kept)
    for lease in leases:
        assert redis_db.get(lease.key) == lease.value.encode()
        assert 2_000 < redis_db.pttl(lease.key) <= 9_000


def test_a_script_flush_between_rounds_loads_the_script_again(make_redis: Callable[..., RedisServer]) -> None:
    server, direct = own_server(make_redis)
    leases = take_leases(server.client(), "flush", TTLS)
    scripted_only(direct)
    keeper = LeaseKeeper()
    kept = [KeptLease(lease, None) for lease in leases]
    renew_round(keeper, kept)
    assert all(k.renewals == 1 for k in kept)
    for lease in leases:
        direct.pexpire(lease.key, 2_000)
    direct.script_flush()

    renew_round(keeper, kept)

    assert not any(k.lost for k in kept) and all(k.renewals == 2 for k in kept)
    for n, lease in enumerate(leases):
        assert 2_000 < direct.pttl(lease.key) <= TTLS[n] * 1000, f"lease {n} renewed after the flush"


def test_more_than_a_batch_of_leases_in_buckets_are_all_renewed_each_round(redis_db: redis.Redis) -> None:
    count = batches.BATCH_MAX + 200
    short, long = LockSpec(task="many", ttl=600.0), LockSpec(task="many", ttl=900.0)
    leases: list[Lease] = []
    with redis_db.pipeline(transaction=False):
        pass
    for n in range(count):
        lease = acquire(redis_db, f"singleton:{{many:{n}}}", short if n % 3 else long, f"run-{n}").lease
        assert lease is not None
        leases.append(lease)
    scripted_only(redis_db)
    keeper = LeaseKeeper()
    keeper._running = True  # no thread: the rounds run here
    kept = [keeper.keep(lease) for lease in leases]
    sizes: list[int] = []
    for _ in range(3):  # every lease due at once, three times over
        with keeper._mutex:
            keeper._move_all_forward(float("-inf"))
        renewed = 0
        while renewed < count:
            with keeper._mutex:
                taken = keeper._take_due(float("inf"))
            assert taken, "every lease is due"
            sizes.append(len(taken))
            keeper._handle(taken)
            renewed += len(taken)
        assert renewed == count
    assert max(sizes) <= batches.BATCH_MAX, f"a round of {max(sizes)} leases"
    assert all(k.renewals == 3 and not k.lost for k in kept), sorted({k.renewals for k in kept})
    assert any(isinstance(entry, Bucket) for _, _, entry in keeper._queue)
    assert keeper.tracked == count


def test_a_lease_abandoned_while_its_renewal_is_in_flight_is_not_put_back(
        make_redis: Callable[..., RedisServer]) -> None:
    """Two leases; the keeper's round takes them off the queue; meanwhile the run of one is
    cut short as it begins (:meth:`.keeper.LeaseKeeper.abandon`: forgotten and released),
    and the server restarts empty within the leases' put-back window (a data loss the round
    then finds). The abandoned run's lock must not be written back: its release ran, and
    the run that owned it is gone (the lock would be renewed for the life of the process).
    """
    server, direct = own_server(make_redis)
    client = server.client()
    leases = take_leases(client, "abandon", [30.0, 30.0])
    scripted_only(direct)
    keeper, kept, lost, taken = round_in_flight(leases)
    assert len(taken) == 2, "the round has both leases in flight"

    keeper.abandon(leases[0])
    assert direct.get(leases[0].key) is None, "the abandoned run's lock was released"
    server.restart()

    keeper._handle(taken)

    assert direct.get(leases[1].key) == leases[1].value.encode(), "the kept lease was put back"
    assert direct.get(leases[0].key) is None, "the abandoned run's released lock was written back"
    assert not kept[0].active, "the abandoned lease is still kept (renewed for the life of the process)"
    assert lost == [], "a loss was reported for a run that never ran"


def test_runs_released_while_their_bucket_is_in_flight_are_not_put_back(
        make_redis: Callable[..., RedisServer]) -> None:
    """Six leases renewed together (one queue entry); the keeper's round takes the entry; runs
    2 and 4 end meanwhile (``releasing``, their release, ``forget``) and the server restarts
    empty (a data loss the round finds). The four kept leases are put back and confirmed;
    the two released locks stay gone, and no loss is reported for them."""
    server, direct = own_server(make_redis)
    leases = take_leases(server.client(), "inflight", TTLS)
    scripted_only(direct)
    keeper = LeaseKeeper()
    keeper._running = True  # no thread: the rounds run here
    lost: list[str] = []
    kept = [keeper.keep(lease, on_lost=lambda k, reason: lost.append(k.lease.key)) for lease in leases]
    with keeper._mutex:
        first = keeper._take_due(float("inf"))
    keeper._handle(first)
    assert all(isinstance(entry, Bucket) for _, _, entry in keeper._queue), "renewed together"
    with keeper._mutex:
        keeper._move_all_forward(float("-inf"))
        taken = keeper._take_due(float("inf"))
    assert len(taken) == 6
    for n in (2, 4):
        keeper.releasing(kept[n])
        assert leases[n].release() is True
        keeper.forget(kept[n])
    server.restart()
    vouched = [lease.vouched_until for lease in leases]

    keeper._handle(taken)

    assert lost == [], "a loss was reported for a run that released its lock"
    for n in (2, 4):
        assert direct.get(leases[n].key) is None, f"run {n}'s released lock was written back"
        assert leases[n].vouched_until == vouched[n], f"run {n}'s lease was vouched for again"
    for n in (0, 1, 3, 5):
        assert direct.get(leases[n].key) == leases[n].value.encode(), f"lease {n} put back"
        assert kept[n].renewals == 2 and leases[n].vouched_until > vouched[n]


def test_a_mixed_reply_after_a_partial_data_loss_judges_each_lease(make_redis: Callable[..., RedisServer]) -> None:
    """The server restarts and comes back with some locks only (a persistence file older than
    the last writes): leases 0, 3 and 5 are there, 1 was taken by another holder, 2 and 4
    are gone. One script call: 0, 3, 5 renewed to their own TTL; 2 and 4 put back alone; 1
    lost alone, and none of the three not renewed by the script confirmed by it."""
    server, direct = own_server(make_redis)
    client = server.client()
    leases = take_leases(client, "partial", TTLS)
    scripted_only(direct)
    epoch = server_of(client).epoch
    server.restart()
    for n in (0, 3, 5):
        direct.set(leases[n].key, leases[n].value, px=2_000)
    direct.set(leases[1].key, "another holder's value", px=2_000)
    keeper = LeaseKeeper()
    kept = [KeptLease(lease, None) for lease in leases]
    keeper._active = len(kept)
    vouched = [lease.vouched_until for lease in leases]
    calls = evalsha_calls(direct)

    renew_round(keeper, kept)

    assert server_of(client).epoch > epoch, "the round found the data lost"
    assert evalsha_calls(direct) == calls + 1, "the six renewals went out in one script call"
    assert [k.lost for k in kept] == [False, True, False, False, False, False]
    assert leases[1].vouched_until == vouched[1], "a lease the script did not renew was vouched for"
    assert direct.get(leases[1].key) == b"another holder's value"
    for n in (0, 2, 3, 4, 5):
        assert direct.get(leases[n].key) == leases[n].value.encode(), f"lease {n} held"
        assert 2_000 < direct.pttl(leases[n].key) <= TTLS[n] * 1000, f"lease {n} at its own TTL"
        assert leases[n].vouched_until > vouched[n]


def test_a_full_server_still_renews_through_the_script(make_redis: Callable[..., RedisServer]) -> None:
    """``noeviction`` and over ``maxmemory``: the script's ``PEXPIRE`` is no command a full
    server refuses; every lease renewed in the one call."""
    server, direct = own_server(make_redis)
    leases = take_leases(server.client(), "full", TTLS)
    scripted_only(direct)
    used = int(direct.info("memory")["used_memory"])
    direct.config_set("maxmemory-policy", "noeviction")
    direct.config_set("maxmemory", str(used + 200_000))
    with pytest.raises(redis.ResponseError, match="maxmemory"):
        for n in range(100_000):
            direct.set(f"filler:{n}", "x" * 1_000)
    for lease in leases:
        direct.pexpire(lease.key, 2_000)
    keeper = LeaseKeeper()
    kept = [KeptLease(lease, None) for lease in leases]

    renew_round(keeper, kept)

    assert not any(k.lost for k in kept) and all(k.renewals == 1 for k in kept)
    for n, lease in enumerate(leases):
        assert 2_000 < direct.pttl(lease.key) <= TTLS[n] * 1000


@pytest.mark.parametrize("options", [{"protocol": 3}, {"decode_responses": True}, {"protocol": 3, "db": 5}],
                         ids=["resp3", "decoded", "resp3-db5"])
def test_the_script_reply_is_read_whatever_the_clients_options(
        make_redis: Callable[..., RedisServer], options: dict[str, object]) -> None:
    """Lock clients speaking RESP3, decoding replies, or on another database: the script's
    reply (empty, and listing two leases) is read the same way."""
    server, direct = own_server(make_redis)
    client = redis.Redis(port=server.port, **options)  # type: ignore[arg-type]
    db = redis.Redis(port=server.port, db=int(options.get("db", 0)))  # type: ignore[call-overload]
    leases = take_leases(client, "options", TTLS)
    scripted_only(direct)
    keeper = LeaseKeeper()
    kept = [KeptLease(lease, None) for lease in leases]
    for round_ in (1, 2):
        for lease in leases:
            db.pexpire(lease.key, 2_000)
        renew_round(keeper, kept)
        assert all(k.renewals == round_ for k in kept) and not any(k.lost for k in kept)
    db.set(leases[1].key, "another holder's value", keepttl=True)
    db.delete(leases[2].key)

    renew_round(keeper, kept)

    assert [k.lost for k in kept] == [False, True, True, False, False, False]
    for n in (0, 3, 4, 5):
        assert kept[n].renewals == 3 and db.get(leases[n].key) == leases[n].value.encode()


def test_the_keepers_thread_with_buckets_through_releases_and_a_data_loss(
        make_redis: Callable[..., RedisServer]) -> None:
    """The keeper's own thread keeps 200 leases (renewed together, in queue entries of many);
    60 runs end (``releasing``, release, ``forget``) while it renews, then the server restarts
    empty. Every kept lock is put back and renewed again; no released lock comes back; no
    loss is reported."""
    server, direct = own_server(make_redis)
    leases = take_leases(server.client(), "thread", [3.0] * 200)
    scripted_only(direct)
    keeper = LeaseKeeper()
    lost: list[str] = []
    kept = [keeper.keep(lease, on_lost=lambda k, reason: lost.append(f"{k.lease.key}: {reason}")) for lease in leases]
    ending, staying = kept[::10] + kept[1::10] + kept[2::10], [k for n, k in enumerate(kept) if n % 10 > 2]
    try:
        wait_for(lambda: all(k.renewals >= 2 for k in kept), message="every lease renewed twice")
        assert any(isinstance(entry, Bucket) for _, _, entry in list(keeper._queue))
        for k in ending:
            keeper.releasing(k)
            k.lease.release()
            keeper.forget(k)
        before = {id(k): k.renewals for k in staying}
        server.restart()
        wait_for(lambda: all(k.renewals >= before[id(k)] + 2 for k in staying),
                 message="every kept lease put back and renewed again")
        assert lost == []
        assert all(direct.get(k.lease.key) == k.lease.value.encode() for k in staying)
        assert [k.lease.key for k in ending if direct.exists(k.lease.key)] == [], "released locks came back"
    finally:
        for k in kept:
            keeper.forget(k)


@pytest.mark.parametrize("how", ["demoted", "killed"])
def test_six_leases_across_a_sentinel_failover(how: str) -> None:
    """Sentinel: a primary, a replica, three sentinels; six leases (renewed in one script call)
    kept by the keeper's thread, replicated. The sentinels fail the primary over: demoted
    (``SENTINEL FAILOVER``: the old primary, still up, answers the script ``-READONLY``) or
    killed. Every lease's renewal reaches the new primary and finds its lock there; none is
    reported lost, none put back."""
    group = start_sentinels(down_after_ms=1000)
    try:
        host, port = group.master_address()
        client = group.lock_client()
        leases = [take(client, f"singleton:{{failover:{n}}}", spec(f"boot-{n}"), f"run-{n}", "taken")
                  for n in range(6)]
        scripted_only(client)
        put_backs = [PutBacks(lease) for lease in leases]
        keeper = LeaseKeeper()
        lost: list[str] = []
        kept = [keeper.keep(lease, on_lost=lambda k, reason: lost.append(reason)) for lease in leases]
        try:
            replica = next(s for s in group.servers[:2] if s.port != port)
            wait_for(lambda: all(replica.client().get(lease.key) == lease.value.encode() for lease in leases),
                     timeout=20, message="the replica has every lock")
            wait_for(lambda: all(k.renewals >= 2 for k in kept), timeout=10, message="renewed together")
            if how == "killed":
                group.server_on(port).kill()
            else:
                group.sentinel().execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
            wait_for_new_primary(group, (host, port))
            before = [k.renewals for k in kept]
            wait_for(lambda: lost or all(k.renewals >= n + 2 for k, n in zip(kept, before, strict=True)),
                     timeout=30, message="renewed on the new primary")
            assert lost == [], f"live runs lost their locks in a Sentinel failover: {lost}"
            assert sum(p.count for p in put_backs) == 0, "the locks were on the promoted replica"
            new = group.server_on(group.master_address()[1]).client()
            assert all(new.get(lease.key) == lease.value.encode() for lease in leases)
        finally:
            for k in kept:
                keeper.forget(k)
    finally:
        group.stop()


def test_a_late_put_back_survives_the_keepers_own_renew_all_soon(make_redis: Callable[..., RedisServer]) -> None:
    """The process's keeper (:func:`.keeper.get_keeper`, the one the data-loss listener moves
    forward) keeps ``h``'s run, last confirmed longer ago than a take-over needs when the
    server restarts empty: its put-back must wait for the end of the recovery window
    (``Later``). The very renewal that found the restart also told the keeper to renew every
    lease at once (``renew_all_soon``), which moves the waiting put-back's entry to now: the
    lease must still wait for its time and put its lock back then, not be reported lost."""
    server = make_redis()
    mark_in_use(server.client())
    direct = server.client()
    h = stale_process(server.port)
    held = acquire(h, LATE_KEY, stale_spec(live=True, boot="h-boot"), "h").lease
    assert held is not None
    wait_for(lambda: time.monotonic() > held.put_back_until, message="h unconfirmed past a possible take-over")
    server.kill()
    server.start()
    keeper = get_keeper()
    kept = keeper.keep(held)  # its first renewal finds the restart (and opens the window)
    try:
        wait_for(lambda: kept.put_back_at is not None or kept.lost, message="h's keeper found its lock gone")
        wait_for(lambda: kept.lost or direct.get(LATE_KEY) is not None or not server_of(h).recovery().open,
                 timeout=30, message="h's late put-back or the window's end")
        assert not kept.lost, f"a late put-back was judged lost before its time: {kept.lost_reason}"
        assert direct.get(LATE_KEY) == held.value.encode(), "h put its lock back as the window closed"
    finally:
        keeper.forget(kept)
