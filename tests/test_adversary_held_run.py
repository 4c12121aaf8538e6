"""Adversary tests of the held run (adv-held): a run holding its lock is its lease's keeper
entry (:class:`~celery_singleton_beat.task.run.HeldRun`), a fail-open run an
:class:`~celery_singleton_beat.task.run.UnlockedRun`, and the run lock is taken by
``SingletonTask._take_run_lock`` (no closures per run).

Real redis-server of the test session; eager runs, and runs traced as a worker's pool
traces them (``build_tracer``, not eager). Tried, and what held:

1. Identity: ``self.singleton is self.singleton_run``; it is a ``HeldRun``, the very object
   in the keeper's queue (no separate entry), its ``key`` the task's ``singleton_key``, its
   ``fence`` what ``ensure_held()`` returns; forgotten and its lock gone once the run ends,
   the keeper's count of kept leases back where it was: **held**.
2. Nested runs (the body calls ``self(...)`` with other arguments): each level its own
   ``HeldRun`` kept at once; the outer body gets its own run back, still kept and held, once
   the nested call returned; both forgotten at the end: **held**.
3. Fail-open (``singleton_fail_open`` and the lock Redis down): an ``UnlockedRun``, held
   False, lost False, fence None, ``ensure_held`` raises ``LockLost``, its key the task's;
   nothing kept by the keeper, nothing released: **held**.
4. A lease taken by another during the run: the keeper marks the run itself lost; the body
   sees ``lost`` and ``ensure_held`` raises; the lost report names the run's task id and
   lock; the other's lock is left alone at the end: **held**.
5. A soft limit held in ``_begin`` raised at its safe point (after ``keep_entry``): the
   ``HeldRun`` entry abandoned (inactive in the queue), its lock freed, nothing held:
   **held** (the full line-by-line sweep is tests/test_adversary_soft_hold.py).
6. ``acks_late`` worker runs: the run carries the done marker's TTL (``_done_ttl``) and its
   release writes the marker: a second delivery of the same message does not run; an eager
   run carries none: **held**.
7. ``until_executed`` worker run whose body retries: its lock turned into the retry's claim
   at the end (a publish of the same arguments is deduplicated): **held**.
8. Soft limits on the late-reply path, which the outage sweep no longer reaches (it sweeps
   ``_take_run_lock`` now, and ``in_time``'s lines run only for a late lease): each line of
   ``in_time``, of ``_give_back`` and all it calls (an eager run's pending release, the
   keeper's thread started), of ``_give_back`` and ``claim_back`` of a worker's
   ``until_executed`` run (the key must stay the message's claim): **held**.
9. Each line of making the ``HeldRun`` and of ``keep_entry`` on a keeper that never ran (its
   thread started by that run): the run cut short at its safe point, not left kept, its lock
   freed, the keeper's thread running: **held**.
10. ``abandon(lease)`` finds the ``HeldRun`` alone in the queue, in a bucket, in flight:
    **held**. A release answered after the run (``release_soon``) that found the lock gone
    marks the ended run itself lost, reported once with its task id: **held**.
11. gevent: 100 eager runs at once, each with a nested run, every body sees its own
    ``HeldRun`` across switches; all forgotten and freed: **held**.
12. ``singleton_fail_open`` and a late reply: the run goes ahead as an ``UnlockedRun`` (a
    late reply fails the acquire as a timeout does; as before the change), its late lock
    given back, not kept. Pinned, not a regression.
13. A release that gets no answer (the link holds every byte past the read timeout): the
    ended run forgotten, its lease's release sent again once the link passes bytes, the key
    freed, the run not lost: **held**.
14. Four threads running 100 eager runs at once, every other one's lock taken by another
    holder mid-run while the keeper renews everything: exactly those runs marked lost, the
    others held and their own; all forgotten; taken locks left to their holder: **held**.
15. The public ``SingletonRun`` (exported from the package, documented in docs/api.md):
    ``SingletonRun(key, None)`` built a run without a lock before this change; now that is
    ``UnlockedRun(key)`` (CHANGELOG), and no run takes attributes of a body's own.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from types import CodeType
from typing import Any

import pytest
import redis
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery, Task, states
from celery.app.task import Context
from celery.app.trace import TraceInfo, build_tracer

from celery_singleton_beat import SingletonRun, SingletonTask
from celery_singleton_beat.connection.flusher import read_all_replies
from celery_singleton_beat.exceptions import LockLost, LockUnavailable
from celery_singleton_beat.lease.holder import parse_holder
from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper, get_keeper
from celery_singleton_beat.lease.kept import Bucket
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.lock_redis import reset_clients
from celery_singleton_beat.task import outage as outage_module
from celery_singleton_beat.task import release as release_module
from celery_singleton_beat.task import soft_limit
from celery_singleton_beat.task import task as task_module
from celery_singleton_beat.task.run import HeldRun, UnlockedRun

from . import test_adversary_soft_hold as soft_hold
from .support import LOCK_DB, RedisServer, TestProcess, importorskip, wait_for
from .support.processes import child_env
from .support.proxy import DelayProxy
from .support.tasks import lock_keys
from .test_adversary_merge import run_locks

guarded = soft_hold.guarded
lock_app = soft_hold.lock_app
eager_app = soft_hold.eager_app
keeper = soft_hold.keeper


def _entries() -> list[KeptLease]:
    """Every kept lease the keeper has: queued (alone or in a bucket) or in flight."""
    keeper = get_keeper()
    with keeper._mutex:
        queued = [kept for _, _, entry in keeper._queue
                  for kept in (entry.leases if isinstance(entry, Bucket) else (entry,))]
        return [kept for kept in itertools.chain(queued, keeper._in_flight) if isinstance(kept, KeptLease)]


def _active_entries_of(key: str) -> list[KeptLease]:
    return [kept for kept in _entries() if kept.active and kept.lease.key == key]


def eager_lock_app(redis_server: RedisServer, name: str) -> Celery:
    """An eager app whose locks are on the session's server (``lock_ttl`` 30 s)."""
    app = Celery(name, broker="memory://", set_as_current=False)
    app.conf.update(singleton_redis_url=redis_server.url(LOCK_DB), singleton_lock_ttl=30, task_always_eager=True)
    return app


