"""What a run holds for as long as it runs, counted in objects the garbage collector tracks.

A gevent worker holding thousands of leases takes in its next messages while every run
already started holds its objects: each full collection of Python's cyclic garbage
collector goes through all of them, and the runs taken in make the collector run more
often. In the leases benchmark's 1,000-run round the collector's time from the first start
to the last was about 0.24 s of CPU in ours against 0.09 s in plain Celery's worker. So
each thing a held run keeps is counted here (no timing):

* a run that holds its lock is one object with its lease: the run (``self.singleton_run``)
  is also the lease keeper's entry for the lease (a run, a keeper entry and a lease were
  three; at 5,000 runs the two more made the collector's sixth full collection of the
  burst);
* the report of a lost lease (``KeptLease.on_lost``) is shared by a task's runs (it names the
  run by its lease's task id): none per run (a closure was seven: a function, its tuple of
  cells and a cell for each of its five fields; then one object per run);
* a lock server's :meth:`~.LockServer.resumed`, asked once per acquire, reads no
  thread-local while no thread of the process ever waited for a recovery window: in a
  gevent worker that local is the greenlet's, and each run's first read built it a
  greenlet-local entry (four tracked objects and two weak references, for the run's life).
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context

from celery_singleton_beat import SingletonTask
from celery_singleton_beat.lease.keeper import KeptLease, get_keeper
from celery_singleton_beat.recovery.lock_redis import reset_clients
from celery_singleton_beat.recovery.server import LockServer
from celery_singleton_beat.recovery.window import Recovery
from celery_singleton_beat.task.run import HeldRun

from .support import LOCK_DB, RedisServer

#: Callbacks made in one count (the figure is their tracked objects over this).
MADE = 200


def tracked_objects_per(make: Any) -> float:
    """Tracked objects that each of :data:`MADE` results of ``make()`` adds, while held.

    Every object tracked before is frozen (``gc.freeze``: out of ``gc.get_objects()``
    until unfrozen), and of the objects tracked since, only those the results reach
    through new objects count: a process-wide count also took in what other threads of
    the test process (keepers, flushers left by earlier tests) allocated meanwhile."""
    make()  # whatever its first call sets up once
    gc.collect()
    gc.freeze()
    try:
        held = [make() for _ in range(MADE)]
        new = {id(obj) for obj in gc.get_objects()}
        owned: set[int] = set()
        stack = [result for result in held if id(result) in new]
        while stack:
            obj = stack.pop()
            if id(obj) not in owned:
                owned.add(id(obj))
                stack.extend(ref for ref in gc.get_referents(obj) if id(ref) in new)
    finally:
        gc.unfreeze()
    return len(owned) / MADE


@pytest.fixture
def task() -> SingletonTask:
    app = Celery("held-run-objects", set_as_current=False)

    @app.task(base=SingletonTask, lock_ttl=3, shared=False)
    def hold(i: int) -> None:
        """A task of the test's app."""

    return hold  # type: ignore[no-any-return]


def test_a_held_run_keeps_two_tracked_objects_itself_and_its_lease(redis_server: RedisServer) -> None:
    """A run that took its lock (``_begin``, as a worker's run does) holds two tracked
    objects while it runs: the run, which the lease keeper renews as its entry, and the
    lease. The keeper's queue holds the same run (no entry of its own)."""
    app = Celery("held-run-objects-begin", set_as_current=False)
    app.conf.singleton_redis_url = redis_server.url(LOCK_DB)

    @app.task(base=SingletonTask, lock_ttl=30, shared=False)
    def hold(i: int) -> None:
        """A task of the test's app."""

    numbers = itertools.count()
    runs: list[Any] = []

    def begin() -> Any:
        n = next(numbers)
        request = Context(id=f"held-{n}", hostname="w1@host", is_eager=False, args=(n,), kwargs={})
        run = hold._begin(request, (n,), {})
        runs.append(run)
        return run

    keeper = get_keeper()
    try:
        per_run = tracked_objects_per(begin)
        assert all(run.held for run in runs)
        with keeper._mutex:
            queued = {id(entry) for _, _, entry in keeper._queue} | {
                id(kept) for _, _, entry in keeper._queue for kept in getattr(entry, "leases", ())}
        assert per_run == 2, f"each held run keeps {per_run:.2f} tracked objects"
        assert all(id(run) in queued for run in runs), "the keeper renews the run itself"
        assert all(isinstance(run, HeldRun) for run in runs)
    finally:
        for run in runs:
            keeper.forget(run)
            run.lease.release()
        reset_clients()


