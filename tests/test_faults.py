"""Faults whose outcome docs/guarantees.md states, each with real servers and workers.

* start-up outages (a timeout, a server loading its data, a Sentinel that does not
  answer, an unresolvable host) are retried, not refused as configuration errors;
* a publish-time claim with the lock Redis down: ``LockUnavailable``, or published
  unclaimed when failing open;
* a publish meets the run lock of a worker that died: it is deduplicated against that
  dead run until the run's lease lapses (a publish does not check liveness);
* a lock Redis restarted from an RDB snapshot taken before the lock: a recovery window,
  the running holder's key is not run beside it;
* a worker partitioned from the lock Redis (not paused): its key is taken over and run
  beside it, and the run is told its lock was lost;
* counters reach Redis while a worker runs and survive its SIGKILL;
* the solo pool: a run five times longer than its lease keeps it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_beat import LockUnavailable, SingletonTask
from celery_singleton_beat.config import clear_settings_cache, get_settings
from celery_singleton_beat.connection.client import redis_from_url
from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.recovery.lock_redis import reset_clients
from celery_singleton_beat.recovery.startup import LockRedisDown, check_lock_redis

from .support import RedisServer, free_port, start_worker, wait_for
from .support.keeps_lock import (
    call_of,
    decision,
    ended_run,
    knobs,
    live_key_of,
    load_app,
    run_id,
    started_run,
    wait_called,
    wait_started,
    worker,
)
from .support.proxy import DelayProxy
from .support.tasks import lock_keys, skipped

TASKS_APP = "tests.apps.tasks_app"


@pytest.fixture
def app_env(redis_db: redis.Redis) -> Iterator[dict[str, str]]:
    """The keeps-lock workers' environment, filled in by the test."""
    yield from knobs()


# ----------------------------------------------------------------- start-up outages


