"""The admin API (``celery_singleton_beat.admin``) called directly, against real Redis servers.

Locks and counters are made by the library itself (``acquire`` with a
counter hash, a publish-time claim of ``publish_once``, a real worker running
``hold``); slot claims, history and beat counters by in-process schedulers
driven by a clock moved by hand. Loading the app's task modules is checked in
fresh processes (``celery singleton doctor`` and a script), where nothing
imported them before.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import ImproperlyConfigured

from celery_singleton_beat import SingletonError, admin
from celery_singleton_beat.lease.holder import done_key
from celery_singleton_beat.lease.keeper import LeaseKeeper
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.lease.liveness import Heartbeat
from celery_singleton_beat.lease.lock import AcquireResult, acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.lock_redis import get_redis
from celery_singleton_beat.recovery.records import recovery_key
from celery_singleton_beat.recovery.server import LockServer, server_of
from celery_singleton_beat.recovery.window import mark_in_use
from celery_singleton_beat.task.slot_delivery import ENTRY_HEADER

from .support import (
    LOCK_DB,
    RedisServer,
    child_env,
    free_port,
    run_command,
    start_worker,
    wait_for,
)
from .support.beat import ManualClock, RecordingScheduler, beat_app, run_ticks
from .support.locking import take_lock
from .support.slots import UTC

HOLD = "tests.apps.ops_app.hold"
PUBLISH_ONCE = "tests.apps.ops_app.publish_once"
PUBLISH_QUEUED = "tests.apps.ops_app.publish_queued"
GONE = "w9@gone-host"


def hold_lock(ops: ModuleType, key: str, task_id: str, node: str = GONE) -> Lease:
    """Take the lock of ``hold(key)`` as a worker would (with counters), from this process."""
    result: AcquireResult = take_lock(get_redis(ops.app), ops.hold.singleton_key((key,), {}), 30, task=HOLD,
                                    task_id=task_id, node=node, stats_key=ops.hold.singleton_stats_key())
    assert result.lease is not None, result
    return result.lease


def app_for(url: str, **conf: Any) -> Celery:
    """A bare app whose locks live at ``url`` (settings are cached per app: a new one each time)."""
    app = Celery("admin-tests", set_as_current=False)
    app.conf.update(broker_url="memory://", singleton_redis_url=url, **conf)
    return app


# ----------------------------------------------------------------- locks


def test_list_locks_with_filters_and_read_lock(ops: ModuleType, locks: redis.Redis) -> None:
    a = hold_lock(ops, "a", "task-a")
    b = hold_lock(ops, "b", "task-b", node="w8@other-host")
    claim = ops.publish_once.delay("q")  # queued, no worker: a publish-time claim
    foreign = "singleton:{" + HOLD + ":" + "f" * 64 + "}"
    locks.set(foreign, "not a lock record", px=60_000)

    held = admin.list_locks(ops.app)
    assert [(lock.task, lock.kind) for lock in held] == [
        (HOLD, "unknown"), (HOLD, "run"), (HOLD, "run"), (PUBLISH_ONCE, "claim")]  # task, then time
    by_id = {lock.holder.task_id: lock for lock in held}
    lock_a = by_id["task-a"]
    assert isinstance(lock_a, admin.HeldLock)
    assert (lock_a.key, lock_a.value, lock_a.holder.node) == (a.key, a.value.encode(), GONE)
    assert lock_a.renewed_ago is not None and 0 <= lock_a.renewed_ago < 30
    assert lock_a.ttl is not None and 0 < lock_a.ttl <= 30
    assert lock_a.as_json()["task_id"] == "task-a"
    assert by_id[claim.id].task == PUBLISH_ONCE

    assert {lock.holder.task_id for lock in admin.list_locks(ops.app, task=HOLD, kind="run")} == {
        "task-a", "task-b"}
    assert [lock.key for lock in admin.list_locks(ops.app, kind=["unknown", "claim"])] == [
        foreign, by_id[claim.id].key]
    assert [lock.key for lock in admin.list_locks(ops.app, node="w8@other-host")] == [b.key]
    assert admin.list_locks(ops.app, task="no.such.task") == []

    read = admin.read_lock(ops.app, a.key)
    assert read is not None and replace(read, ttl=None) == replace(lock_a, ttl=None)
    locks.persist(b.key)
    assert admin.read_lock(ops.app, b.key).ttl is None  # type: ignore[union-attr]  # never expires
    assert admin.read_lock(ops.app, "singleton:{" + HOLD + ":" + "0" * 64 + "}") is None
    with pytest.raises(admin.NotALockKey) as bad:
        admin.read_lock(ops.app, "singleton:{beat:tick}:2024-01-01T00:00:00Z")
    assert isinstance(bad.value, ValueError) and "is not a task lock" in str(bad.value)


STALE_TASK = "tests.stale_locks"


def stale_test_key(name: str) -> str:
    """A run lock key of :data:`STALE_TASK` (``<prefix>:{<task>:<sha256>}``)."""
    return f"singleton:{{{STALE_TASK}:{hashlib.sha256(name.encode()).hexdigest()}}}"


def holder_process(server: RedisServer, liveness: float) -> redis.Redis:
    """The lock client of a process of its own (its own memory of the servers it saw), whose
    holders renew on ``singleton_liveness_ttl`` ``liveness``."""
    client = server.client(LOCK_DB, socket_timeout=30)
    client.csb_server = LockServer("singleton", liveness)  # type: ignore[attr-defined]
    return client


def test_a_lock_not_confirmed_after_a_snapshot_restart_is_listed_as_stale(
        make_redis: Callable[..., RedisServer]) -> None:
    """An RDB snapshot holds two locks of live-looking runs; one run ends (releases) after the
    snapshot; the server restarts from it: the ended run's lock is back. While the recovery
    window is open neither is stale. Once it has closed, the lock the keeper renewed in the
    window (confirmed) is not; the ended run's is, in ``list_locks``, ``read_lock``, the JSON
    and the ``locks`` command, until the next acquire of its key replaces it."""
    server = make_redis()
    direct = server.client(LOCK_DB)
    mark_in_use(direct)  # a Redis in use: no first-deploy window
    # Renewals every 2 s: the restarted server's window lasts this holder's need (3.5 s, in
    # the server record of the snapshot), long enough to list the locks inside it.
    holder = holder_process(server, liveness=6.0)
    spec = LockSpec(task=STALE_TASK, ttl=60.0, liveness_ttl=6.0)
    ended = acquire(holder, stale_test_key("ended"), spec, "ended-run").lease
    live = acquire(holder, stale_test_key("live"), spec, "live-run").lease
    assert ended is not None and live is not None
    assert json.loads(direct.get("singleton:server"))["need_ms"] == 3500
    app = app_for(server.url(LOCK_DB), singleton_liveness_ttl=1.5)  # its own need is shorter
    keeper = LeaseKeeper()
    kept = keeper.keep(live)
    try:
        direct.save()  # the snapshot holds both locks
        assert ended.release()  # the run ends after the snapshot
        server.kill()
        server.start()  # from the snapshot: the ended run's lock is back

        inside = admin.list_locks(app, task=STALE_TASK)  # its connection finds the loss: the window opens
        assert direct.exists(recovery_key("singleton")), "listed within the recovery window"
        assert {lock.holder.task_id: lock.stale for lock in inside} == {"ended-run": False, "live-run": False}

        renewals = kept.renewals
        wait_for(lambda: kept.renewals > renewals and server_of(holder).epoch > 0, timeout=30,
                 message="the live run's keeper renewed its lock on the restarted server")
        wait_for(lambda: not direct.exists(recovery_key("singleton")), timeout=30,
                 message="the recovery window to close")
        after = {lock.holder.task_id: lock for lock in admin.list_locks(app, task=STALE_TASK)}
        assert after["ended-run"].stale and not after["live-run"].stale
        assert after["ended-run"].as_json()["stale"] is True and after["live-run"].as_json()["stale"] is False
        read = admin.read_lock(app, ended.key)
        assert read is not None and read.stale

        command = run_command([sys.executable, "-m", "celery", "-A", "tests.apps.ops_app", "singleton", "locks"],
                              env=child_env(server), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=120)
        assert command.returncode == 0, command.stderr
        rows = {line.split()[2]: line.split() for line in command.stdout.splitlines() if STALE_TASK in line}
        assert rows["ended-run"][-2:] == ["stale", ended.key] and rows["live-run"][-2:] == ["-", live.key]
        assert "2 lock(s) held, 1 stale" in command.stdout

        # The next acquire of the key replaces it (the library's rule): held, and not stale.
        taken = acquire(holder_process(server, 1.5), ended.key, LockSpec(task=STALE_TASK, ttl=60.0), "next-run")
        assert taken.acquired, taken.holder
        replaced = admin.read_lock(app, ended.key)
        assert replaced is not None and replaced.holder.task_id == "next-run" and not replaced.stale
        assert not kept.lost
    finally:
        keeper.forget(kept)


def test_release_deletes_exactly_what_was_listed_and_refuses_a_changed_lock(
    ops: ModuleType, locks: redis.Redis,
) -> None:
    first = hold_lock(ops, "a", "task-a")
    [listed] = admin.list_locks(ops.app, task=HOLD)
    assert first.release()
    again = hold_lock(ops, "a", "task-a2")  # the key re-taken by another run meanwhile
    assert again.key == listed.key

    result = admin.release(ops.app, [listed])
    assert result == admin.ReleaseResult(released=(), changed=(listed,)) and not result.ok
    assert admin.release_lock(ops.app, listed) is False
    assert locks.get(listed.key) == again.value.encode(), "the new holder's lock is left alone"

    [current] = admin.list_locks(ops.app, task=HOLD)
    result = admin.release(ops.app, [current])
    assert result.released == (current,) and result.ok
    assert not locks.exists(listed.key)
    assert admin.read_counters(ops.app).tasks[HOLD]["force_released"] == 1


def test_force_release_variants(ops: ModuleType, locks: redis.Redis) -> None:
    c = hold_lock(ops, "c", "task-c")
    d = hold_lock(ops, "d", "task-d")
    with pytest.raises(admin.AmbiguousRelease) as ambiguous:
        admin.find_release_targets(ops.app, task=HOLD)
    assert {lock.key for lock in ambiguous.value.locks} == {c.key, d.key}
    with pytest.raises(admin.AmbiguousRelease):
        admin.force_release(ops.app, task=HOLD)
    assert locks.exists(c.key, d.key) == 2, "nothing released when ambiguous"
    with pytest.raises(TypeError):
        admin.find_release_targets(ops.app)
    with pytest.raises(TypeError):
        admin.find_release_targets(ops.app, key=c.key, every=True)
    with pytest.raises(admin.NotALockKey):
        admin.force_release(ops.app, key="singleton:{stats}:task:" + HOLD)

    [by_key] = admin.find_release_targets(ops.app, key=c.key)
    assert by_key.holder.task_id == "task-c"
    [freed] = admin.force_release(ops.app, key=c.key).released
    assert (freed.key, freed.value) == (by_key.key, by_key.value) == (c.key, c.value.encode())
    assert admin.force_release(ops.app, key=c.key) == admin.ReleaseResult((), ())  # not held
    assert [lock.key for lock in admin.force_release(ops.app, task=HOLD).released] == [d.key]

    e = hold_lock(ops, "e", "task-e")
    f = hold_lock(ops, "f", "task-f")
    released = admin.force_release(ops.app, task=HOLD, every=True)
    assert {lock.key for lock in released.released} == {e.key, f.key} and released.ok
    assert admin.find_release_targets(ops.app, task=HOLD, every=True) == []
    # A value that is not a lock record is released but not counted.
    foreign = "singleton:{" + HOLD + ":" + "f" * 64 + "}"
    locks.set(foreign, "junk", px=60_000)
    assert admin.force_release(ops.app, key=foreign).released[0].kind == "unknown"
    assert admin.read_counters(ops.app).tasks[HOLD]["force_released"] == 4


def test_purge_claims_deletes_claims_only_and_only_as_read(ops: ModuleType, locks: redis.Redis) -> None:
    """Publish-time claims of both modes are found and deleted; a running lock is refused,
    and a claim that changed after it was read (its run took it over) is left alone."""
    a = ops.publish_once.delay("a")       # no worker: the claims stay
    b = ops.publish_once.delay("b")
    queued = ops.publish_queued.delay("a")
    run = hold_lock(ops, "r", "task-r")
    found = admin.find_claims(ops.app)
    assert sorted(claim.holder.task_id for claim in found) == sorted([a.id, b.id, queued.id])
    assert sorted(claim.kind for claim in found) == ["claim", "claim", "queued"]
    [only] = admin.find_claims(ops.app, task=PUBLISH_QUEUED)
    assert only.holder.task_id == queued.id and only.key.endswith(":queued")

    with pytest.raises(ValueError, match="running locks are never purged"):
        admin.purge_claims(ops.app, admin.list_locks(ops.app, task=HOLD))
    assert locks.get(run.key) == run.value.encode()

    claim_b = next(claim for claim in found if claim.holder.task_id == b.id)
    adopted = json.dumps({**json.loads(claim_b.value), "claim": False, "token": "its run"})
    locks.set(claim_b.key, adopted, keepttl=True)  # b's run started and took its key over
    result = admin.purge_claims(ops.app, found)
    assert {claim.holder.task_id for claim in result.released} == {a.id, queued.id}
    assert result.changed == (claim_b,)
    assert locks.get(claim_b.key) == adopted.encode() and locks.get(run.key) == run.value.encode()
    assert admin.find_claims(ops.app) == [] and admin.purge_claims(ops.app) == admin.ReleaseResult((), ())
    assert admin.read_counters(ops.app).tasks[PUBLISH_ONCE]["claims_purged"] == 1
    with pytest.raises(TypeError):
        admin.purge_claims(ops.app, [], task=PUBLISH_ONCE)


def test_check_holders_asks_the_workers(
    ops: ModuleType, redis_server: RedisServer, locks: redis.Redis, records: redis.Redis,
) -> None:
    start_worker(redis_server, "tests.apps.ops_app", "admin1")
    node = f"admin1@{socket.gethostname()}"
    ops.hold.delay("run")
    wait_for(lambda: records.exists("running:run"), timeout=30, message="hold('run') running")
    try:
        running = admin.list_locks(ops.app, task=HOLD, node=node)
        stale = hold_lock(ops, "stale", "not-running-here", node=node)
        silent = hold_lock(ops, "silent", "task-gone")
        claim = take_lock(get_redis(ops.app), ops.publish_once.singleton_key(("q",), {}), 30,
                        task=PUBLISH_ONCE, task_id="queued-claim", claim=True)
        assert claim.acquired
        report = admin.check_holders(ops.app, admin.list_locks(ops.app), timeout=2)
        states = {status.lock.holder.task_id: status.state for status in report.holders}
        assert report.error is None
        assert states == {running[0].holder.task_id: "running", "not-running-here": "stale",
                          "task-gone": "silent"}
        assert "queued-claim" not in states, "claims have no running holder to ask about"
        assert [lock.key for lock in report.running] == [running[0].key]
        assert stale.key and silent.key
    finally:
        records.set("go:run", 1)

    # The broker cannot be reached: nobody is asked, and the report says why.
    nowhere = Celery("no-broker", broker=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False)
    unreachable = admin.check_holders(nowhere, admin.list_locks(ops.app), timeout=1)
    assert unreachable.holders == () and unreachable.error
    assert admin.check_holders(ops.app, [], timeout=1) == admin.HolderReport(())


# ----------------------------------------------------------------- slots and counters


def test_recent_slots_and_beat_counters_from_real_schedulers(
    redis_db: redis.Redis, redis_server: RedisServer, locks: redis.Redis,
) -> None:
    clock = ManualClock(datetime(2024, 5, 1, 12, 0, 0, 300000, tzinfo=UTC))
    schedule = {"tick": {"task": "t.tick", "schedule": 30.0},
                "tock": {"task": "t.tock", "schedule": 60.0}}
    apps = [beat_app(clock, schedule, redis_server.url(LOCK_DB)) for _ in range(2)]
    beats = [RecordingScheduler(app=app) for app in apps]
    run_ticks(beats, clock, 150, 5)
    sent = {(s["options"]["headers"][ENTRY_HEADER], s["slot"]) for beat in beats for s in beat.sent}
    app = apps[0]

    history = admin.recent_slots(app, last=1000)
    assert history.source == "history"
    assert {(claim.entry, claim.slot) for claim in history.claims} == sent
    assert [c.slot for c in history.claims] == sorted((c.slot for c in history.claims), reverse=True)
    assert {claim.winner for claim in history.claims} <= {beat.instance_id for beat in beats}
    ticks = admin.recent_slots(app, entry="tick", last=2).claims
    tick_slots = sorted((slot for entry, slot in sent if entry == "tick"), reverse=True)
    assert len(tick_slots) >= 4 and [c.slot for c in ticks] == tick_slots[:2]
    assert {c.task for c in ticks} == {"t.tick"}

    counters = admin.read_counters(app)
    won = {entry: sum(1 for e, _ in sent if e == entry) for entry in ("tick", "tock")}
    assert {name: c["won"] for name, c in counters.beat_entries.items()} == won
    assert counters.beat_total["won"] == len(sent) and counters.beat_total["lost"] >= 1
    assert counters.tasks == {} and not counters.empty

    # Without the history list, from the live claim keys (SCAN).
    locks.delete("singleton:{beat}:history")
    live = admin.recent_slots(app, entry="tick", last=1000)
    assert live.source == "claims"
    assert [(c.entry, c.slot) for c in live.claims] == sorted(
        ((e, s) for e, s in sent if e == "tick"), key=lambda es: es[1], reverse=True)
    assert all(c.key == f"singleton:{{beat:tick}}:{c.slot}" and c.task is None for c in live.claims)
    with pytest.raises(ValueError):
        admin.recent_slots(app, last=0)


def test_read_counters_of_tasks(ops: ModuleType) -> None:
    assert admin.read_counters(ops.app) == admin.Counters({}, {}, {}, stats_enabled=True)
    assert admin.read_counters(ops.app).empty
    hold_lock(ops, "a", "task-a")
    assert not take_lock(get_redis(ops.app), ops.hold.singleton_key(("a",), {}), 30, task=HOLD,
                       task_id="dup", stats_key=ops.hold.singleton_stats_key()).acquired
    ops.publish_once.delay("q")
    counters = admin.read_counters(ops.app)
    assert counters.tasks[HOLD] == {"acquired": 1, "skipped": 1, "released": 0, "renewed": 0, "lost": 0,
                                    "reclaimed": 0, "taken_over": 0, "redelivered": 0}
    assert counters.tasks[PUBLISH_ONCE]["claimed"] == 1
    assert counters.as_json() == {"tasks": {HOLD: dict(counters.tasks[HOLD]),
                                            PUBLISH_ONCE: dict(counters.tasks[PUBLISH_ONCE])},
                                  "beat": {"entries": {}, "total": {}}}
    no_stats = app_for(ops.app.conf.singleton_redis_url, singleton_stats=False)
    assert admin.read_counters(no_stats).stats_enabled is False


# ----------------------------------------------------------------- doctor


def test_doctor_report(redis_db: redis.Redis, redis_server: RedisServer,
                       make_redis: Callable[..., RedisServer]) -> None:
    report = admin.doctor(app_for(redis_server.url(LOCK_DB)))
    assert report.ok and report.exit_code == 0 and report.problems == 0
    assert [(c.name, c.status) for c in report.checks] == [
        ("configuration", "OK"), ("redis", "OK"), ("version", "OK"), ("access", "OK"), ("lua", "OK"),
        ("eviction", "OK"), ("expiry", "OK")]
    assert report.settings is not None and report.settings.key_prefix == "singleton"
    assert report.as_json() == {"ok": True, "checks": [c.as_json() for c in report.checks]}

    cache = make_redis("--maxmemory-policy", "allkeys-lru", "--maxmemory", "64mb")
    stuck = "singleton:{t.x:" + "0" * 64 + "}"
    cache.client(2).set(stuck, json.dumps({"task": "t.x", "task_id": "t1", "token": "x"}))
    report = admin.doctor(app_for(cache.url(2)))
    assert not report.ok and report.exit_code == 1 and report.problems == 2
    eviction, expiry = report.check("eviction"), report.check("expiry")
    assert eviction is not None and eviction.status == "FAIL" and "allkeys-lru" in eviction.detail
    assert expiry is not None and expiry.status == "FAIL" and stuck in expiry.detail

    invalid = admin.doctor(app_for(redis_server.url(LOCK_DB), singleton_lock_ttl=-1))
    assert [(c.name, c.status) for c in invalid.checks] == [("configuration", "FAIL")]
    assert invalid.exit_code == 78 and invalid.settings is None

    cache.stop()  # Redis down: a FAIL check, not an exception
    down = admin.doctor(app_for(cache.url(2)))
    assert [(c.name, c.status) for c in down.checks] == [("configuration", "OK"), ("redis", "FAIL")]
    assert down.exit_code == 69 and "unreachable" in down.checks[1].detail


def test_doctor_expiry_check_knows_done_markers_and_liveness_keys(redis_db: redis.Redis,
                                                                  redis_server: RedisServer) -> None:
    """The library writes ``<lock>:done:<task id>`` (acks_late runs) and ``<prefix>:live:<boot>``
    (worker liveness), each with a TTL. Without one, a done marker refuses that task id for
    good and a liveness key keeps a dead worker's locks from ever being taken over: the
    expiry check must fail on them, not call them keys "this library does not write"."""
    app = app_for(redis_server.url(LOCK_DB))
    client = get_redis(app)
    key = "singleton:{t.x:" + "1" * 64 + "}"
    lease = take_lock(client, key, 30, task="t.x", task_id="t1").lease
    assert lease is not None and lease.release(done_ttl=60)
    heartbeat = Heartbeat(client, "singleton", 10, "w@h")
    heartbeat.beat()
    done = done_key(key, "t1")
    assert client.exists(done, heartbeat.key) == 2

    expiry = admin.doctor(app, load=False).check("expiry")
    assert expiry is not None and (expiry.status, expiry.detail) == (
        "OK", "2 key(s) under 'singleton:'; every lock and claim expires")  # no fencing counter since 0.3

    client.persist(done)
    client.persist(heartbeat.key)
    report = admin.doctor(app, load=False)
    expiry = report.check("expiry")
    assert expiry is not None and expiry.status == "FAIL", expiry
    assert done in expiry.detail and heartbeat.key in expiry.detail and report.exit_code == 1
    assert admin.KeySpace("singleton").kind(done) == "done"
    assert admin.KeySpace("singleton").kind(heartbeat.key) == "live"
    assert admin.KeySpace("singleton").lock(done) is None  # not a lock of its own


def test_doctor_loads_the_example_projects_tasks(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """``celery -A example_project.shop.celery_app singleton doctor`` counts its three tasks
    (they are in ``include``): the command imports the app's task modules as a worker does."""
    env = child_env(redis_server, REDIS_URL=redis_server.url(LOCK_DB))
    result = run_command([sys.executable, "-m", "celery", "-A", "example_project.shop.celery_app",
                          "singleton", "doctor", "--json"], env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    configuration = json.loads(result.stdout)["checks"][0]
    assert configuration["status"] == "OK"
    assert configuration["detail"].endswith("3 singleton task(s) registered: shop.build_sales_report, "
                                            "shop.import_products, shop.sync_customer")


def test_doctor_api_loads_included_and_autodiscovered_tasks(redis_db: redis.Redis,
                                                          redis_server: RedisServer) -> None:
    """The API does the same, in a fresh process: ``include`` (the example project) and
    ``autodiscover_tasks`` (``tests.apps.discover_app``)."""
    script = (
        "import importlib, json, sys\n"
        "from celery_singleton_beat import admin\n"
        "app = importlib.import_module(sys.argv[1]).app\n"
        "print(json.dumps([admin.singleton_tasks(app, load=False), admin.doctor(app).tasks]))\n"
    )
    env = child_env(redis_server, REDIS_URL=redis_server.url(LOCK_DB))
    found: dict[str, Any] = {}
    for module in ("example_project.shop.celery_app", "tests.apps.discover_app"):
        # One process each: Celery shares tasks between the apps of a process.
        result = run_command([sys.executable, "-c", script, module], env=env, capture_output=True,
                             text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        found[module] = json.loads(result.stdout)
    assert found["example_project.shop.celery_app"] == [
        [], ["shop.build_sales_report", "shop.import_products", "shop.sync_customer"]]
    assert found["tests.apps.discover_app"] == [[], ["discovered.refresh"]]


def test_doctor_reports_a_task_module_that_does_not_import(redis_db: redis.Redis,
                                                           redis_server: RedisServer) -> None:
    app = app_for(redis_server.url(LOCK_DB), include=["tests.apps.no_such_module"])
    report = admin.doctor(app)
    first = report.checks[0]
    assert (first.name, first.status) == ("configuration", "FAIL")
    assert "cannot import the app's task modules: ModuleNotFoundError" in first.detail
    assert report.exit_code == 78 and report.check("redis") is not None  # Redis still checked
    with pytest.raises(ModuleNotFoundError):
        admin.load_tasks(app)


# ----------------------------------------------------------------- errors


def test_redis_down_and_invalid_settings_raise_admin_errors(
    redis_db: redis.Redis, make_redis: Callable[..., RedisServer],
) -> None:
    server = make_redis()
    app = app_for(server.url(2))
    assert admin.list_locks(app) == []  # connected once: the client has a pooled connection
    server.stop()
    key = "singleton:{t.x:" + "0" * 64 + "}"
    calls: list[Callable[[], object]] = [
        lambda: admin.list_locks(app), lambda: admin.read_lock(app, key),
        lambda: admin.find_release_targets(app, task="t.x"), lambda: admin.recent_slots(app),
        lambda: admin.read_counters(app),
    ]
    for call in calls:
        with pytest.raises(admin.RedisUnavailable) as down:
            call()
        assert isinstance(down.value, admin.AdminRedisError) and isinstance(down.value, SingletonError)
        assert str(down.value).startswith(f"cannot reach Redis at {server.url(2)}: ConnectionError")
        assert isinstance(down.value.cause, redis.ConnectionError)

    cluster = app_for(f"redis+cluster://127.0.0.1:{free_port()}")
    cluster.conf.singleton_stats = False
    with pytest.raises(admin.RedisUnavailable):
        admin.list_locks(cluster)

    bad = app_for(server.url(2), singleton_lock_ttl=-1)
    for call in (lambda: admin.list_locks(bad), lambda: admin.read_counters(bad)):
        with pytest.raises(admin.InvalidSettings) as invalid:
            call()
        assert isinstance(invalid.value, ImproperlyConfigured) and "singleton_lock_ttl" in str(invalid.value)


def test_a_refused_command_is_an_admin_redis_error(make_redis: Callable[..., RedisServer]) -> None:
    """An ACL that allows no SCAN: Redis answers, so it is not "unavailable"."""
    server = make_redis()
    server.client().acl_setuser("noscan", enabled=True, passwords=["+pw"], keys=["singleton:*"],
                                commands=["-@all", "+ping", "+select", "+get", "+pttl", "+exists"])
    app = app_for(f"redis://noscan:pw@127.0.0.1:{server.port}/2")
    with pytest.raises(admin.AdminRedisError) as refused:
        admin.list_locks(app)
    assert not isinstance(refused.value, admin.RedisUnavailable)
    assert isinstance(refused.value.cause, redis.exceptions.NoPermissionError)
    assert "redis://noscan:**@" in str(refused.value) and ":pw@" not in str(refused.value)
    assert admin.read_lock(app, "singleton:{t.x:" + "0" * 64 + "}") is None  # GET and PTTL allowed

