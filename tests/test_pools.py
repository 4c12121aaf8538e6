"""Every worker pool: prefork, threads, gevent, eventlet, solo.

Each pool kind gets real workers (module-scoped, on a queue of their own)
that serve all its tests: one worker with several slots (prefork 4
processes; threads, gevent and eventlet 8 threads or greenlets in one
process), or two ``solo`` workers (one task at a time each: two make a
conflict possible). On each: one key never runs twice at once, every ending
of a run releases its lock, and (where many runs share one process) the lease
keeper renews a long run's lease while the other runs keep the process busy.

gevent and eventlet are test dependencies (the ``test`` extra), not runtime ones.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest
import redis
from celery.result import AsyncResult

from celery_singleton_beat.lease.behalf import read_holder

from .support import CeleryProcess, Owner, RedisServer, owning, start_worker, wait_for
from .support.tasks import check_one_run_at_a_time, clear_runs, counts_when, lock_keys, runs, skipped, submit_spread

APP = "tests.apps.tasks_app"

#: Pool kind -> (workers, concurrency of each).
POOLS: dict[str, tuple[int, int]] = {
    "prefork": (1, 4),
    "threads": (1, 8),
    "gevent": (1, 8),
    "eventlet": (1, 8),
    "solo": (2, 1),
}
#: Pools that run many tasks in one process (and one lease keeper for all of them).
SHARED_PROCESS = ["threads", "gevent", "eventlet"]
#: Keys of the overlap test: 200 submissions, 40 of each key.
KEYS = [f"k{i}" for i in range(5)]


@dataclass(frozen=True)
class Pool:
    """The workers of one pool kind and the queue they consume."""

    kind: str
    queue: str
    workers: list[CeleryProcess]


@pytest.fixture(scope="module")
def pool(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[Pool]:
    """The workers of the pool kind the test is parametrized with (``indirect``)."""
    kind: str = request.param
    count, concurrency = POOLS[kind]
    queue = f"pool-{kind}"
    redis_server.flushall()
    with owning(Owner(f"{kind} pool workers")) as owner:
        workers = [start_worker(redis_server, APP, f"{kind}{n}", pool=kind, concurrency=concurrency,
                                extra=["-Q", queue]) for n in range(count)]
    banner = "thread" if kind == "threads" else kind
    for worker in workers:  # the pool really is the one asked for
        worker.wait_for_line("concurrency:", f"{concurrency} ({banner}", timeout=5)
    yield Pool(kind, queue, workers)
    owner.close()


@pytest.fixture
def tasks_app(pool: Pool, redis_server: RedisServer) -> ModuleType:
    """``tests.apps.tasks_app`` for the pool's workers: no locks, no records."""
    return clear_runs(redis_server)


def stats(locks: redis.Redis, task: str) -> dict[str, int]:
    """The lock counters of ``task`` (acquired, released, skipped, renewed, lost, ...)."""
    return {k.decode(): int(v) for k, v in locks.hgetall(f"singleton:{{stats}}:task:{task}").items()}


@pytest.mark.parametrize("pool", list(POOLS), indirect=True)
def test_200_submissions_over_5_keys_never_run_one_key_twice_at_once(
    pool: Pool, tasks_app: ModuleType, records: redis.Redis, locks: redis.Redis,
) -> None:
    """200 submissions from 4 threads at once, 40 per key: every one runs or is a
    visible skip, runs of one key never overlap, every lock is released."""
    began = time.monotonic()
    by_key = submit_spread(tasks_app.work, KEYS, 200, queue=pool.queue)
    figures = check_one_run_at_a_time(records, locks, tasks_app.work.name, by_key, since=began)
    print(f"{pool.kind}: {figures}")
    assert figures.submissions == 200 and figures.runs + figures.skips == 200


