"""Eager mode (task_always_eager): the lock works in-process, with and without propagation."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import celery
import pytest
import redis
from celery import Celery, chain, states

from celery_singleton_beat import (
    DuplicateTaskError,
    LockLost,
    LockUnavailable,
    SingletonKeyError,
    SingletonRun,
    SingletonTask,
    TaskSkipped,
)
from celery_singleton_beat.lease import counters
from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.recovery.lock_redis import reset_clients

from .support import LOCK_DB, RedisServer, free_port
from .support.locking import take_lock
from .support.tasks import lock_keys


@pytest.fixture
def eager_app(redis_db: redis.Redis, redis_server: RedisServer) -> Iterator[Celery]:
    app = Celery("eager", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, singleton_redis_url=redis_server.url(LOCK_DB))
    yield app
    reset_clients()


@pytest.mark.parametrize("propagates", [True, False])
def test_eager_runs_take_and_release_the_lock(eager_app: Celery, locks: redis.Redis, propagates: bool) -> None:
    eager_app.conf.task_eager_propagates = propagates
    seen: list[object] = []

    @eager_app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int, fail: bool = False) -> int:
        seen.append((lock_keys(locks), self.singleton.fence))
        if fail:
            raise ValueError("boom")
        return x

    assert job.delay(1).get() == 1
    assert seen[0][0] and seen[0][1] is not None, "the body ran holding the lock"
    assert lock_keys(locks) == []
    if propagates:
        with pytest.raises(ValueError):
            job.delay(2, fail=True)
    else:
        assert job.delay(2, fail=True).state == "FAILURE"
    assert lock_keys(locks) == [], "released after a failure too"


def test_eager_duplicate_inside_a_run_is_skipped(eager_app: Celery, locks: redis.Redis) -> None:
    @eager_app.task(base=SingletonTask, shared=False, unique_on=["x"])
    def job(x: int, nested: bool = False) -> str:
        if nested:
            return "ran"
        return job.apply(args=(x, True)).state  # the same key while this run holds it

    assert job.delay(1).get() == "REVOKED", "a skipped duplicate, as a worker records it"
    assert job.apply(args=(1, True)).get() == "ran", "free again once the outer run returned"
    assert lock_keys(locks) == []


def test_a_run_sees_the_request_celery_pushed_and_a_base_classes_own_call_still_runs(
        eager_app: Celery, locks: redis.Redis) -> None:
    """A traced run calls the body as Celery calls a task without a ``__call__`` of its own:
    the body sees the one request the tracer pushed (no copy of it pushed on top); a class
    of the task's own between SingletonTask and Celery's Task whose ``__call__`` wraps the
    body keeps wrapping it, and a call nested in a run of the same task gets its own request."""
    wrapped: list[int] = []

    class Wrapping(celery.Task):  # type: ignore[misc]  # a user's base class with a __call__
        def __call__(self, *args: object, **kwargs: object) -> object:
            wrapped.append(len(self.request_stack.stack))
            return super().__call__(*args, **kwargs)

    @eager_app.task(base=SingletonTask, bind=True, shared=False)
    def plain_base(self: SingletonTask, x: int) -> tuple[int, bool, int | None]:
        return len(self.request_stack.stack), self.request.id is not None, self.singleton.fence

    depth, has_id, fence = plain_base.delay(1).get()
    assert (depth, has_id) == (1, True) and isinstance(fence, int), "the tracer's request, with the run on it"

    class Base(SingletonTask, Wrapping):  # type: ignore[misc]
        abstract = True

    @eager_app.task(base=Base, bind=True, shared=False, unique_on=["x"])
    def mixed(self: SingletonTask, x: int, nested: bool = False) -> object:
        if nested:
            return self.request.args, self.singleton.fence, len(self.request_stack.stack)
        outer = self.singleton
        inner = self(x + 1, nested=True)  # a nested direct call of the same task, lock taken
        return inner[0], inner[2], self.request.args, outer is not None

    inner_args, inner_depth, outer_args, had_run = mixed.delay(1).get()
    assert wrapped and wrapped[0] == 1, "the base class's __call__ wrapped the body"
    assert list(inner_args) == [2] and inner_depth > 1 and list(outer_args) == [1] and had_run
    assert lock_keys(locks) == []


def test_called_directly_runs_the_body_without_a_lock(eager_app: Celery, locks: redis.Redis) -> None:
    @eager_app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> object:
        return self.singleton, lock_keys(locks)

    assert job(1) == (None, [])


def test_singleton_run_is_the_runs_lock_and_says_where_there_is_none(eager_app: Celery) -> None:
    """The typed accessor of the body (README Usage); ``singleton`` keeps working."""
    @eager_app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> tuple[bool, int, int | None]:
        run = self.singleton_run
        return run is self.singleton, run.ensure_held(), run.fence

    same, fence, expected = job.delay(1).get()
    assert same and fence == expected and isinstance(fence, int)
    with pytest.raises(RuntimeError, match=r"no singleton run: the task is called directly \(no lock"):
        job(1)
    with pytest.raises(RuntimeError, match="no singleton run: the task is outside a run"):
        job.singleton_run  # noqa: B018


def test_a_run_that_ended_no_longer_vouches_for_its_released_lock(eager_app: Celery, locks: redis.Redis) -> None:
    """A body may hand its run to work that outlives it (a thread it started, a callback):
    once the run ended and released its lock, another run can take the key at once, so
    ``held`` is False and ``ensure_held()`` raises, within the grace the lease still had."""
    @eager_app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> tuple[SingletonRun, bool, int]:
        run = self.singleton_run
        return run, run.held, run.ensure_held()

    run, held_inside, fence = job.delay(1).get()
    assert held_inside and isinstance(fence, int), "vouched for while it ran"
    assert lock_keys(locks) == [], "released as the run ended"
    assert run.fence == fence and not run.lost
    assert not run.held, "an ended run's released lock is not held"
    with pytest.raises(LockLost, match="the run ended"):
        run.ensure_held()
    again, _, next_fence = job.delay(1).get()  # the key is free: the next run takes it
    assert again is not run and next_fence > fence and not run.held


def test_eager_with_redis_down_fails_closed_with_a_clear_error() -> None:
    app = Celery("down", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True,
                    singleton_redis_url=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
                    singleton_redis_options={"socket_connect_timeout": 0.5})
    ran: list[int] = []

    @app.task(base=SingletonTask, shared=False)
    def job(x: int) -> None:
        ran.append(x)

    with pytest.raises(LockUnavailable, match="cannot reach Redis"):
        job.delay(1)
    assert ran == []
    reset_clients()


def test_eager_fail_open_runs_anyway() -> None:
    app = Celery("open", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True, singleton_fail_open=True,
                    singleton_redis_url=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
                    singleton_redis_options={"socket_connect_timeout": 0.5})

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> bool:
        return self.singleton.held

    assert job.delay(1).get() is False
    reset_clients()


def test_unencodable_argument_in_eager_mode(eager_app: Celery) -> None:
    eager_app.conf.task_eager_propagates = True

    @eager_app.task(base=SingletonTask, shared=False, name="proj.job")
    def job(x: object) -> None: ...

    with pytest.raises(SingletonKeyError, match=r"proj.job: argument 'x'"):
        job.apply(args=(object(),))


def hold(locks: redis.Redis, task: SingletonTask, *args: object) -> Lease:
    """Take the lock of ``task(*args)`` as another run would (task id ``holder``)."""
    result = take_lock(locks, task.singleton_key(args), 60, task=task.name, task_id="holder")
    assert result.lease is not None
    return result.lease


@pytest.mark.parametrize("propagates", [True, False])
def test_an_eager_skip_is_what_a_worker_records(eager_app: Celery, locks: redis.Redis, propagates: bool) -> None:
    """REVOKED with TaskSkipped, as stored by a worker: ``.get()`` raises (issue 22: IGNORED, None)."""
    eager_app.conf.task_eager_propagates = propagates
    ran: list[int] = []

    @eager_app.task(base=SingletonTask, shared=False, unique_on=["x"], name="proj.job")
    def job(x: int) -> int:
        ran.append(x)
        return x

    lease = hold(locks, job, 1)
    result = job.delay(1)  # a skip is an outcome, not an error of the caller: never raised here
    assert result.state == states.REVOKED and result.ready()
    with pytest.raises(TaskSkipped) as caught:
        result.get()
    assert caught.value.holder_task_id == "holder" and caught.value.key == lease.key
    assert isinstance(result.get(propagate=False), TaskSkipped)
    assert ran == [] and read_holder(locks, lease.key).task_id == "holder", "the holder's lock stands"
    assert lease.release()


def test_a_skip_has_one_name_on_every_surface(eager_app: Celery, locks: redis.Redis, on_log_line: object) -> None:
    """README "One skip, the name on each surface": "skipped" wherever the library
    names it, REVOKED where Celery needs a ready state, SKIPPED where Celery's event
    state derives it from the event name, "ignored" in Celery's own trace line."""
    from celery.events.state import State

    @eager_app.task(base=SingletonTask, shared=False, name="proj.job")
    def job(x: int) -> int:
        return x

    ours = on_log_line("skipped: duplicate of task holder", lambda n: None)  # type: ignore[operator]
    celerys, trace = _OnLine("Task proj.job[", lambda n: None), logging.getLogger("celery.app.trace")
    level = trace.level
    trace.addHandler(celerys)
    trace.setLevel(logging.INFO)
    counters.flush()  # what earlier tests of this process counted, written before ours
    locks.delete(job.singleton_stats_key())
    lease = hold(locks, job, 1)
    try:
        result = job.delay(1)
    finally:
        trace.removeHandler(celerys)
        trace.setLevel(level)
        lease.release()
    assert result.state == states.REVOKED and isinstance(result.result, TaskSkipped)  # IGNORED before
    assert "skipped, duplicate of task holder" in str(result.result)
    assert ours.seen == 1
    assert [text for at, text in celerys.messages] == [f"Task proj.job[{result.id}] ignored"]
    counters.flush()  # counted in this process, written in batches
    assert locks.hget(job.singleton_stats_key(), "skipped") == b"1"
    flower = State()  # what Flower keeps of the events: task-skipped -> SKIPPED
    flower.event({"type": "task-skipped", "uuid": result.id, "hostname": "w1", "timestamp": time.time(),
                  "local_received": time.time(), "clock": 1})
    assert flower.tasks[result.id].state == "SKIPPED"


