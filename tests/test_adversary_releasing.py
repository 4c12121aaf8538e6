"""Adversarial review of a run's lease renewed until its release is sent
(:meth:`.keeper.LeaseKeeper.releasing`, then :meth:`~.keeper.LeaseKeeper.forget`) and of a
kept lease's first renewal due one interval after its acquire started, against real
redis-servers.

A reviewer who did not write the change tried to break what must keep holding. Each
attack, and what it found:

1. A restart without persistence while a run ends; the keeper's renewal found the lock gone
   and decided to put it back, and is held there while the run begins its release and
   releases (through the run's client, and through another client of the same server, as a
   greenlet process's keeper has): HELD, the key stays free, nothing reported lost.
   ``test_a_put_back_decided_before_releasing_never_writes_a_released_lock_back``.
2. A put-back waiting for the end of the recovery window (a lease confirmed too long before
   the loss) when its run begins its release: HELD, at its time it writes nothing and
   reports nothing. ``test_a_late_put_back_waiting_when_the_run_releases_writes_nothing``.
3. A lock deleted, or taken over by another holder, while the body ran, the keeper not due
   yet: HELD, the release reports the run lost (``lost`` counter), the other holder's lock
   untouched; found by the keeper in the body: ``ensure_held()`` raises.
   ``test_a_loss_during_the_body_is_reported_by_the_release``. The keeper reading the reply
   of such a loss just before the run begins its release (it then says nothing): HELD, the
   release reports it.
   ``test_a_loss_the_keeper_read_just_before_releasing_is_reported_by_the_release``.
   60 leases ending one by one while the keeper, woken by a restart without persistence,
   puts the others back (in three runs 9 to 32 of the 60 releases came before their
   put-back): HELD, no released lock is left (without the ``releasing`` guard on the
   put-back, every run left locks behind).
   ``test_runs_ending_while_the_keeper_puts_locks_back_after_a_restart_leave_no_lock``.
4. Renewals racing releases across threads: 60 leases of 0.3 s TTL renewed by the
   process's keeper while the test thread ends them one by one (``releasing``, release,
   ``forget``): HELD, none lost, every key free once all ended, the keeper's count back.
   ``test_renewals_racing_releases_lose_nothing_and_write_nothing_back``.
5. A release that cannot be sent (the lock Redis killed in the body): HELD, it goes to the
   pending-release path; the lease is forgotten, the pending release given up once the
   lease ended, the keeper's count back where it was and its queue drained.
   ``test_a_release_that_cannot_be_sent_is_forgotten``.
6. ``SoftTimeLimitExceeded`` and ``KeyboardInterrupt`` raised inside the release: HELD, the
   lease is forgotten. ``test_an_exception_inside_the_release_still_forgets``.
7. An ``acks_late`` run on a worker's path (not eager): HELD, its done marker is written.
   ``test_an_acks_late_run_still_writes_its_done_marker``.
8. A lease kept long after its acquire (the first renewal overdue): HELD, renewed at once,
   not skipped; a lease already expired at keep time whose key another took: HELD, lost,
   the other's lock untouched. ``test_a_lease_kept_after_its_renewal_was_due_is_renewed_at_once``,
   ``test_a_lease_expired_at_keep_time_is_lost_and_never_extends_the_next_holder``.
9. A nested call (an eager run calling another singleton task): HELD, the outer run's lease
   is still renewed after the inner one ended, and both keys are free at the end.
   ``test_a_nested_run_ending_leaves_the_outer_lease_renewed``.
10. gevent (monkeypatched process, keeper an OS thread): 40 runs in greenlets sharing a pool
    of two connections, ending together: HELD, none lost, every key free, the keeper's count
    at zero. ``test_gevent_runs_ending_together_lose_nothing``. (At ``lock_ttl=1`` it failed
    once in four runs on a machine at load 11 on 2 cores: 25 of 40 leases found expired by
    the keeper itself while the bodies ran, a keeper thread starved for a second, not a
    release's doing; at ``lock_ttl=3`` it holds.)
11. A late soft time limit (or ``KeyboardInterrupt``) raised by its signal handler just
    after the release ran, while the run's ``forget`` waited for the keeper's lock:
    **BROKE**. ``forget`` never ran: the released lease stayed kept (and counted) for the
    life of the process. Fixed: a releasing lease whose renewal finds its lock gone (or its
    end passed while Redis did not answer) is forgotten by the keeper itself. The same
    signal at the start of the run's end (waiting in ``releasing``): HELD (the ``finally``
    forgets; the lock expires unrenewed). Before the change (``forget`` first, then the
    release, no ``finally``) that one left the lease kept and its lock renewed for the life
    of the process.
    ``test_a_signal_while_the_runs_end_waits_for_the_keeper_never_keeps_the_lease_for_ever``.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

from celery_singleton_beat import SingletonTask
from celery_singleton_beat.exceptions import LockLost
from celery_singleton_beat.lease import counters
from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.lease.holder import done_key
from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper, get_keeper
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.lock_redis import get_redis
from celery_singleton_beat.recovery.server import server_of
from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer, TestProcess, importorskip, wait_for
from .support.keyspace import keyspace_events
from .support.locking import take_leases
from .support.paths import ROOT

KEY = "singleton:{adv-releasing:k}"


def _frames_of(ident: int) -> list[Any]:
    """The frames of thread ``ident``'s stack, innermost first."""
    frame = sys._current_frames().get(ident)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def url_of(client: redis.Redis) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db', 0)}"


