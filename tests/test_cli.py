"""``celery -A ... singleton <command>`` run as a real subprocess against a real Redis.

Locks and counters are made by the library itself (``acquire`` with a counter
hash, a publish-time claim of ``publish_once``); beat slot claims and beat
counters by two real ``celery beat -S singleton`` processes.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import redis

from celery_singleton_beat.lease import counters
from celery_singleton_beat.lease.lock import AcquireResult
from celery_singleton_beat.recovery.lock_redis import get_redis

from .support import CeleryProcess, RedisServer, child_env, free_port, run_command, start_worker, wait_for
from .support.beat import start_beat
from .support.locking import take_lock
from .support.tasks import lock_keys

APP = "tests.apps.ops_app"
HOLD = "tests.apps.ops_app.hold"
PUBLISH_ONCE = "tests.apps.ops_app.publish_once"
PUBLISH_QUEUED = "tests.apps.ops_app.publish_queued"
BRIEF = "tests.apps.ops_app.brief"
#: Beat claim margin (s) of the slots test: its claim keys outlive all of its deadlines
#: together (two beat starts and the claims' wait, 60 s each; two stops, 20 s each;
#: eight commands, 120 s each: under 20 minutes).
CLAIMS_OUTLIVE_TEST = 3600


def cli(redis_server: RedisServer, *args: str, settings: dict[str, Any] | None = None
        ) -> subprocess.CompletedProcess[str]:
    """Run ``celery -A tests.apps.ops_app singleton <args>`` without a terminal (stdin closed)."""
    env = child_env(redis_server, CSB_OPS_SETTINGS=json.dumps(settings or {}))
    return run_command([sys.executable, "-m", "celery", "-A", APP, "singleton", *args],
                       env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)


def cli_in_terminal(redis_server: RedisServer, answer: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the command with a pseudo-terminal as stdin, ``answer`` typed in advance."""
    main, child = pty.openpty()
    try:
        os.write(main, answer.encode() + b"\n")
        return run_command([sys.executable, "-m", "celery", "-A", APP, "singleton", *args],
                           env=child_env(redis_server), stdin=child, capture_output=True, text=True, timeout=120)
    finally:
        os.close(main)
        os.close(child)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


#: The TTL of the locks these tests take by hand. Nothing renews them (a renewal would
#: change the counters the tests read), so they must outlive every CLI call of a test:
#: each starts a Celery app in a new process, several seconds on a loaded machine.
HELD_TTL = 600


def hold_lock(ops: ModuleType, key: str, task_id: str, node: str = "w9@gone-host") -> AcquireResult:
    """Take the lock of ``hold(key)`` as a worker would (with counters, written at once), from this process."""
    result = take_lock(get_redis(ops.app), ops.hold.singleton_key((key,), {}), HELD_TTL, task=HOLD, task_id=task_id,
                       node=node, stats_key=ops.hold.singleton_stats_key())
    counters.flush()
    return result


def test_every_command_works_on_an_empty_redis(ops: ModuleType, redis_server: RedisServer) -> None:
    assert "No task lock is held" in ok(cli(redis_server, "locks"))
    assert json.loads(ok(cli(redis_server, "locks", "--json"))) == []
    assert "No beat slot claim is recorded" in ok(cli(redis_server, "slots"))
    assert json.loads(ok(cli(redis_server, "slots", "--json"))) == []
    assert "No counters recorded" in ok(cli(redis_server, "stats"))
    assert json.loads(ok(cli(redis_server, "stats", "--json"))) == {
        "tasks": {}, "beat": {"entries": {}, "total": {}}}
    assert "nothing to release" in ok(cli(redis_server, "release", "--task", HOLD))
    assert "nothing to purge" in ok(cli(redis_server, "purge-claims"))
    report = json.loads(ok(cli(redis_server, "doctor", "--json")))
    assert report["ok"] is True
    assert [(c["check"], c["status"]) for c in report["checks"]] == [
        ("configuration", "OK"), ("redis", "OK"), ("version", "OK"), ("access", "OK"), ("lua", "OK"),
        ("eviction", "OK"), ("expiry", "OK")]
    assert "nothing held" in report["checks"][-1]["detail"]


