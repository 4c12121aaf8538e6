"""Adversary tests of the soft time limit held in the library's part of a run (soft-hold).

The pool process's ``SIGUSR1`` handler (:mod:`.soft_limit`) is run where the signal lands:
at a chosen line (a ``sys.settrace`` line hook calls it with that frame, as the
interpreter runs a signal handler between two instructions of the frame it interrupts),
or right after a C call returns (where CPython 3.11 looks for pending signals). Real
redis-server, eager runs, a fresh keeper per test. After each landing: the run's lock is
freed (not left until its TTL), its lease no longer kept by the keeper, nothing held, and
the soft limit reached the run (its result is ``SoftTimeLimitExceeded``).

1. Every line executed under ``SingletonTask._begin`` (its own and those of everything it
   calls: the acquire, its reply, the keeper) and under ``_end``: **held** (one landing on
   ``_begin``'s ``return``, after its safe point, was held through the body and raised once
   the body had run its course: the body never got it; real only where the interpreter
   looks for signals there, which CPython 3.11 does not: fixed anyway, see 2).
2. Every line of ``SingletonTask.__call__`` itself: **broke**. One landing between
   ``_begin`` returning and the ``try`` (the ``try`` line), or in the ``finally`` before
   ``_end`` began, was raised in ``__call__``'s frame (no marked frame under it: "in the
   run"), before ``_end`` ran: the lease stayed in the keeper, renewed for as long as the
   process lived. CPython 3.11 does look for signals there: right after ``sys.exc_info()``
   returned, the argument ``__call__`` computed for ``_end``
   (``test_a_soft_limit_as_exc_info_returns_in_call_leaves_no_lock_kept``). Fixed:
   ``_begin`` is called inside the ``try``, the ending exception is caught by an
   ``except`` clause (no call between the body and ``_end``), and a held one is raised as
   the ``try`` begins, before the body.
   The same change: a singleton call nested in an ``except`` block of a body (a fallback
   run when something failed) ended, in ``_end``, as if it had raised the exception the
   outer body was handling (``sys.exc_info()`` in a ``finally`` sees it): an
   ``until_executed`` nested run that returned turned its lock into a retry's claim when
   the outer body handled a ``Retry`` (**broke**, fixed with the same change:
   ``test_a_nested_run_in_an_except_block_ends_as_it_returned``).
3. Nested runs (the nested call's frames), ``until_executed`` and ``until_executing``
   runs, ``fail_open`` runs, runs that meet their lock held by another (skipped, refused:
   they end as that says, the limit dropped) swept the same way: **held** once 2 was fixed
   (before: the same ``__call__`` lines broke, and ``fail_open``'s ``return`` after its
   ``raise_held`` held the limit through the body).
4. The wait of a worker's run for its lock Redis: each line of ``wait_for_redis``,
   ``OutageWait.after_failure`` and ``SingletonTask._take_run_lock`` (the acquire tried
   again, its lease checked and returned): **held**. Under the retry's publish (``Task.retry`` -> ``apply_async``):
   **broke**. ``retry()`` turns any ``Exception`` its publish raises into ``Reject``
   ("could not publish"): the soft limit was taken for a failed publish and lost, the
   wait went on, got its lock once Redis was back and ran the body past its soft limit
   (``test_a_soft_limit_in_the_publish_of_a_waits_retry_ends_the_wait``). Fixed:
   ``OutageWait._publish`` is a held region; the held limit ends the wait as the pause
   begins (the publish failed), or is dropped with the run once the retry is published.
5. A soft limit held in ``_end`` of a run whose body decided its ending (``Ignore``,
   ``Reject(requeue=True)``, ``Retry``): raised after ``_end`` in its place (**broke**): the
   run stored as a ``FAILURE`` over the body's own state, its message acknowledged as a
   failure instead of given back, contradicting what was recorded, which ``_begin``'s rule
   for a run that did not begin avoids. Fixed: dropped there too.
"""

from __future__ import annotations

import dis
import inspect
import itertools
import signal
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import celery.app.task
import celery.exceptions
import pytest
import redis
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery
from celery.app.trace import build_tracer
from celery.exceptions import Retry

from celery_singleton_beat import SingletonTask
from celery_singleton_beat.exceptions import DuplicateTaskError, LockUnavailable, TaskSkipped
from celery_singleton_beat.lease import counters
from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper
from celery_singleton_beat.recovery import lock_redis
from celery_singleton_beat.task import outage as outage_module
from celery_singleton_beat.task import soft_limit
from celery_singleton_beat.task import task as task_module

