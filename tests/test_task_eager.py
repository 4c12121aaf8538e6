"""Eager mode (task_always_eager): the lock works in-process, with and without propagation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_singleton_beat import LockUnavailable, SingletonKeyError, SingletonTask
from celery_singleton_beat.client import reset_clients

from .support import LOCK_DB, RedisServer, free_port
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

    assert job.delay(1).get() == "IGNORED"
    assert job.apply(args=(1, True)).get() == "ran", "free again once the outer run returned"
    assert lock_keys(locks) == []


def test_called_directly_runs_the_body_without_a_lock(eager_app: Celery, locks: redis.Redis) -> None:
    @eager_app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask, x: int) -> object:
        return self.singleton, lock_keys(locks)

    assert job(1) == (None, [])


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
