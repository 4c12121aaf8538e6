"""The admin tools on a Redis with many other keys: how they walk the keyspace.

Each test fills a redis-server of its own (so that ``INFO commandstats`` and
``MONITOR`` see the admin functions' commands only) with about 20,000 keys of
other applications, plus lock values in the library's own format, slot claims
and counter hashes. What is checked is what the server was asked, never how
long it took (speed is ``benchmarks/bench_admin.py``'s, in docs/performance.md):
SCAN with the module's COUNT and never KEYS, one walk per command, the task
filter sent as the SCAN's MATCH, locks yielded while the walk goes on, only the
newest slot claims read, and a progress line on a terminal only.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pty
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import Celery

from celery_singleton_beat import admin
from celery_singleton_beat.admin import _common
from celery_singleton_beat.beat.claims import claim_value as slot_claim_value
from celery_singleton_beat.beat.entries import slot_key
from celery_singleton_beat.lease.holder import lock_value
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.window import mark_in_use
from celery_singleton_beat.task.keys import task_stats_key

from .support import RedisServer, child_env, run_command
from .support.topologies import Topology

#: Other applications' keys in each test's server.
OTHERS = 20_000
PREFIX = "singleton"
TASKS = ("tests.scale.sync", "tests.scale.export")
#: A task whose name holds glob characters, and one that its unescaped pattern would match too.
ODD, ODD_LOOKALIKE = "tests.scale.odd[x]", "tests.scale.oddx"
APP = "tests.apps.ops_app"


# ----------------------------------------------------------------- filling


def lock_key(task: str, n: int) -> str:
    return f"{PREFIX}:{{{task}:{hashlib.sha256(f'{task}-{n}'.encode()).hexdigest()}}}"


def fill(client: redis.Redis, *, locks: dict[str, int], counters: int = 0, others: int = OTHERS) -> list[str]:
    """``others`` keys of other applications, ``locks[task]`` locks of each task (values in
    the library's format, an hour's TTL), ``counters`` task counter hashes; the lock keys.
    The library's record of the server is written first (a Redis in use: see ``mark_in_use``)."""
    mark_in_use(client)
    pipe = client.pipeline(transaction=False)
    keys = []
    for task, count in locks.items():
        spec = LockSpec(task=task, ttl=3600.0)
        for n in range(count):
            keys.append(lock_key(task, n))
            pipe.set(keys[-1], lock_value(spec, f"{task}-id-{n}", "w1@scale-host"), px=3_600_000)
    for n in range(counters):
        pipe.hset(task_stats_key(PREFIX, f"tests.scale.counted{n}"), mapping={"acquired": n + 1})
    for start in range(0, others, 1000):
        pipe.mset({f"cache:page:{n}": "x" for n in range(start, min(start + 1000, others))})
    pipe.execute()
    return keys


def app_for(server: RedisServer) -> Celery:
    app = Celery("admin-scale-tests", set_as_current=False)
    app.conf.update(broker_url="memory://", singleton_redis_url=server.url(0))
    return app


def scan_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))


def calls_of(client: redis.Redis) -> dict[str, int]:
    return {name[len("cmdstat_"):]: int(stats["calls"]) for name, stats in client.info("commandstats").items()}


@contextmanager
def monitoring(server: RedisServer) -> Iterator[list[list[str]]]:
    """The commands the server runs meanwhile (``MONITOR``), each as its list of arguments."""
    seen: list[list[str]] = []
    marker = "admin-scale-monitor-end"
    watcher = server.client(socket_timeout=60)
    monitor = watcher.monitor()
    monitor.__enter__()  # MONITOR answered OK: every command from now on is seen

    def read() -> None:
        while True:
            line = monitor.connection.read_response()
            text = line.decode() if isinstance(line, bytes) else str(line)
            args = [ast.literal_eval(f'"{arg}"') for arg in re.findall(r'"((?:[^"\\]|\\.)*)"', text)]
            if args[:2] == ["ECHO", marker]:
                return
            seen.append(args)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield seen
    finally:
        server.client().echo(marker)
        reader.join(timeout=60)
        monitor.__exit__()
        watcher.close()
    assert not reader.is_alive(), "MONITOR never showed the end marker"


def read_keys(commands: list[list[str]]) -> list[str]:
    """The keys whose values ``commands`` read (GET and MGET)."""
    return [key for args in commands if args[0].upper() in ("GET", "MGET") for key in args[1:]]


# ----------------------------------------------------------------- SCAN, COUNT, one walk


