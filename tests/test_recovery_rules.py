"""The put-back rules, each forced against a real redis-server that loses its data.

A lease whose lock the server lost (a restart without an append-only file, a promoted
replica) puts the lock back on its next renewal. Two rules bound that, each with the
attack that breaks it when the rule is removed:

* ``test_a_holder_stopped_past_a_possible_take_over_does_not_put_its_lock_back``: a
  holder stopped longer than a take-over needs (a paused pod) was taken over on the old
  server; the server then lost both locks. The stopped holder must not put its lock
  back at once: the key belongs to the holder that took it over (higher fencing token),
  which puts its own back on its usual schedule; the stopped one waits for the end of
  the recovery window, finds the taker's lock and loses its lease.
* ``test_a_renewal_in_flight_when_its_run_releases_never_puts_the_lock_back``: the
  keeper decided to put a lost lock back; before it writes, the run ends and releases.
  The put-back must not bring the ended run's lock back (with its full TTL).
* ``test_a_lock_its_holder_did_not_confirm_after_a_snapshot_restart_is_free_after_the_window``:
  an RDB snapshot brings back the lock of a run that ended since; no live holder renews
  it in the recovery window, so the next acquisition after the window takes it; a lock
  its live holder renewed in the window stays held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis

from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.server import server_of

from .support import RedisServer, wait_for
from .support.keyspace import keyspace_events
from .support.locking import renew

KEY = "singleton:{rules:k}"
OTHER = "singleton:{rules:other}"
#: A short liveness TTL: renewals every 0.5 s, a take-over possible 2 s after the last one.
LIVENESS_TTL = 1.5


def worker_spec(boot: str) -> LockSpec:
    """A worker's run lock: live, take-overs of dead holders allowed."""
    return LockSpec(task="rules", ttl=30.0, boot=boot, live=True, liveness_ttl=LIVENESS_TTL,
                    liveness_prefix="singleton")


def take_over_once_possible(client: redis.Redis, spec: LockSpec) -> Lease:
    """Acquire ``KEY`` again and again until the stopped holder's lock is taken over."""
    taken: list[Lease] = []

    def attempt() -> bool:
        lease = acquire(client, KEY, spec, "b").lease
        if lease is not None:
            taken.append(lease)
        return lease is not None

    wait_for(attempt, timeout=30, message="b took the lock of the stopped holder over")
    return taken[0]


def test_a_holder_stopped_past_a_possible_take_over_does_not_put_its_lock_back(
        make_redis: Callable[..., RedisServer]) -> None:
    """Holder ``a`` (its own client: a process of its own) stops renewing and publishes no
    liveness; ``b`` takes its lock over once it provably could (renewals missed, the
    watch). The server then restarts empty. ``a`` resumes first: its renewal finds the
    lock gone on a server that lost data, but ``a`` was not confirmed when the take-over
    became possible, so it must not put its lock back; ``b`` puts its own back."""
    server = make_redis()
    a, b, direct = server.client(), server.client(), server.client()
    held = acquire(a, KEY, worker_spec("a-boot"), "a").lease
    assert held is not None
    # b's own lock is not a worker's (no take-over of it): its put-back does not hang on how
    # fast the server restarts.
    taker = take_over_once_possible(b, LockSpec(task="rules", ttl=30.0, liveness_ttl=LIVENESS_TTL,
                                                liveness_prefix="singleton"))
    assert taker.fence > held.fence
    server.restart()  # SIGKILL, back empty: both locks are gone

    confirmed_in = held.epoch
    keeper, kept = LeaseKeeper(), KeptLease(held, None)
    with keyspace_events(direct, KEY) as events:
        late = keeper.renewer.renew_one(kept)  # a resumes: its keeper's next renewal
        assert server_of(a).epoch > confirmed_in, "a found its data lost (the rule under test is then asked)"
        assert events() == [], "the stopped holder wrote its lock back, if only for a moment"
    assert not kept.lost and late is not None and late == kept.put_back_at, \
        "a waits for the end of the recovery window before it may put its lock back"
    assert renew(taker), "the holder that took the lock over puts its own back at once"
    assert read_holder(direct, KEY).raw == taker.value
    wait_for(lambda: time.monotonic() >= late, timeout=30, message="a's turn, as the window closes")
    assert keeper.renewer.renew_one(kept) is None and kept.lost, "a finds the taker's lock: its lease is lost"
    assert read_holder(direct, KEY).raw == taker.value


