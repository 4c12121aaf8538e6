"""A run's release is ordered before anything that shows its end.

A run writes its release on its lock connection; its result store, its task
events and the publish of what follows (a chain's next step, ``link`` callbacks,
``link_error`` errbacks, a chord's body) go over other connections. When the lock
connection's bytes are late, whoever saw the run end and took the same key at once
found the finished run's lock and was skipped. So a run whose end can be seen
waits for its release's reply before it ends; a run whose end no one can see (it
ignores its result, its worker sends no task events, nothing follows it) writes
its release and goes on (its reply is read later).

Real workers of ``tests.apps.order_app``, broker and results direct on the
session's redis-server; a :class:`~tests.support.proxy.DelayProxy` on loopback
in front of the lock database only:

* Worker ``a`` (queue ``a``) reaches the locks through the proxy (300 ms each way
  for followers, 3 ms for a caller's next submission), worker ``b`` (queue ``b``)
  reaches them directly, as a worker whose path to Redis is not the slow one. The
  first run goes to ``a``, the next on the same key to ``b``: it must run, not be
  skipped.
* The proxy *holds* the lock traffic while a run ends: a run whose end can be seen
  does not end until its release has run; a run whose end no one sees does.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord
from celery.result import AsyncResult

from celery_singleton_beat import SingletonTask
from celery_singleton_beat.lease.behalf import read_holder

from .support import LOCK_DB, CeleryProcess, RedisServer, soak, start_worker, wait_for
from .support.proxy import DelayProxy

APP = "tests.apps.order_app"
#: One-way delay of the slow worker's lock connection.
DELAY = 0.3


@dataclass(frozen=True)
class Workers:
    """Worker ``a`` (locks through ``proxy``) and worker ``b`` (locks direct)."""

    proxy: DelayProxy
    a: CeleryProcess
    b: CeleryProcess



@pytest.fixture
def start_workers(redis_server: RedisServer) -> Callable[..., Workers]:
    """``start_workers(delay, events=True)``: a proxy with that delay in front of the lock
    database, worker ``a`` behind it (sending task events unless ``events`` is False),
    worker ``b`` direct (all stopped when the test ends)."""
    def start(delay: float, events: bool = True) -> Workers:
        proxy = DelayProxy(redis_server.port, delay, name="lock-proxy").start()
        a = start_worker(redis_server, APP, "slow-a", concurrency=2, extra=["-Q", "a"],
                         env={"CSB_LOCK_REDIS": proxy.url(LOCK_DB)}, events=events)
        b = start_worker(redis_server, APP, "direct-b", concurrency=1, extra=["-Q", "b"],
                         env={"CSB_LOCK_REDIS": redis_server.url(LOCK_DB)})
        return Workers(proxy, a, b)

    return start


def notes(records: redis.Redis, key: str) -> list[str]:
    """The runs of ``key`` that executed, by their note, in the order they ended."""
    return [json.loads(item)["note"] for item in records.lrange(f"runs:{key}", 0, -1)]


# -- a follower on the same key, from a worker whose lock connection is not the slow one


def test_a_chains_next_step_on_the_same_key_runs(
    order: ModuleType, start_workers: Callable[..., Workers], records: redis.Redis,
) -> None:
    """``chain(t.si(1), t.si(1))``: step 2 starts as soon as step 1's end is published."""
    start_workers(DELAY)
    last = chain(order.step.si("k", note="step-1").set(queue="a"),
                 order.step.si("k", note="step-2").set(queue="b")).apply_async()
    assert last.get(timeout=30) == "k", "step 2 ran (not skipped)"
    assert last.parent.get(timeout=5) == "k"
    assert notes(records, "k") == ["step-1", "step-2"]


def test_a_link_callback_on_the_same_key_runs(
    order: ModuleType, start_workers: Callable[..., Workers], records: redis.Redis,
) -> None:
    start_workers(DELAY)
    callback = order.step.si("k", note="callback").set(queue="b")
    callback_result = callback.freeze()
    parent = order.step.apply_async(("k",), {"note": "parent"}, queue="a", link=callback)
    assert parent.get(timeout=30) == "k"
    assert callback_result.get(timeout=30) == "k", "the callback ran (not skipped)"
    assert notes(records, "k") == ["parent", "callback"]


