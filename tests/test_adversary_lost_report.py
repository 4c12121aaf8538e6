"""Adversary of the shared lost-lease report (``LostReport``, one per task, worker hostname
and eagerness, naming the run by its lease's task id; commit 259a599).

The report a run's kept lease holds is no longer the run's own: it is looked up in the
task instance's ``__dict__`` and names the run by ``kept.lease.task_id``. Probed here:

* that the lease's task id is the id of the run holding it, whichever way the run took its
  lock or was started: a custom ``task_id``, a publish-time claim adopted
  (``until_executed``), a run retried under the same id, a call nested in a run
  (``self(...)``, whose lock is the outer run's and named by its id, as before), runs of
  one task at once on one worker (threads pool: one shared report) and runs on two
  workers of different hostnames and pools: each ``task-lock-lost`` event and WARNING
  line names the run whose lease was deleted, and each event comes from that run's worker;
* the cache itself: threads creating it at once get one report per place; a shared task
  (``shared=True``) has a report per app whose task (and so app, for the event) is that
  app's; a forked child's reports carry the hostnames they were made for.
"""

from __future__ import annotations

import os
import socket
import threading
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery
from celery.app.task import Context

from celery_singleton_beat import SingletonTask
from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.task.release import LostReport

from .support import BACKEND_DB, BROKER_DB, LOCK_DB, RedisServer, start_worker, wait_for
from .support.tasks import EventCapture, lock_keys
from .test_held_run_objects import task as task  # the same task fixture (an app of its own, one test each)

APP = "tests.apps.lost_report_app"


class EventsCapture(EventCapture):
    """:class:`EventCapture` that keeps listening after the first event (``events`` grows)."""

    class _Never:
        def set(self) -> None: ...

        def is_set(self) -> bool:
            return False

    def __init__(self, app: Any, event_type: str) -> None:
        super().__init__(app, event_type)
        self._got = self._Never()  # type: ignore[assignment]


@pytest.fixture
def lost_report_app(tasks: ModuleType) -> ModuleType:
    """``tests.apps.lost_report_app`` (tasks_app's app, already pointed at the session's server)."""
    from .apps import lost_report_app

    return lost_report_app


def test_every_lost_lease_names_its_own_run_and_worker(
    lost_report_app: ModuleType, tasks: ModuleType, redis_server: RedisServer,
    records: redis.Redis, locks: redis.Redis,
) -> None:
    """Eight runs hold their locks at once: five on a threads worker (sharing the task's
    reports), one on a prefork worker, two on a gevent worker; the nested run holds two
    (its own and its call's, both named by its id, as before the change). All nine locks
    are deleted; each run is told, and each ``task-lock-lost`` event and WARNING line names the run whose lock it
    was, the lock and the run's worker."""
    host = socket.gethostname()
    w1 = start_worker(redis_server, APP, "w1", pool="threads", concurrency=5, extra=["-Q", "lr1"])
    w2 = start_worker(redis_server, APP, "w2", pool="prefork", concurrency=1, extra=["-Q", "lr2"])
    w3 = start_worker(redis_server, APP, "w3", pool="gevent", concurrency=2, extra=["-Q", "lr3"])
    app = lost_report_app
    seconds = 30.0
    sent = {  # key: (the run's AsyncResult, its worker, the id the lock must name)
        "custom": tasks.watch_lease.apply_async(("custom", seconds), task_id="lr-custom-id", queue="lr1"),
        "plain": tasks.watch_lease.apply_async(("plain", seconds), queue="lr1"),
        "claimed": app.claimed_watch.apply_async(("claimed", seconds), queue="lr1"),
        "retried": app.retried_watch.apply_async(("retried", seconds), queue="lr1"),
        "nested": app.nested_watch.apply_async(("nested", seconds), queue="lr1"),
        "other": tasks.watch_lease.apply_async(("other", seconds), queue="lr2"),
        "green1": tasks.watch_lease.apply_async(("green1", seconds), queue="lr3"),
        "green2": tasks.watch_lease.apply_async(("green2", seconds), queue="lr3"),
    }
    name_of = {key: (app.claimed_watch if key == "claimed" else app.retried_watch if key == "retried"
                     else app.nested_watch if key == "nested" else tasks.watch_lease).name for key in sent}
    watched = {"nested": "nested-inner"}  # the nested call's lock is on its own key
    worker_of = {key: ("w2" if key == "other" else "w3" if key.startswith("green") else "w1") for key in sent}
    for key in sent:
        body_key = watched.get(key, key)
        wait_for(lambda k=body_key: records.get(f"running:{k}"), timeout=60, message=f"run {key} started")
    assert records.get("running:custom") == b"lr-custom-id"
    held: list[tuple[str, str, str]] = []  # (task id, lock, node) of every lock held
    for lock in lock_keys(locks):
        holder = read_holder(locks, lock)
        assert holder is not None and not holder.claim and holder.task_id, f"{lock}: {holder}"
        held.append((holder.task_id, lock, holder.node))
    ids = {key: result.id for key, result in sent.items()}
    key_of = {task_id: key for key, task_id in ids.items()}
    # one lock per run, two for the nested one (the outer run's and its call's, both its id)
    assert sorted(task_id for task_id, _, _ in held) == sorted([*ids.values(), ids["nested"]]), held
    for task_id, _, node in held:
        assert node == f"{worker_of[key_of[task_id]]}@{host}"
    with EventsCapture(tasks.app, "task-lock-lost") as capture:
        for _, lock, _ in held:
            locks.delete(lock)
        for key in sent:
            body_key = watched.get(key, key)
            wait_for(lambda k=body_key: records.get(f"outcome:{k}"), timeout=30, message=f"run {key} told")
            assert records.get(f"outcome:{body_key}") == b"LockLost", key
        wait_for(lambda: len(capture.events) >= len(held), timeout=30,
                 message=f"{len(held)} task-lock-lost events (got {capture.events})")
    got = sorted((event["uuid"], event["key"], event["hostname"]) for event in capture.events)
    assert got == sorted((task_id, lock, node) for task_id, lock, node in held)
    for task_id, lock, _ in held:
        key = key_of[task_id]
        worker = {"w1": w1, "w2": w2, "w3": w3}[worker_of[key]]
        worker.wait_for_line(f"{name_of[key]}[{task_id}] lost its lock {lock} while running", timeout=30)
    for key in sent:
        records.set(f"retaken:{watched.get(key, key)}", "1")
    for key, result in sent.items():
        assert result.get(timeout=30) == "LockLost", key


