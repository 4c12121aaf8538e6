"""Attacks on two changes: a lock granted by a reply later than its lease is given back
(never run on), and a worker frees a discarded message's claims on a thread of its own.

Real redis-server from the test session; the slow link is the tests' delaying proxy,
whose delay is changed while it runs (a fast publish, then a slow acquire), or a holding
proxy in front of a real worker stopped while its reply waits (SIGSTOP).

An ``until_executed`` run whose late lock is given back as its message's claim was
suspected of being lost: its retry (same task id) refused by that very claim. It is
not: the retry is published (a task's own re-publish never conflicts with its claim)
and its run adopts the claim; the body runs once (a real worker, with and without a
result backend, the late lock expired or still standing).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest
import redis
from celery import Celery, Task, states
from celery.app.trace import TraceInfo, build_tracer

from celery_singleton_beat import LockUnavailable, SingletonTask
from celery_singleton_beat.lease import counters
from celery_singleton_beat.lease.holder import parse_holder
from celery_singleton_beat.lease.keeper import get_keeper
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.lock_redis import reset_clients
from celery_singleton_beat.task.request import _in_background

from .support import BROKER_DB, LOCK_DB, RECORD_DB, CeleryProcess, RedisServer, start_worker, wait_for
from .support.holding_proxy import HoldingProxy
from .support.proxy import DelayProxy
from .support.tasks import lock_keys
from .test_redelivery import entries, load_app, worker

#: The lease of the runs here, and the delay of each chunk through the proxy while the
#: link is slow: a round trip takes at least twice the delay, longer than the lease.
LEASE, DELAY = 1.0, 0.6
ORDER_APP = "tests.apps.order_app"


@pytest.fixture
def proxy(redis_db: redis.Redis, redis_server: RedisServer) -> Iterator[DelayProxy]:
    """A proxy (no delay yet) in front of the session's emptied redis-server."""
    link = DelayProxy(redis_server.port, 0.0).start()
    yield link
    reset_clients()
    link.close()


def _app(proxy: DelayProxy, **conf: object) -> Celery:
    app = Celery("late-adversary", broker="memory://", set_as_current=False)
    app.conf.update(singleton_lock_ttl=LEASE, singleton_redis_url=f"redis://127.0.0.1:{proxy.port}/{LOCK_DB}",
                    singleton_redis_options={"socket_timeout": 10.0, "socket_connect_timeout": 10.0}, **conf)
    return app


def test_a_late_reply_adopting_a_publish_claim_does_not_free_the_claim(proxy: DelayProxy, locks: redis.Redis) -> None:
    """``until_executed``: the message's run adopts its publish claim, but the reply comes
    after the lease, so the run does not start (it waits for Redis, its retry queued). The
    key must still stand for the queued message: a second publish of the same arguments
    is deduplicated, not queued beside it."""
    app = _app(proxy)
    ran: list[int] = []

    @app.task(base=SingletonTask, shared=False, lock_mode="until_executed")
    def job(x: int) -> int:
        ran.append(x)
        return x

    first = job.apply_async(args=(1,))  # the claim, over a fast link
    assert lock_keys(locks), "the publish claim is written"
    proxy.delay = DELAY
    info = _run_as_worker(job, first.id, (1,))  # its run, over a slow link
    proxy.delay = 0.0
    assert ran == [] and info.state == states.RETRY, "the run waits for Redis: its retry is published"
    wait_for(lambda: not get_keeper().pending_releases, timeout=30, message="the late lock given back")
    second = job.apply_async(args=(1,))
    assert second.id == first.id, "a duplicate of a message still waiting to run was published beside it"
    counters.flush()
    assert locks.hget(job.singleton_stats_key() or "", "lost") is None, "no run lost a lease"


def _run_as_worker(task: Task, task_id: str, args: tuple[object, ...]) -> TraceInfo:
    """Run ``task`` as a worker's pool does (not eager: a wait for Redis publishes its retry)."""
    tracer = build_tracer(task.name, task, app=task.app, eager=False, propagate=False)
    traced = tracer(task_id, args, {}, {"id": task_id, "retries": 0, "is_eager": False,
                                        "delivery_info": {"routing_key": "celery"}})
    return traced[1]  # type: ignore[no-any-return]


