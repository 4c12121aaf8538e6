"""The keeper's many-lease renewal script on a server without ``SET ... IFEQ`` (real redis-server).

Where the server renews in Lua anyway and is not a Cluster, the leases of a batch go in
one call of ``RENEW_MANY``, whose reply lists only the leases it did not renew; the
leases renewed together are scheduled again as one entry of the keeper's queue.

* ``test_one_script_call_judges_each_lease_on_its_own_outcome``: six leases in one call;
  one lock held by another (lost alone, the other's key untouched), one deleted (through
  the put-back rules: no data loss seen, so lost), the four others renewed to their own
  TTL; the same call sent again renews them again and changes nothing else.
* ``test_leases_renewed_together_are_due_together_and_forgotten_ones_skipped``: leases of
  two renewal intervals renewed in one round are due again each a renewal interval after
  the request started (one queue entry per interval); a lease forgotten meanwhile is
  not renewed again.
* ``test_a_round_makes_few_python_calls_per_renewed_lease``: a whole round of the keeper's
  thread (take the due leases, renew them, schedule them) makes at most
  :data:`CALLS_PER_LEASE` Python calls per lease (counted with ``sys.setprofile``; the
  pipelined path made about 24 per lease in its renewal alone).
* ``test_a_lease_spells_its_script_arguments_as_the_encoder_does``: a lease's arguments of a
  many-lease call, encoded once and kept, are the bytes :func:`.wire.pack` writes for them
  (a key and a value not all ASCII: lengths in bytes); and the whole call, written in parts
  behind its head, is the command :func:`.wire.pack` writes.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import redis

from celery_singleton_beat.connection.wire import pack
from celery_singleton_beat.lease.batches import renew_scripted, scripted_call
from celery_singleton_beat.lease.commands import Renewal
from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper
from celery_singleton_beat.lease.kept import Bucket
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.scripts import RENEW_MANY
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.lock_redis import thread_client
from celery_singleton_beat.recovery.server import server_of

from .support.locking import take_leases

#: Python calls (``sys.setprofile`` "call" events) a keeper round may make per lease it renews
#: through the script (today about 1: the lease's confirmation).
CALLS_PER_LEASE = 3

#: Distinct TTLs: a renewal sent with another lease's TTL shows.
TTLS = [3.0, 30.0, 7.0, 11.0, 19.0, 5.0]


def scripted_server(client: redis.Redis) -> None:
    info = server_of(client).info
    if info is not None and info.set_ifeq:
        pytest.skip("the server renews natively (SET IFEQ): the keeper pipelines its renewals there")


def evalsha_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_one_script_call_judges_each_lease_on_its_own_outcome(redis_db: redis.Redis) -> None:
    leases = take_leases(redis_db, "scripted", TTLS)
    scripted_server(redis_db)
    for lease in leases:
        redis_db.pexpire(lease.key, 2_000)  # a renewal puts it back to its own TTL
    redis_db.set(leases[1].key, "another holder's value", keepttl=True)
    redis_db.delete(leases[2].key)
    keeper = LeaseKeeper()
    kept = [KeptLease(lease, None) for lease in leases]
    calls = evalsha_calls(redis_db)

    keeper._handle(list(kept))

    assert evalsha_calls(redis_db) == calls + 1, "the six renewals went out in one script call"
    assert [k.lost for k in kept] == [False, True, True, False, False, False]
    assert "taken by another holder" in (kept[1].lost_reason or "")
    assert redis_db.get(leases[1].key) == b"another holder's value", "another holder's lock is left alone"
    assert redis_db.get(leases[2].key) is None, "a lock gone with no data loss seen is not put back"
    for n in (0, 3, 4, 5):
        assert kept[n].renewals == 1 and redis_db.get(leases[n].key) == leases[n].value.encode()
        assert 2_000 < redis_db.pttl(leases[n].key) <= TTLS[n] * 1000, f"lease {n} renewed to its own TTL"

    via = thread_client(redis_db)
    for _ in range(2):  # sent twice (a reply lost): the second finds the same, and renews again
        _, _, failed = renew_scripted(via, leases)
        assert failed == {1: Renewal.HELD_BY_ANOTHER, 2: Renewal.GONE}
    assert redis_db.get(leases[1].key) == b"another holder's value"
    assert redis_db.get(leases[2].key) is None


def queued(keeper: LeaseKeeper) -> list[tuple[float, list[KeptLease]]]:
    """The keeper's queue: each entry's due time and its leases."""
    return sorted((when, list(entry.leases) if isinstance(entry, Bucket) else [entry])
                  for when, _, entry in keeper._queue)  # type: ignore[misc]


def test_leases_renewed_together_are_due_together_and_forgotten_ones_skipped(redis_db: redis.Redis) -> None:
    short, long = LockSpec(task="due", ttl=3.0), LockSpec(task="due", ttl=30.0)
    leases: list[Lease] = []
    for n in range(8):
        lease = acquire(redis_db, f"singleton:{{due:{n}}}", short if n % 2 else long, f"run-{n}").lease
        assert lease is not None
        leases.append(lease)
    scripted_server(redis_db)
    keeper = LeaseKeeper()
    kept = [KeptLease(lease, None) for lease in leases]
    keeper._active = len(kept)  # kept, as keep() counts them

    keeper._handle(list(kept))

    entries = queued(keeper)
    assert len(entries) == 2, "one queue entry per renewal interval"
    (first_due, first), (second_due, second) = entries
    assert sorted(map(id, first)) == sorted(id(k) for k in kept[1::2]), "the short leases are due first"
    assert sorted(map(id, second)) == sorted(id(k) for k in kept[0::2])
    confirmed = leases[0].confirmed_at
    assert all(lease.confirmed_at == confirmed for lease in leases), "confirmed from the request's start"
    assert first_due == pytest.approx(confirmed + short.renew_every)
    assert second_due == pytest.approx(confirmed + long.renew_every)

    keeper.forget(kept[1])
    with keeper._mutex:
        taken = keeper._take_due(first_due)
    assert sorted(map(id, taken)) == sorted(id(k) for k in kept[3::2]), "the forgotten lease is skipped"
    with keeper._mutex:
        assert keeper._take_due(first_due) == [], "the later entry is not due yet"
    keeper._handle(taken)
    assert [k.renewals for k in kept] == [1, 1, 1, 2, 1, 2, 1, 2]


def test_a_round_makes_few_python_calls_per_renewed_lease(redis_db: redis.Redis) -> None:
    spec = LockSpec(task="calls", ttl=600.0)
    leases = [acquire(redis_db, f"singleton:{{calls:{n}}}", spec, f"run-{n}").lease for n in range(220)]
    assert all(leases)
    scripted_server(redis_db)
    calls = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[0] += 1

    def round_of(keeper: LeaseKeeper, profiled: bool) -> int:
        """One round of the keeper's thread over every lease it keeps: its Python calls."""
        before = calls[0]
        if profiled:
            sys.setprofile(profile)
        try:
            with keeper._mutex:
                taken = keeper._take_due(float("inf"))
            keeper._handle(taken)
        finally:
            sys.setprofile(None)
        assert len(taken) == keeper._active
        return calls[0] - before

    counts = []
    kept: list[KeptLease] = []
    for some in (leases[:20], leases[20:]):
        keeper = LeaseKeeper()
        keeper._running = True  # no thread: the rounds run here
        kept += [keeper.keep(lease) for lease in some]  # type: ignore[arg-type]
        round_of(keeper, False)  # the keeper's own client is made, the leases' arguments spelt
        counts.append(round_of(keeper, True))
    assert all(k.renewals == 2 and not k.lost for k in kept)
    few, many = counts
    per_lease = (many - few) / 180
    assert per_lease <= CALLS_PER_LEASE, \
        f"{per_lease:.1f} Python calls per renewed lease ({few} for 20, {many} for 200)"


def test_a_lease_spells_its_script_arguments_as_the_encoder_does(redis_db: redis.Redis) -> None:
    spec = LockSpec(task="spelt", ttl=7.5)
    lease = acquire(redis_db, "singleton:{spelt:\u00e9t\u00e9}", spec, "run-\u00e9").lease
    assert lease is not None
    key, rest = lease.spell_batch_parts()
    assert lease.batch_parts == (key, rest), "kept for the next round"
    assert b"*3\r\n" + key + rest == pack(lease.key, lease.value, spec.ttl_ms)

    leases = [lease, *take_leases(redis_db, "spelt", TTLS)]
    keys = [each.key for each in leases]
    args = [arg for each in leases for arg in (each.value, each.spec.ttl_ms)]
    assert scripted_call(leases) == pack(*RENEW_MANY.command(keys, args))