def test_threads_making_the_cache_at_once_get_one_report_per_place(task: SingletonTask) -> None:
    """32 threads ask at once, for two hostnames: one report per hostname, whatever the race."""
    barrier = threading.Barrier(32)
    got: list[LostReport] = []

    def ask(n: int) -> None:
        barrier.wait()
        got.append(task._lease_lost_callback(Context(id=f"id-{n}", hostname=f"w{n % 2}@h", is_eager=False)))

    threads = [threading.Thread(target=ask, args=(n,)) for n in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(report) for report in got}) == 2
    assert {(report.hostname, report.eager, report.task) for report in got} == {
        ("w0@h", False, task), ("w1@h", False, task)}


def test_a_task_of_two_apps_has_a_report_per_app_whose_task_is_that_apps() -> None:
    """The same task in two apps (as ``shared=True`` makes it: one instance per app; defined
    here in each, ``shared=False``, so that no later app of the test process gets it): each
    instance has its own reports, whose task (and so app, the one the event is sent with)
    is that app's."""
    apps = [Celery(f"adversary-lost-report-{n}", set_as_current=False) for n in range(2)]
    instances = []
    for app in apps:
        @app.task(base=SingletonTask, name="adversary.lost_report.both", shared=False)
        def both(i: int) -> None:
            """The task, in this app."""

        instances.append(app.tasks["adversary.lost_report.both"])
    assert instances[0] is not instances[1]
    request = Context(id="id-1", hostname="w1@h", is_eager=False)
    reports = [instance._lease_lost_callback(request) for instance in instances]
    assert reports[0] is not reports[1]
    assert [report.task.app for report in reports] == apps


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_childs_reports_carry_their_own_hostnames(task: SingletonTask) -> None:
    """The cache copied into a forked child: its report for the parent's hostname is the
    parent's (same hostname, harmless); one for another hostname is made for that one."""
    parent = task._lease_lost_callback(Context(id="id-1", hostname="w1@h", is_eager=False))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and exit without running pytest's teardown
        try:
            same = task._lease_lost_callback(Context(id="id-2", hostname="w1@h", is_eager=False))
            other = task._lease_lost_callback(Context(id="id-3", hostname="w2@h", is_eager=False))
            os.write(write, f"{same.hostname}|{other.hostname}|{same is not other}".encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1000).decode() == "w1@h|w2@h|True"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert parent.hostname == "w1@h"


