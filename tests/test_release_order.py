"""A run's release is ordered before what its end causes (issue 21, point 2).

A run writes its release on its lock connection; the result store and the
publish of what follows (a chain's next step, ``link`` callbacks, ``link_error``
errbacks, a chord's body) go over other connections. When the lock connection's
bytes are late, a follower that takes the same key found the finished run's lock
and was skipped. Now a run with followers waits for its release's reply before
its end is published; a run without followers still writes its release and
goes on (its reply is read later).

Real workers of ``tests.apps.order_app``, broker and results direct on the
session's redis-server; a :class:`~tests.support.proxy.DelayProxy` on loopback
in front of the lock database only:

* Worker ``a`` (queue ``a``) reaches the locks through the proxy, 300 ms each
  way; worker ``b`` (queue ``b``) reaches them directly, as a worker whose path to
  Redis is not the slow one. The first run goes to ``a``, the follower on the same
  key to ``b``: it must run, not be skipped.
* The proxy *holds* the lock traffic while a run ends: a run with followers does
  not publish its end until its release has run; a run without followers does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import pytest
import redis
from celery import chain, chord
from celery.result import AsyncResult

from celery_singleton_beat.lock import read_holder

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
def order(redis_db: redis.Redis, redis_server: RedisServer) -> ModuleType:
    """``tests.apps.order_app`` on the session's (emptied) redis-server."""
    os.environ["CSB_TEST_REDIS"] = base = f"redis://127.0.0.1:{redis_server.port}"
    from .apps import order_app

    assert base == order_app.BASE, "order_app was imported for another server"
    return order_app


@pytest.fixture
def start_workers(redis_server: RedisServer) -> Callable[[float], Workers]:
    """``start_workers(delay)``: a proxy with that delay in front of the lock database,
    worker ``a`` behind it, worker ``b`` direct (all stopped when the test ends)."""
    def start(delay: float) -> Workers:
        proxy = DelayProxy(redis_server.port, delay, name="lock-proxy").start()
        a = start_worker(redis_server, APP, "slow-a", concurrency=2, extra=["-Q", "a"],
                         env={"CSB_LOCK_REDIS": proxy.url(LOCK_DB)})
        b = start_worker(redis_server, APP, "direct-b", concurrency=1, extra=["-Q", "b"],
                         env={"CSB_LOCK_REDIS": redis_server.url(LOCK_DB)})
        return Workers(proxy, a, b)

    return start


def notes(records: redis.Redis, key: str) -> list[str]:
    """The runs of ``key`` that executed, by their note, in the order they ended."""
    return [json.loads(item)["note"] for item in records.lrange(f"runs:{key}", 0, -1)]


# -- a follower on the same key, from a worker whose lock connection is not the slow one


def test_a_chains_next_step_on_the_same_key_runs(
    order: ModuleType, start_workers: Callable[[float], Workers], records: redis.Redis,
) -> None:
    """``chain(t.si(1), t.si(1))``: step 2 starts as soon as step 1's end is published."""
    start_workers(DELAY)
    last = chain(order.step.si("k", note="step-1").set(queue="a"),
                 order.step.si("k", note="step-2").set(queue="b")).apply_async()
    assert last.get(timeout=30) == "k", "step 2 ran (not skipped)"
    assert last.parent.get(timeout=5) == "k"
    assert notes(records, "k") == ["step-1", "step-2"]


def test_a_link_callback_on_the_same_key_runs(
    order: ModuleType, start_workers: Callable[[float], Workers], records: redis.Redis,
) -> None:
    start_workers(DELAY)
    callback = order.step.si("k", note="callback").set(queue="b")
    callback_result = callback.freeze()
    parent = order.step.apply_async(("k",), {"note": "parent"}, queue="a", link=callback)
    assert parent.get(timeout=30) == "k"
    assert callback_result.get(timeout=30) == "k", "the callback ran (not skipped)"
    assert notes(records, "k") == ["parent", "callback"]


