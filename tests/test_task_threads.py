"""SingletonTask in an in-process worker (celery.contrib.testing) with a thread pool.

Threads share one process, one Redis client and one lease keeper: concurrent
runs of one key must still never overlap, and every distinct key runs.
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
from .taskfixtures import lock_keys


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

    @app.task(base=SingletonTask, shared=False, lock_ttl=0.5)
    def job(key: str) -> str:
        with guard:
            in_flight[key] += 1
            peak[key] = max(peak[key], in_flight[key])
            ran[key] += 1
        time.sleep(0.2)
        with guard:
            in_flight[key] -= 1
        return key

    app.loader.import_module("celery.contrib.testing.tasks")
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, loglevel="WARNING"):
        results = [job.delay("same") for _ in range(12)] + [job.delay(f"k{i}") for i in range(4)]
        wait_for(lambda: all(r.state in ("SUCCESS", "REVOKED") for r in results), timeout=60)
    assert peak["same"] == 1, "one key never ran twice at once"
    assert ran["same"] == sum(r.state == "SUCCESS" for r in results[:12]) >= 1
    assert all(ran[f"k{i}"] == 1 for i in range(4))
    assert max(peak.values()) == 1
    assert lock_keys(redis_server.client(LOCK_DB)) == []