@pytest.mark.parametrize("pool", list(POOLS), indirect=True)
def test_every_ending_releases(pool: Pool, tasks_app: ModuleType, records: redis.Redis,
                               locks: redis.Redis) -> None:
    """Return, exception, retry (both runs), Ignore and Reject: each run frees its own
    lock (counted as released, not expired, taken over or lost)."""
    endings = ("return", "fail", "retry", "ignore", "reject")
    results = {how: tasks_app.ending.apply_async((f"k-{how}", how, 0.5), queue=pool.queue)
               for how in endings}
    assert results["return"].get(timeout=30) == "return"
    with pytest.raises(ValueError, match="boom"):
        results["fail"].get(timeout=30)
    assert results["retry"].get(timeout=30) == "retry"
    assert [run["retries"] for run in runs(records, "k-retry")] == [0, 1]
    wait_for(lambda: runs(records, "k-ignore") and runs(records, "k-reject"), timeout=30,
             message="the Ignore and Reject runs")
    # The locks' TTL is 30 s: gone within 10 s means released.
    wait_for(lambda: lock_keys(locks) == [], timeout=10, message="every lock released")
    counts = counts_when(locks, tasks_app.ending.name,
                         lambda c: c.get("acquired") == c.get("released") == len(endings) + 1)
    assert not {"lost", "reclaimed", "skipped"} & counts.keys(), counts


@pytest.mark.parametrize("pool", SHARED_PROCESS, indirect=True)
def test_a_run_five_times_its_lease_keeps_it_while_the_other_runs_keep_the_process_busy(
    pool: Pool, tasks_app: ModuleType, records: redis.Redis, locks: redis.Redis,
) -> None:
    """``long_run`` (5 s on a 1 s lease) beside 3 ``busy`` runs (1 s leases too) that
    keep the process working in cooperative rounds: every lease stays with its
    run throughout (checked in Redis all along), duplicates of the long run are
    skipped, no lease is lost."""
    busy = {f"b{i}": tasks_app.busy.apply_async((f"b{i}", 60.0), queue=pool.queue) for i in range(3)}
    wait_for(lambda: all(records.get(f"running:{key}") for key in busy), timeout=30,
             message="the busy runs working")
    long = tasks_app.long_run.apply_async(("k", 5.0), queue=pool.queue)
    wait_for(lambda: records.get("fence:k"), timeout=30, message="the long run started")
    started_at = time.monotonic()
    owners = {tasks_app.long_run.singleton_key(("k", 0.0)): long.id}
    owners.update({tasks_app.busy.singleton_key((key, 0.0)): result.id for key, result in busy.items()})
    long_key = tasks_app.long_run.singleton_key(("k", 0.0))
    duplicates: list[tuple[float, AsyncResult]] = []

    def leases_held_until_the_long_run_ends() -> bool:
        for key, task_id in owners.items():
            holder = read_holder(locks, key)
            if holder is not None and holder.task_id == task_id:
                continue
            # Read after the lock: the long run records its end before it releases.
            assert key == long_key and runs(records, "k"), f"{key} held by {holder} instead of {task_id}"
        if not duplicates or duplicates[-1][1].ready():
            duplicates.append((time.monotonic(), tasks_app.long_run.apply_async(("k", 0.0), queue=pool.queue)))
        return long.ready()

    wait_for(leases_held_until_the_long_run_ends, timeout=60, interval=0.05,
             message="the long run to end, every lease held meanwhile")
    assert long.get(timeout=30) == {"lost": False}
    records.set("release:busy", "1")
    for key, result in busy.items():
        outcome = result.get(timeout=30)
        assert outcome["lost"] is False and outcome["rounds"] > 0, (key, outcome)
    wait_for(lambda: all(result.ready() for _, result in duplicates), timeout=30, message="duplicates settled")
    [first, *later] = runs(records, "k")
    assert first["task_id"] == long.id and first["lost"] is False
    assert all(run["start"] >= first["end"] for run in later), "no second run while the first held its lease"
    skipped_at = [at - started_at for at, result in duplicates if skipped(result)]
    assert skipped_at and max(skipped_at) > 3 * 1.0, f"duplicates skipped after 3 TTLs: {skipped_at}"
    assert records.get("lost:k") is None
    wait_for(lambda: lock_keys(locks) == [], timeout=10, message="every lock released")
    for task in (tasks_app.long_run, tasks_app.busy):
        counts = counts_when(locks, task.name, lambda c: c.get("renewed", 0) > 0)
        assert "lost" not in counts, (task.name, counts)
    print(f"{pool.kind}: {len(duplicates)} duplicates tried, {len(skipped_at)} skipped, "
          f"renewals {stats(locks, tasks_app.long_run.name)['renewed']} (long) "
          f"{stats(locks, tasks_app.busy.name)['renewed']} (3 busy)")
