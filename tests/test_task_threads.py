"""SingletonTask in an in-process worker (celery.contrib.testing) with a thread pool.

Threads share one process, one Redis client and one lease keeper: concurrent
runs of one key must still never overlap, and distinct keys must run at the
same time.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_singleton_beat import SingletonTask

from .support import BACKEND_DB, BROKER_DB, LOCK_DB, RedisServer, wait_for
from .support.tasks import lock_keys

DISTINCT = 4  # distinct keys, one per thread of the pool


def test_thread_pool_worker_serialises_one_key_and_runs_distinct_keys_in_parallel(
    redis_db: redis.Redis, redis_server: RedisServer
) -> None:
    app = Celery("threads", broker=redis_server.url(BROKER_DB), backend=redis_server.url(BACKEND_DB),
                 set_as_current=False)
    app.conf.update(singleton_redis_url=redis_server.url(LOCK_DB), worker_prefetch_multiplier=1)
    guard = threading.Lock()
    in_flight: Counter[str] = Counter()
    peak: Counter[str] = Counter()
    ran: Counter[str] = Counter()
    # Each distinct key's run waits here until the runs of all distinct keys are in
    # flight at once: if they could not run in parallel, the barrier would break.
    together = threading.Barrier(DISTINCT, timeout=30)
    met: list[int] = []

    @app.task(base=SingletonTask, shared=False, lock_ttl=0.5)
    def job(key: str) -> str:
        with guard:
            in_flight[key] += 1
            peak[key] = max(peak[key], in_flight[key])
            ran[key] += 1
        try:
            if key == "same":
                time.sleep(0.2)  # the holder's run: duplicates arrive while it lasts
            else:
                met.append(together.wait())
        finally:
            with guard:
                in_flight[key] -= 1
        return key

    app.loader.import_module("celery.contrib.testing.tasks")
    with start_worker(app, pool="threads", concurrency=DISTINCT, perform_ping_check=False, loglevel="WARNING"):
        results = [job.delay("same") for _ in range(12)] + [job.delay(f"k{i}") for i in range(DISTINCT)]
        wait_for(lambda: all(r.state in ("SUCCESS", "REVOKED", "SKIPPED", "FAILURE") for r in results),
                 timeout=60, message="every submission settled")
    assert peak["same"] == 1, "one key never ran twice at once"
    assert ran["same"] == sum(r.state == "SUCCESS" for r in results[:12]) >= 1
    assert [r.state for r in results[12:]] == ["SUCCESS"] * DISTINCT, "a distinct key failed (barrier broken?)"
    assert sorted(met) == list(range(DISTINCT)), f"all {DISTINCT} distinct keys were running at once"
    assert all(ran[f"k{i}"] == 1 for i in range(DISTINCT))
    assert all(peak[f"k{i}"] == 1 for i in range(DISTINCT))
    assert lock_keys(redis_server.client(LOCK_DB)) == []