@pytest.fixture
def app(redis_db: redis.Redis, redis_server: RedisServer) -> Iterator[Celery]:
    yield eager_lock_app(redis_server, "adv-held-run")
    reset_clients()


def run_as_worker(task: Task, task_id: str, args: tuple[object, ...]) -> str:
    """Run ``task`` as a worker's pool does (not eager); the state it ends in."""
    tracer = build_tracer(task.name, task, app=task.app, eager=False, propagate=False)
    traced = tracer(task_id, args, {}, {"id": task_id, "retries": 0, "is_eager": False, "hostname": "w1@host",
                                        "delivery_info": {"routing_key": "celery"}})
    info: TraceInfo | None = traced[1]
    return states.SUCCESS if info is None else str(info.state)


def test_the_run_is_the_keepers_entry_and_is_forgotten_at_its_end(app: Celery, locks: redis.Redis) -> None:
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> int:
        run = self.singleton_run
        assert isinstance(run, HeldRun)
        seen.update(run=run, same=self.singleton is run, entries=[kept for kept in _entries() if kept is run],
                    active=run.active, held=run.held, lost=run.lost, fence=run.fence, ensured=run.ensure_held(),
                    key=run.key, in_redis=locks.get(run.key))
        return x

    before = get_keeper()._active
    assert job.apply(args=(1,), throw=True).get() == 1
    run = seen["run"]
    assert isinstance(run, HeldRun) and isinstance(run, SingletonRun) and isinstance(run, KeptLease)
    assert seen["same"], "self.singleton is not self.singleton_run"
    assert seen["entries"] == [run], "the keeper's queue does not hold the run itself (exactly once)"
    assert seen["active"] and seen["held"] and not seen["lost"]
    assert seen["fence"] == seen["ensured"] == run.lease.fence
    assert seen["key"] == job.singleton_key((1,), {}) == run.lease.key
    assert seen["in_redis"] == run.lease.value.encode()
    assert not run.active, "the run was not forgotten by the keeper at its end"
    assert not _active_entries_of(run.key)
    assert get_keeper()._active == before
    assert lock_keys(locks) == []