def eager_app(url: str, name: str) -> Celery:
    app = Celery(name, set_as_current=False)
    app.conf.update(singleton_redis_url=url, task_always_eager=True)
    return app


@pytest.fixture
def keeper_count() -> Iterator[Callable[[], int]]:
    """The process keeper's count of kept leases and pending releases, relative to the test's start."""
    keeper = get_keeper()
    before = keeper._active
    yield lambda: keeper._active - before


# -------------------------------------------------------------------- 1. a put-back decided before


@pytest.mark.parametrize("via", ["run's client", "another client"])
def test_a_put_back_decided_before_releasing_never_writes_a_released_lock_back(
        make_redis: Callable[..., RedisServer], via: str) -> None:
    """The server restarts empty; the keeper's renewal finds the lock gone and decides to put
    it back, then is held while the run ends (``releasing``, its release on the run's
    client). The renewal goes on: the key must stay free and no loss be reported."""
    server = make_redis()
    client, direct = server.client(), server.client()
    other = server.client() if via == "another client" else None
    if other is not None:
        other.csb_server = server_of(client)  # type: ignore[attr-defined]  # as a keeper's copy shares it
    lease = acquire(client, KEY, LockSpec(task="adv", ttl=30.0), "a").lease
    assert lease is not None
    server.restart()
    keeper = LeaseKeeper()
    lost: list[str] = []
    kept = KeptLease(lease, lambda _, why: lost.append(why))
    decided, ended = threading.Event(), threading.Event()
    may_put_back = lease.may_put_back

    def decide_then_hold(client: Any = None) -> bool:
        answer = may_put_back(client)
        decided.set()
        ended.wait(30)
        return answer

    lease.may_put_back = decide_then_hold  # type: ignore[method-assign]
    outcome: list[float | None] = []
    renewal = threading.Thread(target=lambda: outcome.append(keeper.renewer.renew_one(kept, via=other or client)))
    renewal.start()
    assert decided.wait(30), "the renewal reached its put-back decision"
    with keyspace_events(direct, KEY) as events:
        keeper.releasing(kept)
        released = lease.release()
        ended.set()
        renewal.join(30)
        keeper.forget(kept)
        assert events() == [], "the released lock was written back"
    assert released is False  # the restart took it
    assert outcome == [None] and lost == []
    assert direct.get(KEY) is None


# -------------------------------------------------------------------- 2. a late put-back waiting


def test_a_late_put_back_waiting_when_the_run_releases_writes_nothing(
        make_redis: Callable[..., RedisServer]) -> None:
    """A worker's lease confirmed longer before the restart than a take-over needs waits for
    the end of the recovery window to put its lock back; its run begins its release
    meanwhile. At its time the renewal must write nothing and report nothing."""
    server = make_redis()
    client, direct = server.client(), server.client()
    spec = LockSpec(task="adv", ttl=30.0, boot="adv-boot", live=True, liveness_ttl=1.5,
                    liveness_prefix="singleton")
    lease = acquire(client, KEY, spec, "a").lease
    assert lease is not None
    wait_for(lambda: time.monotonic() > lease.put_back_until, timeout=30, message="past a possible take-over")
    server.restart()
    keeper = LeaseKeeper()
    lost: list[str] = []
    kept = KeptLease(lease, lambda _, why: lost.append(why))
    late = keeper.renewer.renew_one(kept)
    assert late is not None and late == kept.put_back_at, "the put-back waits for the window's end"
    keeper.releasing(kept)
    assert lease.release() is False
    wait_for(lambda: time.monotonic() >= late, timeout=30, message="the late put-back's time")
    with keyspace_events(direct, KEY) as events:
        assert keeper.renewer.renew_one(kept) is None
        assert events() == [], "the released lock was written back at the window's end"
    keeper.forget(kept)
    assert lost == [] and direct.get(KEY) is None


