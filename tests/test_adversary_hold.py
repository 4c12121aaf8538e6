"""Adversary tests of the soft time limit held while the library begins or ends a run.

A pool process's ``SIGUSR1`` handler (:mod:`.soft_limit`) holds a soft time limit that
lands anywhere in ``SingletonTask._begin`` or ``_end`` (or what they call) during a
traced run, and ``_begin`` raises it once the lease is kept. Attacked here (real
redis-server; the handler is called where the signal lands, as a real ``SIGUSR1`` would
run it, for determinism):

1. a held soft limit is never lost nor delivered to another run: ``keep`` raising
   something else once it held one; a nested run whose ``keep`` gets it; two in one run
   (one held in ``keep``, one in ``_end``); one landing as ``_begin`` starts (not taken
   for one left from an earlier run);
2. ``keep`` outside any run: dropped, nothing held;
3. the other places a soft limit can land between a run's lock taken and its lease kept:
   the keeper's thread start from a release sent again (``_add`` after ``_running``), the
   counter writer's thread start (its ``started`` flag), ``get_keeper()`` before ``keep``;
4. in the acquire's request (its reply read, the key written: held, the lock released) and
   in the wait for the lock Redis (its pause: raised at once; its acquire tried again:
   held, and the wait ends as its next pause begins, or the lock is released).
"""

from __future__ import annotations

import inspect
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
import redis
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery
from celery.app.trace import build_tracer

from celery_singleton_beat import SingletonTask, native
from celery_singleton_beat.config import clear_settings_cache
from celery_singleton_beat.connection.channel import Channel
from celery_singleton_beat.connection.wire import SocketLink
from celery_singleton_beat.exceptions import LockUnavailable
from celery_singleton_beat.lease import counters
from celery_singleton_beat.lease import keeper as keeper_module
from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper
from celery_singleton_beat.recovery.lock_redis import reset_clients
from celery_singleton_beat.task import outage as outage_module
from celery_singleton_beat.task import soft_limit
from celery_singleton_beat.task import task as task_module
from celery_singleton_beat.task.run import HeldRun

from . import test_adversary_merge as merge
from .support import RedisServer, wait_for
from .support.locking import take_lock
from .support.outages import Outage
from .test_adversary_merge import run_locks

# The merged change's fixtures: its guarded SIGUSR1 handler, its app (eager runs, lock Redis).
guarded = merge.guarded
lock_app = merge.lock_app
eager_app = merge.eager_app


def land_here() -> None:
    """The pool process's handler, run where the signal lands: in the caller's frame."""
    soft_limit._on_soft_limit(signal.SIGUSR1, sys._getframe(1))


@pytest.fixture
def keeper(monkeypatch: pytest.MonkeyPatch) -> LeaseKeeper:
    """A process's keeper before its first run (its thread not started); nothing held."""
    fresh = LeaseKeeper()
    monkeypatch.setattr(task_module, "get_keeper", lambda: fresh)
    monkeypatch.setattr(soft_limit, "_held", False)
    return fresh


def assert_renews(keeper: LeaseKeeper, client: redis.Redis, name: str) -> None:
    """A lease handed to ``keeper`` now is renewed (its thread runs)."""
    later = take_lock(client, f"singleton:{{adv.hold:{name}}}", 1.0, task="adv.hold.later", task_id=name).lease
    assert later is not None
    kept = keeper.keep(later)
    try:
        wait_for(lambda: kept.renewals >= 2 or kept.lost, timeout=15, message="the later lease renewed")
        assert not kept.lost
    finally:
        keeper.forget(kept)
        later.release()



def signalled_at_second_kept(calls: list[str]) -> type:
    """A run's keeper entry (``HeldRun``) whose second making (a nested run's, as its lease
    is kept) is where the soft limit's signal lands; each making noted in ``calls``."""
    made = task_module.HeldRun

    class Signalled(made):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any) -> None:
            calls.append("kept")
            if len(calls) == 2:  # the nested run's: as its lease is kept
                soft_limit._on_soft_limit(signal.SIGUSR1, sys._getframe())
            super().__init__(*args)

    return Signalled

def run_during(outage: Outage, task: Any, task_id: str) -> Any:
    """``task`` run as a worker runs it (:func:`run_as_worker`) while ``outage`` lasts."""
    outage.begin()
    try:
        return run_as_worker(task, task_id)
    finally:
        outage.end()