def test_nested_runs_each_keep_their_own_run_and_the_outer_gets_its_back(app: Celery, locks: redis.Redis) -> None:
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> int:
        run = self.singleton_run
        if x == 0:
            seen["outer"] = run
            self(1)  # nested: its own request, its own lock
            seen.update(back=self.singleton_run, outer_active=run.active, outer_held=run.held,  # type: ignore[attr-defined]
                        inner_active_after=seen["inner"].active, keys_after=lock_keys(locks))
        else:
            seen.update(inner=run, both=[kept for kept in _entries() if kept in (seen["outer"], run)],
                        keys_inside=lock_keys(locks))
        return x

    before = get_keeper()._active
    job.apply(args=(0,), throw=True).get()
    outer, inner = seen["outer"], seen["inner"]
    assert isinstance(outer, HeldRun) and isinstance(inner, HeldRun) and outer is not inner
    assert outer.key != inner.key
    assert {id(kept) for kept in seen["both"]} == {id(outer), id(inner)}, "both levels kept at once"
    assert sorted(seen["keys_inside"]) == sorted([outer.key, inner.key])
    assert seen["back"] is outer, "the outer body did not get its own run back"
    assert seen["outer_active"] and seen["outer_held"]
    assert not seen["inner_active_after"] and seen["keys_after"] == [outer.key]
    assert not outer.active and get_keeper()._active == before
    assert lock_keys(locks) == []


def test_a_fail_open_run_is_unlocked_and_keeps_nothing(redis_db: redis.Redis) -> None:
    app = Celery("adv-held-open", broker="memory://", set_as_current=False)
    app.conf.update(singleton_redis_url="redis://127.0.0.1:1/0", singleton_fail_open=True, task_always_eager=True,
                    singleton_redis_options={"socket_timeout": 1.0, "socket_connect_timeout": 1.0})
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> int:
        run = self.singleton_run
        seen.update(run=run, same=self.singleton is run, held=run.held, lost=run.lost, fence=run.fence,
                    key=run.key, kept=[kept for kept in _entries() if id(kept) == id(run)])
        with pytest.raises(LockLost, match="holds no lock"):
            run.ensure_held()
        seen["raised"] = True
        return x

    before = get_keeper()._active
    try:
        assert job.apply(args=(1,), throw=True).get() == 1
    finally:
        reset_clients()
    run = seen["run"]
    assert type(run) is UnlockedRun and seen["same"] and seen["raised"]
    assert seen["held"] is False and seen["lost"] is False and seen["fence"] is None
    assert seen["key"] == job.singleton_key((1,), {})
    assert seen["kept"] == [] and get_keeper()._active == before


def test_a_lease_taken_by_another_marks_the_run_itself_lost(app: Celery, locks: redis.Redis,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="celery_singleton_beat")
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> int:
        run = self.singleton_run
        seen["run"] = run
        locks.set(run.key, "another-holder", keepttl=True)  # taken by another
        get_keeper().renew_all_soon()
        wait_for(lambda: run.lost, timeout=30, message="the keeper marks the run lost")
        seen.update(held=run.held, kept=run.active)  # type: ignore[attr-defined]
        with pytest.raises(LockLost):
            run.ensure_held()
        seen["raised"] = True
        return x

    result = job.apply(args=(1,), task_id="held-run-lost", throw=True)
    assert result.get() == 1
    run = seen["run"]
    assert seen["raised"] and seen["held"] is False
    assert run.lost and run.lost_reason
    assert locks.get(run.key) == b"another-holder", "the run's end touched the other holder's lock"
    assert not _active_entries_of(run.key)
    lines = [record.getMessage() for record in caplog.records if "lost its lock" in record.getMessage()]
    assert any("[held-run-lost]" in line and run.key in line for line in lines), lines
    locks.delete(run.key)


def test_a_soft_limit_held_through_begin_abandons_the_held_run_entry(app: Celery, locks: redis.Redis) -> None:
    @app.task(base=SingletonTask, shared=False)
    def job(x: int) -> int:
        return x

    key = job.singleton_key((1,), {})
    before = get_keeper()._active
    request = Context(id="held-soft", hostname="w1@host", is_eager=True, args=(1,), kwargs={})
    soft_limit.drop_held()
    soft_limit._held = True  # as if SIGUSR1 landed in _begin: raised at its safe point
    try:
        with pytest.raises(SoftTimeLimitExceeded):
            job._begin(request, (1,), {})
    finally:
        soft_limit.drop_held()
    assert not soft_limit._held
    assert not _active_entries_of(key), "the abandoned run is still kept by the keeper"
    assert get_keeper()._active == before
    assert lock_keys(locks) == [], "the abandoned run's lock was left in Redis"