from . import test_adversary_hold as hold
from . import test_adversary_merge as merge
from .support import wait_for
from .support.locking import take_lock
from .support.outages import Outage
from .test_adversary_merge import run_locks

guarded = merge.guarded
lock_app = merge.lock_app
eager_app = merge.eager_app
keeper = hold.keeper
outage_app = hold.outage_app




class LineHook:
    """A ``sys.settrace`` hook that acts once (:meth:`land`), at the ``nth`` line event (from
    0) counted in the frames of ``code`` it :meth:`enters` and in the frames under them it
    :meth:`follows`. ``landed``: the function and line it acted at."""

    def __init__(self, code: CodeType, nth: int) -> None:
        self.code, self.nth = code, nth
        self.depth = self.count = 0
        self.landed: tuple[str, int] | None = None

    def enters(self, frame: FrameType) -> bool:
        return frame.f_code is self.code

    def follows(self, frame: FrameType) -> bool:
        """A frame under one of ``code``'s is counted too."""
        return False

    def lands_at(self, frame: FrameType) -> bool:
        return self.count == self.nth

    def land(self, frame: FrameType) -> None:
        raise NotImplementedError

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "return" and frame.f_code is self.code:
            self.depth -= 1
        elif event == "line" and self.landed is None:
            if self.lands_at(frame):
                self.landed = (frame.f_code.co_name, frame.f_lineno)
                self.land(frame)  # may raise, into the frame
            self.count += 1
        return self._local

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.landed is not None:
            return None
        if self.enters(frame):
            self.depth += 1
            return self._local
        return self._local if self.depth > 0 and self.follows(frame) else None


class Landing(LineHook):
    """A :class:`LineHook` landing the soft limit, in the frames of ``code`` (``deep``: and in
    every frame under them; ``nested``: only those of a run nested in another's body)."""

    def __init__(self, code: CodeType, nth: int, *, deep: bool, nested: bool = False) -> None:
        super().__init__(code, nth)
        self.deep, self.nested = deep, nested

    def enters(self, frame: FrameType) -> bool:
        return frame.f_code is self.code and (not self.nested or _nested(frame))

    def follows(self, frame: FrameType) -> bool:
        return self.deep

    def land(self, frame: FrameType) -> None:
        soft_limit._on_soft_limit(signal.SIGUSR1, frame)

    def run(self, call: Callable[[], Any]) -> Any:
        sys.settrace(self)
        try:
            return call()
        finally:
            sys.settrace(None)


def _nested(frame: FrameType | None) -> bool:
    """The frame belongs to a run nested in another one's body (two runs' ``__call__`` on the stack)."""
    calls = 0
    while frame is not None:
        calls += frame.f_code is SingletonTask.__call__.__code__
        frame = frame.f_back
    return calls >= 2


def kept_leases(keeper: LeaseKeeper) -> list[KeptLease]:
    """The leases ``keeper`` still renews."""
    with keeper._mutex:
        entries = [kept for _, _, entry in keeper._queue
                   for kept in (getattr(entry, "leases", None) or (entry,))]
    return [kept for kept in entries + list(keeper._in_flight) if isinstance(kept, KeptLease) and kept.active]


def sweep(code: CodeType, one_run: Callable[[int], Any], redis_db: redis.Redis, keeper: LeaseKeeper,
          task: str, *, deep: bool, body_ran: list[int], nested: bool = False,
          ends: tuple[type[BaseException], ...] = (SoftTimeLimitExceeded,),
          others: frozenset[str] = frozenset()) -> list[str]:
    """Land the soft limit at each line event under ``code`` in turn, one run each
    (``one_run(n)``, its own key), until a run ends before the next one; what went wrong,
    one line per landing."""
    one_run(0)  # the process warmed up: its clients, scripts, the keeper's thread
    problems = []
    numbers = itertools.count(1)
    for nth in itertools.count():
        body_ran.clear()
        landing = Landing(code, nth, deep=deep, nested=nested)
        result = landing.run(lambda: one_run(next(numbers)))
        if landing.landed is None:
            assert nth > 0, f"no line of {code.co_name} executed"
            break
        counters.flush()  # the counts written: the counter hash is not taken for a lock
        held, soft_limit._held = soft_limit._held, False
        wrong = [what for what, bad in (
            ("a soft limit left held", held),
            (f"lease still kept: {kept_leases(keeper)}", kept_leases(keeper)),
            (f"lock left: {run_locks(redis_db, task)}", not freed(redis_db, task, others)),
            (f"the run ended {result.result!r}", not isinstance(result.result, ends)),
            ("held through the body, raised after it", body_ran and code.co_name == "_begin"),
        ) if bad]
        if wrong:
            problems.append(f"landing at {landing.landed}: {'; '.join(wrong)}")
        for kept in kept_leases(keeper):
            keeper.forget(kept)
        for key in set(run_locks(redis_db, task)) - others:
            redis_db.delete(key)
    return problems