class _SilentServer:
    """A loopback TCP server that accepts connections and never answers (a hung server)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(connection)

    def close(self) -> None:
        self.sock.close()
        for connection in self.accepted:
            connection.close()


@pytest.mark.parametrize("outage", ["timeout", "loading", "busy", "sentinel", "unresolvable"])
def test_start_up_outages_are_retried_not_refused(outage: str, make_redis: Callable[..., RedisServer],
                                                   busy_script: Callable[[RedisServer], Callable[[], None]]) -> None:
    """The start-up check sorts each of these as an outage (``LockRedisDown``: the worker and
    the beat start and check again), not as a configuration error (exit code 78)."""
    silent: _SilentServer | None = None
    options: dict[str, Any] = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}
    if outage == "timeout":
        silent = _SilentServer()
        url = f"redis://127.0.0.1:{silent.port}/0"
    elif outage == "loading":
        # Events (and so client requests, answered LOADING) are served every 1 KiB of the file.
        server = make_redis("--key-load-delay", "500", "--loading-process-events-interval-bytes", "1024")
        client = server.client()
        pipe = client.pipeline(transaction=False)
        for i in range(20_000):
            pipe.set(f"k{i}", "x")
        pipe.execute()
        client.save()  # an RDB of 20,000 keys, loaded at 0.5 ms a key: seconds of LOADING
        server.restart()  # SIGKILL, started again on its port: it loads the RDB
        url = server.url()
        wait_for(lambda: _loading(server.port), timeout=20, interval=0.02, message="the server loading its data")
    elif outage == "busy":
        # Another client's script (-BUSY): the server answers, it is not misconfigured.
        server = make_redis()
        url = server.url()
        busy_script(server)  # killed when the test ends
    elif outage == "sentinel":
        url = f"sentinel://127.0.0.1:{free_port()};sentinel://127.0.0.1:{free_port()}?master_name=mymaster"
    else:
        url = "redis://no-such-host.invalid:6379/0"
    app = Celery("faults-startup", set_as_current=False)
    app.conf.update(singleton_redis_url=url, singleton_redis_options=options)
    try:
        settings = get_settings(app)
        with pytest.raises(LockRedisDown) as raised:
            check_lock_redis(lambda: redis_from_url(url, **options), settings)
        print(f"{outage}: {raised.value}")
        if outage in ("loading", "busy"):
            assert outage in str(raised.value).lower(), raised.value
    finally:
        if silent is not None:
            silent.close()
        clear_settings_cache(app)


def _loading(port: int) -> bool:
    """True while the server on ``port`` answers that it is loading its data."""
    try:
        redis.Redis(port=port, socket_timeout=1).ping()
    except redis.exceptions.BusyLoadingError:
        return True
    except redis.ConnectionError:
        return False
    return False


# ----------------------------------------------------------------- publish-time claims, Redis down


@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "fail-open"])
def test_publish_time_claims_with_redis_down(fail_open: bool, redis_db: redis.Redis,
                                             redis_server: RedisServer) -> None:
    """``until_executed`` and ``until_executing`` publishes with the lock Redis unreachable:
    ``LockUnavailable`` and nothing published (fail closed), or published without a claim
    (``singleton_fail_open``)."""
    app = Celery("faults-publish", broker=redis_server.url(0), set_as_current=False)
    app.conf.update(singleton_redis_url=f"redis://127.0.0.1:{free_port()}/0", singleton_fail_open=fail_open,
                    singleton_redis_options={"socket_timeout": 0.5, "socket_connect_timeout": 0.5})

    @app.task(base=SingletonTask, lock_mode="until_executed", shared=False, name="faults.executed")
    def executed(key: str) -> None: ...

    @app.task(base=SingletonTask, lock_mode="until_executing", shared=False, name="faults.executing")
    def executing(key: str) -> None: ...

    try:
        for task in (executed, executing):
            queue = f"faults-{task.name}"
            if fail_open:
                result = task.apply_async(("k",), queue=queue)
                assert result.id
                assert redis_db.llen(queue) == 1, "published without a claim"
            else:
                with pytest.raises(LockUnavailable):
                    task.apply_async(("k",), queue=queue)
                assert redis_db.llen(queue) == 0, "nothing published"
    finally:
        clear_settings_cache(app)
        reset_clients()


# ----------------------------------------------------------------- a dead worker's run lock at publish


@pytest.mark.timeout(120)
def test_a_publish_is_deduplicated_against_a_dead_workers_run_until_its_lease_lapses(
        tasks: Any, redis_server: RedisServer, records: redis.Redis, locks: redis.Redis) -> None:
    """An ``until_executed`` run on a worker that is SIGKILLed whole (no ``acks_late``): a
    publish of its key returns the dead run's result while the run's lease lasts (a publish
    does not check liveness), the dead run's result never completes, and once the lease
    lapsed a publish queues a new run."""
    doomed = start_worker(redis_server, TASKS_APP, "doomed", concurrency=1,
                          env={"CSB_LOCK_TTL": "10", "CSB_LIVENESS_TTL": "2"}, extra=["-Q", "doomed"])
    records.set("hold:k", "1")
    original = tasks.queued_once.apply_async(("k",), queue="doomed")
    wait_for(lambda: records.llen("started:k") == 1, timeout=30, message="the original running")
    key = tasks.queued_once.singleton_key(("k",))
    doomed.kill_group()

    again = tasks.queued_once.apply_async(("k",), queue="elsewhere")
    holder = read_holder(locks, key)
    assert holder is not None and holder.task_id == original.id and not holder.claim, \
        "the dead run's lock was still held at the publish"
    assert again.id == original.id, "deduplicated against the dead run"

    fresh: list[Any] = []

    def published_anew() -> bool:
        result = tasks.queued_once.apply_async(("k",), queue="elsewhere")
        if result.id != original.id:
            fresh.append(result)
        return bool(fresh)

    wait_for(published_anew, timeout=60, interval=0.5, message="a publish once the dead run's lease lapsed")
    assert original.state in ("PENDING", "STARTED"), "nothing completes the dead run without acks_late"
    assert read_holder(locks, key) is not None and read_holder(locks, key).task_id == fresh[0].id  # type: ignore[union-attr]


# ----------------------------------------------------------------- RDB snapshot restart


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_rdb_snapshot_restart_opens_a_recovery_window(
    redis_server: RedisServer, make_redis: Callable[..., RedisServer], records: redis.Redis,
    app_env: dict[str, str],
) -> None:
    """A runs ``k`` (``lock_ttl`` 6 s); the lock Redis, whose last RDB snapshot predates A's
    lock, is SIGKILLed and restarts from that snapshot; ``k`` sent to B right after must
    not run beside A: a restart that lost data opens a recovery window, the holder puts its
    lock back (B's run is skipped as A's duplicate, or runs after A)."""
    lock_redis = make_redis()
    lock_client = lock_redis.client()
    app_env.update(CSB_LOCK_TTL="6", CSB_LIVENESS_TTL="2", CSB_LOCK_REDIS=lock_redis.url())
    app = load_app(redis_server, **app_env)
    worker(redis_server, "a", app_env)
    worker(redis_server, "b", app_env)
    lock_client.set("faults:snapshot", "1")
    lock_client.save()  # the snapshot: without A's lock
    records.set("hold:k", "1")
    original = app.hold.apply_async(("k",), queue="a")
    wait_started(records, "k", original)
    key = app.hold.singleton_key(("k",))
    assert lock_client.exists(key)
    before = run_id(lock_client)

    lock_redis.restart()  # SIGKILL, started again on its port: it loads the snapshot
    assert run_id(lock_client) != before, "the lock Redis restarted"
    assert lock_client.exists("faults:snapshot"), "it restarted from the RDB snapshot"
    second = app.hold.apply_async(("k",), {"seconds": 0.5, "hold": "second"}, queue="b")
    wait_called(records, "k", second)
    decision(records, "k", second.id)
    assert ended_run(records, "k", original.id) is None, "the original still ran when B decided"
    assert started_run(records, "k", second.id) is None or skipped(second), "B ran beside A"
    records.delete("hold:k")
    assert original.get(timeout=30)
    wait_for(lambda: second.ready(), timeout=60, message="B's copy settled")
    runs = [json.loads(r) for r in records.lrange("runs:k", 0, -1)]
    first = next(r for r in runs if r["task_id"] == original.id)
    assert all(r["start"] >= first["end"] for r in runs if r["task_id"] != original.id), runs
    assert call_of(records, "k", second.id) is not None


# ----------------------------------------------------------------- a partitioned worker


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_partitioned_worker_is_overlapped_and_told(
    redis_server: RedisServer, make_redis: Callable[..., RedisServer], records: redis.Redis,
    app_env: dict[str, str],
) -> None:
    """Worker A reaches the lock Redis through a proxy that stops forwarding (a partition:
    A keeps running, unlike a paused process); B reaches it directly. Once A's liveness
    key expired, B takes ``k`` over and runs it beside A's run, and A's run is told:
    its keeper reports the lock lost (WARNING line) while the partition lasts."""
    lock_redis = make_redis()
    lock_client = lock_redis.client()
    proxy = DelayProxy(lock_redis.port, 0.0).start()
    app_env.update(CSB_LOCK_TTL="3", CSB_LIVENESS_TTL="2", CSB_LOCK_REDIS=lock_redis.url())
    app = load_app(redis_server, **app_env)
    a = worker(redis_server, "a", {**app_env, "CSB_LOCK_REDIS": proxy.url()})
    worker(redis_server, "b", app_env)
    live = live_key_of(a)
    records.set("hold:k", "1")
    original = app.hold.apply_async(("k",), queue="a")
    wait_started(records, "k", original)
    assert lock_client.exists(live)

    proxy.hold()  # the partition: nothing A sends reaches the lock Redis
    try:
        wait_for(lambda: not lock_client.exists(live), timeout=30, message="A's liveness key expired")
        records.set("hold:second", "1")
        tries: list[Any] = []

        def b_runs_k() -> bool:
            # A copy that finds A's lock not yet provably dead is skipped: send another.
            if not tries or skipped(tries[-1]):
                tries.append(app.hold.apply_async(("k",), {"hold": "second"}, queue="b"))
            return started_run(records, "k", tries[-1].id) is not None

        wait_for(b_runs_k, timeout=60, interval=0.1, message="B running k")
        second = tries[-1]
        assert ended_run(records, "k", original.id) is None, "A's run still going: B runs beside it"
        a.wait_for_log("lost its lock", timeout=30)  # told while still cut off
        assert proxy.held_bytes > 0, "A's requests were held: the partition was real"
    finally:
        proxy.resume()
    records.delete("hold:k")
    original.get(timeout=30)
    [entry] = [json.loads(r) for r in records.lrange("runs:k", 0, -1) if json.loads(r)["task_id"] == original.id]
    assert entry["lost_at"] is not None, "A's run saw its lock lost"
    records.delete("hold:second")
    second.get(timeout=30)


# ----------------------------------------------------------------- counters and SIGKILL


@pytest.mark.timeout(120)
def test_counters_reach_redis_while_the_worker_runs_and_survive_its_sigkill(
        tasks: Any, redis_server: RedisServer, locks: redis.Redis) -> None:
    """Counts are written in batches by the worker itself, not at its exit: they appear
    while it runs and stay after a SIGKILL of the whole worker."""
    counted = start_worker(redis_server, TASKS_APP, "counted", concurrency=1, extra=["-Q", "counted"])
    results = [tasks.work.apply_async((f"c{i}",), queue="counted") for i in range(5)]
    for result in results:
        result.get(timeout=30)
    counts = "singleton:{stats}:task:" + tasks.work.name
    wait_for(lambda: locks.hget(counts, "released") == b"5", timeout=30,
             message="the five runs counted while the worker runs")
    counted.kill_group()
    wait_for(lambda: not counted.running, timeout=10, message="the worker gone")
    assert int(locks.hget(counts, "acquired")) == 5 and int(locks.hget(counts, "released")) == 5


# ----------------------------------------------------------------- the solo pool


@pytest.mark.timeout(120)
def test_solo_pool_run_longer_than_its_lease_keeps_it(tasks: Any, redis_server: RedisServer,
                                                     records: redis.Redis, locks: redis.Redis) -> None:
    """Two solo workers: ``long_run`` (5 s on a 1 s lease) runs in one worker's main process;
    its keeper thread renews the lease throughout, so duplicates sent to the other worker
    after three lease lengths are skipped and nothing is lost."""
    for name in ("solo1", "solo2"):
        start_worker(redis_server, TASKS_APP, name, pool="solo", concurrency=1, extra=["-Q", "solo"])
    long = tasks.long_run.apply_async(("k", 5.0), queue="solo")
    wait_for(lambda: records.get("fence:k"), timeout=30, message="the long run started")
    started_at = time.monotonic()
    duplicates: list[tuple[float, Any]] = []

    def long_run_done() -> bool:
        if not duplicates or duplicates[-1][1].ready():
            duplicates.append((time.monotonic(), tasks.long_run.apply_async(("k", 0.0), queue="solo")))
        return bool(long.ready())

    wait_for(long_run_done, timeout=60, interval=0.05, message="the long run to end")
    assert long.get(timeout=30) == {"lost": False}
    wait_for(lambda: all(result.ready() for _, result in duplicates), timeout=30, message="duplicates settled")
    skipped_at = [at - started_at for at, result in duplicates if skipped(result)]
    assert skipped_at and max(skipped_at) > 3 * 1.0, f"duplicates skipped after 3 lease lengths: {skipped_at}"
    runs = [json.loads(r) for r in records.lrange("runs:k", 0, -1)]
    first = next(r for r in runs if r["task_id"] == long.id)
    assert first["lost"] is False
    assert all(r["start"] >= first["end"] for r in runs if r["task_id"] != long.id)
    wait_for(lambda: lock_keys(locks) == [], timeout=10, message="every lock released")