def test_locks_shows_holders_and_stats_counts_them(
    ops: ModuleType, redis_server: RedisServer, locks: redis.Redis,
) -> None:
    first = hold_lock(ops, "a", "task-a")
    second = hold_lock(ops, "b", "task-b", node="w8@other-host")
    assert first.acquired and second.acquired
    assert not hold_lock(ops, "a", "duplicate-of-a").acquired  # counted as skipped
    claim = ops.publish_once.delay("q")  # queued, no worker: a publish-time claim

    table = ok(cli(redis_server, "locks"))
    header, *rows = table.splitlines()
    assert header.split() == ["TASK", "KIND", "HOLDER", "TASK", "ID", "NODE", "PID", "ACQUIRED",
                              "(UTC)", "TTL", "RENEWED", "STALE", "KEY"]
    row_a = next(row for row in rows if "task-a" in row)
    assert row_a.split()[:4] == [HOLD, "run", "task-a", "w9@gone-host"]
    assert row_a.split()[-2:] == ["-", first.lease.key]  # not stale: no data loss on this server
    assert " ago " in row_a and first.lease.key in row_a
    assert any(claim.id in row and "claim" in row for row in rows)
    assert "3 lock(s) held." in table

    listed = {item["task_id"]: item for item in json.loads(ok(cli(redis_server, "locks", "--json")))}
    assert set(listed) == {"task-a", "task-b", claim.id}
    a = listed["task-a"]
    assert a["task"] == HOLD and a["kind"] == "run" and a["node"] == "w9@gone-host"
    assert a["key"] == first.lease.key and 0 <= a["renewed_ago"] < HELD_TTL
    assert listed[claim.id]["renewed_ago"] is None, "a claim is not renewed"
    assert a["pid"] == os.getpid() and a["acquired_at"] == first.lease.holder.acquired_at
    assert 0 < a["ttl"] <= HELD_TTL
    assert listed[claim.id]["kind"] == "claim" and listed[claim.id]["task"] == PUBLISH_ONCE
    assert not any(item["stale"] for item in listed.values())

    only = json.loads(ok(cli(redis_server, "locks", "--task", PUBLISH_ONCE, "--json")))
    assert [item["task_id"] for item in only] == [claim.id]

    counts = json.loads(ok(cli(redis_server, "stats", "--json")))["tasks"]
    assert counts[HOLD] == {"acquired": 2, "skipped": 1, "released": 0, "renewed": 0, "lost": 0,
                            "reclaimed": 0, "taken_over": 0, "redelivered": 0}
    assert counts[PUBLISH_ONCE]["claimed"] == 1
    stats_table = ok(cli(redis_server, "stats")).splitlines()
    assert stats_table[0].split() == ["TASK", "ACQUIRED", "SKIPPED", "RELEASED", "RENEWED", "LOST",
                                      "RECLAIMED", "TAKEN_OVER", "REDELIVERED", "OTHER"]
    assert any(line.split() == [HOLD, "2", "1", "0", "0", "0", "0", "0", "0", "-"] for line in stats_table)
    assert any(line.split()[0] == PUBLISH_ONCE and line.split()[-1] == "claimed=1" for line in stats_table)


def test_stats_count_every_run_of_pool_processes_recycled_after_each_task(
    ops: ModuleType, redis_server: RedisServer, locks: redis.Redis, records: redis.Redis,
) -> None:
    """A prefork child recycled by ``--max-tasks-per-child 1`` ends with ``os._exit`` right
    after its run: what it counted, and the reply of its last release (which counts it
    released, or lost), must not go with it. Ten runs, ten children: ten acquired, ten
    released, none lost. The worker sends no task events and the task stores no result,
    so each release's reply is left to be read later (the case where it is unread at exit)."""
    worker = start_worker(redis_server, APP, "recycled", concurrency=2, events=False,
                          extra=["--max-tasks-per-child", "1", "-Q", "recycled"])
    keys = [f"r{i}" for i in range(10)]
    for key in keys:
        ops.brief.apply_async((key,), queue="recycled")
    wait_for(lambda: records.scard("brief") == len(keys), timeout=60, message="the ten runs")
    stats_key = ops.brief.singleton_stats_key()

    def counted() -> dict[str, int]:
        return {k.decode(): int(v) for k, v in locks.hgetall(stats_key).items()}

    wait_for(lambda: counted().get("acquired") == len(keys) and counted().get("released") == len(keys),
             timeout=30, message=f"ten acquired and ten released in {stats_key} (counted: {counted()})")
    assert counted().get("lost", 0) == 0
    assert json.loads(ok(cli(redis_server, "stats", "--json")))["tasks"][BRIEF] == {
        "acquired": 10, "skipped": 0, "released": 10, "renewed": 0, "lost": 0, "reclaimed": 0, "taken_over": 0,
        "redelivered": 0}
    assert lock_keys(locks) == [], "every release ran"
    worker.check_running()