def test_scan_count_is_large_enough_for_a_million_keys() -> None:
    """A SCAN call is a round trip: COUNT 1,000 meant 1,000 of them for a million keys
    (docs/performance.md, "Admin tools on a large Redis")."""
    assert _common.SCAN_COUNT >= 5000


@pytest.mark.parametrize("command", ["locks", "locks --task", "stats", "slots", "doctor"])
def test_each_command_walks_the_keys_once_with_scan_and_never_keys(
    make_redis: Callable[..., RedisServer], command: str,
) -> None:
    server = make_redis()
    client = server.client()
    fill(client, locks={TASKS[0]: 40, TASKS[1]: 40}, counters=20)
    app = app_for(server)
    keys = int(client.dbsize())
    client.config_resetstat()

    if command == "locks":
        assert len(admin.list_locks(app)) == 80
    elif command == "locks --task":
        assert len(list(admin.iter_locks(app, task=TASKS[1]))) == 40
    elif command == "stats":
        assert len(admin.read_counters(app).tasks) == 20
    elif command == "slots":
        assert admin.recent_slots(app).claims == ()
    else:
        assert admin.doctor(app).ok

    calls = calls_of(client)
    assert "keys" not in calls, "KEYS blocks the server for the whole walk"
    # Each SCAN call looks at about COUNT keys: one walk is keys / COUNT calls (and the last).
    walks = keys / _common.SCAN_COUNT
    assert walks - 1 <= calls["scan"] <= walks + 2, (calls["scan"], keys)


def test_progress_reports_each_scan_call_and_the_total(make_redis: Callable[..., RedisServer]) -> None:
    server = make_redis()
    client = server.client()
    fill(client, locks={TASKS[0]: 30})
    keys = int(client.dbsize())
    seen: list[admin.ScanProgress] = []
    client.config_resetstat()

    assert len(list(admin.iter_locks(app_for(server), progress=seen.append))) == 30

    assert len(seen) == scan_calls(client)
    assert {status.total for status in seen} == {keys}
    assert [status.done for status in seen] == [False] * (len(seen) - 1) + [True]
    scanned = [status.scanned for status in seen]
    assert scanned == sorted(scanned) and scanned[-1] == keys
    assert scanned[0] == _common.SCAN_COUNT  # about COUNT keys looked at per call
    assert seen[-1].matched == 30


def test_progress_without_dbsize_has_no_total(make_redis: Callable[..., RedisServer]) -> None:
    """An admin user whose ACL refuses DBSIZE still walks the keys; the total is unknown."""
    server = make_redis()
    client = server.client()
    fill(client, locks={TASKS[0]: 5}, others=2000)
    client.acl_setuser("viewer", enabled=True, passwords=["+viewer-pw"], keys=["*"],
                       commands=["+@all", "-dbsize"])
    app = Celery("admin-scale-acl", set_as_current=False)
    app.conf.update(broker_url="memory://",
                    singleton_redis_url=f"redis://viewer:viewer-pw@127.0.0.1:{server.port}/0")
    seen: list[admin.ScanProgress] = []

    assert len(list(admin.iter_locks(app, progress=seen.append))) == 5

    assert seen and {status.total for status in seen} == {None} and seen[-1].done


def test_locks_on_every_primary_of_a_cluster_are_yielded_with_progress(cluster: Topology) -> None:
    """On Redis Cluster each primary is walked in turn (its locks read through the Cluster
    client, in a round trip of their own); the total is every primary's DBSIZE."""
    cluster.flush()
    pipe = cluster.admin.pipeline(transaction=False)
    keys = []
    for task in TASKS:
        spec = LockSpec(task=task, ttl=3600.0)
        for n in range(30):
            keys.append(lock_key(task, n))
            pipe.set(keys[-1], lock_value(spec, f"{task}-id-{n}", "w1@scale-host"), px=3_600_000)
    for n in range(3000):
        pipe.set(f"cache:page:{n}", "x")
    pipe.execute()
    assert sum(1 for node in cluster.primaries() if node.scan(0, match=PREFIX + ":{*", count=10_000)[1]) > 1
    app = Celery("admin-scale-cluster", set_as_current=False)
    app.conf.update(broker_url="memory://", singleton_redis_url=cluster.url, singleton_stats=False)
    seen: list[admin.ScanProgress] = []

    assert sorted(lock.key for lock in admin.iter_locks(app, progress=seen.append)) == sorted(keys)

    total = sum(int(node.dbsize()) for node in cluster.primaries())
    assert seen[-1].done and seen[-1].scanned == seen[-1].total == total
    assert [status.done for status in seen].count(True) == 1
    assert sorted(lock.key for lock in admin.list_locks(app, task=TASKS[1])) == sorted(keys[30:])