def test_a_link_error_errback_on_the_same_key_runs(
    order: ModuleType, start_workers: Callable[..., Workers], records: redis.Redis,
) -> None:
    start_workers(DELAY)
    errback = order.step.si("k", note="errback").set(queue="b")
    errback_result = errback.freeze()
    parent = order.step.apply_async(("k",), {"note": "parent", "fail": True}, queue="a", link_error=errback)
    with pytest.raises(ValueError, match="k fails"):
        parent.get(timeout=30)
    assert errback_result.get(timeout=30) == "k", "the errback ran (not skipped)"
    assert notes(records, "k") == ["parent", "errback"]


def test_a_chord_body_on_the_same_key_as_its_last_part_runs(
    order: ModuleType, start_workers: Callable[..., Workers], records: redis.Redis,
) -> None:
    """Parts on ``k2`` and ``k`` (the ``k`` part ends last, so its end publishes the
    body), body on ``k``."""
    start_workers(DELAY)
    records.set("hold:k", "1")
    result = chord([order.step.si("k2", note="part-k2").set(queue="a"),
                    order.step.si("k", note="part-k").set(queue="a")],
                   order.step.si("k", note="body").set(queue="b")).apply_async()
    wait_for(lambda: notes(records, "k2") and records.get("running:k"), timeout=30,
             message="part k2 done, part k running")
    records.delete("hold:k")
    assert result.get(timeout=30) == "k", "the body ran (not skipped)"
    assert notes(records, "k") == ["part-k", "body"]


# -- what waits and what does not: the proxy holds the release while the run ends


def end_with_the_release_held(task: Any, workers: Workers, records: redis.Redis, locks: redis.Redis,
                              publish: Callable[[], AsyncResult]) -> tuple[AsyncResult, str]:
    """``publish`` a run of ``task`` on ``k`` for worker ``a``; once it holds its lock, hold
    the lock traffic in the proxy and let the run's body return. Its result and lock key."""
    records.set("hold:k", "1")
    result = publish()
    wait_for(lambda: records.get("running:k"), timeout=30, message="the run holding its lock")
    key = task.singleton_key(("k",), {})
    holder = read_holder(locks, key)
    assert holder is not None and holder.task_id == result.id
    workers.proxy.hold()
    records.delete("hold:k")
    wait_for(lambda: notes(records, "k"), timeout=30, message="the run's body returned")
    return result, key


def test_a_run_whose_end_no_one_can_see_does_not_wait_for_its_release(
    order: ModuleType, start_workers: Callable[..., Workers], records: redis.Redis, locks: redis.Redis,
) -> None:
    """A task that ignores its result, on a worker without task events, with no
    followers: its run ends while its release is held in the proxy. The release was
    written (the proxy holds it) and the run went on without its reply -- neither read
    nor given up on (the connection that waits for it is still open; a run that waited
    would block until its socket timeout, then drop the connection). Then the release
    runs, and its late reply is read without a complaint."""
    workers = start_workers(0.0, events=False)
    proxy = workers.proxy
    closed_before = proxy.clients_closed
    result, key = end_with_the_release_held(
        order.quiet, workers, records, locks, lambda: order.quiet.apply_async(("k",), {"note": "run"}, queue="a"))
    wait_for(lambda: records.get(f"ended:{result.id}"), timeout=30, interval=0.005, message="the run's end")
    assert proxy.clients_closed == closed_before, "the run did not wait for its release's reply (nor give up on it)"
    wait_for(lambda: proxy.held_bytes > 0, timeout=10, message="the release written, held in the proxy")
    holder = read_holder(locks, key)
    assert holder is not None and holder.task_id == result.id, "the release had not run yet"
    proxy.resume()
    wait_for(lambda: not locks.exists(key), timeout=10, message="the release run once let through")
    assert "reply was lost" not in workers.a.output() and "could not release" not in workers.a.output()


#: Why a run's end can be seen: task to run, worker ``a`` sends task events, a follower.
SEEN_BY = {
    "its stored result": ("step", False, None),
    "its task-succeeded event": ("quiet", True, None),
    "a link callback": ("quiet", False, "link"),
    "a link_error errback": ("quiet", False, "link_error"),
    "a chain's next step": ("quiet", False, "chain"),
}