# -------------------------------------------------------------------- 3. a loss during the body


@pytest.mark.parametrize("how", ["deleted", "taken over", "found by the keeper"])
def test_a_loss_during_the_body_is_reported_by_the_release(redis_db: redis.Redis, how: str,
                                                           keeper_count: Callable[[], int]) -> None:
    """The body's lock is deleted (or taken by another holder) while the keeper is not yet
    due: the run's end (``releasing``, then its release) must still report it lost. Found
    by the keeper while the body runs: ``ensure_held()`` raises, and the end keeps it lost."""
    app = eager_app(url_of(redis_db), "adv-releasing-loss")
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, bind=True, lock_ttl=60 if how != "found by the keeper" else 0.6, shared=False)
    def body(self: Any) -> None:
        run = self.singleton_run
        seen["run"] = run
        redis_db.delete(run.key)
        if how == "taken over":
            other = acquire(redis_db, run.key, LockSpec(task="other", ttl=60.0), "other").lease
            assert other is not None
            seen["other"] = other
        if how == "found by the keeper":
            wait_for(lambda: run.lost, timeout=30, message="the keeper found the loss")
            with pytest.raises(LockLost):
                run.ensure_held()

    body.apply().get()
    run = seen["run"]
    assert run.lost and run.lost_reason == (
        "the lock was deleted, expired or taken by another holder" if how == "found by the keeper"
        else "the lock was gone when the run ended")
    assert keeper_count() == 0
    counters.flush()
    assert redis_db.hget(body.singleton_stats_key(), "lost") == b"1"
    if how == "taken over":
        assert read_holder(redis_db, run.key).raw == seen["other"].value, "the other holder's lock stays"


def test_a_loss_the_keeper_read_just_before_releasing_is_reported_by_the_release(
        redis_db: redis.Redis, keeper_count: Callable[[], int]) -> None:
    """The keeper's renewal reads the reply of a lock deleted in the body (a real loss), and
    the run begins its release before the keeper judges that reply: the keeper says nothing
    (the lease is releasing), so the release must report the loss."""
    app = eager_app(url_of(redis_db), "adv-releasing-read")
    seen: dict[str, Any] = {}
    read = threading.Event()

    @app.task(base=SingletonTask, bind=True, lock_ttl=0.6, shared=False)
    def body(self: Any) -> None:
        run = seen["run"] = self.singleton_run
        kept = run
        renew_once = kept.lease.renew_once

        def read_then_wait(client: Any = None) -> Any:
            outcome = renew_once(client)
            read.set()
            wait_for(lambda: kept.releasing, timeout=30, interval=0.001, message="the run is releasing")
            return outcome

        kept.lease.renew_once = read_then_wait
        redis_db.delete(run.key)
        assert read.wait(30), "the keeper read the reply"

    body.apply().get()
    run = seen["run"]
    assert run.lost and run.lost_reason == "the lock was gone when the run ended"
    wait_for(lambda: keeper_count() == 0, timeout=30, message="the lease forgotten")
    counters.flush()
    assert redis_db.hget(body.singleton_stats_key(), "lost") == b"1"


# -------------------------------------------------------------------- 4. renewals racing releases


def test_renewals_racing_releases_lose_nothing_and_write_nothing_back(
        redis_db: redis.Redis, keeper_count: Callable[[], int]) -> None:
    """60 leases of 0.3 s (renewed every 0.1 s by the process's keeper) ended one by one, at
    random moments, by the test thread as a run ends them: none may be reported lost,
    every key must be free once all ended and the keeper has renewed through them."""
    client = get_redis(eager_app(url_of(redis_db), "adv-releasing-race"))
    mark_in_use(redis_db)
    keeper = get_keeper()
    rng = random.Random(7)
    leases = take_leases(client, "adv-race", [0.3] * 60)
    lost: list[str] = []
    kept = [keeper.keep(lease, lambda k, why: lost.append(f"{k.lease.key}: {why}")) for lease in leases]
    results = []
    for k in kept:
        wait_for(lambda: rng.random() < 0.3, timeout=30, interval=0.01, message="a random moment")
        keeper.releasing(k)
        results.append(k.lease.release())
        keeper.forget(k)
    assert lost == [] and all(results), (lost, results)
    assert keeper_count() == 0
    assert not any(redis_db.exists(lease.key) for lease in leases)


