"""The app of the leases benchmark: a plain and a singleton task whose body sleeps.

One gevent worker (``-P gevent -c N``) runs N of them at once. Each body stamps
``time.time()`` at its start and at its end in the record Redis (the broker's
server, db 3: sorted sets ``starts`` and ``ends``, one member per run; a start's
member is ``<i>:<the process's CPU seconds so far>``), and
sleeps in between with ``time.sleep``: under Celery's gevent pool the time
module is monkey-patched, so that is a gevent sleep. The singleton task holds a
3 s lease (``lock_ttl = 3``: the keeper renews it every second) on the lock
server, a redis-server of its own; the pool size and every other connection
option are the library's defaults.

For :mod:`benchmarks.bench_start_instructions`: ``BENCH_LOCK_TTL`` and
``BENCH_LIVENESS_TTL`` change the lease and the worker's liveness TTL, and with
``BENCH_CALLGRIND_LIB`` (a library of two callgrind client requests) and
``BENCH_MARK_LAST`` the first body zeroes callgrind's counts as it starts and the
``BENCH_MARK_LAST``-th dumps them: the instructions from the first start to the last.

When the worker is ready (``worker_ready``: its consumer is registered, no
message handled yet) it writes its pid, the CPU it used so far (``utime + stime``
of the process) and whether ``time`` is patched into the record hash ``ready``.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import itertools
import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task
from celery.signals import worker_ready

from celery_singleton_beat import SingletonTask

from . import thread_stats
from .common import process_cpu_seconds

BROKER = os.environ["BENCH_BROKER"]
LOCKS = os.environ["BENCH_LOCKS"]
#: The lease of the singleton task, in seconds (renewed every third of it).
LOCK_TTL = int(os.environ.get("BENCH_LOCK_TTL", "3"))

app = Celery("leases", broker=f"{BROKER}/0")
app.conf.update(
    singleton_redis_url=f"{LOCKS}/0",
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
)
if os.environ.get("BENCH_LIVENESS_TTL"):
    app.conf.singleton_liveness_ttl = float(os.environ["BENCH_LIVENESS_TTL"])

#: The callgrind marks: (zero, dump) of the library, and the body that dumps (0: none).
_MARKS = ctypes.CDLL(os.environ["BENCH_CALLGRIND_LIB"]) if os.environ.get("BENCH_CALLGRIND_LIB") else None
_MARK_LAST = int(os.environ.get("BENCH_MARK_LAST", "0"))
_started = itertools.count(1)
#: With ``BENCH_THREAD_STATS=<N>``: the first body and the N-th write a snapshot of the
#: worker's threads and collector (:mod:`benchmarks.thread_stats`) to the record hash
#: ``thread_stats`` (fields ``first`` and ``last``, JSON), and the collector is timed.
_STATS_LAST = int(os.environ.get("BENCH_THREAD_STATS", "0"))
_stats_started = itertools.count(1)
if _STATS_LAST:
    thread_stats.watch_gc()
    thread_stats.name_library_threads()

_records: redis.Redis | None = None


def records() -> redis.Redis:
    """The record client: at most 64 connections, a greenlet waits for one (N greenlets share it)."""
    global _records
    if _records is None:
        pool = redis.BlockingConnectionPool.from_url(f"{BROKER}/3", max_connections=64, timeout=None)
        _records = redis.Redis(connection_pool=pool)
    return _records


def _mark() -> None:
    """Zero callgrind's counts at the first start, dump them at the ``BENCH_MARK_LAST``-th."""
    assert _MARKS is not None
    nth = next(_started)
    if nth == 1:
        _MARKS.csb_zero()
    elif nth == _MARK_LAST:
        _MARKS.csb_dump()


def _stats(nth: int) -> None:
    """Snapshot the worker's threads: the first body before its start stamp (the window opens
    at it), the ``BENCH_THREAD_STATS``-th after its own (the window has closed): neither the
    snapshot's write nor the count of the collector's objects falls inside the window."""
    snap = thread_stats.snapshot()
    if nth == _STATS_LAST:
        tracked = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
        snap["gc_objects"] = sum(tracked.values())
        snap["gc_types"] = dict(tracked.most_common(60))
    records().hset("thread_stats", "first" if nth == 1 else "last", json.dumps(snap))


def body(i: int, seconds: float) -> None:
    if _MARKS is not None:
        _mark()
    nth = next(_stats_started) if _STATS_LAST else 0
    if nth == 1:
        _stats(nth)
    started = time.time()
    # the member also carries the worker process's CPU so far (every thread's: the keeper's
    # too), so that the CPU spent from the first start to the last is known, whatever share
    # of the machine the worker had: no extra command, the same write as plain's
    records().zadd("starts", {f"{i}:{time.process_time():.6f}": started})
    if nth > 1 and nth == _STATS_LAST:
        _stats(nth)
    time.sleep(seconds)  # gevent's sleep: Celery patched the time module for -P gevent
    records().zadd("ends", {str(i): time.time()})


@app.task(base=Task)
def plain(i: int, seconds: float) -> None:
    body(i, seconds)


@app.task(base=SingletonTask, lock_ttl=LOCK_TTL)
def singleton(i: int, seconds: float) -> None:
    body(i, seconds)


@worker_ready.connect
def _ready(**_: Any) -> None:
    try:
        from gevent import monkey
        patched = monkey.is_module_patched("time")
    except ImportError:
        patched = False
    records().hset("ready", mapping={"pid": os.getpid(), "cpu_s": process_cpu_seconds(os.getpid()),
                                     "time_patched": int(patched)})
