"""Adversary tests of a run that ended (adv-ended): ``HeldRun.held`` is False and
``ensure_held()`` raises ``LockLost`` ("the run ended") once ``_end`` set its ``releasing``
(the lease keeper's ``releasing(kept)``, before the release is sent), whatever grace the
lease had left; while the body runs, nothing else sets it.

Real redis-server of the test session; eager runs, and runs traced as a worker's pool
traces them (``build_tracer``, not eager). Tried, and what held:

1. A thread the body started outlives the run (the case the change is for): it saw the
   run held while the body ran; once the lock is gone from Redis it sees ``held`` False
   and ``ensure_held()`` raising ``LockLost`` with the run's key and "the run ended" (not
   a fail-open or grace message), while the next run holds the key: **held**.
2. Every ending of a worker's run (success, an exception, ``Ignore``, ``Reject``, a
   ``Retry`` of an ``until_executing`` run, and of an ``until_executed`` run, whose lock
   is *not* released but turned into the retry's claim): ``releasing`` set, ``held``
   False, ``ensure_held()`` raises, the run not lost: **held**. In the claim case the key
   is still in Redis (the retry's claim); the message (``run.ENDED``) names both.
3. A soft time limit landing at each line executed under ``_end`` (its own and all it
   calls: the keeper's ``releasing``, the release and its reply): held there, raised
   after ``_end``; the ended run never vouches again: **held**.
4. A release that gets no answer (the link holds every byte past the read timeout): the
   lock is still in Redis, the keeper sends the release again; the ended run says not
   held from its end on (on the safe side), and is not lost once the resend ran: **held**.
5. Nested runs (``self(...)`` of the same task): a nested run that returned, or raised
   and was caught, is not held; the outer body still is (its own run back, ``ensure_held``
   passes); a nested call with the outer's own key (refused, ``DuplicateTaskError``)
   leaves the outer held: **held** (nothing sets ``releasing`` on a run whose body runs).
6. A nested run cut short by a soft time limit held in its ``_begin`` (raised at its safe
   point, its lease abandoned): the outer body gets its own run back, held; the
   abandoned entry never reaches any body (``self.singleton`` is the outer's): **held**.
   ``LeaseKeeper.abandon`` forgets the entry: the abandoned ``HeldRun``, found only in
   the keeper's queue, says not held (a run the keeper no longer renews has ended).
7. A thread reading ``held`` and ``ensure_held()`` in a loop as the run ends (no keeper
   mutex on the read): True until the end, then False for good, the first False with
   ``releasing`` set and "the run ended"; never True again: **held**.
8. Two runs on two threads: one ending leaves the other, still in its body, held (its
   ``releasing`` untouched by the other's end or by keeper rounds): **held**.
9. A hand renewal (a tool's ``keeper.renew``) of a run that ended, its lock released:
   not counted lost, still not held: **held**.
10. A fail-open run (``UnlockedRun``) after its end: its fail-open message, not "the run
    ended" (it had no lock to release): **held** (pinned).

11. Real workers (``threads``, ``prefork``, ``gevent`` pools): a body leaves a thread (a
    greenlet under gevent) running; once the run's lock is gone from Redis the thread finds
    ``held`` False and ``ensure_held()`` raising "the run ended": **held**. Before the
    change it found ``True`` and ``ensure_held()`` passing with the lock already gone.
12. An eager ``until_executed`` run that retries: the retry (run by ``apply()`` after the
    first run ended) adopts the claim and holds the same key; the first run's object,
    asked from the retry's body, says not held; the task's ``after_return`` (after the
    end) sees its run not held: **held**. Task handlers (``after_return``, ``on_success``,
    ``on_failure``) run after ``__call__``: ``ensure_held()`` raises there now, where it
    passed before with the lock already released (not said in the CHANGELOG; right in
    effect).
13. A ``KeyboardInterrupt`` (any exception a signal handler raises; a soft limit is held
    there) landing at each line of ``_end`` and of what it calls without a ``with``
    (``get_keeper``, ``_release``, ``_end_is_seen``, ``ending_of``): an ended run that
    still says held always has its lock in Redis as its own (the safety the change is
    for): **held**. It **broke** (a cause older than the change) where one landed before
    ``_end``'s ``try``, at the start of ``get_keeper()``, where CPython 3.11 runs a pending
    ``SIGINT`` handler (the callee's ``RESUME``): ``keeper.releasing`` and ``keeper.forget``
    were skipped, the ended run said held, and its lease stayed kept and renewed for as
    long as the process lived (its key refused to every later run). Reachable where a
    ``SIGINT`` ends an eager run and the process lives on (an interactive session, a
    command catching ``KeyboardInterrupt``). Fixed: ``_end`` gets the keeper inside its
    ``try`` and forgets the run in its ``finally``; a run the keeper no longer renews
    says not held
    (``test_an_interrupt_as_end_gets_its_keeper_leaves_the_run_forgotten_and_not_held``).

Reverting d365d9f (``held`` and ``ensure_held`` without the ``releasing`` check) fails
1, 2, 3, 4, 7, 9, 11, 12 and 13's sweep (5, 6 and 8, direction "not held while the
body runs", fail only at their final checks of the runs that ended); 10 and the xfail
are unchanged by it.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable, Iterator
from types import CodeType, FrameType, ModuleType
from typing import Any

import pytest
import redis
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery, states
from celery.exceptions import Ignore, Reject

from celery_singleton_beat import SingletonRun, SingletonTask
from celery_singleton_beat.exceptions import DuplicateTaskError, LockLost
from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper, get_keeper
from celery_singleton_beat.recovery.lock_redis import reset_clients
from celery_singleton_beat.task import soft_limit
from celery_singleton_beat.task.endings import ending_of
from celery_singleton_beat.task.release import ReleaseAtEnd
from celery_singleton_beat.task.run import ENDED, HeldRun, UnlockedRun

from . import test_adversary_soft_hold as soft_hold
from .support import RedisServer, importorskip, start_worker, wait_for
from .support.tasks import lock_keys
from .test_adversary_held_run import eager_lock_app, job_whose_release_gets_no_answer, run_as_worker


@pytest.fixture
def app(redis_db: redis.Redis, redis_server: RedisServer) -> Iterator[Celery]:
    yield eager_lock_app(redis_server, "adv-ended-run")
    reset_clients()


def assert_ended(run: SingletonRun) -> None:
    """``run`` ended: it no longer vouches, and says so with its own key and why."""
    assert isinstance(run, HeldRun)
    assert run.releasing, "the run's end did not set releasing"
    assert not run.lost, f"an ended run counted lost: {run.lost_reason}"
    assert not run.held, "an ended run still says held"
    with pytest.raises(LockLost) as raised:
        run.ensure_held()
    assert raised.value.key == run.key
    assert raised.value.reason == ENDED
    assert str(raised.value) == f"lock {run.key} lost: {ENDED}"


# ------------------------------------------------------------- 1. a thread outlives the run

def test_a_thread_the_body_started_sees_its_run_end(app: Celery, locks: redis.Redis) -> None:
    inside = threading.Event()
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> int:
        run = self.singleton_run

        def left_running() -> None:
            seen["during"] = run.held, run.ensure_held()
            inside.set()
            wait_for(lambda: locks.get(run.key) is None, timeout=30, message="the run's lock released")
            seen["after"] = run.held
            try:
                run.ensure_held()
            except LockLost as exc:
                seen["raised"] = exc

        if x == 1:
            seen["thread"] = threading.Thread(target=left_running, name="left-running")
            seen["thread"].start()
            assert inside.wait(30), "the thread never read the run"
        seen.setdefault("runs", []).append(run)
        return x

    assert job.apply(args=(1,), throw=True).get() == 1
    seen["thread"].join(30)
    first = seen["runs"][0]
    assert seen["during"] == (True, first.fence), "the thread did not see the run held while it ran"
    assert seen["after"] is False, "the thread saw the ended run held"
    assert isinstance(seen.get("raised"), LockLost) and seen["raised"].reason.startswith("the run ended")
    assert job.apply(args=(2,), throw=True).get() == 2  # another key: unaffected
    assert_ended(first)


def test_the_ended_run_does_not_vouch_while_the_next_run_holds_the_key(app: Celery, locks: redis.Redis) -> None:
    seen: list[SingletonRun] = []
    beside: dict[str, Any] = {}

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> int:
        run = self.singleton_run
        if seen:  # the second run: the first run's object is asked beside it
            previous = seen[0]
            beside.update(previous_held=previous.held, own_held=run.held, same_key=previous.key == run.key)
        seen.append(run)
        return x

    job.apply(args=(1,), throw=True)
    job.apply(args=(1,), throw=True)
    assert beside == {"previous_held": False, "own_held": True, "same_key": True}
    first, second = seen
    assert isinstance(first, HeldRun) and isinstance(second, HeldRun) and second.fence > first.fence
    assert_ended(first)
    assert_ended(second)


# ------------------------------------------------------------- 2. every ending of a worker's run

@pytest.mark.parametrize(("ending", "mode", "state", "claim_left"), [
    ("return", "until_executing", states.SUCCESS, False),
    ("error", "until_executing", states.FAILURE, False),
    ("ignore", "until_executing", states.IGNORED, False),
    ("reject", "until_executing", states.REJECTED, False),
    ("retry", "until_executing", states.RETRY, False),
    ("retry", "until_executed", states.RETRY, True),
    ("return", "until_executed", states.SUCCESS, False),
])
def test_every_ending_of_a_worker_run_ends_its_vouching(ending: str, mode: str, state: str, claim_left: bool,
                                                        app: Celery, locks: redis.Redis) -> None:
    app.conf.update(task_always_eager=False)
    runs: list[SingletonRun] = []

    @app.task(base=SingletonTask, bind=True, shared=False, lock_mode=mode)
    def job(self: SingletonTask, x: int) -> int:
        run = self.singleton_run
        assert run.held and run.ensure_held() == run.fence
        runs.append(run)
        if ending == "error":
            raise ValueError("the body failed")
        if ending == "ignore":
            raise Ignore()
        if ending == "reject":
            raise Reject("rejected", requeue=False)
        if ending == "retry":
            raise self.retry(countdown=60)
        return x

    task_id = job.apply_async(args=(1,)).id if mode == "until_executed" else f"ended-{ending}-{mode}"
    assert run_as_worker(job, task_id, (1,)) == state
    (run,) = runs
    assert isinstance(run, HeldRun) and not run.active
    if claim_left:  # the lock is not released: turned into the retry's claim, the retry's to take
        assert run.key in lock_keys(locks), "the retry's claim is not in Redis"
    else:  # (a retry's publish leaves its own queue claim, another key)
        assert run.key not in lock_keys(locks)
    assert_ended(run)


# ------------------------------------------------------------- 3. a soft limit in _end

def test_a_soft_limit_at_any_line_under_end_leaves_the_ended_run_not_held(app: Celery, locks: redis.Redis) -> None:
    app.conf.task_store_eager_result = False
    runs: list[SingletonRun] = []

    @app.task(base=SingletonTask, bind=True, shared=False, name="adv.ended.soft", lock_ttl=600.0, unique_on=["n"])
    def job(self: SingletonTask, n: int) -> str:
        runs.append(self.singleton_run)
        return "ran"

    job.apply((0,))  # warmed up: clients, scripts, the keeper's thread
    code = SingletonTask._end.__code__
    numbers = itertools.count(1)
    problems: list[str] = []
    landings = 0
    for nth in itertools.count():
        runs.clear()
        landing = soft_hold.Landing(code, nth, deep=True)
        result = landing.run(lambda: job.apply((next(numbers),)))
        if landing.landed is None:
            break
        landings += 1
        held, soft_limit._held = soft_limit._held, False
        (run,) = runs
        wrong = [what for what, bad in (
            (f"ended as {result.result!r}", not isinstance(result.result, SoftTimeLimitExceeded)),
            ("a soft limit left held", held),
            ("releasing not set", not (isinstance(run, HeldRun) and run.releasing)),
            ("still held", run.held),
        ) if bad]
        try:
            run.ensure_held()
            wrong.append("ensure_held passed")
        except LockLost as exc:
            if not exc.reason.startswith("the run ended") and not run.lost:
                wrong.append(f"ensure_held: {exc.reason}")
        if wrong:
            problems.append(f"landing at {landing.landed}: {'; '.join(wrong)}")
        for key in lock_keys(locks):
            locks.delete(key)
    assert landings > 10, f"only {landings} lines of _end swept"
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------- 4. a release without an answer

def test_an_ended_run_whose_release_got_no_answer_is_not_held(redis_db: redis.Redis, redis_server: RedisServer,
                                                              locks: redis.Redis) -> None:
    link, job, runs = job_whose_release_gets_no_answer(redis_server, "adv-ended-no-answer")
    try:
        assert job.apply(args=(1,), throw=True).get() == 1
        (run,) = runs
        assert isinstance(run, HeldRun)
        assert locks.get(run.key) is not None, "the release got through: nothing tried"
        assert [pending.lease for pending in get_keeper().pending_releases] == [run.lease]
        assert_ended(run)  # its lock still in Redis, its release on its way: on the safe side
    finally:
        link.resume()
    try:
        wait_for(lambda: not get_keeper().pending_releases, timeout=30, message="the release sent again")
        assert locks.get(run.key) is None
        assert_ended(run)
    finally:
        reset_clients()
        link.close()


# ------------------------------------------------------------- 5. and 6. nested runs

def test_nested_runs_end_alone_and_the_outer_body_still_vouches(app: Celery, locks: redis.Redis) -> None:
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int, fail: bool = False) -> int:
        run = self.singleton_run
        if x == 0:
            seen["outer"] = run
            self(1)  # returns
            seen["after_return"] = (self.singleton_run is run, run.held, run.ensure_held(), seen["inner"].held)
            with pytest.raises(ValueError, match="the nested body failed"):
                self(2, fail=True)  # raises, caught here
            seen["after_raise"] = (self.singleton_run is run, run.held, run.ensure_held(), seen["failed"].held)
            try:
                self(0)  # the outer's own key: refused
            except DuplicateTaskError:
                seen["refused"] = True
            seen["after_refused"] = (self.singleton_run is run, run.held, run.ensure_held(), lock_keys(locks))
            return x
        seen["failed" if fail else "inner"] = run
        if fail:
            raise ValueError("the nested body failed")
        return x

    assert job.apply(args=(0,), throw=True).get() == 0
    outer, inner, failed = seen["outer"], seen["inner"], seen["failed"]
    assert seen["after_return"] == (True, True, outer.fence, False)
    assert seen["after_raise"] == (True, True, outer.fence, False)
    assert seen.get("refused"), "the nested call with the outer's key ran"
    assert seen["after_refused"] == (True, True, outer.fence, [outer.key])
    for run in (inner, failed, outer):
        assert_ended(run)


def test_a_nested_run_cut_short_in_begin_leaves_the_outer_body_its_held_run(
        app: Celery, locks: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    cut: list[str] = []
    kept_runs: list[KeptLease] = []
    keep_entry = LeaseKeeper.keep_entry

    def noting(keeper: LeaseKeeper, kept: KeptLease) -> KeptLease:
        kept_runs.append(kept)
        return keep_entry(keeper, kept)

    monkeypatch.setattr(LeaseKeeper, "keep_entry", noting)

    class CutNested(SingletonTask):
        def _take_run_lock(self, request: Any, client: Any, key: str, spec: Any, adopt: str | None,
                           copy: bool) -> Any:
            result = super()._take_run_lock(request, client, key, spec, adopt, copy)
            if key in cut:  # the nested run's: a soft limit lands in its _begin
                soft_limit._held = True
            return result

    @app.task(base=CutNested, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> str:
        run = self.singleton_run
        if x == 1:
            seen["nested_body"] = True
            return "nested"
        try:
            self(1)
        except SoftTimeLimitExceeded:
            seen["cut"] = True
        seen["outer"] = (self.singleton is run, run.held, run.ensure_held() == run.fence, lock_keys(locks))
        seen["run"] = run
        return "outer"

    nested_key = job.singleton_key((1,), {})
    cut.append(nested_key)
    assert job.singleton_key((0,), {}) != nested_key
    try:
        assert job.apply(args=(0,), throw=True).get() == "outer"
    finally:
        soft_limit.drop_held()
    run = seen["run"]
    assert seen.get("cut") and not seen.get("nested_body"), "the soft limit did not cut the nested run's _begin"
    assert seen["outer"] == (True, True, True, [run.key]), "the outer body lost its run to the nested one's cut"
    assert_ended(run)
    # The abandoned nested entry: forgotten, its lock released, and never any body's run.
    (abandoned,) = [kept for kept in kept_runs if kept.lease.key == nested_key]
    assert isinstance(abandoned, HeldRun) and not abandoned.active and abandoned is not run
    assert not abandoned.releasing  # abandon() forgets it without a release of the run's own
    assert not abandoned.held, "a run its keeper no longer renews has ended"
    with pytest.raises(LockLost, match="the run ended"):
        abandoned.ensure_held()
    assert lock_keys(locks) == []


# ------------------------------------------------------------- 7. and 8. threads

def test_a_thread_polling_held_sees_true_then_false_for_good(app: Celery, locks: redis.Redis) -> None:
    polled: list[tuple[bool, bool, str | None]] = []
    go = threading.Event()

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> int:
        run = self.singleton_run
        assert isinstance(run, HeldRun)

        def poll() -> bool:
            releasing_before = run.releasing
            held = run.held
            try:
                run.ensure_held()
                reason = None
            except LockLost as exc:
                reason = exc.reason
            polled.append((held, releasing_before, reason))
            if polled and len(polled) == 1:
                go.set()
            return not held and reason is not None

        def poller() -> None:
            wait_for(poll, timeout=30, interval=0.0005, message="the run's end seen")

        thread = threading.Thread(target=poller, name="held-poller")
        seen_thread.append(thread)
        thread.start()
        assert go.wait(30), "the poller never read the run"
        runs.append(run)
        return x

    runs: list[HeldRun] = []
    seen_thread: list[threading.Thread] = []
    job.apply(args=(1,), throw=True)
    seen_thread[0].join(30)
    assert not seen_thread[0].is_alive()
    helds = [held for held, _, _ in polled]
    first_false = helds.index(False)
    assert first_false >= 1 and all(helds[:first_false]) and not any(helds[first_false:]), helds
    assert all(reason is None for _, _, reason in polled[:first_false])
    assert polled[-1][2] == ENDED, polled[-1]
    assert_ended(runs[0])


def test_one_threads_run_ending_leaves_another_threads_run_held(app: Celery, locks: redis.Redis) -> None:
    second_in_body = threading.Event()
    first_ended = threading.Event()
    seen: dict[int | str, Any] = {}

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> int:
        run = self.singleton_run
        seen[x] = run
        if x == 2:
            second_in_body.set()
            assert first_ended.wait(30)
            wait_for(lambda: locks.get(seen[1].key) is None, timeout=30, message="the first run's lock released")
            seen["second_after"] = (run.held, run.ensure_held() == run.fence, seen[1].held)
        return x

    second = threading.Thread(target=lambda: job.apply(args=(2,), throw=True), name="second-run")
    second.start()
    assert second_in_body.wait(30)
    job.apply(args=(1,), throw=True)
    first_ended.set()
    second.join(30)
    assert seen["second_after"] == (True, True, False)
    assert_ended(seen[1])
    assert_ended(seen[2])


# ------------------------------------------------------------- 9. a hand renewal after the end

def test_a_renewal_by_hand_after_the_end_is_no_loss_and_does_not_vouch(app: Celery, locks: redis.Redis) -> None:
    runs: list[SingletonRun] = []

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> int:
        runs.append(self.singleton_run)
        return x

    job.apply(args=(1,), throw=True)
    (run,) = runs
    assert isinstance(run, HeldRun) and lock_keys(locks) == []
    assert get_keeper().renew(run) is False, "a released lock renewed"
    assert_ended(run)


# ------------------------------------------------------------- 10. fail-open

def test_a_fail_open_run_after_its_end_says_it_ran_unlocked(redis_db: redis.Redis) -> None:
    app = Celery("adv-ended-open", broker="memory://", set_as_current=False)
    app.conf.update(singleton_redis_url="redis://127.0.0.1:1/0", singleton_fail_open=True, task_always_eager=True,
                    singleton_redis_options={"socket_timeout": 1.0, "socket_connect_timeout": 1.0})
    runs: list[SingletonRun] = []

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> int:
        runs.append(self.singleton_run)
        return x

    try:
        assert job.apply(args=(1,), throw=True).get() == 1
    finally:
        reset_clients()
    (run,) = runs
    assert isinstance(run, UnlockedRun) and not run.held and not run.lost
    with pytest.raises(LockLost, match="fail-open"):
        run.ensure_held()


# ------------------------------------------------------------- 12. eager retry, handlers

def test_an_eager_until_executed_retry_runs_beside_the_ended_first_run(app: Celery, locks: redis.Redis) -> None:
    """An eager ``until_executed`` run that retries: its lock turns into the retry's claim,
    and the retry (run by ``apply()`` once the first run ended) adopts it and holds the
    same key, while the first run's object says not held; the task's ``after_return``
    (after the last run's end) sees its run not held."""
    seen: list[Any] = []
    runs: list[SingletonRun] = []

    class Handled(SingletonTask):
        def after_return(self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any,
                         einfo: Any) -> None:
            run = self.singleton
            seen.append(("after_return", status, run is runs[-1], run.held if run is not None else None))

    @app.task(base=Handled, bind=True, shared=False, lock_mode="until_executed", max_retries=1)
    def job(self: SingletonTask, x: int) -> int:
        run = self.singleton_run
        runs.append(run)
        seen.append(("body", [(each.held, run.key in lock_keys(locks)) for each in runs]))
        if not self.request.retries:
            raise self.retry(countdown=0)
        return x

    result = job.apply(args=(1,))
    assert result.get() == 1
    first, second = runs
    assert isinstance(first, HeldRun) and isinstance(second, HeldRun)
    assert first.key == second.key and second.fence > first.fence
    assert seen == [("body", [(True, True)]),
                    ("body", [(False, True), (True, True)]),  # the first run's object beside the retry
                    ("after_return", states.SUCCESS, True, False)]
    assert_ended(first)
    assert_ended(second)


# ------------------------------------------------------------- 13. KeyboardInterrupt in _end

class Interrupt(soft_hold.LineHook):
    """A line hook raising ``KeyboardInterrupt`` (what a ``SIGINT`` raises, where the
    interpreter runs the handler) once: at the ``nth`` line event counted in the frames of
    ``code`` and, under them, of ``under``; or (``at``) at the first line of a frame of
    ``at`` under ``code``. Only frames without a ``with`` statement are counted: a line hook
    fires on a ``with`` line again just before its ``__exit__`` call, where a signal handler
    never runs (the lock it raised past was left held: a hook artefact, not a finding)."""

    def __init__(self, code: CodeType, nth: int = -1, at: CodeType | None = None,
                 under: tuple[CodeType, ...] = ()) -> None:
        super().__init__(code, nth)
        self.at, self.under = at, under

    def follows(self, frame: FrameType) -> bool:
        return frame.f_code in self.under or frame.f_code is self.at

    def lands_at(self, frame: FrameType) -> bool:
        return self.count == self.nth or (self.at is not None and frame.f_code is self.at)

    def land(self, frame: FrameType) -> None:
        raise KeyboardInterrupt  # (the hook is unset by the interpreter: once)

    def run(self, call: Callable[[], Any]) -> str:
        sys.settrace(self)
        try:
            call()
            return "returned"
        except KeyboardInterrupt:
            return "interrupted"
        finally:
            sys.settrace(None)


def _interrupt_task(app: Celery, runs: list[SingletonRun]) -> Any:
    app.conf.task_store_eager_result = False

    @app.task(base=SingletonTask, bind=True, shared=False, name="adv.ended.interrupt", lock_ttl=600.0,
              unique_on=["n"])
    def job(self: SingletonTask, n: int) -> int:
        runs.append(self.singleton_run)
        return n

    return job


def _clean(locks: redis.Redis) -> None:
    keeper = get_keeper()
    for kept in soft_hold.kept_leases(keeper):
        if kept.lease.spec.task == "adv.ended.interrupt":
            keeper.forget(kept)
    for key in lock_keys(locks):
        locks.delete(key)


def test_an_interrupt_at_any_line_under_end_never_leaves_held_without_the_lock(app: Celery,
                                                                               locks: redis.Redis) -> None:
    """The safety the change is for, under any exception a signal handler raises as the run
    ends (not only a soft limit, which ``_end`` holds): an ended run that still says held
    has its lock in Redis, as its own. Landings (each line of ``_end``, ``get_keeper``,
    ``_release``, ``_end_is_seen``, ``ending_of``) before ``releasing`` is set leave it held
    with the lock in place (the release never sent); from ``releasing`` on it says not held."""
    runs: list[SingletonRun] = []
    job = _interrupt_task(app, runs)
    job.apply((0,))  # warmed up
    numbers = itertools.count(1)
    problems: list[str] = []
    after_releasing = 0
    try:
        for nth in itertools.count():
            runs.clear()
            landing = Interrupt(SingletonTask._end.__code__, nth, under=(
                get_keeper.__code__, ReleaseAtEnd._release.__code__, ReleaseAtEnd._end_is_seen.__code__,
                ending_of.__code__))
            outcome = landing.run(lambda: job.apply((next(numbers),)))
            if landing.landed is None:
                break
            (run,) = runs
            assert isinstance(run, HeldRun)
            ours = locks.get(run.key) == run.lease.value.encode()
            after_releasing += run.releasing
            if outcome != "interrupted":
                problems.append(f"landing at {landing.landed}: {outcome}")
            if run.held and not ours:
                problems.append(f"landing at {landing.landed}: held, its lock not in Redis as its own")
            if run.releasing and run.held:
                problems.append(f"landing at {landing.landed}: releasing and held")
            _clean(locks)
    finally:
        _clean(locks)
    assert after_releasing > 5, f"only {after_releasing} landings after releasing was set"
    assert not problems, "\n".join(problems)


def test_an_interrupt_as_end_gets_its_keeper_leaves_the_run_forgotten_and_not_held(app: Celery,
                                                                                   locks: redis.Redis) -> None:
    """A ``KeyboardInterrupt`` at the start of ``get_keeper()`` in ``_end`` (a function's start
    runs pending signal handlers): the run is still forgotten (not renewed for the life of
    the process) and says not held. It used to land before ``_end``'s ``try``."""
    runs: list[SingletonRun] = []
    job = _interrupt_task(app, runs)
    job.apply((0,))  # warmed up
    runs.clear()
    landing = Interrupt(SingletonTask._end.__code__, at=get_keeper.__code__)
    try:
        outcome = landing.run(lambda: job.apply((1,)))
        assert landing.landed is not None and landing.landed[0] == "get_keeper", landing.landed
        assert outcome == "interrupted"
        (run,) = runs
        assert isinstance(run, HeldRun)
        renewals = run.renewals
        kept = run.active
        if kept:  # shown renewed after the end: the key is blocked while the process lives
            wait_for(lambda: run.renewals > renewals, timeout=30, message="a renewal of the ended run's lease")
        assert not kept, "the ended run's lease is still kept (renewed after the end)"
        assert not run.held, "the ended run still says held"
    finally:
        _clean(locks)


# ------------------------------------------------------------- 11. real workers

@pytest.mark.parametrize("pool", ["threads", "prefork", "gevent"])
def test_a_thread_left_by_a_worker_run_sees_its_end(pool: str, tasks: ModuleType, redis_server: RedisServer,
                                                    records: redis.Redis, locks: redis.Redis) -> None:
    """A real worker of each pool runs a body that leaves a thread (a greenlet under gevent)
    running; once the run's lock is gone from Redis, the thread asks the run."""
    if pool == "gevent":
        importorskip("gevent")
    from .apps import ended_run_app

    start_worker(redis_server, "tests.apps.ended_run_app", f"ended-{pool}", pool=pool, concurrency=2,
                 extra=["-Q", f"ended-{pool}"])
    key = f"outlived-{pool}"
    result = ended_run_app.outlived.apply_async((key, 30.0), queue=f"ended-{pool}")
    assert result.get(timeout=60) == key
    wait_for(lambda: records.get(f"outcome:{key}"), timeout=60, message="the left thread's outcome")
    assert records.get(f"during:{key}") == b"True|True", "the run was not held while its body ran"
    assert records.get(f"outcome:{key}") == f"False|{ENDED}|gone".encode()