@pytest.mark.parametrize("task_id", ["adv-lr-run", None])
def test_a_run_on_a_worker_path_sends_its_event_by_its_lease_id_and_none_without_one(
    redis_db: redis.Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    task_id: str | None,
) -> None:
    """A run on a worker's path (a request pushed, not eager) whose lock is deleted under it,
    on a real Redis: its report logs the run by its lease's task id and sends the event for
    it from the request's hostname; a request without an id (only a hand-pushed request has
    none) sends none, as :func:`~.events.send_task_event` never did (the report before the
    change sent one with ``uuid=None``). Sending itself is recorded, not done."""
    from celery_singleton_beat.task import release

    sent: list[tuple[Any, ...]] = []
    monkeypatch.setattr(release, "send_task_event_soon",
                        lambda app, hostname, uuid, kind, **fields: sent.append((app, hostname, uuid, kind, fields)))
    caplog.set_level("WARNING", logger="celery_singleton_beat")
    kwargs = redis_db.connection_pool.connection_kwargs
    app = Celery("adv-lost-report-path", set_as_current=False)
    app.conf.update(singleton_redis_url=f"redis://{kwargs['host']}:{kwargs['port']}/2")
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, bind=True, lock_ttl=0.6, shared=False)
    def body(self: Any) -> None:
        run = self.singleton_run
        seen["key"], seen["lease_id"] = run.key, run.lease.task_id
        locks = redis.Redis(host=kwargs["host"], port=kwargs["port"], db=2)
        try:
            locks.delete(run.key)
        finally:
            locks.close()
        wait_for(lambda: run.lost, timeout=10, message="the keeper notices the deleted lock")

    body.push_request(id=task_id, hostname="adv@host", is_eager=False, delivery_info={}, called_directly=False)
    try:
        body()
    finally:
        body.pop_request()
    assert seen["lease_id"] == task_id
    lines = [r.getMessage() for r in caplog.records if "lost its lock" in r.getMessage()]
    assert lines == [f"{body.name}[{task_id}] lost its lock {seen['key']} while running: "
                     "the lock was deleted, expired or taken by another holder"]
    if task_id is None:
        assert sent == []
    else:
        assert [(a, h, u, k, f["key"]) for a, h, u, k, f in sent] == [
            (app, "adv@host", task_id, "task-lock-lost", seen["key"])]


def test_two_workers_in_one_process_share_the_task_and_each_event_names_its_worker(
    redis_db: redis.Redis, redis_server: RedisServer,
) -> None:
    """Two in-process workers (celery.contrib.testing, threads) of one app, so one task
    instance and one cache of reports: a run on each, both locks deleted; each event
    names its run and comes from the hostname that run's request has. (In-process workers
    run Celery's ``trace_task_ret``, not ``fast_trace_task``: their requests' hostname is
    the machine's, ``socket.gethostname()``, not the node name, for any task, so both runs
    share one report here, as they shared that hostname before the change.)"""
    from celery.contrib.testing.worker import start_worker as start_in_process

    app = Celery("adv-lost-report-two", broker=redis_server.url(BROKER_DB), backend=redis_server.url(BACKEND_DB),
                 set_as_current=False)
    # No remote control: two in-process workers of one app each poll a pidbox fanout (a
    # Redis pub/sub connection) and one of them was left blocked reading it at shutdown (its
    # thread did not stop, and broke the in-process workers of the tests after it).
    app.conf.update(singleton_redis_url=redis_server.url(LOCK_DB), worker_prefetch_multiplier=1,
                    worker_send_task_events=True, worker_enable_remote_control=False)
    told = {"a": threading.Event(), "b": threading.Event()}

    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=0.6)
    def hold(self: Any, key: str) -> str:
        run = self.singleton_run
        wait_for(lambda: run.lost, timeout=30, message=f"{key}'s lease lost")
        told[key].set()
        return str(self.request.hostname)

    app.loader.import_module("celery.contrib.testing.tasks")
    locks = redis_server.client(LOCK_DB)
    with start_in_process(app, pool="threads", concurrency=1, perform_ping_check=False, loglevel="WARNING",
                          hostname="adv-a@host", queues=["adv-a"]), \
            start_in_process(app, pool="threads", concurrency=1, perform_ping_check=False, loglevel="WARNING",
                             hostname="adv-b@host", queues=["adv-b"]):
        results = {key: hold.apply_async((key,), queue=f"adv-{key}") for key in ("a", "b")}
        held = wait_for(lambda: (lambda found: found if len(found) == 2 else None)(
            {read_holder(locks, lock).task_id: lock for lock in lock_keys(locks)}),  # type: ignore[union-attr]
            timeout=30, message="both runs hold their locks")
        with EventsCapture(app, "task-lock-lost") as capture:
            for lock in held.values():
                locks.delete(lock)
            wait_for(lambda: len(capture.events) >= 2, timeout=30, message="two task-lock-lost events")
        hostnames = {key: result.get(timeout=30) for key, result in results.items()}
    got = sorted((event["uuid"], event["key"], event["hostname"]) for event in capture.events)
    assert got == sorted((results[key].id, held[results[key].id], hostnames[key]) for key in results)
    reports = hold.__dict__["_singleton_lost_reports"]
    assert set(reports) == {(hostname, False) for hostname in hostnames.values()}
