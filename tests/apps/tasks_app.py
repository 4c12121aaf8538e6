"""The Celery app that worker subprocesses of the task tests run.

Its tasks record every execution in Redis (database RECORD_DB) so tests can
count runs and detect overlap without trusting clocks: a run increments an
in-flight counter at start and decrements it at the end; a value above one
is an overlap and is recorded as such.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded

from celery_singleton_beat import SingletonTask

from .records import record_client

BASE = os.environ.get("CSB_TEST_REDIS", "redis://127.0.0.1:6379")

app = Celery("tasks_app", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    singleton_redis_url=os.environ.get("CSB_LOCK_REDIS", f"{BASE}/2"),
    singleton_lock_ttl=float(os.environ.get("CSB_LOCK_TTL", "30")),
    singleton_fail_open=os.environ.get("CSB_FAIL_OPEN") == "1",
    singleton_liveness_ttl=float(os.environ.get("CSB_LIVENESS_TTL", "2")),
    singleton_retry_backoff_max=float(os.environ.get("CSB_BACKOFF_MAX", "60")),
    # CSB_LOCK_REDIS_OPTIONS (JSON) adds redis-py options, e.g. {"protocol": 2} for an old server.
    singleton_redis_options={"socket_timeout": 1.0, "socket_connect_timeout": 1.0,
                             **json.loads(os.environ.get("CSB_LOCK_REDIS_OPTIONS") or "{}")},
    worker_prefetch_multiplier=1,
    task_acks_late=os.environ.get("CSB_ACKS_LATE") == "1",
    task_reject_on_worker_lost=os.environ.get("CSB_ACKS_LATE") == "1",
    broker_connection_retry_on_startup=True,
    result_expires=600,
    worker_hijack_root_logger=True,
)

if os.environ.get("CSB_ENDLESS_CONSUMED_WAIT") == "1":
    # billiard's pool process, before it exits, waits for the main process to count the
    # results it sent: 300 looks 0.1 s apart, then it exits anyway. Endless here, so that
    # a worker whose main process never counts them hangs instead of exiting late.
    import billiard.pool

    billiard.pool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_LIMIT = 10**9

if os.environ.get("CSB_HOLD_REPORT") == "1":
    from celery.signals import task_postrun

    @task_postrun.connect(weak=False)
    def _hold_report(args: tuple[Any, ...] | None = None, **_: Any) -> None:
        """Keep a pool process from reporting its result to the main process while
        ``hold-report:<first argument>`` is set (at most 60 s).

        ``task_postrun`` fires after the result is stored in the backend and before the
        pool process reports it: a caller's ``get()`` has returned while the worker
        still counts the run as its own (and its pool process as busy).
        """
        if not args:
            return
        r = records()
        deadline = time.monotonic() + 60
        while r.exists(f"hold-report:{args[0]}") and time.monotonic() < deadline:
            time.sleep(0.01)


def records() -> redis.Redis:
    """Client of the record database (one per process)."""
    return record_client(BASE)


def record_run(key: str, task: Any, seconds: float) -> dict[str, Any]:
    """Mark a run of ``key`` as in flight for ``seconds``, recording overlap.

    The run lasts at least ``seconds``, and for as long as ``hold:<key>`` is set
    in the record database (at most 60 s): a test decides when it ends.
    """
    r = records()
    in_flight = r.incr(f"inflight:{key}")
    r.zadd("peak", {key: in_flight}, gt=True)  # the most runs of ``key`` ever in flight at once
    if in_flight > 1:
        r.incr(f"overlap:{key}")
    run = task.singleton
    entry = {"task_id": task.request.id, "pid": os.getpid(), "start": time.time(),
             "fence": run.fence if run else None}
    r.rpush(f"started:{key}", json.dumps(entry))
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        held_until = time.monotonic() + 60
        while r.exists(f"hold:{key}") and time.monotonic() < held_until:
            time.sleep(0.02)
    finally:
        r.decr(f"inflight:{key}")
    entry["end"] = time.time()
    r.rpush(f"runs:{key}", json.dumps(entry))
    return entry


@app.task(bind=True, base=SingletonTask, unique_on=["key"])
def work(self: SingletonTask, key: str, seconds: float = 0.0, note: str = "") -> str:
    """A unit of work on ``key`` lasting ``seconds``; ``note`` is not part of the key."""
    record_run(key, self, seconds)
    return key


@app.task(bind=True, base=SingletonTask, lock_ttl=1.0, unique_on=["key"])
def long_run(self: SingletonTask, key: str, seconds: float) -> dict[str, Any]:
    """Runs many times its 1 s lease; reports whether the lease held throughout."""
    r = records()
    r.set(f"fence:{key}", self.singleton.fence)
    start = time.time()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if self.singleton.lost:
            r.set(f"lost:{key}", "1")
            break
        time.sleep(0.05)
    r.rpush(f"runs:{key}", json.dumps({"lost": self.singleton.lost, "task_id": self.request.id,
                                       "start": start, "end": time.time()}))
    return {"lost": self.singleton.lost}


@app.task(bind=True, base=SingletonTask, lock_ttl=1.0, unique_on=["key"])
def hold_lease(self: SingletonTask, key: str) -> dict[str, Any]:
    """Holds its 1 s lease until ``release:<key>`` is set in the record database (at most
    300 s) or the lease is lost; reports whether it was lost, and why."""
    r = records()
    r.set(f"fence:{key}", self.singleton.fence)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not self.singleton.lost and not r.exists(f"release:{key}"):
        time.sleep(0.05)
    return {"lost": self.singleton.lost, "reason": getattr(self.singleton, "lost_reason", None)}


@app.task(bind=True, base=SingletonTask, lock_ttl=1.0, unique_on=["key"])
def busy(self: SingletonTask, key: str, seconds: float) -> dict[str, Any]:
    """Keeps its thread or greenlet busy while holding a 1 s lease, until
    ``release:busy`` is set in the record database (at most ``seconds``).

    Cooperative work in a loop: 5 ms of computation, a Redis round trip and a
    1 ms sleep. Under gevent or eventlet the other runs of the process and the
    lease keeper get their turns only at the sleep: a green socket whose reply
    is already there when it is read returns without switching, so a loop of
    Redis calls and computation alone may never yield.
    """
    r = records()
    r.set(f"running:{key}", self.request.id)
    rounds = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not self.singleton.lost and not r.exists("release:busy"):
        burst = time.monotonic() + 0.005
        while time.monotonic() < burst:
            pass
        time.sleep(0.001)
        rounds += 1
    return {"lost": self.singleton.lost, "rounds": rounds}


@app.task(bind=True, base=SingletonTask, lock_ttl=0.6, unique_on=["key"])
def watch_lease(self: SingletonTask, key: str, seconds: float) -> str:
    """Waits until its lease is reported lost (or ``seconds`` pass) and records how it ended."""
    r = records()
    r.set(f"running:{key}", self.request.id)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not self.singleton.lost:
        time.sleep(0.02)
    try:
        self.singleton.ensure_held()
        outcome = "held"
    except Exception as exc:  # LockLost
        outcome = type(exc).__name__
    r.set(f"outcome:{key}", outcome)
    # Hold on a little so the test can re-take the key before our release runs.
    wait_until = time.monotonic() + seconds
    while time.monotonic() < wait_until and not r.exists(f"retaken:{key}"):
        time.sleep(0.02)
    return outcome


@app.task(bind=True, base=SingletonTask, on_conflict="raise", unique_on=["key"])
def strict(self: SingletonTask, key: str, seconds: float = 0.0) -> str:
    record_run(key, self, seconds)
    return key


@app.task(bind=True, base=SingletonTask, on_conflict="retry", max_retries=20, unique_on=["key"])
def patient(self: SingletonTask, key: str, seconds: float = 0.0) -> str:
    record_run(key, self, seconds)
    return key


@app.task(bind=True, base=SingletonTask, max_retries=3)
def ending(self: SingletonTask, key: str, how: str, countdown: float = 0.5) -> str:
    """Ends its run the way ``how`` says, after recording that it held the lock."""
    records().rpush(f"runs:{key}", json.dumps({"how": how, "retries": self.request.retries}))
    if how == "fail":
        raise ValueError("boom")
    if how == "retry" and self.request.retries == 0:
        raise self.retry(countdown=countdown)
    if how == "ignore":
        raise Ignore()
    if how == "reject":
        raise Reject("rejected", requeue=False)
    if how == "exit":
        os._exit(1)  # the pool child dies mid-run
    return how


@app.task(bind=True, base=SingletonTask, time_limit=1.5)
def hard_limited(self: SingletonTask, key: str) -> None:
    records().set(f"running:{key}", self.request.id)
    time.sleep(30)


@app.task(bind=True, base=SingletonTask, lock_mode="until_executed", unique_on=["key"])
def queued_once(self: SingletonTask, key: str, seconds: float = 0.0) -> str:
    record_run(key, self, seconds)
    return key


@app.task(bind=True, base=SingletonTask, lock_mode="until_executing", unique_on=["key"])
def queued_until_start(self: SingletonTask, key: str, seconds: float = 0.0) -> str:
    record_run(key, self, seconds)
    return key


@app.task(bind=True, base=SingletonTask, unique_on=["key"])
def nesting(self: SingletonTask, key: str, inner: bool = False) -> list[Any]:
    """Calls itself (``self(...)``: a plain call nested in the run) once; each call records
    the request its body sees, and the key of the lock it holds."""
    seen = [key, inner, list(self.request.args or ()), dict(self.request.kwargs or {}), self.singleton_run.key]
    records().rpush("nesting", json.dumps(seen))
    if not inner:
        self(f"{key}-inner", inner=True)
    return seen


@app.task
def pid_of() -> int:
    """A plain task: the pid of the pool process that ran it."""
    return os.getpid()


@app.task(bind=True, base=SingletonTask, unique_on=["key"])
def until_soft_limit(self: SingletonTask, key: str) -> str:
    """Marks ``running:<key>`` with its pid, then waits (60 s at most) for a soft time limit."""
    records().set(f"running:{key}", os.getpid())
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
    except SoftTimeLimitExceeded:
        return "stopped by its soft time limit"
    return "never stopped"


#: Bytes :func:`fails_large`'s exception carries: more than a pipe holds (64 KiB on Linux).
LARGE_DETAIL = 100_000


@app.task(bind=True, base=SingletonTask, unique_on=["key"])
def fails_large(self: SingletonTask, key: str, how: str) -> str:
    """Runs (recorded like :func:`work`), then ends as ``how`` says (``"fail"``: FAILURE,
    ``"retry"``: RETRY, in 60 s) with ``ValueError("large")`` carrying :data:`LARGE_DETAIL`
    bytes in an attribute (pickled with it; not in its text, so logs stay short).

    The pool process sends its main process the exception information of such an end:
    a message larger than the pipe between them holds.
    """
    record_run(key, self, 0.0)
    error = ValueError("large")
    error.detail = b"x" * LARGE_DETAIL  # type: ignore[attr-defined]
    if how == "retry":
        raise self.retry(exc=error, countdown=60)
    raise error