def test_release_asks_for_yes_and_deletes_only_what_it_showed(
    ops: ModuleType, redis_server: RedisServer, locks: redis.Redis,
) -> None:
    a = hold_lock(ops, "a", "task-a").lease
    b = hold_lock(ops, "b", "task-b").lease
    assert a is not None and b is not None

    refused = cli(redis_server, "release", a.key)
    assert refused.returncode == 1
    assert "not an interactive terminal (pass --yes)" in refused.stderr
    assert locks.get(a.key) == a.value.encode()

    ambiguous = cli(redis_server, "release", "--task", HOLD, "--yes")
    assert ambiguous.returncode == 1 and "pass --all" in ambiguous.stderr
    assert locks.exists(a.key, b.key) == 2

    released = ok(cli(redis_server, "release", a.key, "--yes", "--timeout", "0.2"))
    assert f"released {a.key}" in released
    assert not locks.exists(a.key) and locks.exists(b.key)
    # No worker named w9@gone-host answers: the holder is reported as probably gone.
    assert "did not answer" in cli(redis_server, "release", b.key, "--yes", "--timeout", "0.2").stderr
    assert not locks.exists(b.key)

    assert "is not held; nothing to release" in ok(cli(redis_server, "release", a.key, "--yes"))
    c = hold_lock(ops, "c", "task-c").lease
    d = hold_lock(ops, "d", "task-d").lease
    assert c is not None and d is not None
    ok(cli(redis_server, "release", "--task", HOLD, "--all", "--yes", "--timeout", "0.2"))
    assert not locks.exists(c.key, d.key)
    assert json.loads(ok(cli(redis_server, "stats", "--json")))["tasks"][HOLD]["force_released"] == 4

    assert cli(redis_server, "release", "singleton:{beat:tick}:2024-01-01T00:00:00Z", "--yes").returncode == 2
    assert cli(redis_server, "release").returncode == 2
    assert cli(redis_server, "release", "--all").returncode == 2


def test_release_in_a_terminal_asks_first_and_no_keeps_the_lock(
    ops: ModuleType, redis_server: RedisServer, locks: redis.Redis,
) -> None:
    lease = hold_lock(ops, "a", "task-a").lease
    assert lease is not None
    declined = cli_in_terminal(redis_server, "n", "release", lease.key, "--timeout", "0.2")
    assert declined.returncode == 1, declined.stderr
    assert "Release 1 lock(s)? [y/N]" in declined.stdout and "not released" in declined.stderr
    assert locks.exists(lease.key)
    accepted = cli_in_terminal(redis_server, "y", "release", lease.key, "--timeout", "0.2")
    assert accepted.returncode == 0, accepted.stderr
    assert not locks.exists(lease.key)