def test_an_eager_chain_stops_at_a_skipped_step(eager_app: Celery, locks: redis.Redis) -> None:
    after: list[object] = []

    @eager_app.task(base=SingletonTask, shared=False, unique_on=["x"])
    def job(x: int) -> int:
        return x

    @eager_app.task(shared=False)
    def then(value: object) -> None:
        after.append(value)

    lease = hold(locks, job, 1)
    with pytest.raises(TaskSkipped):  # Celery's eager chain raises what a step's .get() raises
        chain(job.s(1), then.s()).delay()
    assert after == [], "the rest of the chain did not run (it ran with None before)"
    lease.release()


def test_an_eager_skip_is_stored_with_task_store_eager_result(eager_app: Celery, locks: redis.Redis) -> None:
    eager_app.conf.update(result_backend="cache+memory://", task_store_eager_result=True)

    @eager_app.task(base=SingletonTask, shared=False)
    def job(x: int) -> int:
        return x

    lease = hold(locks, job, 1)
    stored = eager_app.AsyncResult(job.delay(1).id)
    assert stored.state == states.REVOKED and isinstance(stored.result, TaskSkipped)
    lease.release()


class _OnLine(logging.Handler):
    """Calls ``action`` for each record of the library's logger containing ``text``;
    keeps when each came (monotonic) and its arguments."""

    def __init__(self, text: str, action: object) -> None:
        super().__init__()
        self.text, self.action, self.seen = text, action, 0
        self.records: list[tuple[float, tuple[object, ...]]] = []
        self.messages: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.text in message:
            self.seen += 1
            self.records.append((time.monotonic(), tuple(record.args or ())))
            self.messages.append((time.monotonic(), message))
            self.action(self.seen)  # type: ignore[operator]

    def countdown(self, index: int) -> tuple[float, float]:
        """When the ``index``-th "waits" line came, and the countdown it announced."""
        at, args = self.records[index]
        return at, float(args[2])  # type: ignore[arg-type]  # "%s[%s] waits %.1fs: ..."