def numbered_task(app: Celery, name: str) -> Any:
    """A singleton task ``name`` of ``app`` whose runs (one key per ``n``) return ``"ran"``."""
    @app.task(base=SingletonTask, name=name, shared=False, lock_ttl=1.0, unique_on=["n"])
    def numbered(n: int) -> str:
        return "ran"

    return numbered

# ------------------------------------------------------ 1. never lost, never misdelivered

def test_a_soft_limit_held_in_keep_that_then_fails_does_not_cut_a_later_run(
        guarded: None, eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    start_thread = native.start_thread
    fired: list[bool] = []

    def signal_then_fail(target: Callable[[], Any], name: str) -> None:
        if not fired and name == "singleton-lease-keeper":
            fired.append(True)
            land_here()
            raise RuntimeError("can't start new thread")
        start_thread(target, name)

    monkeypatch.setattr(native, "start_thread", signal_then_fail)

    failing = numbered_task(eager_app, "adv.hold.failing")

    first = failing.apply((1,))
    assert fired and isinstance(first.result, (RuntimeError, SoftTimeLimitExceeded)), first.result
    monkeypatch.setattr(task_module, "get_keeper", lambda: LeaseKeeper())  # a keeper that can start
    second = failing.apply((2,))
    assert second.result == "ran", f"a later run cut by the first run's soft limit: {second.result!r}"


def test_a_soft_limit_in_a_nested_runs_keep_cuts_it_and_reaches_the_outer_body(
        guarded: None, eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The soft limit lands as the nested call's lease is kept: the nested call does not run
    its body, the outer body gets the exception, nothing stays held, both locks are freed."""
    calls: list[str] = []
    monkeypatch.setattr(task_module, "HeldRun", signalled_at_second_kept(calls))

    nesting = merge.nesting_task(eager_app, "adv.hold.nesting", lambda: calls.append("inner body ran"))

    assert nesting.apply(("k",)).get() == "the outer body stopped"
    assert calls == ["kept", "kept"], "the nested body never ran"
    assert not soft_limit._held
    counters.flush()
    wait_for(lambda: not run_locks(redis_db, "adv.hold.nesting"), timeout=15, message="both locks freed")
    monkeypatch.setattr(task_module, "HeldRun", HeldRun)
    assert nesting.apply(("again",)).get() == "never stopped", "a later run is not cut"


def test_two_soft_limits_one_held_in_keep_one_in_end_are_each_raised_once(
        guarded: None, eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One lands in the nested call's keep() (the outer body catches it), another as the
    outer run ends: the outer run fails with the second; none is left for a later run."""
    forget = LeaseKeeper.forget
    calls: list[str] = []
    Signalled = signalled_at_second_kept(calls)

    def signal_then_forget(self: LeaseKeeper, kept: Any) -> None:
        if isinstance(kept, KeptLease) and "caught" in calls and "ending" not in calls:
            calls.append("ending")
            land_here()
        forget(self, kept)

    monkeypatch.setattr(task_module, "HeldRun", Signalled)
    monkeypatch.setattr(LeaseKeeper, "forget", signal_then_forget)

    @eager_app.task(base=SingletonTask, name="adv.hold.twice", shared=False, bind=True, unique_on=["key"])
    def twice(self: SingletonTask, key: str, inner: bool = False) -> str:
        if inner:
            return "inner"
        try:
            self(f"{key}-inner", inner=True)
        except SoftTimeLimitExceeded:
            calls.append("caught")
        return "outer body returned"

    result = twice.apply(("k",))
    assert calls == ["kept", "kept", "caught", "ending"]
    assert isinstance(result.result, SoftTimeLimitExceeded), result.result
    assert not soft_limit._held
    monkeypatch.setattr(task_module, "HeldRun", HeldRun)
    monkeypatch.setattr(LeaseKeeper, "forget", forget)
    assert twice.apply(("later",)).get() == "outer body returned"
    counters.flush()
    wait_for(lambda: not run_locks(redis_db, "adv.hold.twice"), timeout=15, message="every lock freed")


# ------------------------------------------------------------ 2. keep() outside a run

def test_a_soft_limit_in_keep_outside_a_run_is_dropped_and_nothing_held(
        guarded: None, redis_db: redis.Redis, keeper: LeaseKeeper, monkeypatch: pytest.MonkeyPatch) -> None:
    made = keeper_module.KeptLease

    class Signalled(made):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any) -> None:
            soft_limit._on_soft_limit(signal.SIGUSR1, sys._getframe())
            super().__init__(*args)

    monkeypatch.setattr(keeper_module, "KeptLease", Signalled)
    before = soft_limit.dropped()
    lease = take_lock(redis_db, "singleton:{adv.hold:outside}", 5.0, task="adv.hold.outside", task_id="o").lease
    assert lease is not None
    kept = keeper.keep(lease)
    keeper.forget(kept)
    lease.release()
    assert soft_limit.dropped() == before + 1
    assert not soft_limit._held


# ------------------------------------- 3. elsewhere between the lock taken and the lease kept

def test_a_soft_limit_as_a_late_replys_give_back_starts_the_keeper_leaves_later_leases_renewed(
        guarded: None, eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    acquire = task_module.acquire
    start_thread = native.start_thread
    fired: list[bool] = []

    def late_reply(*args: Any, **kwargs: Any) -> Any:
        result = acquire(*args, **kwargs)
        if result.lease is not None and not fired:
            result.lease.vouched_until = float("-inf")  # read after its holder could vouch for it
        return result

    def signal_then_start(target: Callable[[], Any], name: str) -> None:
        if not fired and name == "singleton-lease-keeper":
            fired.append(True)
            land_here()
        start_thread(target, name)

    monkeypatch.setattr(task_module, "acquire", late_reply)
    monkeypatch.setattr(native, "start_thread", signal_then_start)

    @eager_app.task(base=SingletonTask, name="adv.hold.late", shared=False, lock_ttl=1.0)
    def late() -> str:
        return "ran"

    result = late.apply()
    assert fired, result.result
    assert_renews(keeper, redis_db, "after-give-back")


@pytest.mark.parametrize("lands", ["before the thread starts", "after the thread starts"])
def test_a_soft_limit_as_the_counter_writer_starts_leaves_later_counts_written(
        lands: str, guarded: None, eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(counters, "_current", None)  # a process before its first count
    monkeypatch.setattr(counters, "_batches", {})
    start_thread = native.start_thread
    fired: list[bool] = []

    def signal_then_start(target: Callable[[], Any], name: str) -> None:
        if not fired and name == "singleton-counters":
            fired.append(True)
            if lands == "after the thread starts":
                start_thread(target, name)
            land_here()
        start_thread(target, name)

    monkeypatch.setattr(native, "start_thread", signal_then_start)

    counted = numbered_task(eager_app, "adv.hold.counted")

    first = counted.apply((1,))
    assert fired, first.result
    batch = counters._current
    assert batch is not None
    try:
        assert counted.apply((2,)).get() == "ran"
        wait_for(lambda: not batch.pending, timeout=15, message="the later run's counts written by the writer")
    finally:
        batch.flush()  # not left for the process's exit


def test_a_soft_limit_between_the_lock_taken_and_keep_frees_the_lock(
        guarded: None, eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    fired: list[bool] = []

    def signal_then_keeper() -> LeaseKeeper:
        if not fired:
            fired.append(True)
            land_here()
        return keeper

    monkeypatch.setattr(task_module, "get_keeper", signal_then_keeper)

    result = merge.one_run(eager_app, "adv.hold.between", lock_ttl=600.0)
    try:
        assert fired and isinstance(result.result, SoftTimeLimitExceeded), result.result
        counters.flush()
        wait_for(lambda: not run_locks(redis_db, "adv.hold.between"), timeout=15,
                 message="the cut run's lock freed (its TTL is 600s)")
    finally:
        for key in run_locks(redis_db, "adv.hold.between"):
            redis_db.delete(key)


def test_a_soft_limit_as_begin_starts_is_raised_before_the_body(
        guarded: None, eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Landing in ``_begin`` before the lock is asked for (its key being computed), it is
    held and raised as the run begins: not taken for one left from an earlier run and
    dropped (the body then ran its full course past its soft limit)."""
    lock_key = task_module.lock_key
    fired: list[bool] = []

    def signal_then_key(*args: Any) -> str:
        if not fired:
            fired.append(True)
            land_here()
        return lock_key(*args)

    monkeypatch.setattr(task_module, "lock_key", signal_then_key)

    result = merge.one_run(eager_app, "adv.hold.starts")
    assert fired and isinstance(result.result, SoftTimeLimitExceeded), result.result
    assert not soft_limit._held
    assert not run_locks(redis_db, "adv.hold.starts")


def test_a_second_soft_limit_as_the_held_one_is_raised_leaves_nothing_held(
        guarded: None, eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    schedule = LeaseKeeper._schedule
    code = soft_limit.raise_held.__code__
    lines, first = inspect.getsourcelines(soft_limit.raise_held)
    clearing = first + next(at for at, line in enumerate(lines) if line.strip() == "_held = False")
    fired: list[str] = []

    def signalled(self: LeaseKeeper, *args: Any) -> None:  # inside LeaseKeeper._add, from keep()
        if not fired:
            fired.append("held in keep")
            soft_limit._on_soft_limit(signal.SIGUSR1, sys._getframe())
        schedule(self, *args)

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == clearing and fired == ["held in keep"]:
            fired.append("second in raise_held")
            soft_limit._on_soft_limit(signal.SIGUSR1, frame)  # where the second signal lands
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code is code else None

    monkeypatch.setattr(LeaseKeeper, "_schedule", signalled)

    second = numbered_task(eager_app, "adv.hold.second")

    sys.settrace(calls)
    try:
        first_run = second.apply((1,))
    finally:
        sys.settrace(None)
    assert fired == ["held in keep", "second in raise_held"]
    assert isinstance(first_run.result, SoftTimeLimitExceeded), first_run.result
    later = second.apply((2,))
    assert later.result == "ran", f"a later run cut by a soft limit left held: {later.result!r}"


# ---------------------------------------------- 4. in the acquire's request, in the outage wait

def test_a_soft_limit_as_the_acquires_reply_is_read_is_held_and_the_lock_released(
        guarded: None, eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The signal lands as the acquire reads its reply, the key already written by Redis.
    Raised there, the run never learnt it held the lock: left until its TTL (600 s here).
    Held, the acquire ends: the run is cut short as it begins and its lock released."""
    merge.one_run(eager_app, "adv.hold.warm")  # this thread's channel up, its scripts loaded
    runner = threading.get_ident()
    receive = SocketLink._receive
    acquire = task_module.acquire
    armed: list[str] = []

    def signal_then_receive(self: SocketLink) -> None:
        if armed == ["acquiring"] and threading.get_ident() == runner:  # not the counter writer's
            armed.append("landed")
            wait_for(lambda: run_locks(redis_db, "adv.hold.reply"), timeout=15, message="the lock written")
            land_here()
        receive(self)

    def armed_acquire(*args: Any, **kwargs: Any) -> Any:
        armed.append("acquiring")
        return acquire(*args, **kwargs)

    monkeypatch.setattr(SocketLink, "_receive", signal_then_receive)
    monkeypatch.setattr(task_module, "acquire", armed_acquire)

    result = merge.one_run(eager_app, "adv.hold.reply", lock_ttl=600.0)
    try:
        assert armed == ["acquiring", "landed"] and isinstance(result.result, SoftTimeLimitExceeded), result.result
        assert not soft_limit._held
        wait_for(lambda: not run_locks(redis_db, "adv.hold.reply"), timeout=15,
                 message="the cut run's lock freed (its TTL is 600s)")
    finally:
        for key in run_locks(redis_db, "adv.hold.reply"):
            redis_db.delete(key)


@pytest.fixture
def outage_app(make_redis: Callable[..., RedisServer]) -> Iterator[tuple[Celery, Outage]]:
    """An app whose lock Redis is its broker too, and an outage of it that refuses writes:
    a run fails its acquire and cannot publish its retry either, so it waits in the worker."""
    server = make_redis()
    server.flushall()  # its records written, as a Redis in use: no recovery window to wait out
    app = Celery("adversary-hold-outage", broker=server.url(1), set_as_current=False)
    app.conf.update(singleton_redis_url=server.url(), task_publish_retry=False, broker_connection_retry=False)
    clear_settings_cache()
    reset_clients()
    yield app, Outage("refused-writes", server)
    reset_clients()
    clear_settings_cache()


def run_as_worker(task: Any, task_id: str) -> Any:
    """Run ``task`` as a worker's pool does (not eager: a run waits for its lock Redis);
    its trace's info (state, retval)."""
    tracer = build_tracer(task.name, task, app=task.app, eager=False, propagate=False)
    return tracer(task_id, (), {}, {"id": task_id, "retries": 0, "is_eager": False,
                                    "delivery_info": {"routing_key": "celery"}})[1]


def ended_because(caplog: pytest.LogCaptureFixture, task_id: str) -> list[str]:
    """Why the wait of ``task_id`` ended, as logged."""
    return [record.getMessage() for record in caplog.records
            if f"[{task_id}] ends without running" in record.getMessage()]


@pytest.mark.parametrize("lands", ["in the pause", "in the acquire tried again, refused"])
def test_a_soft_limit_in_the_wait_for_redis_ends_the_wait_before_its_next_pause(
        lands: str, guarded: None, outage_app: tuple[Celery, Outage], keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Landing in the pause between two attempts (nothing held), it is raised at once and
    ends the wait ("its soft time limit struck"); landing in an acquire the wait tries
    again, it is held there and ends the wait as the next pause begins: never slept
    through. A pause that goes on ends the wait another way ("shutting down")."""
    caplog.set_level(logging.ERROR, logger="celery_singleton_beat")
    app, outage = outage_app
    pause = outage_module._pause
    call = Channel.call
    steps: list[str] = []

    def signalled_pause(seconds: float) -> bool:
        steps.append("pause")
        if lands == "in the pause":
            land_here()
        elif steps.count("pause") == 1:
            return pause(0.0)  # the next attempt at once; its reply read lands the signal
        return False  # a wait that went on into this pause: ended here ("shutting down")

    def signal_then_call(self: Channel, *args: Any) -> Any:
        if steps == ["pause"] and lands != "in the pause":  # the acquire's request
            steps.append("landed")
            land_here()
        return call(self, *args)

    monkeypatch.setattr(outage_module, "_pause", signalled_pause)
    monkeypatch.setattr(Channel, "call", signal_then_call)

    @app.task(base=SingletonTask, name="adv.hold.waits", shared=False)
    def waits() -> str:
        return "ran"

    info = run_during(outage, waits, "waits-1")
    assert steps == (["pause"] if lands == "in the pause" else ["pause", "landed"])
    assert isinstance(info.retval, LockUnavailable), info.retval
    assert ended_because(caplog, "waits-1") and all(
        "its soft time limit struck" in line for line in ended_because(caplog, "waits-1")), caplog.text
    assert not soft_limit._held


def test_a_soft_limit_in_the_acquire_the_wait_for_redis_tries_again_is_held_and_the_lock_released(
        guarded: None, outage_app: tuple[Celery, Outage], keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait's next attempt is answered (the outage is over) and the signal lands as its
    reply is read, the key written. Raised there, the wait ended on it and the lock it had
    just taken stayed until its TTL (600 s here). Held, the run is cut short as it begins,
    its lock released."""
    app, outage = outage_app
    locks = outage.server.client()
    runner = threading.get_ident()
    receive = SocketLink._receive
    steps: list[str] = []

    def outage_over(seconds: float) -> bool:
        steps.append("pause")
        outage.end()
        return True

    def signal_then_receive(self: SocketLink) -> None:
        if steps == ["pause"] and threading.get_ident() == runner:  # the acquire's reply
            steps.append("landed")
            wait_for(lambda: run_locks(locks, "adv.hold.waited"), timeout=15, message="the lock written")
            land_here()
        receive(self)

    monkeypatch.setattr(outage_module, "_pause", outage_over)
    monkeypatch.setattr(SocketLink, "_receive", signal_then_receive)

    @app.task(base=SingletonTask, name="adv.hold.waited", shared=False, lock_ttl=600.0)
    def waited() -> str:
        return "ran"

    info = run_during(outage, waited, "waited-1")
    try:
        assert steps == ["pause", "landed"]
        assert isinstance(info.retval, SoftTimeLimitExceeded), info.retval
        assert not soft_limit._held
        wait_for(lambda: not run_locks(locks, "adv.hold.waited"), timeout=15,
                 message="the cut run's lock freed (its TTL is 600s)")
    finally:
        locks.flushall()
        locks.close()