def test_an_acks_late_run_carries_its_done_ttl_and_its_end_writes_the_marker(app: Celery,
                                                                              locks: redis.Redis) -> None:
    app.conf.update(task_always_eager=False, singleton_done_ttl=600)
    ran: list[Any] = []

    @app.task(base=SingletonTask, bind=True, shared=False, acks_late=True)
    def job(self: SingletonTask, x: int) -> int:
        ran.append(self.singleton_run._done_ttl)  # type: ignore[attr-defined]
        return x

    assert run_as_worker(job, "held-done", (1,)) == states.SUCCESS
    assert ran == [600]
    assert lock_keys(locks) == []
    assert any(b":done:" in key for key in locks.scan_iter(match="singleton:{*")), "no done marker written"
    again = run_as_worker(job, "held-done", (1,))  # the same message delivered again
    assert ran == [600], "a delivery of a completed message ran again"
    assert again == states.IGNORED

    eager: list[Any] = []

    @app.task(base=SingletonTask, bind=True, shared=False, acks_late=True)
    def eager_job(self: SingletonTask, x: int) -> int:
        eager.append(self.singleton_run._done_ttl)  # type: ignore[attr-defined]
        return x

    eager_job.apply(args=(1,), throw=True)
    assert eager == [None]


def test_an_until_executed_run_that_retries_leaves_its_claim(app: Celery, locks: redis.Redis) -> None:
    app.conf.update(task_always_eager=False)
    runs: list[Any] = []

    @app.task(base=SingletonTask, bind=True, shared=False, lock_mode="until_executed")
    def job(self: SingletonTask, x: int) -> int:
        runs.append(self.singleton_run)
        raise self.retry(countdown=60)

    first = job.apply_async(args=(1,))
    assert run_as_worker(job, first.id, (1,)) == states.RETRY
    (run,) = runs
    assert isinstance(run, HeldRun) and not run.active
    assert lock_keys(locks) == [run.key], "the retry's claim is not in Redis"
    second = job.apply_async(args=(1,))
    assert second.id == first.id, "a publish of the same arguments was queued beside the retry"


def test_a_run_without_its_lock_is_an_unlocked_run_and_runs_hold_no_state_of_a_bodys_own() -> None:
    """``SingletonRun`` is the type a body reads (``self.singleton_run``): a run holding its
    lock is a ``HeldRun``, one without it (fail-open, or a stand-in in a body's unit test) an
    ``UnlockedRun(key)``; ``SingletonRun(key, kept)`` of earlier releases is gone
    (CHANGELOG). No attribute of a body's own can be set on a run (``__slots__``: a held
    run is one object with the keeper's entry)."""
    unlocked = UnlockedRun("singleton:{job:abc}")
    assert isinstance(unlocked, SingletonRun)
    assert unlocked.key == "singleton:{job:abc}" and not unlocked.held and not unlocked.lost
    assert unlocked.fence is None
    with pytest.raises(LockLost):
        unlocked.ensure_held()
    with pytest.raises(TypeError):
        SingletonRun("singleton:{job:abc}", None)  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        unlocked.note = 1  # type: ignore[attr-defined]