def test_purge_claims_after_celery_purge_lets_publishes_run_again(
    ops: ModuleType, redis_server: RedisServer, locks: redis.Redis, processes: list[CeleryProcess],
) -> None:
    """``celery purge -f`` drops the queued messages, not their publish-time claims: a new
    publish returns the purged message's id and nothing runs. ``purge-claims`` deletes the
    claims (both modes) and leaves running locks alone, one of which began as a claim."""
    records = redis_server.client(3)
    purged_once = ops.publish_once.delay("k")      # until_executed: claim on the lock key
    purged_queued = ops.publish_queued.delay("k")  # until_executing: claim on <key>:queued
    purge = run_command([sys.executable, "-m", "celery", "-A", APP, "purge", "-f"],
                        env=child_env(redis_server), capture_output=True, text=True, timeout=120)
    assert purge.returncode == 0 and "Purged 2 messages" in purge.stdout, purge.stdout + purge.stderr
    claim_keys = [ops.publish_once.singleton_key(("k",), {}), ops.publish_queued.singleton_key(("k",), {}) + ":queued"]
    assert all(locks.pttl(key) > 3_500_000 for key in claim_keys)  # an hour left

    start_worker(redis_server, APP, "purger")
    assert ops.publish_once.delay("k").id == purged_once.id      # deduplicated against nothing
    assert ops.publish_queued.delay("k").id == purged_queued.id
    running = ops.hold.delay("r")               # a run lock
    claimed_run = ops.hold_claimed.delay("r2")  # a claim its run adopted: a run lock now
    wait_for(lambda: records.exists("running:r", "running:r2") == 2, timeout=30, message="both holds running")
    run_keys = [ops.hold.singleton_key(("r",), {}), ops.hold_claimed.singleton_key(("r2",), {})]
    run_values = [locks.get(key) for key in run_keys]
    assert all(json.loads(value)["claim"] is False for value in run_values)

    refused = cli(redis_server, "purge-claims")
    assert refused.returncode == 1 and "pass --yes" in refused.stderr
    assert locks.exists(*claim_keys) == 2

    out = ok(cli(redis_server, "purge-claims", "--yes"))
    assert "To purge (2)" in out and purged_once.id in out and purged_queued.id in out
    assert "purged 2 claim(s)" in out
    assert locks.exists(*claim_keys) == 0
    assert [locks.get(key) for key in run_keys] == run_values  # running locks untouched
    counts = json.loads(ok(cli(redis_server, "stats", "--json")))["tasks"]
    assert counts[PUBLISH_ONCE]["claims_purged"] == 1

    fresh = ops.publish_once.delay("k")
    fresh_queued = ops.publish_queued.delay("k")
    assert fresh.id != purged_once.id and fresh_queued.id != purged_queued.id
    assert fresh.get(timeout=60) == "k" and fresh_queued.get(timeout=60) == "k"
    records.set("go:r", 1)
    records.set("go:r2", 1)
    assert running.get(timeout=60) == "r" and claimed_run.get(timeout=60) == "r2"
    assert "No publish-time claim is held; nothing to purge" in ok(cli(redis_server, "purge-claims", "--yes"))


def test_purge_claims_of_one_task(ops: ModuleType, redis_server: RedisServer, locks: redis.Redis) -> None:
    once = ops.publish_once.delay("a")
    queued = ops.publish_queued.delay("a")
    out = ok(cli(redis_server, "purge-claims", "--task", PUBLISH_QUEUED, "--yes"))
    assert queued.id in out and once.id not in out
    assert locks.exists(ops.publish_once.singleton_key(("a",), {}))
    assert not locks.exists(ops.publish_queued.singleton_key(("a",), {}) + ":queued")