def test_a_link_error_errback_on_the_same_key_runs(
    order: ModuleType, start_workers: Callable[[float], Workers], records: redis.Redis,
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
    order: ModuleType, start_workers: Callable[[float], Workers], records: redis.Redis,
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


def end_with_the_release_held(order: ModuleType, workers: Workers, records: redis.Redis, locks: redis.Redis,
                              publish: Callable[[], AsyncResult]) -> tuple[AsyncResult, str]:
    """``publish`` a run of ``k`` for worker ``a``; once it holds its lock, hold the lock
    traffic in the proxy and let the run's body return. Its result and lock key."""
    records.set("hold:k", "1")
    result = publish()
    wait_for(lambda: records.get("running:k"), timeout=30, message="the run holding its lock")
    key = order.step.singleton_key(("k",), {})
    holder = read_holder(locks, key)
    assert holder is not None and holder.task_id == result.id
    workers.proxy.hold()
    records.delete("hold:k")
    wait_for(lambda: notes(records, "k"), timeout=30, message="the run's body returned")
    return result, key


def test_a_run_without_followers_publishes_its_end_without_waiting_for_its_release(
    order: ModuleType, start_workers: Callable[[float], Workers], records: redis.Redis, locks: redis.Redis,
) -> None:
    """Its result is stored while its release is held in the proxy: the release was
    written (the proxy holds it), and the run went on without its reply -- neither
    read nor given up on (the connection that waits for it is still open; a run that
    waited would block until its socket timeout, then drop the connection). Then the
    release runs, and its late reply is read without a complaint."""
    workers = start_workers(0.0)
    proxy = workers.proxy
    closed_before = proxy.clients_closed
    result, key = end_with_the_release_held(
        order, workers, records, locks, lambda: order.step.apply_async(("k",), {"note": "run"}, queue="a"))
    wait_for(result.ready, timeout=30, interval=0.005, message="the run's end published")
    assert proxy.clients_closed == closed_before, "the run did not wait for its release's reply (nor give up on it)"
    assert result.get(timeout=5) == "k"
    wait_for(lambda: proxy.held_bytes > 0, timeout=10, message="the release written, held in the proxy")
    holder = read_holder(locks, key)
    assert holder is not None and holder.task_id == result.id, "the release had not run yet"
    proxy.resume()
    wait_for(lambda: not locks.exists(key), timeout=10, message="the release run once let through")
    assert "reply was lost" not in workers.a.output() and "could not release" not in workers.a.output()


@pytest.mark.parametrize("follower", ["link", "link_error", "chain"])
def test_a_run_with_followers_publishes_its_end_only_after_its_release_ran(
    follower: str, order: ModuleType, start_workers: Callable[[float], Workers], records: redis.Redis,
    locks: redis.Redis,
) -> None:
    """The follower is a plain task for worker ``b`` (no lock of its own). While the
    release is held in the proxy the run's end is not published; once let through,
    the release has run before the result is stored."""
    workers = start_workers(0.0)
    run = order.step.si("k", note="run").set(queue="a")
    then = order.plain.si("after").set(queue="b")

    def publish() -> AsyncResult:
        if follower == "chain":
            return chain(run, then).apply_async().parent  # type: ignore[no-any-return]
        return run.apply_async(**{follower: then})  # type: ignore[no-any-return]

    result, key = end_with_the_release_held(order, workers, records, locks, publish)

    def not_ended_and_still_locked() -> bool:
        return not result.ready() and locks.exists(key) == 1

    soak(1.0, check=not_ended_and_still_locked, what="the release held in the proxy")
    workers.proxy.resume()
    wait_for(result.ready, timeout=30, interval=0.005, message="the run's end once its release ran")
    assert not locks.exists(key), "the release ran before the run's end was published"
    assert result.get(timeout=5) == "k"