def test_runs_ending_while_the_keeper_puts_locks_back_after_a_restart_leave_no_lock(
        make_redis: Callable[..., RedisServer], keeper_count: Callable[[], int]) -> None:
    """60 leases of 30 s kept by the process's keeper; the server restarts empty; the test
    thread then ends them one by one as runs do while the keeper, woken by the restart
    (found by the first release), puts the others back. A lock put back after its run's
    release would stay 30 s: once every run ended, no key may be left."""
    server = make_redis()
    client = server.client()
    mark_in_use(client)
    keeper = get_keeper()
    leases = take_leases(client, "adv-restart", [30.0] * 60)
    lost: list[str] = []
    kept = [keeper.keep(lease, lambda k, why: lost.append(f"{k.lease.key}: {why}")) for lease in leases]
    server.restart()
    for k in kept:
        keeper.releasing(k)
        k.lease.release()  # True where the keeper put it back first, False where the restart took it
        keeper.forget(k)
    direct = server.client()
    assert [lease.key for lease in leases if direct.exists(lease.key)] == [], "a released lock was put back"
    assert lost == [] and keeper_count() == 0


# -------------------------------------------------------------------- 5. a release that cannot be sent


def test_a_release_that_cannot_be_sent_is_forgotten(make_redis: Callable[..., RedisServer],
                                                    keeper_count: Callable[[], int]) -> None:
    """The lock Redis is killed in the body: the release fails, goes to the pending path;
    the kept lease is forgotten at once and the pending release given up once the lease
    has ended: the keeper's count comes back, its queue holds nothing of them."""
    server = make_redis()
    app = eager_app(server.url(0), "adv-releasing-down")
    app.conf.singleton_redis_options = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, bind=True, lock_ttl=1.5, shared=False)
    def body(self: Any) -> None:
        seen["kept"] = self.singleton_run
        server.kill()

    body.apply()
    kept = seen["kept"]
    assert not kept.active, "the kept lease is forgotten as the run ends"
    keeper = get_keeper()
    assert any(p.lease is kept.lease for p in keeper.pending_releases), "its release is sent again"
    wait_for(lambda: keeper_count() == 0, timeout=30, message="the pending release given up")
    assert not keeper.pending_releases
    renewals = kept.renewals
    wait_for(lambda: all(entry[2] is not kept and getattr(entry[2], "lease", None) is not kept.lease
                         for entry in list(keeper._queue)), timeout=30, message="its entries dropped")
    assert kept.renewals == renewals


# -------------------------------------------------------------------- 6. exceptions inside the release


@pytest.mark.parametrize("error", [SoftTimeLimitExceeded, KeyboardInterrupt])
def test_an_exception_inside_the_release_still_forgets(redis_db: redis.Redis, error: type[BaseException],
                                                       keeper_count: Callable[[], int]) -> None:
    app = eager_app(url_of(redis_db), "adv-releasing-raise")
    seen: dict[str, Any] = {}

    def raising(*args: Any, **kwargs: Any) -> bool:
        raise error()

    @app.task(base=SingletonTask, bind=True, lock_ttl=30, shared=False)
    def body(self: Any) -> None:
        kept = seen["kept"] = self.singleton_run
        kept.lease.release = raising

    if error is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            body.apply()
    else:
        body.apply()
    assert not seen["kept"].active and keeper_count() == 0


# -------------------------------------------------------------------- 7. done markers


def test_an_acks_late_run_still_writes_its_done_marker(redis_db: redis.Redis,
                                                       keeper_count: Callable[[], int]) -> None:
    """A run on a worker's path (a request pushed, not eager) of an ``acks_late`` task: its
    release leaves its done marker."""
    app = Celery("adv-releasing-marker", set_as_current=False)
    app.conf.update(singleton_redis_url=url_of(redis_db))
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, bind=True, acks_late=True, lock_ttl=30, shared=False)
    def body(self: Any) -> None:
        seen["key"] = self.singleton_run.key

    body.push_request(id="marker-1", hostname="adv@host", is_eager=False, delivery_info={}, called_directly=False)
    try:
        body()
    finally:
        body.pop_request()
    wait_for(lambda: redis_db.exists(done_key(seen["key"], "marker-1")), timeout=10, message="the done marker")
    assert not redis_db.exists(seen["key"]) and keeper_count() == 0