def test_slots_and_beat_counters_from_two_real_beats(
    ops: ModuleType, redis_server: RedisServer, locks: redis.Redis, processes: list[CeleryProcess],
    tmp_path: Path,
) -> None:
    schedule = {"tick": {"every": 1}}
    # The end reads the live claim keys, which expire the entry's period plus the claim
    # margin after their claim (61 s by default): on a loaded machine the commands run in
    # between took longer, every key was gone and the fallback found none (CI: stdout '[]',
    # no note). The margin makes them outlive every deadline of this test together.
    settings = {"singleton_beat_claim_margin": CLAIMS_OUTLIVE_TEST}
    beats = [start_beat(redis_server, tmp_path, name, schedule, settings=settings) for name in ("one", "two")]
    processes.extend(beats)

    def claimed(field: str) -> int:
        return int(locks.hget("singleton:{stats}:beat:tick", field) or 0)

    wait_for(lambda: claimed("won") >= 3 and claimed("lost") >= 1, timeout=60, interval=0.2,
             message="both beats claiming slots of 'tick'")
    for beat in beats:
        beat.stop()
    instances = {line.split(" won by ")[1].split(",")[0]
                 for beat in beats for line in beat.output().splitlines() if " won by " in line}

    claims = json.loads(ok(cli(redis_server, "slots", "--entry", "tick", "--last", "1000", "--json")))
    assert claims and {c["entry"] for c in claims} == {"tick"}
    slots = [c["slot"] for c in claims]
    assert len(slots) == len(set(slots)), "each slot was won once"
    assert slots == sorted(slots, reverse=True), "newest first"
    assert {c["winner"] for c in claims} <= instances
    assert all(c["key"] == f"singleton:{{beat:tick}}:{c['slot']}" for c in claims)
    beat = json.loads(ok(cli(redis_server, "stats", "--json")))["beat"]
    entries, total = beat["entries"], beat["total"]
    assert entries["tick"]["won"] == len(claims) and entries["tick"]["lost"] >= 1
    assert {counter: sum(e[counter] for e in entries.values()) for counter in total} == total
    assert total["won"] == len(json.loads(ok(cli(redis_server, "slots", "--last", "1000", "--json"))))

    last_two = json.loads(ok(cli(redis_server, "slots", "--entry", "tick", "--last", "2", "--json")))
    assert [c["slot"] for c in last_two] == slots[:2]
    table = ok(cli(redis_server, "slots", "--entry", "tick", "--last", "2")).splitlines()
    assert table[0].split() == ["SLOT", "(UTC)", "ENTRY", "WON", "BY", "CLAIMED", "AT", "(UTC)", "TASK"]
    assert table[1].split()[:3] == [slots[0], "tick", claims[0]["winner"]]
    stats_rows = [line.split() for line in ok(cli(redis_server, "stats")).splitlines()]
    assert ["BEAT", "ENTRY", "SLOTS", "WON", "SLOTS", "LOST", "TAKEN", "OVER", "COPIES", "DROPPED"] in stats_rows
    tick = entries["tick"]
    assert ["tick", *(str(tick[c]) for c in ("won", "lost", "taken_over", "duplicates_dropped"))] in stats_rows
    assert ["(all", "entries)", *(str(total[c]) for c in ("won", "lost", "taken_over", "duplicates_dropped"))
            ] in stats_rows
    assert "No beat slot claim of entry nope" in ok(cli(redis_server, "slots", "--entry", "nope"))

    # Without the history list, slots are read from the live claim keys (SCAN).
    assert locks.exists(*(c["key"] for c in claims)) == len(claims), "a claim key expired"
    locks.delete("singleton:{beat}:history")
    fallback = cli(redis_server, "slots", "--entry", "tick", "--last", "1000", "--json")
    assert "no beat history list" in fallback.stderr
    from_keys = json.loads(ok(fallback))
    assert [c["slot"] for c in from_keys] == slots
    assert [c["winner"] for c in from_keys] == [c["winner"] for c in claims]


def test_doctor_flags_an_evicting_redis_and_locks_that_never_expire(
    ops: ModuleType, make_redis: Callable[..., RedisServer],
) -> None:
    cache = make_redis("--maxmemory-policy", "allkeys-lru", "--maxmemory", "64mb")
    settings = {"singleton_redis_url": cache.url(2)}
    stuck = "singleton:{tests.apps.ops_app.hold:" + "0" * 64 + "}"
    cache.client(2).set(stuck, json.dumps({"task": HOLD, "task_id": "t1", "token": "x"}))

    result = cli(cache, "doctor", settings=settings)
    assert result.returncode == 1, result.stdout
    lines = {line.split()[1]: line for line in result.stdout.splitlines()[1:-1]}
    assert lines["eviction"].startswith("FAIL") and "allkeys-lru" in lines["eviction"]
    assert lines["expiry"].startswith("FAIL") and stuck in lines["expiry"]
    assert lines["redis"].startswith("OK") and lines["lua"].startswith("OK")
    assert result.stdout.splitlines()[-1] == "2 problem(s), 0 warning(s)"

    # volatile-ttl evicts the keys closest to expiry first: the locks.
    cache.client().config_set("maxmemory-policy", "volatile-ttl")
    cache.client(2).delete(stuck)
    report = json.loads(cli(cache, "doctor", "--json", settings=settings).stdout)
    assert report["ok"] is False
    assert {c["check"]: c["status"] for c in report["checks"]}["eviction"] == "FAIL"

    cache.client().config_set("maxmemory-policy", "noeviction")
    assert json.loads(ok(cli(cache, "doctor", "--json", settings=settings)))["ok"] is True

    # A user allowed only what the locks need: what it may not read (INFO, CONFIG) is a
    # warning; the version then rests on SET ... GET, which the heartbeat sends.
    cache.client().acl_setuser("locks", enabled=True, passwords=["+pw"], keys=["singleton:*"],
                               commands=["-@all", "+ping", "+select", "+scan", "+pttl", "+set",
                                         "+evalsha", "+script|load"])
    limited = {"singleton_redis_url": f"redis://locks:pw@127.0.0.1:{cache.port}/2"}
    report = json.loads(ok(cli(cache, "doctor", "--json", settings=limited)))
    assert {c["check"]: c["status"] for c in report["checks"]} == {
        "configuration": "OK", "redis": "OK", "version": "WARN", "access": "OK", "lua": "OK",
        "eviction": "WARN", "expiry": "OK"}

    # Without SET the user cannot write a liveness key: a configuration error (78), as for a worker.
    cache.client().acl_setuser("locks", enabled=True, commands=["-set"])
    result = cli(cache, "doctor", settings=limited)
    assert result.returncode == 78, result.stdout
    lines = {line.split()[1]: line for line in result.stdout.splitlines()[1:-1]}
    assert lines["access"].startswith("FAIL") and "the ACL user may not" in lines["access"]