def test_the_pending_give_back_of_a_late_lock_spares_the_same_task_ids_next_lock(
    proxy: DelayProxy, locks: redis.Redis, redis_server: RedisServer,
) -> None:
    """The late lock's give-back is sent by the keeper after the run failed its acquire; by
    then the key may hold a newer lock of the same task id (the run's retry took it after
    the late one expired). The give-back compares the lock's value (a fresh token per
    acquire), not the task id: the newer lock stays."""
    app = _app(proxy, task_always_eager=True)

    @app.task(base=SingletonTask, shared=False)
    def job(x: int) -> int:
        return x

    task_id = "late-then-retried"
    proxy.delay = DELAY
    with pytest.raises(LockUnavailable, match="could vouch for it"):
        job.apply(args=(1,), task_id=task_id, throw=True)
    proxy.hold()  # the give-back waits in the proxy
    try:
        (key,) = lock_keys(locks) or [job.singleton_key((1,), {})]
        locks.delete(key)  # the late lock expired ...
        direct = redis.Redis(port=redis_server.port, db=LOCK_DB)
        newer = acquire(direct, key, LockSpec(task=job.name, ttl=60.0), task_id).lease  # ... and the retry took it
        assert newer is not None
    finally:
        proxy.delay = 0.0
        proxy.resume()
    wait_for(lambda: not get_keeper().pending_releases, timeout=30, message="the late lock's give-back sent")
    assert locks.get(key) == newer.value.encode(), "the give-back of the late lock deleted the retry's lock"


def test_many_discards_at_once_are_freed_in_order_on_one_thread() -> None:
    """A burst of discarded messages (a mass revoke) queues one piece of work each: they
    run in the order of their discards, on one thread (no thread per message), and one
    that fails does not stop the ones behind it."""
    done: list[int] = []
    release = threading.Event()

    def work(n: int) -> Callable[[], None]:
        def run() -> None:
            if n == 0:
                release.wait(30)  # the lock Redis is slow: the rest pile up behind it
            if n == 7:
                raise redis.ConnectionError("this one could not be freed")
            done.append(n)
        return run

    for n in range(300):
        _in_background(work(n))
    discards = [t for t in threading.enumerate() if t.name == "singleton-discards"]
    assert len(discards) == 1, "one thread frees every discard"
    release.set()
    wait_for(lambda: len(done) == 299, timeout=60, message="every discard freed")
    assert done == [n for n in range(300) if n != 7]
    assert [t for t in threading.enumerate() if t.name == "singleton-discards"] == discards