# -------------------------------------------------------------------- 8. confirmed long before


def test_a_lease_kept_after_its_renewal_was_due_is_renewed_at_once(redis_db: redis.Redis) -> None:
    """A lease handed to a keeper after its first renewal was due (an acquire whose reply was
    read late), the keeper idle with another lease due much later: renewed at once."""
    client = get_redis(eager_app(url_of(redis_db), "adv-releasing-late"))
    mark_in_use(redis_db)
    far, late = take_leases(client, "adv-late", [600.0, 3.0])
    keeper = LeaseKeeper()
    keeper.keep(far)
    wait_for(lambda: keeper.waiting, timeout=10, message="the keeper waits for the far lease")
    wait_for(lambda: time.monotonic() > late.confirmed_at + late.renew_every, timeout=10,
             message="the late lease's renewal is overdue")
    confirmed = late.confirmed_at
    kept = keeper.keep(late)
    wait_for(lambda: kept.renewals or kept.lost, timeout=30, message="the overdue lease renewed")
    assert not kept.lost and late.confirmed_at > confirmed
    assert redis_db.get(late.key) == late.value.encode()
    keeper.forget(kept)


def test_a_lease_expired_at_keep_time_is_lost_and_never_extends_the_next_holder(redis_db: redis.Redis) -> None:
    client = get_redis(eager_app(url_of(redis_db), "adv-releasing-expired"))
    mark_in_use(redis_db)
    [old] = take_leases(client, "adv-expired", [0.2])
    wait_for(lambda: not redis_db.exists(old.key), timeout=10, message="the lease expired")
    nxt = acquire(redis_db, old.key, LockSpec(task="next", ttl=5.0), "next").lease
    assert nxt is not None
    keeper = LeaseKeeper()
    lost: list[str] = []
    with keyspace_events(redis_db, old.key) as events:
        kept = keeper.keep(old, lambda _, why: lost.append(why))
        wait_for(lambda: lost, timeout=30, message="the expired lease found lost")
        assert events() == [], "the next holder's lock was touched"
    keeper.forget(kept)
    assert read_holder(redis_db, old.key).raw == nxt.value


# -------------------------------------------------------------------- 9. nested runs


def test_a_nested_run_ending_leaves_the_outer_lease_renewed(redis_db: redis.Redis,
                                                           keeper_count: Callable[[], int]) -> None:
    app = eager_app(url_of(redis_db), "adv-releasing-nested")
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, bind=True, lock_ttl=0.6, shared=False)
    def inner(self: Any) -> None:
        seen["inner"] = self.singleton_run

    @app.task(base=SingletonTask, bind=True, lock_ttl=0.6, shared=False)
    def outer(self: Any) -> None:
        run = seen["outer"] = self.singleton_run
        inner.apply().get()
        assert not seen["inner"].active
        renewals = run.renewals
        wait_for(lambda: run.renewals >= renewals + 3 or run.lost, timeout=30,
                 message="the outer lease renewed")
        assert not run.lost, run.lost_reason
        run.ensure_held()

    outer.apply().get()
    assert not seen["outer"].lost and not seen["inner"].lost
    assert not redis_db.exists(seen["outer"].key) and not redis_db.exists(seen["inner"].key)
    assert keeper_count() == 0


# -------------------------------------------------------------------- 10. gevent

GEVENT_CHILD = r"""
from gevent import monkey
monkey.patch_all()

import random
import sys

import gevent
import redis
from celery import Celery

from celery_singleton_beat import SingletonTask
from celery_singleton_beat.lease.keeper import get_keeper

url = sys.argv[1]
app = Celery("adv-releasing-gevent", set_as_current=False)
app.conf.update(singleton_redis_url=url, singleton_redis_options={"max_connections": 2},
                task_always_eager=True)
looker = redis.Redis.from_url(url)
runs = []


# lock_ttl 3: a keeper slowed by a busy machine (load 11 on 2 cores) let 25 of 40 leases of
# lock_ttl 1 expire before their renewal, once in four runs (found by the keeper, not at the release).
@app.task(base=SingletonTask, bind=True, lock_ttl=3, shared=False)
def held(self, n):
    run = self.singleton_run
    runs.append(run)
    renewals = run.renewals
    while run.renewals < renewals + 2 and not run.lost:
        gevent.sleep(0.01)
    end = __import__("time").perf_counter() + random.uniform(0, 0.05)
    while __import__("time").perf_counter() < end:  # the hub blocked a little, as ending runs do
        pass


gevent.joinall([gevent.spawn(held.apply, args=(n,), kwargs={}) for n in range(40)])
lost = [run.lost_reason for run in runs if run.lost]
left = sum(looker.exists(run.key) for run in runs)
print(f"RESULT runs={len(runs)} lost={len(lost)} left={left} active={get_keeper()._active} why={lost[:3]}",
      flush=True)
"""