def test_bad_settings_and_an_unreachable_redis_are_errors(ops: ModuleType, redis_server: RedisServer) -> None:
    bad = {"singleton_lock_ttl": -1}
    doctor = cli(redis_server, "doctor", settings=bad)
    assert doctor.returncode == 78  # EX_CONFIG, as for every command
    assert doctor.stdout.splitlines()[0].startswith("FAIL") and "singleton_lock_ttl" in doctor.stdout
    assert cli(redis_server, "locks", settings=bad).returncode == 78

    nowhere = {"singleton_redis_url": f"redis://127.0.0.1:{free_port()}/2"}
    doctor = cli(redis_server, "doctor", "--json", settings=nowhere)
    assert doctor.returncode == 69  # EX_UNAVAILABLE, as for every command
    assert [(c["check"], c["status"]) for c in json.loads(doctor.stdout)["checks"]] == [
        ("configuration", "OK"), ("redis", "FAIL")]
    unreachable = cli(redis_server, "stats", settings=nowhere)
    assert unreachable.returncode == 69 and "cannot reach Redis" in unreachable.stderr


def test_an_unreachable_redis_cluster_is_one_line_and_exit_69(ops: ModuleType, redis_server: RedisServer) -> None:
    """A Cluster client asks its nodes for the slot layout when it is made: no traceback."""
    nowhere = {"singleton_redis_url": f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"}
    for command in (["locks"], ["slots"], ["stats"], ["release", "--task", HOLD, "--yes"]):
        result = cli(redis_server, *command, settings=nowhere)
        assert result.returncode == 69, (command, result.stderr)
        assert result.stderr.count("\n") == 1 and "cannot reach Redis at redis+cluster://" in result.stderr
        assert "Traceback" not in result.stderr
    doctor = cli(redis_server, "doctor", "--json", settings=nowhere)
    assert doctor.returncode == 69, doctor.stderr
    assert [(c["check"], c["status"]) for c in json.loads(doctor.stdout)["checks"]] == [
        ("configuration", "OK"), ("redis", "FAIL")]


def test_doctor_version_check_and_exit_codes() -> None:
    """Redis 6.2 is the floor (SET ... GET); 7.0 has every feature; Valkey by its redis_version."""
    from celery_singleton_beat.admin import Check, doctor_exit_code, version_check

    assert version_check("7.0.15", "master").status == "OK"
    assert version_check("7.2.4", "master", "cluster").status == "OK"
    assert version_check("6.2.14", "master").status == "WARN"
    assert version_check("6.0.20", "master").status == "FAIL"  # no SET ... GET: the floor is 6.2
    assert version_check("5.0.0", "master").status == "FAIL"
    assert version_check("4.0.14", "master").status == "FAIL"
    valkey = version_check("7.2.4", "master", name="Valkey 8.1.8")  # Valkey's INFO: redis_version 7.2.4
    assert (valkey.status, valkey.detail) == ("OK", "Valkey 8.1.8 (standalone, master)")
    assert version_check("7.0.15", "slave").status == "FAIL"

    def checks(**status: str) -> list[Check]:
        return [Check(name, value, "") for name, value in status.items()]

    assert doctor_exit_code(checks(configuration="OK", redis="OK", eviction="WARN")) == 0
    assert doctor_exit_code(checks(configuration="OK", redis="OK", eviction="FAIL")) == 1
    assert doctor_exit_code(checks(configuration="OK", redis="FAIL")) == 69
    # A Redis that answers but refuses the settings (password, ACL, database, TLS) is 78, as for a worker.
    assert doctor_exit_code([Check("configuration", "OK", ""), Check("redis", "FAIL", "", exit_code=78)]) == 78
    assert doctor_exit_code(checks(configuration="FAIL")) == 78