def test_a_worker_paused_while_its_acquire_is_in_flight_does_not_run_beside_the_next_holder(
    order: ModuleType, redis_server: RedisServer, locks: redis.Redis, records: redis.Redis,
) -> None:
    """Worker A (solo pool, its lock connection through a proxy) sends the acquire of
    ``k``; the proxy holds it, A is stopped (SIGSTOP), then the acquire reaches Redis and
    its reply waits in A's socket. The lock expires; worker B takes ``k`` and runs, held
    there. A continues (SIGCONT) and reads a reply granting the lock: it must not run
    while B's run holds the key."""
    env = {"CSB_LOCK_TTL": "2"}
    with HoldingProxy(redis_server.port, "paused-a") as link:
        a = start_worker(redis_server, ORDER_APP, "paused-a", pool="solo", concurrency=1, extra=["-Q", "qa"],
                         env={**env, "CSB_LOCK_REDIS": f"redis://127.0.0.1:{link.port}/{LOCK_DB}"})
        b = start_worker(redis_server, ORDER_APP, "holder-b", pool="solo", concurrency=1, extra=["-Q", "qb"],
                         env={**env, "CSB_LOCK_REDIS": f"redis://127.0.0.1:{redis_server.port}/{LOCK_DB}"})
        link.hold(b"order_app.step")
        first = order.step.apply_async(("k",), {"note": "A"}, queue="qa")
        held = wait_for(lambda: link.held_with(b"order_app.step"), timeout=60, message="A's acquire held")
        a.signal(signal.SIGSTOP)
        try:
            link.let_go([held[0][1]], timeout=30)  # returns once Redis answered it: A's lock is written
            wait_for(lambda: not lock_keys(locks), timeout=30, message="A's lock expired")
            records.set("hold:k", "1")
            second = order.step.apply_async(("k",), {"note": "B"}, queue="qb")
            wait_for(lambda: records.get("running:k") == second.id.encode(), timeout=60, message="B runs")
        finally:
            a.signal(signal.SIGCONT)
        wait_for(lambda: "could vouch for it" in a.output() or records.get("running:k") != second.id.encode(),
                 timeout=60, message="A read its late reply")
        assert records.get("running:k") == second.id.encode(), "A ran on a lock granted by a late reply"
        a.wait_for_line(first.id, "could vouch for it", timeout=60)
        records.delete("hold:k")
        assert second.get(timeout=60) == "k"
        runs = [json.loads(r)["note"] for r in records.lrange("runs:k", 0, -1)]
        assert runs[:1] == ["B"], runs
        a.close()
        b.close()


def test_a_late_lock_is_not_counted_as_a_run_that_took_its_lock(proxy: DelayProxy, locks: redis.Redis) -> None:
    """A lock granted by a reply that came after its lease ran out starts no run: the
    ``acquired`` counter (runs that took their lock) nets to nothing for it, and it is
    counted neither ``released`` nor ``lost`` when it is given back."""
    app = _app(proxy, task_always_eager=True)

    @app.task(base=SingletonTask, shared=False)
    def job(x: int) -> int:
        return x

    proxy.delay = DELAY
    with pytest.raises(LockUnavailable, match="could vouch for it"):
        job.apply(args=(1,), throw=True)
    proxy.delay = 0.0
    wait_for(lambda: not get_keeper().pending_releases, timeout=30, message="the late lock given back")
    counters.flush()
    counted = locks.hgetall(job.singleton_stats_key() or "")
    assert {field: int(value) for field, value in counted.items()
            if field in (b"acquired", b"released", b"lost") and int(value)} == {}, counted


def test_a_forked_child_frees_its_own_discards() -> None:
    """A process forked after the discards' thread started (a pool process replaced, a
    daemonising worker) has no such thread: its first discard starts one of its own, and
    its work runs."""
    started = threading.Event()
    _in_background(started.set)
    assert started.wait(30), "the parent's thread runs"
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether its discard ran, and leave at once
        ran = threading.Event()
        _in_background(ran.set)
        os.write(writer, b"1" if ran.wait(30) else b"0")
        os._exit(0)
    os.close(writer)
    try:
        assert os.read(reader, 1) == b"1", "the child's discard ran"
    finally:
        os.close(reader)
        os.waitpid(pid, 0)