def test_a_renewal_in_flight_when_its_run_releases_never_puts_the_lock_back(
        make_redis: Callable[..., RedisServer]) -> None:
    """The keeper's renewal after a restart finds the lock gone and decides to put it back;
    it is held right there while the run ends (the keeper forgets the lease, the run
    releases). Then the renewal goes on: the key must stay free."""
    server = make_redis()
    client, direct = server.client(), server.client()
    lease = acquire(client, KEY, LockSpec(task="rules", ttl=30.0), "a").lease
    assert lease is not None
    server.restart()

    keeper = LeaseKeeper()
    kept = KeptLease(lease, None)
    decided, ended = threading.Event(), threading.Event()
    may_put_back = lease.may_put_back

    def decide_then_hold(via: object = None) -> bool:
        answer = may_put_back(via)  # type: ignore[arg-type]
        decided.set()
        ended.wait(30)
        return answer

    lease.may_put_back = decide_then_hold  # type: ignore[method-assign]
    outcome: list[bool] = []
    renewal = threading.Thread(target=lambda: outcome.append(keeper.renew(kept)))
    renewal.start()
    assert decided.wait(30), "the renewal reached its put-back decision"
    keeper.forget(kept)  # the run ends: the keeper stops, then the run releases
    lease.release()
    ended.set()
    renewal.join(30)
    assert outcome == [False]
    assert direct.get(KEY) is None, "the ended run's lock came back"


def test_a_lock_its_holder_did_not_confirm_after_a_snapshot_restart_is_free_after_the_window(
        make_redis: Callable[..., RedisServer]) -> None:
    """An RDB snapshot holds ``a``'s lock; ``a``'s run then ends and releases; the server
    restarts from the snapshot: the ended run's lock is back, with most of its TTL. No
    live holder renews it in the recovery window, so once the window has closed the next
    acquisition takes it (and is not skipped as its duplicate); a lock its live holder
    renewed in the window stays held."""
    server = make_redis()
    a, b, direct = server.client(), server.client(), server.client()
    ended = acquire(a, KEY, LockSpec(task="rules", ttl=60.0, liveness_ttl=LIVENESS_TTL), "ended").lease
    live = acquire(a, OTHER, LockSpec(task="rules", ttl=60.0, liveness_ttl=LIVENESS_TTL), "live").lease
    assert ended is not None and live is not None
    warm = acquire(b, "singleton:{rules:warm}", LockSpec(task="rules", ttl=60.0), "warm").lease
    assert warm is not None and warm.release()  # b has seen the server too
    direct.save()  # the snapshot holds both locks
    assert ended.release()
    server.kill()
    server.start()  # from the snapshot: the ended run's lock is back
    assert read_holder(direct, KEY).raw == ended.value
    keeper = LeaseKeeper()
    kept = keeper.keep(live)  # the live holder renews every 0.5 s: within the window
    try:
        wait_for(lambda: kept.renewals >= 1 and server_of(a).epoch > 0, timeout=30,
                 message="the live holder renewed on the restarted server")
        taken = acquire(b, KEY, LockSpec(task="rules", ttl=60.0, liveness_ttl=LIVENESS_TTL), "next")
        assert server_of(b).data_lost_since_ms() > 0, "b knows when the window opened"
        assert taken.acquired, f"the ended run's lock, back from the snapshot, held the key: {taken.holder}"
        assert taken.lease is not None and taken.lease.fence > ended.fence
        held = acquire(b, OTHER, LockSpec(task="rules", ttl=60.0, liveness_ttl=LIVENESS_TTL), "other")
        assert not held.acquired and not kept.lost, "a lock its live holder renewed in the window stays held"
    finally:
        keeper.forget(kept)