def freed(client: redis.Redis, task: str, others: frozenset[str] = frozenset()) -> bool:
    """Every run lock of ``task`` freed (a release written, its reply read later, has run),
    but those of ``others`` (held by someone else: left as they are)."""
    try:
        wait_for(lambda: set(run_locks(client, task)) == set(others), timeout=5, message="the locks freed")
    except AssertionError:
        return False
    return True


def sweep_task(app: Celery, name: str, body_ran: list[int], **options: Any) -> Any:
    """A singleton task ``name`` (one key per ``n``; a 600 s lease: one left is seen) whose
    body notes its run."""
    @app.task(base=SingletonTask, name=name, shared=False, lock_ttl=600.0, unique_on=["n"], **options)
    def swept(n: int) -> str:
        body_ran.append(n)
        return "ran"

    return swept


# ------------------------------------------------------------- 1. and 2. every line

@pytest.mark.parametrize(("method", "deep"), [("_begin", True), ("__call__", False), ("_end", True)])
def test_a_soft_limit_landing_at_any_line_of_a_runs_begin_call_or_end(
        method: str, deep: bool, guarded: None, eager_app: Celery, redis_db: redis.Redis,
        keeper: LeaseKeeper) -> None:
    body_ran: list[int] = []
    swept = sweep_task(eager_app, "adv.soft.sweep", body_ran)
    code = getattr(SingletonTask, method).__code__
    problems = sweep(code, lambda n: swept.apply((n,)), redis_db, keeper, "adv.soft.sweep",
                     deep=deep, body_ran=body_ran)
    assert not signal_free(problems), "\n".join(signal_free(problems))


def signal_free(problems: list[str]) -> list[str]:
    """``problems`` but those of landings on the lines of ``__call__``'s ``finally`` before
    ``_end`` begins: a line hook lands there, a signal cannot (no instruction there at which
    CPython runs a pending signal handler:
    ``test_nothing_in_call_between_the_body_and_end_runs_a_signal_handler``)."""
    return [problem for problem in problems
            if not any(f"('__call__', {line})" in problem for line in _before_end())]


def _before_end() -> list[int]:
    """The lines of ``__call__``'s ``finally`` up to and including its call of ``_end``."""
    lines, first = inspect.getsourcelines(SingletonTask.__call__)
    start = next(at for at, line in enumerate(lines) if line.strip() == "finally:")
    end = next(at for at, line in enumerate(lines) if "self._end(" in line)
    return list(range(first + start + 1, first + end + 1))


def test_nothing_in_call_between_the_body_and_end_runs_a_signal_handler() -> None:
    """CPython runs a pending signal handler at a function's start, at a backward jump and
    after a call (of a C function, or one it does not run inline): none of these between
    the body's end and ``_end``'s start, but the call of ``_end`` itself."""
    lines = set(_before_end())
    calls = [(ins.positions.lineno, ins.opname, ins.argrepr)
             for ins in dis.get_instructions(SingletonTask.__call__)
             if ins.positions is not None and ins.positions.lineno in lines
             and (ins.opname.startswith("CALL") or "JUMP_BACKWARD" in ins.opname)]
    copies = sum((ins.opname == "LOAD_METHOD" and ins.argval == "_end") or
                 (ins.opname == "LOAD_ATTR" and ins.argval == "_end")
                 for ins in dis.get_instructions(SingletonTask.__call__))
    assert copies and len(calls) == copies, f"calls other than _end's (one per copy of the finally): {calls}"
    assert not [ins for ins in dis.get_instructions(SingletonTask.__call__)
                if ins.positions is not None and ins.positions.lineno in lines and ins.opname == "STORE_ATTR"
                and ins.argval != "singleton"], "an attribute set there could run Python code"