def test_gevent_runs_ending_together_lose_nothing(redis_db: redis.Redis) -> None:
    importorskip("gevent")
    mark_in_use(redis_db)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = TestProcess("adv-releasing-gevent", [sys.executable, "-c", GEVENT_CHILD, url_of(redis_db)],
                        env=env).start()
    try:
        line = child.wait_for_line("RESULT", timeout=180)
    finally:
        child.close()
    assert "runs=40 lost=0 left=0 active=0" in line, line


# -------------------------------------------------------------------- 11. a signal as the run ends


@pytest.mark.parametrize("error", [SoftTimeLimitExceeded, KeyboardInterrupt])
@pytest.mark.parametrize("at", ["start of the end", "after the release"])
def test_a_signal_while_the_runs_end_waits_for_the_keeper_never_keeps_the_lease_for_ever(
        redis_db: redis.Redis, error: type[BaseException], at: str, keeper_count: Callable[[], int]) -> None:
    """A late soft time limit (billiard's ``SIGUSR1`` handler raises inside the tracer, so in a
    run's end too) or a ``KeyboardInterrupt`` reaches the run while its end waits for the
    keeper's lock (held by the keeper's own work: a round, a put-back's round trip): at the
    start of its end, or after its release ran, as it forgets its lease. The lease must
    not stay kept: the keeper's count comes back, and its lock goes (released, or expired
    unrenewed), never renewed for ever."""
    app = eager_app(url_of(redis_db), "adv-releasing-signal")
    keeper = get_keeper()
    main = threading.get_ident()
    seen: dict[str, Any] = {}
    errors: list[BaseException] = []
    reached, holding, raised = threading.Event(), threading.Event(), threading.Event()
    #: Where the run waits for the keeper's lock: the first call of its end (``forget`` before
    #: the release, in the code before ``releasing``), or ``forget`` after its release.
    waits_in = {"releasing", "forget"} if at == "start of the end" else {"forget"}

    def raise_it(signum: int, frame: Any) -> None:
        raised.set()
        raise error()

    def hold_the_keepers_lock() -> None:
        try:
            assert reached.wait(30)
            with keeper._mutex:  # the keeper's own work holds it; the run's end waits
                holding.set()
                wait_for(lambda: waits_in & {f.f_code.co_name for f in _frames_of(main)}, timeout=30,
                         interval=0.001, message=f"the run waits in {waits_in}")
                signal.pthread_kill(main, signal.SIGUSR2)
                wait_for(raised.is_set, timeout=30, interval=0.001, message="the signal was handled")
        except BaseException as exc:
            errors.append(exc)
            holding.set()

    def let_the_keepers_lock_be_taken() -> None:
        reached.set()
        assert holding.wait(30), "the keeper's lock is held"

    @app.task(base=SingletonTask, bind=True, lock_ttl=0.6, shared=False)
    def body(self: Any) -> None:
        kept = seen["kept"] = self.singleton_run
        if at == "start of the end":
            let_the_keepers_lock_be_taken()
            return
        release = kept.lease.release

        def release_then_let_go(*args: Any, **kwargs: Any) -> bool | None:
            try:
                return release(*args, **kwargs)
            finally:
                let_the_keepers_lock_be_taken()

        kept.lease.release = release_then_let_go

    previous = signal.signal(signal.SIGUSR2, raise_it)
    holder = threading.Thread(target=hold_the_keepers_lock, daemon=True)
    holder.start()
    try:
        try:
            body.apply()
        except KeyboardInterrupt:
            pass
        finally:
            raised.set()
        holder.join(30)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert errors == []
    kept = seen["kept"]
    wait_for(lambda: keeper_count() == 0, timeout=30, message="the lease forgotten")
    wait_for(lambda: not redis_db.exists(kept.lease.key), timeout=30, message="the lock released or expired")
    assert not kept.active