@pytest.fixture
def on_log_line() -> Iterator[object]:
    logger = logging.getLogger("celery_singleton_beat")
    handlers: list[logging.Handler] = []
    level = logger.level
    logger.setLevel(logging.INFO)

    def install(text: str, action: object) -> _OnLine:
        handler = _OnLine(text, action)
        logger.addHandler(handler)
        handlers.append(handler)
        return handler

    yield install
    for handler in handlers:
        logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.parametrize("propagates", [True, False])
def test_an_eager_retry_waits_for_the_holder_and_returns_its_own_result(
    eager_app: Celery, locks: redis.Redis, on_log_line: object, propagates: bool,
) -> None:
    """The caller's process waits out the back-off as a worker would (issue 22: DuplicateTaskError
    within 5 ms, or Celery's Retry raised with task_eager_propagates)."""
    eager_app.conf.update(task_eager_propagates=propagates, singleton_retry_backoff_max=0.2)
    ran: list[tuple[float, str | None]] = []

    @eager_app.task(base=SingletonTask, shared=False, on_conflict="retry", max_retries=3)
    def job(x: int) -> int:
        ran.append((time.monotonic(), read_holder(locks, job.singleton_key((x,))).task_id))
        return x

    lease = hold(locks, job, 1)
    # The holder ends as soon as the duplicate announces its wait.
    waits = on_log_line("waits", lambda n: n == 1 and lease.release())  # type: ignore[operator]
    result = job.delay(1)
    assert result.state == states.SUCCESS and result.get() == 1
    assert waits.seen == 1 and len(ran) == 1 and ran[0][1] != "holder", "ran once, after the holder, holding the lock"
    announced, countdown = waits.countdown(0)
    assert ran[0][0] - announced >= countdown, "the retry waited out its back-off first, as on a worker"
    assert lock_keys(locks) == []


@pytest.mark.parametrize("propagates", [True, False])
def test_an_eager_retry_gives_up_after_max_retries_like_a_worker(
    eager_app: Celery, locks: redis.Redis, on_log_line: object, propagates: bool,
) -> None:
    eager_app.conf.update(task_eager_propagates=propagates, singleton_retry_backoff_max=0.1)
    ran: list[int] = []

    @eager_app.task(base=SingletonTask, shared=False, on_conflict="retry", max_retries=2)
    def job(x: int) -> int:
        ran.append(x)
        return x

    lease = hold(locks, job, 1)
    waits = on_log_line("waits", lambda n: None)
    if propagates:
        with pytest.raises(DuplicateTaskError):
            job.delay(1)
    else:
        result = job.delay(1)
        assert result.state == states.FAILURE
        with pytest.raises(DuplicateTaskError):
            result.get()
    assert waits.seen == 2, "waited before each of the 2 retries, not before giving up"
    (first, countdown), (second, _) = waits.countdown(0), waits.countdown(1)
    assert second - first >= countdown, "the second attempt came after the first one's back-off"
    assert ran == []
    lease.release()