@pytest.mark.parametrize("seen_by", list(SEEN_BY))
def test_a_run_whose_end_can_be_seen_ends_only_after_its_release_ran(
    seen_by: str, order: ModuleType, start_workers: Callable[..., Workers], records: redis.Redis,
    locks: redis.Redis,
) -> None:
    """While the release is held in the proxy the run does not end (no result stored,
    no event sent, no follower published: the task's postrun never came); once let
    through, the release has run before the run's end. Followers are plain tasks for
    worker ``b`` (no lock of their own)."""
    task_name, events, follower = SEEN_BY[seen_by]
    workers = start_workers(0.0, events=events)
    task = getattr(order, task_name)
    run = task.si("k", note="run").set(queue="a")
    then = order.plain.si("after").set(queue="b")

    def publish() -> AsyncResult:
        if follower == "chain":
            return chain(run, then).apply_async().parent  # type: ignore[no-any-return]
        if follower is not None:
            return run.apply_async(**{follower: then})  # type: ignore[no-any-return]
        return run.apply_async()  # type: ignore[no-any-return]

    result, key = end_with_the_release_held(task, workers, records, locks, publish)

    def not_ended_and_still_locked() -> bool:
        return not records.exists(f"ended:{result.id}") and not result.ready() and locks.exists(key) == 1

    soak(1.0, check=not_ended_and_still_locked, what="the release held in the proxy")
    workers.proxy.resume()
    wait_for(lambda: records.exists(f"ended:{result.id}"), timeout=30, interval=0.005,
             message="the run's end once its release ran")
    assert not locks.exists(key), "the release ran before the run ended"
    if task_name == "step":
        assert result.get(timeout=5) == "k"


# -- a result its caller has seen: the next submission of the key is never its duplicate


#: One-way delay of the first worker's lock connection: another network path, a TLS terminator.
SHORT_DELAY = 0.003
ROUNDS = 100


def test_a_result_its_caller_has_seen_means_the_key_is_free(
    order: ModuleType, start_workers: Callable[..., Workers], records: redis.Redis,
) -> None:
    """``r = t.delay(k); r.get(); t.delay(k)``, the first run on worker ``a`` (lock
    connection 3 ms late), the second on worker ``b`` (direct): the second is never
    skipped as a duplicate of the run whose result its caller already holds."""
    start_workers(SHORT_DELAY)
    skipped = []
    for i in range(ROUNDS):
        first = order.step.apply_async(("k",), {"note": f"a-{i}"}, queue="a")
        assert first.get(timeout=30) == "k"
        second = order.step.apply_async(("k",), {"note": f"b-{i}"}, queue="b")
        second.get(timeout=30, propagate=False)
        if second.state != "SUCCESS":
            skipped.append((i, second.state))
    assert skipped == [], f"{len(skipped)} of {ROUNDS} second runs were not run: {skipped[:5]}"
    assert len(notes(records, "k")) == 2 * ROUNDS


def test_an_eager_run_returns_only_after_its_release_ran(redis_db: redis.Redis, redis_server: RedisServer,
                                                         locks: redis.Redis) -> None:
    """``apply()`` (or ``task_always_eager``) in the caller's process: the caller holds the
    result the moment it returns, so the release must have run by then. With the lock
    traffic held in the proxy, ``apply()`` does not return; once let through, it does,
    and the key is free."""
    proxy = DelayProxy(redis_server.port, 0.0, name="eager-lock-proxy").start()
    app = Celery("eager-order", broker="memory://", set_as_current=False)
    app.conf.update(singleton_redis_url=proxy.url(LOCK_DB))
    held = threading.Event()

    @app.task(base=SingletonTask, shared=False, name="eager.step")
    def step(key: str) -> str:
        proxy.hold()  # the run holds its lock: hold what it writes from now on
        held.set()
        return key

    returned: list[Any] = []
    caller = threading.Thread(target=lambda: returned.append(step.apply(("k",)).get()), daemon=True)
    caller.start()
    assert held.wait(30), "the eager run started"
    key = step.singleton_key(("k",), {})
    soak(1.0, check=lambda: not returned and locks.exists(key) == 1, what="the release held in the proxy")
    proxy.resume()
    caller.join(30)
    assert returned == ["k"]
    assert not locks.exists(key), "the release ran before apply() returned"