# ----------------------------------------------------------------- the task filter


def test_the_task_filter_is_the_scans_match_pattern(make_redis: Callable[..., RedisServer]) -> None:
    server = make_redis()
    client = server.client()
    odd = fill(client, locks={ODD: 3, ODD_LOOKALIKE: 4, TASKS[0]: 10})[:3]

    with monitoring(server) as commands:
        found = admin.list_locks(app_for(server), task=ODD)

    assert sorted(lock.key for lock in found) == sorted(odd)
    scans = [args for args in commands if args[0].upper() == "SCAN"]
    assert scans, commands[:5]
    # The server filters: only the task's keys cross the network (glob characters escaped,
    # so "odd[x]" does not match the keys of "oddx").
    pattern = PREFIX + ":{" + ODD.replace("[", "\\[").replace("]", "\\]") + ":*"
    assert all(args[2:] == ["MATCH", pattern, "COUNT", str(_common.SCAN_COUNT)] for args in scans), scans
    assert not [args for args in commands if args[0].upper() == "KEYS"]
    # Only the task's three locks are read (besides the library's own records of the server).
    assert sorted(key for key in read_keys(commands) if key.startswith(PREFIX + ":{")) == sorted(odd)


# ----------------------------------------------------------------- streaming


def test_locks_and_counters_are_yielded_while_the_walk_goes_on(make_redis: Callable[..., RedisServer]) -> None:
    server = make_redis()
    client = server.client()
    fill(client, locks={TASKS[0]: 100, TASKS[1]: 100}, counters=100)
    app = app_for(server)

    for name, walk_of, expected in (
        ("locks", lambda seen: admin.iter_locks(app, progress=seen.append), 200),
        ("counters", lambda seen: admin.iter_counters(app, progress=seen.append), 100),
    ):
        seen: list[admin.ScanProgress] = []
        client.config_resetstat()
        walk = walk_of(seen)
        first = next(walk)
        at_first = scan_calls(client)
        assert not any(status.done for status in seen), f"{name}: the walk had ended at the first item"
        rest = list(walk)
        assert 1 + len(rest) == expected and first not in rest
        assert at_first < scan_calls(client), f"{name}: every SCAN call was made before the first item"
        assert seen[-1].done


def test_list_locks_keeps_its_order_and_iter_locks_yields_the_same(make_redis: Callable[..., RedisServer]) -> None:
    server = make_redis()
    fill(server.client(), locks={TASKS[1]: 30, TASKS[0]: 30}, others=5000)
    app = app_for(server)

    listed = admin.list_locks(app)
    assert [(lock.task, lock.holder.acquired_at or 0.0, lock.key) for lock in listed] == sorted(
        (lock.task, lock.holder.acquired_at or 0.0, lock.key) for lock in listed)
    assert sorted(lock.key for lock in admin.iter_locks(app)) == sorted(lock.key for lock in listed)
    assert [lock.key for lock in admin.list_locks(app, task=TASKS[0])] == [
        lock.key for lock in listed if lock.task == TASKS[0]]


def test_stale_locks_read_the_server_record_once_per_walk(make_redis: Callable[..., RedisServer]) -> None:
    """After a recovery window that closed (its opening in the server record, no window key),
    every lock is judged by the rule: the record and the window are read once per walk, and
    the server's clock once per read of a SCAN call's locks, never once per lock."""
    server = make_redis()
    client = server.client()
    fill(client, locks={TASKS[0]: 150, TASKS[1]: 150})
    seconds, micros = client.time()
    record = json.loads(client.get(f"{PREFIX}:server"))
    record["since_ms"] = seconds * 1000 + micros // 1000  # a window opened after the locks were taken
    client.set(f"{PREFIX}:server", json.dumps(record))
    app = app_for(server)
    assert len(admin.list_locks(app)) == 300  # the client's connection is made and checked

    with monitoring(server) as commands:
        found = admin.list_locks(app)
    assert len(found) == 300 and all(lock.stale for lock in found)  # none renewed since it opened
    names = [args[0].upper() for args in commands]
    assert [args for args in commands if args[:2] == ["GET", f"{PREFIX}:server"]] == [["GET", f"{PREFIX}:server"]]
    assert [args for args in commands if args[0].upper() == "EXISTS"] == [["EXISTS", f"{PREFIX}:recovery"]]
    assert 1 <= names.count("TIME") <= names.count("SCAN") + 1


