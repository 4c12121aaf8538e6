"""A gevent worker whose runs outnumber its lock connections: a busy pool is not an outage.

Under ``-P gevent`` (or eventlet) lock requests borrow a connection of the lock
client's pool, bounded by ``max_connections``. When more runs ask at once than
the pool has connections, the requests wait for one to come back; none is
reported as "Redis unavailable" (which would re-publish the run with a back-off
while Redis is idle), and the worker opens no more connections than the bound.
"""

from __future__ import annotations

import json

from .support import RECORD_DB, Owner, RedisServer, owning, start_worker
from .support.proxy import DelayProxy
from .support.tasks import clear_runs, runs, started

APP = "tests.apps.tasks_app"
QUEUE = "few-connections"
#: Runs at once (gevent concurrency), and the lock pool's connections.
RUNS, CONNECTIONS = 40, 4


def test_a_gevent_worker_with_more_runs_than_lock_connections_starts_every_run(redis_server: RedisServer) -> None:
    """40 runs at once, each with a key of its own, on a lock client with 4 connections
    behind a proxy that delays every reply by 20 ms (so the acquires overlap): every
    run starts at its first delivery (none retried), no "Redis unavailable" line, and
    the worker's lock connections stay far below one per run."""
    tasks_app = clear_runs(redis_server)
    with owning(Owner("gevent worker, few lock connections")) as owner:
        proxy = DelayProxy(redis_server.port, 0.02, name="lock-delay").start()
        worker = start_worker(
            redis_server, APP, "few-connections", pool="gevent", concurrency=RUNS, extra=["-Q", QUEUE],
            env={"CSB_LOCK_REDIS": f"redis://127.0.0.1:{proxy.port}/2",
                 "CSB_LOCK_REDIS_OPTIONS": json.dumps({"max_connections": CONNECTIONS, "socket_timeout": 5.0})})
        keys = [f"conn-{i}" for i in range(RUNS)]
        results = [tasks_app.work.apply_async((key, 0.5), queue=QUEUE) for key in keys]
        assert [result.get(timeout=60) for result in results] == keys
        assert "Redis unavailable" not in worker.output(), worker.tail(30)
        records = redis_server.client(RECORD_DB)
        assert all(len(started(records, key)) == 1 and runs(records, key)[0]["task_id"] == result.id
                   for key, result in zip(keys, results, strict=True)), "each run started once, at its first delivery"
        assert proxy.connections < RUNS // 2, f"{proxy.connections} lock connections for {RUNS} runs"
    owner.close()