def read_late(real: Any) -> Any:
    """``acquire`` whose reply is read once the lease it grants can no longer be vouched for
    (as if this process paused after the reply came): ``_take_run_lock`` finds it late."""
    def late(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        lease = result.lease
        if lease is not None:
            wait_for(lambda: time.monotonic() >= lease.vouched_until, timeout=30, interval=0.01,
                     message="the lease past what its holder could vouch for")
        return result

    return late


@pytest.mark.parametrize(("code", "deep"), [(outage_module.in_time.__code__, False),
                                            (SingletonTask._give_back.__code__, True)],
                         ids=lambda value: getattr(value, "co_name", str(value)))
def test_a_soft_limit_at_every_line_of_a_late_replys_give_back(
        code: CodeType, deep: bool, guarded: None, eager_app: Celery, redis_db: redis.Redis,
        keeper: LeaseKeeper, monkeypatch: pytest.MonkeyPatch) -> None:
    """The acquire's reply is read after the lease it grants can no longer be vouched for
    (this process "paused" after the reply: waited until past ``vouched_until``), so
    ``_take_run_lock`` hands the lease to ``in_time`` and ``_give_back`` (no longer reached
    on every acquire: the outage sweep of tests/test_adversary_soft_hold.py now sweeps
    ``_take_run_lock`` instead of ``in_time``, whose lines run only on this path). The soft
    limit lands at each line of ``in_time``, and of ``_give_back`` and all it calls (the
    keeper's pending release, its thread started): the eager run ends ``LockUnavailable``
    (its late lock given back, the limit dropped with a run that did not begin) or
    ``SoftTimeLimitExceeded``; no lease kept, the lock freed, nothing held."""
    monkeypatch.setattr(task_module, "acquire", read_late(task_module.acquire))
    body_ran: list[int] = []

    @eager_app.task(base=SingletonTask, name="adv.held.late", shared=False, lock_ttl=1.0, unique_on=["n"])
    def swept(n: int) -> str:
        body_ran.append(n)
        return "ran"

    problems = soft_hold.sweep(code, lambda n: swept.apply((n,)), redis_db, keeper, "adv.held.late",
                               deep=deep, body_ran=body_ran, ends=(SoftTimeLimitExceeded, LockUnavailable))
    assert not problems, "\n".join(problems)
    assert body_ran == [], "a run went ahead on a late lock"
    wait_for(lambda: not keeper.pending_releases, timeout=30, message="the late locks given back")


@pytest.mark.parametrize("code", [SingletonTask._give_back.__code__, outage_module.claim_back.__code__],
                         ids=lambda code: code.co_name)
def test_a_soft_limit_at_every_line_of_an_until_executed_late_give_back(
        code: CodeType, guarded: None, lock_app: Celery, redis_db: redis.Redis,
        keeper: LeaseKeeper, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's ``until_executed`` run adopts its message's publish claim, but the reply is
    late: the lock goes back to being the message's claim (``claim_back``, or claimed anew
    once it expired) and the run's retry is published. The soft limit lands at each line of
    ``_give_back`` and of ``claim_back``: the run ends ``RETRY`` (the limit dropped with a
    run that did not begin) or ``SoftTimeLimitExceeded``; the key is the message's claim,
    never a run lock nor freed (a publish of the same arguments would be queued beside the
    retry); no lease kept; nothing held."""
    lock_app.conf.broker_url = "memory://"
    real = task_module.acquire

    def late(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        lease = result.lease
        if lease is not None and kwargs.get("adopt_claim_of"):
            wait_for(lambda: time.monotonic() >= lease.vouched_until, timeout=30, interval=0.01,
                     message="the lease past what its holder could vouch for")
        return result

    monkeypatch.setattr(task_module, "acquire", late)
    body_ran: list[int] = []

    @lock_app.task(base=SingletonTask, name="adv.held.claims", shared=False, lock_ttl=1.0, unique_on=["n"],
                   lock_mode="until_executed")
    def claims(n: int) -> str:
        body_ran.append(n)
        return "ran"

    def one_run(n: int) -> tuple[str, str, Any]:
        published = claims.apply_async(args=(n,))
        state = run_as_worker(claims, published.id, (n,))
        return state, published.id, claims.singleton_key((n,), {})

    one_run(0)
    problems: list[str] = []
    for nth in itertools.count():
        landing = soft_hold.Landing(code, nth, deep=False)
        state, task_id, key = landing.run(lambda n=nth + 1: one_run(n))  # type: ignore[misc]
        if landing.landed is None:
            assert nth > 0, f"no line of {code.co_name} executed"
            break
        held, soft_limit._held = soft_limit._held, False
        holder = parse_holder(redis_db.get(key))
        wrong = [what for what, bad in (
            ("a soft limit left held", held),
            (f"lease still kept: {soft_hold.kept_leases(keeper)}", soft_hold.kept_leases(keeper)),
            (f"the run ended {state}", state not in (states.RETRY, states.FAILURE)),
            (f"the key is not the message's claim: {holder}",
             holder is None or not holder.claim or holder.task_id != task_id),
        ) if bad]
        if wrong:
            problems.append(f"landing at {landing.landed}: {'; '.join(wrong)}")
        for kept in soft_hold.kept_leases(keeper):
            keeper.forget(kept)
    assert not problems, "\n".join(problems)
    assert body_ran == [], "a run went ahead on a late lock"


GREEN_CHILD = r"""
from gevent import monkey
monkey.patch_all()

import json
import sys

import gevent
import redis
from celery import Celery

from celery_singleton_beat import SingletonTask
from celery_singleton_beat.lease.keeper import get_keeper
from celery_singleton_beat.task.run import HeldRun

url = sys.argv[1]
app = Celery("adv-held-green", broker="memory://", set_as_current=False)
app.conf.update(singleton_redis_url=url, singleton_lock_ttl=30, task_always_eager=True)
wrong = []


@app.task(base=SingletonTask, bind=True, shared=False)
def job(self, n):
    run = self.singleton_run
    if not isinstance(run, HeldRun) or self.singleton is not run:
        wrong.append(f"{n}: not its own held run: {run!r}")
    if run.key != job.singleton_key((n,), {}):
        wrong.append(f"{n}: the key of another run: {run.key}")
    gevent.sleep(0)  # the other greenlets' runs begin meanwhile
    if n < 1000:
        self(n + 1000)  # nested, in the same greenlet
    gevent.sleep(0)
    if self.singleton_run is not run:
        wrong.append(f"{n}: saw another run's object after a switch")
    if run.ensure_held() != run.lease.fence or run.lost or not run.active:
        wrong.append(f"{n}: its run not held while it runs")
    return n


greenlets = [gevent.spawn(lambda n=n: job.apply(args=(n,), throw=True).get()) for n in range(0, 200, 2)]
gevent.joinall(greenlets, raise_error=True)
client = redis.Redis.from_url(url)
left = sorted(k.decode() for k in client.scan_iter(match="singleton:{*")
              if not k.endswith(b":fence") and not k.startswith(b"singleton:{stats}"))
out = {"wrong": wrong, "results": sorted(g.value for g in greenlets), "active": get_keeper()._active, "left": left}
print("RESULT " + json.dumps(out), flush=True)
"""


def test_green_runs_each_see_their_own_held_run(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """A gevent process runs 100 eager runs at once (each with a nested run): every body sees
    its own ``HeldRun`` (``self.singleton`` is it, its key its arguments'), still after
    switches to the others' runs; all forgotten and freed at the end."""
    importorskip("gevent")
    url = redis_server.url(LOCK_DB)
    child = TestProcess("adv-held-green", [sys.executable, "-c", GREEN_CHILD, url],
                        env=child_env(redis_server)).start()
    try:
        line = child.wait_for_line("RESULT", timeout=120)
    finally:
        child.close()
    result = json.loads(line.split(" ", 1)[1])
    assert result["wrong"] == []
    assert result["results"] == list(range(0, 200, 2))
    assert result["active"] == 0, "runs left kept by the keeper"
    assert result["left"] == [], "locks left in Redis"


def test_a_release_answered_after_the_run_marks_the_ended_run_lost(app: Celery, locks: redis.Redis,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A worker's run whose end no one sees (no result backend, no events) writes its release
    and reads the reply later (``release_soon``); its lock was gone by then (deleted as the
    body ended, before any renewal): the reply marks the run itself lost, and the report
    names the run's task id and lock, once."""
    app.conf.update(task_always_eager=False)
    caplog.set_level(logging.WARNING, logger="celery_singleton_beat")
    runs: list[Any] = []

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> int:
        run = self.singleton_run
        runs.append(run)
        locks.delete(run.key)
        return x

    assert run_as_worker(job, "held-soon", (1,)) == states.SUCCESS
    (run,) = runs
    assert isinstance(run, HeldRun) and not run.active
    assert not run.lost, "the release was not answered late (release_soon): nothing tried"
    read_all_replies()
    wait_for(lambda: run.lost, timeout=30, message="the late release reply marks the run lost")
    assert run.lost_reason == "the lock was gone when the run ended"
    lines = [record.getMessage() for record in caplog.records if "lost its lock" in record.getMessage()]
    assert len(lines) == 1 and "[held-soon]" in lines[0] and run.key in lines[0], lines
    assert lock_keys(locks) == []


@pytest.mark.parametrize("where", ["queued", "bucket", "in flight"])
def test_abandon_finds_the_held_run_wherever_the_keeper_has_it(where: str, redis_db: redis.Redis,
                                                               locks: redis.Redis) -> None:
    """``abandon(lease)`` (a run cut short as it began) finds the ``HeldRun`` kept for that
    lease: alone in the queue, in a bucket of leases renewed together, or taken by a round
    under way; it is forgotten (not renewed nor put back) and its lock deleted."""
    keeper = LeaseKeeper()
    keeper._running = True  # no thread: the test moves the entry where it wants it
    lease = acquire(locks, "singleton:{adv.held.abandon:1}", LockSpec(task="adv.held.abandon", ttl=30.0),
                    "abandoned").lease
    assert lease is not None
    run = keeper.keep_entry(HeldRun(lease, None))
    other = acquire(locks, "singleton:{adv.held.abandon:2}", LockSpec(task="adv.held.abandon", ttl=30.0),
                    "kept").lease
    assert other is not None
    neighbour = keeper.keep_entry(HeldRun(other, None))
    with keeper._mutex:
        if where == "bucket":
            keeper._queue = []
            keeper._schedule(Bucket([neighbour, run]), time.monotonic() + 60)
        elif where == "in flight":
            keeper._take_due(time.monotonic() + 60)
            assert run in keeper._in_flight
    keeper.abandon(lease)
    assert not run.active and neighbour.active
    assert keeper._active == 1
    assert locks.get(lease.key) is None, "the abandoned run's lock is still in Redis"
    assert locks.get(other.key) == other.value.encode()
    keeper.forget(neighbour)
    other.release()


def _thread_waits(keeper: LeaseKeeper) -> bool:
    """The keeper's own thread reached its wait (it exists and runs its loop)."""
    try:
        wait_for(lambda: keeper.waiting, timeout=10, message="the keeper's thread waiting")
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize(("code", "deep"), [(LeaseKeeper.keep_entry.__code__, True),
                                            (HeldRun.__init__.__code__, True)],
                         ids=["keep_entry", "HeldRun.__init__"])
def test_a_soft_limit_at_every_line_of_keeping_a_run_on_a_cold_keeper(
        code: CodeType, deep: bool, guarded: None, eager_app: Celery, redis_db: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run on a keeper of its own that never ran (its thread started by this run's
    ``keep_entry``): the soft limit lands at each line of making the ``HeldRun`` and of
    keeping it (the queue, the keeper's thread started). The run is cut short at its safe
    point; the run is not left kept, its lock freed, the keeper's thread running (a keeper
    marked running with no thread renews no later lease), nothing held."""
    keepers: list[LeaseKeeper] = []

    def fresh() -> LeaseKeeper:
        return keepers[-1]

    monkeypatch.setattr(task_module, "get_keeper", fresh)
    monkeypatch.setattr(release_module, "get_keeper", fresh)
    monkeypatch.setattr(soft_limit, "_held", False)
    body_ran: list[int] = []
    swept = soft_hold.sweep_task(eager_app, "adv.held.cold", body_ran)

    def one_run(n: int) -> Any:
        keepers.append(LeaseKeeper())
        return swept.apply((n,))

    problems = []
    one_run(0)
    for nth in itertools.count():
        body_ran.clear()
        landing = soft_hold.Landing(code, nth, deep=deep)
        result = landing.run(lambda n=nth + 1: one_run(n))  # type: ignore[misc]
        if landing.landed is None:
            assert nth > 0
            break
        keeper = keepers[-1]
        held, soft_limit._held = soft_limit._held, False
        wrong = [what for what, bad in (
            ("a soft limit left held", held),
            (f"lease still kept: {soft_hold.kept_leases(keeper)}", soft_hold.kept_leases(keeper)),
            ("lock left", not soft_hold.freed(redis_db, "adv.held.cold")),
            (f"the run ended {result.result!r}", not isinstance(result.result, SoftTimeLimitExceeded)),
            ("the body ran", body_ran),
            ("the keeper is marked running without its thread", keeper._running and not _thread_waits(keeper)),
        ) if bad]
        if wrong:
            problems.append(f"landing at {landing.landed}: {'; '.join(wrong)}")
    assert len(keepers) > 3, "too few landings"
    assert not problems, "\n".join(problems)


def test_a_late_reply_with_fail_open_runs_unlocked_and_gives_the_lock_back(
        eager_app: Celery, redis_db: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """``singleton_fail_open``: a late reply fails the acquire as a timeout does, so the run
    goes ahead as an ``UnlockedRun`` (as before this change: pinned, see the report), and
    the late lock is given back, not kept."""
    eager_app.conf.singleton_fail_open = True
    monkeypatch.setattr(task_module, "acquire", read_late(task_module.acquire))
    seen: list[Any] = []

    @eager_app.task(base=SingletonTask, bind=True, name="adv.held.open-late", shared=False, lock_ttl=1.0)
    def job(self: SingletonTask) -> str:
        seen.append(self.singleton_run)
        return "ran"

    before = get_keeper()._active
    assert job.apply(throw=True).get() == "ran"
    (run,) = seen
    assert type(run) is UnlockedRun and not run.held and run.fence is None
    assert not _active_entries_of(run.key), "the late lock is kept for the unlocked run"
    wait_for(lambda: not get_keeper().pending_releases, timeout=30, message="the late lock's give-back sent")
    assert get_keeper()._active == before
    wait_for(lambda: not run_locks(redis_db, "adv.held.open-late"), timeout=30,
             message="the late lock given back")


def job_whose_release_gets_no_answer(redis_server: RedisServer,
                                     name: str) -> tuple[DelayProxy, Any, list[SingletonRun]]:
    """An eager task whose lock client goes through a link its body holds (no byte passes
    from the body's end on, past the client's 1 s read timeout): its run's release gets no
    answer. Returns the link (``resume()`` it), the task, and the runs it records."""
    link = DelayProxy(redis_server.port, 0.0).start()
    app = Celery(name, broker="memory://", set_as_current=False)
    app.conf.update(singleton_redis_url=f"redis://127.0.0.1:{link.port}/{LOCK_DB}", singleton_lock_ttl=30,
                    task_always_eager=True,
                    singleton_redis_options={"socket_timeout": 1.0, "socket_connect_timeout": 1.0})
    runs: list[SingletonRun] = []

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> int:
        runs.append(self.singleton_run)
        link.hold()
        return x

    return link, job, runs


def test_a_release_that_gets_no_answer_is_sent_again_for_the_ended_run(redis_db: redis.Redis,
                                                                       redis_server: RedisServer,
                                                                       locks: redis.Redis) -> None:
    """An eager run's release (sent and waited for) gets no answer: the link holds every byte
    from the end of the body on, past the lock client's read timeout. The run ends anyway,
    forgotten by the keeper; its release is sent again once the link passes bytes again
    (``retry_release`` of the run's lease): the key is freed, the run not counted lost."""
    link, job, runs = job_whose_release_gets_no_answer(redis_server, "adv-held-retry-release")
    try:
        assert job.apply(args=(1,), throw=True).get() == 1
        (run,) = runs
        assert isinstance(run, HeldRun) and not run.active
        assert locks.get(run.key) is not None, "the release got through: nothing tried"
        assert [pending.lease for pending in get_keeper().pending_releases] == [run.lease]
    finally:
        link.resume()
    wait_for(lambda: not get_keeper().pending_releases, timeout=30, message="the release sent again")
    assert locks.get(run.key) is None
    assert not run.lost
    reset_clients()
    link.close()


def test_threads_running_runs_while_some_are_lost_each_see_their_own(app: Celery, locks: redis.Redis) -> None:
    """Four threads run 25 eager runs each at once; every other run's lock is taken by
    another holder mid-run and the keeper renews everything at once: the keeper marks
    exactly those runs lost (the run objects themselves), the others stay held; every run is
    forgotten at its end; the taken locks are left to their holder, the others freed."""
    results: dict[int, tuple[bool, bool, str]] = {}
    errors: list[BaseException] = []

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, n: int) -> int:
        run = self.singleton_run
        assert isinstance(run, HeldRun)
        if n % 2:
            locks.set(run.key, f"another-{n}", keepttl=True)
            get_keeper().renew_all_soon()
            wait_for(lambda: run.lost, timeout=30, message=f"run {n} marked lost")
        else:
            get_keeper().renew_all_soon()
        results[n] = (run.lost, run.held and self.singleton_run is run, run.key)
        return n

    def worker(first: int) -> None:
        try:
            for n in range(first, 100, 4):
                job.apply(args=(n,), throw=True)
        except BaseException as exc:  # reported below
            errors.append(exc)

    before = get_keeper()._active
    threads = [threading.Thread(target=worker, args=(first,)) for first in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert sorted(results) == list(range(100))
    assert sorted(n for n, (lost, _, _) in results.items() if lost) == [n for n in range(100) if n % 2]
    assert all(held for n, (_, held, _) in results.items() if not n % 2)
    wait_for(lambda: get_keeper()._active == before, timeout=30, message="every run forgotten")
    assert sorted(lock_keys(locks)) == sorted(key for n, (_, _, key) in results.items() if n % 2)
    for n, (_, _, key) in results.items():
        if n % 2:
            assert locks.get(key) == f"another-{n}".encode()
