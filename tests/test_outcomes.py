"""Every caller sees an end: skipped runs, canvas, publish-time modes and retries.

One prefork worker (``tests.apps.delivery_app``) per test; a holder run keeps
a key busy while the scenario under test meets it.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import redis
from celery import chain, chord, group
from celery.exceptions import TaskRevokedError

from celery_singleton_beat import DuplicateTaskError, TaskSkipped

from .support import RECORD_DB, CeleryProcess, RedisServer, start_worker, wait_for
from .test_redelivery import entries, load_app

APP = "tests.apps.delivery_app"


@pytest.fixture
def app(redis_db: redis.Redis, redis_server: RedisServer, processes: list[CeleryProcess]) -> Iterator[ModuleType]:
    module = load_app(redis_server)
    processes.append(start_worker(redis_server, APP, "outcomes", concurrency=4))
    yield module


@pytest.fixture
def records(redis_server: RedisServer) -> redis.Redis:
    return redis_server.client(RECORD_DB)


def hold(app: ModuleType, records: redis.Redis, key: str, seconds: float, task: str = "slow") -> object:
    """Start a run that holds ``key`` for ``seconds`` and wait until it runs."""
    result = getattr(app, task).delay(key, seconds)
    wait_for(lambda: entries(records, f"started:{key}"), timeout=30, message=f"the holder of {key} runs")
    return result


def test_get_on_a_skipped_run_raises_task_skipped(app: ModuleType, records: redis.Redis) -> None:
    holder = hold(app, records, "k", 3)
    with pytest.raises(TaskSkipped) as caught:
        app.slow.delay("k", 0).get(timeout=20)
    assert isinstance(caught.value, TaskRevokedError)
    assert caught.value.holder_task_id == holder.id
    assert holder.get(timeout=20)


def test_raise_ends_in_failure_and_retry_runs_after_the_holder(app: ModuleType, records: redis.Redis) -> None:
    hold(app, records, "k", 2, task="strict")
    with pytest.raises(DuplicateTaskError):
        app.strict.delay("k", 0).get(timeout=20)
    hold(app, records, "p", 2, task="patient")
    assert app.patient.delay("p", 0).get(timeout=30)
    assert len(entries(records, "runs:p")) == 2 and records.get("overlap:p") is None


def test_a_chain_starting_with_a_skipped_task_ends(app: ModuleType, records: redis.Redis) -> None:
    hold(app, records, "k", 3)
    result = chain(app.slow.s("k", 0), app.after.s()).apply_async()
    with pytest.raises(TaskRevokedError):
        result.get(timeout=20)
    assert records.llen("chain-after") == 0, "the rest of the chain did not run"


def test_a_chord_with_a_skipped_member_fails_its_body_instead_of_hanging(
    app: ModuleType, records: redis.Redis
) -> None:
    hold(app, records, "k", 3)
    result = chord([app.slow.s("k", 0), app.slow.s("other", 0)], app.collect.s()).apply_async()
    with pytest.raises(TaskSkipped):  # the chord's result: the body failed with the member's skip
        result.get(timeout=20)
    assert records.llen("chord-body") == 0
    # The chord fails as soon as the skip is counted; the other member may still be running.
    wait_for(lambda: len(entries(records, "runs:other")) == 1, timeout=20, message="the other member's run")


def test_a_group_with_a_publish_time_duplicate_ends(app: ModuleType, records: redis.Redis) -> None:
    """until_executed: the member whose key is held is still sent (the group waits on its id)."""
    hold(app, records, "k", 3, task="queued_once")
    result = group(app.queued_once.s("k", 0), app.queued_once.s("j", 0)).apply_async()
    with pytest.raises(TaskRevokedError):
        result.get(timeout=20)
    wait_for(lambda: result.ready(), timeout=20, message="every member ended")
    assert len(entries(records, "runs:j")) == 1


def test_until_executed_retry_runs_once_after_the_holder(app: ModuleType, records: redis.Redis) -> None:
    """A run that conflicts and retries re-publishes under its own task id, never deduplicated."""
    holder = hold(app, records, "k", 2, task="patient_once")
    # send_task bypasses publish-time claims: this run meets the holder's lock.
    late = app.app.send_task("tests.apps.delivery_app.patient_once", ("k", 0))
    assert late.get(timeout=40)
    assert holder.get(timeout=10)
    runs = entries(records, "runs:k")
    assert [r["task_id"] for r in runs] == [holder.id, late.id]
    assert records.get("overlap:k") is None


def test_a_revoked_queued_message_frees_its_claim(app: ModuleType, records: redis.Redis,
                                                  redis_server: RedisServer) -> None:
    """until_executing: the claim of a message revoked before it ran does not block publishes."""
    busy = [app.slow.delay(f"busy{i}", 3) for i in range(4)]  # every pool process is busy
    wait_for(lambda: all(entries(records, f"started:busy{i}") for i in range(4)), timeout=30,
             message="the pool is busy")
    queued = app.queued_until_start.delay("q", 0)
    queued.revoke()
    wait_for(lambda: queued.state == "REVOKED", timeout=30, message="the queued copy was revoked")
    again = app.queued_until_start.delay("q", 0)
    assert again.id != queued.id, "a new publish, not the revoked message's result"
    assert again.get(timeout=30)
    assert [r["task_id"] for r in entries(records, "runs:q")] == [again.id]
    for result in busy:
        result.get(timeout=30)


def test_a_claim_covers_the_countdown(app: ModuleType, records: redis.Redis, redis_server: RedisServer) -> None:
    """The claim of a message published with a countdown lasts the countdown plus the queue TTL."""
    first = app.queued_until_start.apply_async(("c", 0), countdown=3)
    locks = redis_server.client(2)
    claim = next(iter(locks.keys("singleton:{*}:queued")))
    queue_ttl_ms = app.app.conf.get("singleton_queue_lock_ttl", 3600.0) * 1000
    assert locks.pttl(claim) > queue_ttl_ms, "the countdown is added to the claim's TTL"
    second = app.queued_until_start.apply_async(("c", 0))
    assert second.id == first.id, "deduplicated while the first waits out its countdown"
    assert first.get(timeout=30)
    assert len(entries(records, "runs:c")) == 1