# ----------------------------------------------------------------- slots


def test_slots_read_only_the_newest_claim_keys(make_redis: Callable[..., RedisServer]) -> None:
    """100 slots of 5 entries: ``--last 7`` reads the claims of the 2 newest slots (10 keys), not 500."""
    server = make_redis()
    client = server.client()
    start = datetime(2026, 12, 2, tzinfo=timezone.utc)
    pipe = client.pipeline(transaction=False)
    for k in range(100):
        at = start + timedelta(minutes=k)
        for entry in range(5):
            pipe.set(slot_key(PREFIX, f"entry-{entry}", at),
                     slot_claim_value(f"beat-{entry}", at.timestamp() + entry / 10, "sent"), px=3_600_000)
    pipe.execute()
    fill(client, locks={}, others=5000)

    with monitoring(server) as commands:
        history = admin.recent_slots(app_for(server), last=7)

    assert history.source == "claims"
    newest, second = (format(start + timedelta(minutes=k), "%Y-%m-%dT%H:%M:%SZ") for k in (99, 98))
    assert [(claim.slot, claim.entry) for claim in history.claims] == [
        (newest, f"entry-{entry}") for entry in (4, 3, 2, 1, 0)] + [
        (second, f"entry-{entry}") for entry in (4, 3)]
    read = [key for key in read_keys(commands) if key.startswith(PREFIX + ":{beat:")]
    assert sorted(read) == sorted(slot_key(PREFIX, f"entry-{entry}", start + timedelta(minutes=k))
                                  for k in (98, 99) for entry in range(5))


# ----------------------------------------------------------------- the CLI's progress line


def run_cli(redis_server: RedisServer, server: RedisServer, args: list[str], *,
            terminal: bool) -> tuple[subprocess.CompletedProcess[bytes], str]:
    """``celery -A ops_app singleton <args>`` on ``server``, stdout to a pipe and stderr to a
    pseudo-terminal (``terminal``) or a pipe; returns the result and what the terminal showed."""
    env = child_env(redis_server, CSB_OPS_SETTINGS=json.dumps({"singleton_redis_url": server.url(0)}))
    argv = [sys.executable, "-m", "celery", "-A", APP, "singleton", *args]
    if not terminal:
        return run_command(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=120), ""
    main, child = pty.openpty()
    shown: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:  # EIO: every end of the terminal is closed
                return
            if not data:
                return
            shown.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        result = run_command(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=child,
                             timeout=120)
    finally:
        os.close(child)
    reader.join(timeout=60)
    os.close(main)
    assert not reader.is_alive()
    return result, b"".join(shown).decode()


@pytest.mark.parametrize("args", [["locks"], ["locks", "--json"], ["stats", "--json"], ["slots"]])
def test_progress_shows_on_a_terminal_and_not_in_a_pipe(
    make_redis: Callable[..., RedisServer], redis_server: RedisServer, args: list[str],
) -> None:
    server = make_redis()
    keys = fill(server.client(), locks={TASKS[0]: 150}, counters=3)

    result, shown = run_cli(redis_server, server, args, terminal=True)
    assert result.returncode == 0, shown
    assert re.search(r"scanned ~[\d,]+ of [\d,]+ keys: [\d,]+ ", shown), shown
    assert shown.endswith("\r\x1b[K"), "the progress line is erased at the end"
    piped, _ = run_cli(redis_server, server, args, terminal=False)
    assert piped.returncode == 0, piped.stderr
    assert b"scanned" not in piped.stderr and b"\x1b" not in piped.stderr
    assert b"scanned" not in result.stdout and b"\x1b" not in result.stdout
    assert len(result.stdout.splitlines()) == len(piped.stdout.splitlines())

    out = result.stdout.decode()
    if args == ["locks", "--json"]:
        listed = json.loads(out)
        assert sorted(item["key"] for item in listed) == sorted(keys)
        assert out == json.dumps(listed, indent=2) + "\n", "printed item by item as json.dumps prints it whole"
    elif args == ["locks"]:
        header, *rows, blank, total = out.splitlines()
        assert header.split()[:2] == ["TASK", "KIND"] and blank == "" and total == "150 lock(s) held."
        assert sorted(row.split()[-1] for row in rows) == sorted(keys)
        # The first 100 rows size the columns: every row lines up with the header.
        assert {row.index(" run ") for row in rows} == {header.index("KIND") - 1}