class ExcInfoLands:
    """``task.py``'s ``sys``, whose ``exc_info()`` lands the soft limit in its caller as it
    returns: where CPython 3.11 looks for pending signals after a call of a C function."""

    def __init__(self) -> None:
        self.landed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(sys, name)

    def exc_info(self) -> Any:
        info = sys.exc_info()
        caller = sys._getframe(1)
        if not self.landed and caller.f_code is SingletonTask.__call__.__code__:
            self.landed.append(caller.f_code.co_name)
            soft_limit._on_soft_limit(signal.SIGUSR1, caller)
        return info


def test_a_soft_limit_as_exc_info_returns_in_call_leaves_no_lock_kept(
        guarded: None, eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A real signal's handler runs in ``__call__``'s frame once the body returned, after
    the last call made before ``_end`` (``sys.exc_info()``, a C function: CPython looks for
    pending signals as it returns). Raised there, ``_end`` never ran: the lease stayed in
    the keeper for as long as the process lived, its key refused to every later run."""
    lands = ExcInfoLands()
    monkeypatch.setattr(task_module, "sys", lands, raising=False)
    result = merge.one_run(eager_app, "adv.soft.excinfo", lock_ttl=600.0)
    monkeypatch.undo()
    try:
        # (no call left between the body and _end: nowhere for it to land)
        assert isinstance(result.result, SoftTimeLimitExceeded) or not lands.landed, result.result
        assert not kept_leases(keeper), "the run's lease is still renewed"
        counters.flush()
        wait_for(lambda: not run_locks(redis_db, "adv.soft.excinfo"), timeout=15,
                 message="the run's lock freed (its TTL is 600 s)")
    finally:
        for kept in kept_leases(keeper):
            keeper.forget(kept)
        for key in run_locks(redis_db, "adv.soft.excinfo"):
            redis_db.delete(key)


def test_a_nested_run_in_an_except_block_ends_as_it_returned(
        eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper) -> None:
    """A body handles a ``Retry`` (of a call it made) and, in its ``except`` block, runs an
    ``until_executed`` singleton task (``apply()``, eager, in this process): that run
    returns. Its end read the exception being handled (the outer body's ``Retry``) as its
    own ending, and turned its lock into a claim for a retry that was never published: the
    key refused every publish of those arguments until the claim's TTL."""
    @eager_app.task(base=SingletonTask, name="adv.soft.fallback", shared=False, lock_mode="until_executed",
                    lock_ttl=600.0)
    def fallback() -> str:
        return "fell back"

    @eager_app.task(name="adv.soft.handler", shared=False)
    def handler() -> str:
        try:
            raise Retry("a retry handled by the body")
        except Retry:
            return str(fallback.apply().get())  # a run of its own, in the except block

    assert handler.apply().get() == "fell back"
    counters.flush()
    assert not run_locks(redis_db, "adv.soft.fallback"), "the nested run's key is left claimed"


# ------------------------------------------------- 3. nested, until_executed, fail_open

@pytest.mark.parametrize(("method", "deep"), [("_begin", True), ("__call__", False), ("_end", True)])
def test_every_line_of_a_nested_runs_begin_call_and_end(
        method: str, deep: bool, guarded: None, eager_app: Celery, redis_db: redis.Redis,
        keeper: LeaseKeeper) -> None:
    """The nested call's frames only (the outer run's own are swept above): the soft limit
    reaches the outer body through the nested call (which re-raises it), every lock freed."""
    body_ran: list[int] = []

    @eager_app.task(base=SingletonTask, name="adv.soft.nested", shared=False, bind=True, lock_ttl=600.0,
                    unique_on=["n", "inner"])
    def nested(self: SingletonTask, n: int, inner: bool = False) -> Any:
        if inner:
            return "inner"
        self(n, inner=True)  # a soft limit in the nested call ends the outer run with it
        return "never stopped"

    problems = sweep(getattr(SingletonTask, method).__code__, lambda n: nested.apply((n,)), redis_db, keeper,
                     "adv.soft.nested", deep=deep, body_ran=body_ran, nested=True)
    assert not signal_free(problems), "\n".join(signal_free(problems))


@pytest.mark.parametrize("mode", ["until_executed", "until_executing"])
@pytest.mark.parametrize("method", ["_begin", "__call__"])
def test_every_line_of_an_until_executed_runs_begin_and_call(
        method: str, mode: str, guarded: None, eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper) -> None:
    """The run adopts its publish claim (``apply_async`` claims; eager here: the claim
    taken by hand first, as a queued message's)."""
    body_ran: list[int] = []
    swept = sweep_task(eager_app, "adv.soft.until", body_ran, lock_mode=mode)
    code = getattr(SingletonTask, method).__code__
    problems = sweep(code, lambda n: swept.apply((n,)), redis_db, keeper, "adv.soft.until",
                     deep=method == "_begin", body_ran=body_ran)
    assert not signal_free(problems), "\n".join(signal_free(problems))


@pytest.mark.parametrize(("on_conflict", "ended"), [("skip", TaskSkipped), ("raise", DuplicateTaskError)])
def test_every_line_of_a_run_that_meets_its_lock_held_by_another(
        on_conflict: str, ended: type[BaseException], guarded: None, eager_app: Celery, redis_db: redis.Redis,
        keeper: LeaseKeeper) -> None:
    """Another holds the key: wherever in ``_begin`` the soft limit lands, the run ends as
    its conflict says (skipped, refused), the limit dropped (not raised in a later run), the
    other's lock left alone."""
    body_ran: list[int] = []

    @eager_app.task(base=SingletonTask, name="adv.soft.conflict", shared=False, lock_ttl=600.0,
                    on_conflict=on_conflict)
    def conflict(n: int) -> str:
        body_ran.append(n)
        return "ran"

    key = conflict.singleton_key((0,))
    other = take_lock(redis_db, key, 600.0, task="adv.soft.conflict", task_id="the-other")
    assert other.acquired
    try:
        problems = sweep(SingletonTask._begin.__code__, lambda n: conflict.apply((0,)), redis_db, keeper,
                         "adv.soft.conflict", deep=True, body_ran=body_ran, ends=(ended,), others=frozenset({key}))
        assert not problems, "\n".join(problems)
        assert not body_ran
    finally:
        redis_db.delete(key)


def test_every_line_of_a_fail_open_runs_begin(
        guarded: None, eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock Redis refuses the acquire; ``fail_open`` runs the body unlocked: a soft limit
    landing anywhere as it decides so is raised before the body."""
    eager_app.conf.singleton_fail_open = True
    from celery_singleton_beat.config import clear_settings_cache
    clear_settings_cache()
    acquire = task_module.acquire

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("the lock Redis is down")

    monkeypatch.setattr(task_module, "acquire", refused)
    body_ran: list[int] = []
    swept = sweep_task(eager_app, "adv.soft.open", body_ran)
    problems = sweep(SingletonTask._begin.__code__, lambda n: swept.apply((n,)), redis_db, keeper,
                     "adv.soft.open", deep=True, body_ran=body_ran)
    monkeypatch.setattr(task_module, "acquire", acquire)
    assert not problems, "\n".join(problems)
    assert lock_redis  # (the clients reset by the app fixture)


# ------------------------------------------------------- 4. the wait for the lock Redis

def traced(task: Any, task_id: str, *args: Any) -> Any:
    """Run ``task`` as a worker's pool does (not eager: a run waits for its lock Redis)."""
    tracer = build_tracer(task.name, task, app=task.app, eager=False, propagate=False)
    return tracer(task_id, args, {}, {"id": task_id, "retries": 0, "is_eager": False,
                                      "delivery_info": {"routing_key": "celery"}})


class Ended:
    """A worker run's outcome, as an eager result shows it."""

    def __init__(self, traced: Any) -> None:
        retval, info = traced[0], traced[1]
        self.result = info.retval if info is not None else retval


@pytest.mark.parametrize("code", [outage_module.wait_for_redis.__code__,
                                  outage_module.OutageWait.after_failure.__code__,
                                  SingletonTask._take_run_lock.__code__],
                         ids=lambda code: code.co_name)
def test_every_line_of_a_wait_for_the_lock_redis(
        code: CodeType, guarded: None, outage_app: tuple[Celery, Outage], keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's run finds its lock Redis refusing writes (the retry cannot be published
    either: it waits in the worker); the outage ends during its pause and the next acquire
    gets the lock. The soft limit lands at each line under ``wait_for_redis`` in turn (its
    pause, the publish tried, the acquire tried again and its reply, the lease returned):
    the wait ends on it ("its soft time limit struck", ``LockUnavailable``) or the run is
    cut short as it begins (``SoftTimeLimitExceeded``), never with its lock left, kept, or
    the limit held."""
    app, outage = outage_app
    locks = outage.server.client()
    monkeypatch.setattr(outage_module, "_pause", lambda seconds: outage.end() or True)
    body_ran: list[int] = []

    @app.task(base=SingletonTask, name="adv.soft.waits", shared=False, lock_ttl=600.0, unique_on=["n"])
    def waits(n: int) -> str:
        body_ran.append(n)
        return "ran"

    def one_run(n: int) -> Ended:
        outage.begin()
        try:
            return Ended(traced(waits, f"waits-{n}", n))
        finally:
            outage.end()

    try:
        # Each line of the frame itself (a line hook under them, in kombu's and Celery's code
        # building the retry, takes minutes: test_a_soft_limit_in_the_publish_of_a_waits_retry_...)
        problems = sweep(code, one_run, locks, keeper, "adv.soft.waits", deep=False, body_ran=body_ran,
                         ends=(SoftTimeLimitExceeded, LockUnavailable))
        assert not problems, "\n".join(problems)
    finally:
        locks.flushall()
        locks.close()


@pytest.mark.parametrize("nth", [0, 3])
def test_a_soft_limit_in_the_publish_of_a_waits_retry_ends_the_wait(
        nth: int, guarded: None, outage_app: tuple[Celery, Outage], keeper: LeaseKeeper,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The soft limit lands as the waiting run publishes its retry (``Task.apply_async``,
    called by ``Task.retry``). ``retry()`` turns any ``Exception`` its publish raises into
    ``Reject`` ("could not publish"): raised there, the soft limit was taken for a publish
    that failed, and lost; the wait went on, got its lock once Redis was back, and ran the
    body past its soft limit. Held there, it ends the wait as the pause begins (the publish
    failed), or is dropped with the run once the retry is published."""
    app, outage = outage_app
    locks = outage.server.client()
    monkeypatch.setattr(outage_module, "_pause", lambda seconds: outage.end() or True)
    body_ran: list[int] = []

    @app.task(base=SingletonTask, name="adv.soft.publish", shared=False, lock_ttl=600.0)
    def publish() -> str:
        body_ran.append(1)
        return "ran"

    landing = Landing(celery.app.task.Task.apply_async.__code__, nth, deep=True)
    outage.begin()
    try:
        ended = landing.run(lambda: Ended(traced(publish, "publish-1")))
    finally:
        outage.end()
    try:
        assert landing.landed is not None
        assert not body_ran, f"the body ran past its soft limit (landed at {landing.landed})"
        assert isinstance(ended.result, (LockUnavailable, SoftTimeLimitExceeded)), ended.result
        assert not soft_limit._held
        assert freed(locks, "adv.soft.publish")
        assert not kept_leases(keeper)
    finally:
        locks.flushall()
        locks.close()


# ------------------------------------------- 5. a held limit after an ending already decided

@pytest.mark.parametrize("decided", ["Ignore", "Reject"])
def test_a_soft_limit_held_in_end_after_a_decided_ending_is_dropped(
        decided: str, guarded: None, eager_app: Celery, redis_db: redis.Redis, keeper: LeaseKeeper) -> None:
    """The body ends its run as decided and recorded by itself: ``Ignore`` (its state stored
    by the body, not to be overwritten), ``Reject(requeue=True)`` (its message given back).
    A soft limit landing in ``_end`` was held and raised after it, in place of that ending:
    the run stored as a ``FAILURE`` over the body's state, the message acknowledged as a
    failure instead of given back. ``_begin`` drops one for a run whose ending is decided
    (skip, retry, given back: "which a failure would contradict"); ``_end`` now does too."""
    @eager_app.task(base=SingletonTask, name=f"adv.soft.decided.{decided}", shared=False, lock_ttl=600.0)
    def decides() -> str:
        raise celery.exceptions.Ignore() if decided == "Ignore" else celery.exceptions.Reject("later", requeue=True)

    landing = Landing(SingletonTask._end.__code__, 0, deep=True)
    result = landing.run(decides.apply)
    assert landing.landed is not None
    assert not isinstance(result.result, SoftTimeLimitExceeded), f"{decided} replaced by the held soft limit"
    assert isinstance(result.result, getattr(celery.exceptions, decided)), result.result
    assert not soft_limit._held
    assert freed(redis_db, f"adv.soft.decided.{decided}")
