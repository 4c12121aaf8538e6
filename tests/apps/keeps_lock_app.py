"""The Celery app of the keeps-lock tests (issue 20): a running run keeps its lock through faults.

Configured from the environment, so each test starts workers with its own figures:

* ``CSB_TEST_REDIS``: the test redis-server (broker db 0, results db 1, records db 3);
* ``CSB_BROKER``: the broker URL (default: the test Redis, db 0);
* ``CSB_LOCK_REDIS``: Redis of the locks (default: the test Redis, db 2); a server of
  its own where a test restarts, stops or proxies it, so the broker is not what is tested;
* ``CSB_LOCK_TTL`` (default 30 s), ``CSB_LIVENESS_TTL`` (default 2 s);
* ``CSB_VISIBILITY``: the Redis transport's visibility timeout (default 3600 s);
* ``CSB_SOCKET_TIMEOUT``: socket timeout of the lock client (default 1 s);
* ``CSB_TRACK_STARTED``: ``task_track_started`` (default off).

Every task is ``acks_late`` (the exactly-once configuration). What the record
database (db 3) holds, written by the workers:

* ``calls:<key>``: one entry per delivery that reached the task (task id, node,
  pid, ``prerun``/``postrun`` times from Celery's ``task_prerun``/``task_postrun``
  signals: the run's acquire happens between the two), written at postrun;
* ``started:<key>`` / ``runs:<key>``: each run that got its lock, at its start and
  at its end (task id, node, pid, fence, retries, start, end, ``lost_at``: when
  ``task.singleton.lost`` first read True); ``inflight:<key>`` counts the runs in
  flight and ``overlap:<key>`` the starts that found another run in flight;
* ``revoked:<task id>``: each delivery of that id that Celery discarded as revoked or
  expired (its ``task_revoked`` signal);
* ``passes:<task id>``: each ``ensure_held()`` that passed in :func:`guarded`, as
  ``[before, after]`` times around the call.

A run lasts its ``seconds``, and for as long as ``hold:<hold>`` exists in the
record database (``hold`` defaults to the key): the test decides when it ends.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import task_postrun, task_prerun, task_revoked

from celery_singleton_beat import LockLost, SingletonTask

from .records import record_client

BASE = os.environ.get("CSB_TEST_REDIS", "redis://127.0.0.1:6379")
#: Seconds between two looks of a running body at its hold key (and its lock).
TICK = 0.02

app = Celery("keeps_lock_app", broker=os.environ.get("CSB_BROKER", f"{BASE}/0"), backend=f"{BASE}/1")
app.conf.update(
    singleton_redis_url=os.environ.get("CSB_LOCK_REDIS", f"{BASE}/2"),
    singleton_lock_ttl=float(os.environ.get("CSB_LOCK_TTL", "30")),
    singleton_liveness_ttl=float(os.environ.get("CSB_LIVENESS_TTL", "2")),
    singleton_retry_backoff_max=1.0,
    singleton_redis_options={"socket_timeout": float(os.environ.get("CSB_SOCKET_TIMEOUT", "1")),
                             "socket_connect_timeout": 1.0},
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("CSB_VISIBILITY", "3600")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    worker_hijack_root_logger=True,
    task_track_started=os.environ.get("CSB_TRACK_STARTED", "") == "1",
)


def records() -> redis.Redis:
    """Client of the record database (one per process)."""
    return record_client(BASE)


# -------------------------------------------------------------------- deliveries

_prerun: dict[str, float] = {}


def _key_of(args: Any, kwargs: Any) -> str | None:
    if args:
        return str(args[0])
    return str(kwargs["key"]) if kwargs and "key" in kwargs else None


@task_prerun.connect(weak=False)  # type: ignore[untyped-decorator]
def _before(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    if task_id is not None and getattr(task, "app", None) is app:
        _prerun[task_id] = time.time()


@task_postrun.connect(weak=False)  # type: ignore[untyped-decorator]
def _after(task_id: str | None = None, task: Any = None, args: Any = None, kwargs: Any = None,
           state: str | None = None, **_: Any) -> None:
    if task_id is None or getattr(task, "app", None) is not app:
        return
    key = _key_of(args, kwargs)
    if key is None:
        return
    records().rpush(f"calls:{key}", json.dumps({
        "task_id": task_id, "node": task.request.hostname, "pid": os.getpid(), "state": state,
        "prerun": _prerun.pop(task_id, None), "postrun": time.time()}))


@task_revoked.connect(weak=False)  # type: ignore[untyped-decorator]
def _discarded(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    task_id = getattr(request, "id", None)
    if task_id is None or getattr(sender, "app", None) is not app:
        return
    records().rpush(f"revoked:{task_id}", json.dumps({"node": getattr(request, "hostname", None),
                                                      "expired": bool(expired), "at": time.time()}))


# -------------------------------------------------------------------- runs


class Run:
    """The record of one run that holds its lock (see the module docstring)."""

    def __init__(self, task: Any, key: str, hold: str | None) -> None:
        self.task, self.key, self.hold = task, key, f"hold:{hold or key}"
        self.r = records()
        run = task.singleton
        self.entry: dict[str, Any] = {
            "task_id": task.request.id, "node": task.request.hostname, "pid": os.getpid(),
            "fence": run.fence if run is not None else None, "retries": task.request.retries or 0,
            "start": time.time(), "lost_at": None}

    def __enter__(self) -> Run:
        if self.r.incr(f"inflight:{self.key}") > 1:
            self.r.incr(f"overlap:{self.key}")
        self.r.rpush(f"started:{self.key}", json.dumps(self.entry))
        return self

    def __exit__(self, *_: Any) -> None:
        self.r.decr(f"inflight:{self.key}")
        self.entry["end"] = time.time()
        self.r.rpush(f"runs:{self.key}", json.dumps(self.entry))

    def going(self, deadline: float) -> bool:
        """True while the run should go on; notes when the lease was first reported lost."""
        run = self.task.singleton
        if self.entry["lost_at"] is None and run is not None and run.lost:
            self.entry["lost_at"] = time.time()
        return time.monotonic() < deadline or bool(self.r.exists(self.hold))


@app.task(shared=False, bind=True, base=SingletonTask, unique_on=["key"])
def hold(self: SingletonTask, key: str, seconds: float = 0.0, hold: str | None = None) -> str:
    """A run of ``key`` lasting ``seconds`` and while ``hold:<hold>`` exists; returns the node."""
    deadline = time.monotonic() + seconds
    with Run(self, key, hold) as run:
        while run.going(deadline):
            time.sleep(TICK)
    return str(self.request.hostname)


@app.task(shared=False, bind=True, base=SingletonTask, unique_on=["key"])
def guarded(self: SingletonTask, key: str, seconds: float = 0.0, hold: str | None = None) -> str:
    """Like :func:`hold`, calling ``ensure_held()`` before each step of work.

    Each pass is recorded in ``passes:<task id>``; the first ``LockLost`` ends the
    run (returns ``"lost"``), as a body that checks before irreversible work would.
    """
    r = records()
    deadline = time.monotonic() + seconds
    with Run(self, key, hold) as run:
        while run.going(deadline):
            before = time.time()
            try:
                self.singleton.ensure_held()
            except LockLost:
                run.entry["lost_at"] = run.entry["lost_at"] or time.time()
                return "lost"
            r.rpush(f"passes:{self.request.id}", json.dumps([before, time.time()]))
            time.sleep(TICK)
    return "held"


def _unpatched_sleep() -> Any:
    """``time.sleep`` as it was before gevent or eventlet patched it: it blocks the whole process."""
    try:
        import gevent.monkey

        if gevent.monkey.is_module_patched("time"):
            return gevent.monkey.get_original("time", "sleep")
    except ImportError:
        pass
    try:
        import eventlet.patcher

        if eventlet.patcher.is_monkey_patched("time"):
            return eventlet.patcher.original("time").sleep
    except ImportError:
        pass
    return time.sleep


@app.task(shared=False, bind=True, base=SingletonTask, unique_on=["key"])
def block_hub(self: SingletonTask, key: str, seconds: float) -> dict[str, float]:
    """Blocks its whole process (the gevent/eventlet hub included) for ``seconds``, as an
    unpatched C call would; returns when the block began and ended."""
    with Run(self, key, None) as run:
        began = time.time()
        _unpatched_sleep()(seconds)
        ended = time.time()
        run.entry.update(blocked=[began, ended])
    return {"began": began, "ended": ended}