@pytest.mark.slow
@pytest.mark.parametrize("results", ["backend", "no-backend"])
@pytest.mark.parametrize("lease", ["expired", "still-held"])
def test_an_until_executed_run_whose_adoption_reply_comes_late_runs_once_from_its_retry(
    lease: str, results: str, redis_server: RedisServer, redis_db: redis.Redis, locks: redis.Redis,
    processes: list[CeleryProcess], delivery_env: dict[str, str],
) -> None:
    """``until_executed``: the run of a published message adopts its publish claim, and the
    adoption's reply comes later than the lease could be vouched for (worker A, solo pool,
    its lock connection through a proxy: the adoption is held, A stopped, the adoption let
    through, A continued once that long had passed). The late lock is given back as the
    message's claim again (turned back into it while it stands, ``still-held``; claimed
    anew once it expired, ``expired``), and the run waits for Redis: its retry is
    published under the same task id. That retry must not be refused by the claim the
    give-back left (same task id): the body runs exactly once, from the retry; a publish of
    the same arguments meanwhile returns the waiting message's result; the key is free at
    the end and the next publish runs. With and without a result backend."""
    ttl = 2.0 if lease == "expired" else 300.0  # expired: the lock is gone before A reads the reply
    delivery_env.update(CSB_LOCK_TTL=str(ttl))
    if results == "no-backend":
        delivery_env.update(CSB_BACKEND="")
    app = load_app(redis_server, **delivery_env)  # the client: its claims go straight to Redis
    records = redis_server.client(RECORD_DB)
    grace = LockSpec(task="late", ttl=ttl, live=True, liveness_ttl=float(app.app.conf.singleton_liveness_ttl)).grace
    with HoldingProxy(redis_server.port, "late-adoption") as link:
        a = worker(redis_server, processes, "late-a", {**delivery_env, "CSB_LOCK_REDIS": link.url(LOCK_DB)},
                   pool="solo")
        records.set("hold:k", "1")  # the run, once it starts, holds the key until the test lets it end
        link.hold(b'"claim":true')  # the adoption names the claim it replaces; the run's first SET does not
        first = app.queued_once.delay("k", 0)
        key = app.queued_once.singleton_key(("k", 0), {})
        claim = parse_holder(locks.get(key))
        assert claim is not None and claim.claim and claim.task_id == first.id, "the publish claim is written"
        held = wait_for(lambda: link.held_with(b'"claim":true'), timeout=60, message="A's adoption held")
        a.signal(signal.SIGSTOP)
        try:
            link.let_go([held[0][1]], timeout=30)  # returns once Redis answered: A's lock is written
            lock = parse_holder(locks.get(key))
            assert lock is not None and not lock.claim and lock.task_id == first.id, "the adoption ran"
            if lease == "expired":
                wait_for(lambda: not locks.exists(key), timeout=30, message="A's lock expired")
            else:  # written longer ago than A can vouch for it, still there
                wait_for(lambda: 0 < locks.pttl(key) <= (ttl - grace) * 1000, timeout=30,
                         message=f"A's lock older than its {grace:g}s grace")
        finally:
            a.signal(signal.SIGCONT)
        # Only the late reply's path logs this: the acquire failed as a timeout, past the grace.
        late = a.wait_for_line(first.id, "not started, Redis unavailable", "could vouch for it", timeout=60)
        # The give-back ran before that line: the key stands for the message (its claim, or
        # by now its retried run, held by the test).
        holder = parse_holder(locks.get(key))
        assert holder is not None and holder.task_id == first.id, f"the key left to {holder} after: {late}"
        second = app.queued_once.delay("k", 0)
        assert second.id == first.id, "a duplicate was published beside the message waiting for its retry"
        started = wait_for(lambda: entries(records, "started:k"), timeout=60, message="the retried run started")
        assert [run["task_id"] for run in started] == [first.id]
        records.delete("hold:k")
        wait_for(lambda: entries(records, "runs:k"), timeout=60, message="the retried run ended")
        if results == "backend":
            assert first.get(timeout=30).startswith("late-a@"), "the caller of the message gets its run's result"
            assert first.state == states.SUCCESS
        wait_for(lambda: lock_keys(locks) == [], timeout=30, message="the key free once the run ended")
        assert [run["task_id"] for run in entries(records, "runs:k")] == [first.id], "the body ran exactly once"
        assert not records.exists("overlap:k")
        third = app.queued_once.delay("k", 0)
        assert third.id != first.id, "a publish after the run ended was taken for a duplicate of it"
        wait_for(lambda: len(entries(records, "runs:k")) == 2, timeout=60, message="the next publish ran")
        assert [run["task_id"] for run in entries(records, "runs:k")] == [first.id, third.id]
        with redis_server.client(BROKER_DB) as queue:
            wait_for(lambda: queue.llen("celery") == 0 and queue.hlen("unacked") == 0, timeout=30,
                     message="no copy of a message left in the queue or unacknowledged")