def test_a_lost_lease_report_is_shared_by_the_runs_of_a_task(task: SingletonTask) -> None:
    """The report a run's kept lease holds adds no tracked object per run (a closure was
    seven, then one object per run): the runs of a task on one worker share it."""
    requests = iter([Context(id=f"id-{n}", hostname="w1@host", is_eager=False) for n in range(MADE + 1)])
    per_run = tracked_objects_per(lambda: task._lease_lost_callback(next(requests)))
    assert per_run == 0, f"each run's lost-lease report holds {per_run:.2f} tracked objects"
    eager = task._lease_lost_callback(Context(id="id-x", hostname="w1@host", is_eager=True))
    elsewhere = task._lease_lost_callback(Context(id="id-y", hostname="w2@host", is_eager=False))
    worker = task._lease_lost_callback(Context(id="id-z", hostname="w1@host", is_eager=False))
    assert len({id(eager), id(elsewhere), id(worker)}) == 3  # an eager run sends no event


def test_a_lost_lease_report_says_which_run_lost_which_lock(task: SingletonTask,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The shared report logs the task, the id of the run whose lease was lost, the lock and
    the reason, as the closure did."""
    caplog.set_level(logging.WARNING, logger="celery_singleton_beat")
    report = task._lease_lost_callback(Context(id="id-7", hostname="w1@host", is_eager=True))
    assert task._lease_lost_callback(Context(id="id-8", hostname="w1@host", is_eager=True)) is report

    class Lease:
        def __init__(self, key: str, task_id: str) -> None:
            self.key, self.task_id = key, task_id

    report(KeptLease(Lease("singleton:{hold:abc}", "id-7"), None), "the lock expired")  # type: ignore[arg-type]
    report(KeptLease(Lease("singleton:{hold:def}", "id-8"), None), "another holder")  # type: ignore[arg-type]
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [f"{task.name}[id-7] lost its lock singleton:{{hold:abc}} while running: the lock expired",
                     f"{task.name}[id-8] lost its lock singleton:{{hold:def}} while running: another holder"]


class Spy:
    """A stand-in for the server's thread-local: counts the attributes read from it."""

    def __init__(self) -> None:
        object.__setattr__(self, "reads", 0)

    def __getattribute__(self, name: str) -> Any:
        if name != "reads":
            object.__setattr__(self, "reads", object.__getattribute__(self, "reads") + 1)
        return object.__getattribute__(self, name)


def test_resumed_reads_no_thread_local_while_no_thread_ever_waited() -> None:
    """Before any wait for a recovery window, ``resumed()`` is 0.0 without reading the local."""
    server = LockServer("singleton", 10.0)
    spy = Spy()
    server._paused = spy  # type: ignore[assignment]
    assert server.pause() == 0.0  # no window open: no wait
    assert server.resumed() == 0.0
    assert spy.reads == 0, f"resumed() read the thread-local {spy.reads} time(s) though no thread ever waited"


def test_resumed_is_the_waiting_threads_own_after_a_wait() -> None:
    """A thread that waited for a window sees when its wait ended; another thread, 0.0."""
    server = LockServer("singleton", 10.0)
    server._memory.windows["singleton"] = Recovery(until=time.monotonic() + 0.05, reason="a test's window")
    before = time.monotonic()
    assert server.pause() > 0
    assert server.resumed() >= before
    other: list[float] = []
    thread = threading.Thread(target=lambda: other.append(server.resumed()))
    thread.start()
    thread.join()
    assert other == [0.0]
