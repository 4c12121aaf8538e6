"""Admin tools on a large Redis: ``singleton locks``, ``stats`` and ``slots`` over a million keys.

Fills a throw-away redis-server with ``--keys`` keys: mostly other applications'
keys (no TTL), ``--locks`` task locks of five tasks written in the library's
own lock value format (``lock_value``; a tenth are publish-time claims, some
``:queued``, and ``--real`` of them taken with ``acquire`` itself), of which
``--rare`` belong to the task given to ``--task``; ``--slots`` beat slot
claims of ten entries without a beat history list (so ``slots`` reads the
claim keys); the counter hashes of the tasks and entries. Then times:

* the admin API, in a child process (``benchmarks/admin_app.py``):
  ``list_locks`` (all, and of one task), ``read_counters``, ``recent_slots``;
  where ``iter_locks`` exists, the time to its first lock; the SCAN calls,
  their mean server time and the commands of each call (``INFO commandstats``);
* the CLI as a subprocess (``celery -A admin_app singleton locks | locks
  --task | stats | slots``, stdout to a pipe), and the same CLI on an empty
  database: Python's and Celery's start-up, which every command pays.

``--before REF`` measures the library of git commit ``REF`` on the same
server too (its ``celery_singleton_beat/`` exported into a scratch directory),
for a before/after table. Each figure is the median of ``--rounds``.

Usage: python -m benchmarks.bench_admin [--keys N] [--locks N] [--rounds R] [--before REF]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import redis

from celery_singleton_beat.beat.claims import claim_value as slot_claim_value
from celery_singleton_beat.beat.entries import slot_key
from celery_singleton_beat.lease.holder import claim_value, lock_value
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.task.keys import beat_stats_key, task_stats_key

from .common import ROOT, Server, bench_cli, markdown_table, progress

PREFIX = "singleton"
#: The tasks holding most locks; ``RARE`` holds ``--rare`` of them (``locks --task``).
TASKS = ("bench.admin.sync_customer", "bench.admin.export", "bench.admin.report", "bench.admin.mail")
RARE = "bench.admin.rebuild"
ENTRIES = 10
#: Other applications' keys, by prefix: a cache, sessions, Celery results, a queue's jobs.
OTHERS = ("cache:page:", "session:", "celery-task-meta-", "jobs:item:")
LOCK_TTL_MS = 3_600_000
APP_FILE = Path(__file__).resolve().parent / "admin_app.py"
OPERATIONS = {
    "locks": ("locks", "`locks`"),
    "locks_task": ("locks --task", "`locks --task` (one task)"),
    "stats": ("stats", "`stats`"),
    "slots": ("slots", "`slots` (claim keys)"),
}


# --------------------------------------------------------------------------- filling


def fill(client: redis.Redis, keys: int, locks: int, rare: int, real: int, slots: int) -> dict[str, int]:
    """Write the keys; returns how many of each kind."""
    specs = {task: LockSpec(task=task, ttl=LOCK_TTL_MS / 1000, boot="bench0boot", live=True)
             for task in (*TASKS, RARE)}
    pipe = client.pipeline(transaction=False)
    written = {"locks": 0, "claims": 0, "real": 0, "slots": 0, "counters": 0}
    for i in range(locks - real):
        task = RARE if i < rare else TASKS[i % len(TASKS)]
        value = lock_value(specs[task], str(uuid.UUID(int=i)), f"w{i % 8}@bench-host-{i % 3}")
        key = f"{PREFIX}:{{{task}:{hashlib.sha256(str(i).encode()).hexdigest()}}}"
        if i % 10 == 5:
            value = claim_value(value, LOCK_TTL_MS / 1000)
            written["claims"] += 1
            if i % 20 == 5:
                key += ":queued"
        pipe.set(key, value, px=LOCK_TTL_MS)
        written["locks"] += 1
        if len(pipe) >= 1000:
            pipe.execute()
    pipe.execute()
    for i in range(real):  # through the library's own acquire (held until the server is thrown away)
        task = TASKS[i % len(TASKS)]
        key = f"{PREFIX}:{{{task}:{hashlib.sha256(f'real-{i}'.encode()).hexdigest()}}}"
        result = acquire(client, key, specs[task], str(uuid.uuid4()), node="w9@bench-real")
        if result.lease is None:
            raise RuntimeError(f"could not take {key}: {result}")
        written["real"] += 1
    start = datetime(2026, 12, 2, tzinfo=timezone.utc)
    for i in range(slots):
        at = start + timedelta(seconds=i // ENTRIES)
        pipe.set(slot_key(PREFIX, f"bench-entry-{i % ENTRIES}", at),
                 slot_claim_value(f"beat-{i % 2}", at.timestamp(), "sent"), px=LOCK_TTL_MS)
        written["slots"] += 1
    for task in (*TASKS, RARE):
        pipe.hset(task_stats_key(PREFIX, task), mapping={"acquired": 10, "skipped": 2, "released": 9})
        written["counters"] += 1
    for entry in range(ENTRIES):
        pipe.hset(beat_stats_key(PREFIX, f"bench-entry-{entry}"), mapping={"won": 5, "lost": 5})
        written["counters"] += 1
    pipe.execute()
    others = keys - int(client.dbsize())
    batch: dict[str, str] = {}
    for i in range(max(0, others)):
        batch[f"{OTHERS[i % len(OTHERS)]}{i:08d}"] = "x" * 16
        if len(batch) >= 1000:
            pipe.mset(batch)
            batch = {}
            if len(pipe) >= 20:
                pipe.execute()
    if batch:
        pipe.mset(batch)
    pipe.execute()
    written["others"] = max(0, others)
    written["total"] = int(client.dbsize())
    return written


# --------------------------------------------------------------------------- measuring


def export_library(ref: str, into: Path) -> Path:
    """``celery_singleton_beat/`` of git commit ``ref``, in ``into``; returns the directory to put on the path."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "celery_singleton_beat"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def child_env(library: Path, scratch: Path, url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(library), str(scratch)])
    env["BENCH_ADMIN_REDIS"] = url
    return env


def measure_api(library: Path, scratch: Path, url: str) -> dict[str, Any]:
    """One round of the admin API calls (``admin_app.py``), in a child process."""
    out = subprocess.run([sys.executable, str(scratch / "admin_app.py"), "--task", RARE, "--rounds", "1"],
                         env=child_env(library, scratch, url), cwd=scratch, capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"admin_app.py failed:\n{out.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(out.stdout)
    if not report["library"].startswith(str(library)):
        raise RuntimeError(f"measured {report['library']}, not the library in {library}")
    return report


def cli_commands() -> dict[str, list[str]]:
    commands = {name: args.split() for name, (args, _) in OPERATIONS.items()}
    commands["locks_task"] = ["locks", "--task", RARE]
    commands["empty"] = ["locks"]
    return commands


def measure_cli(library: Path, scratch: Path, url: str, args: list[str]) -> dict[str, Any]:
    """One run of ``celery -A admin_app singleton <args>`` (stdout to a pipe): seconds, lines printed."""
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "admin_app", "singleton", *args],
                         env=child_env(library, scratch, url), cwd=scratch,
                         stdin=subprocess.DEVNULL, capture_output=True, timeout=1800)
    seconds = time.perf_counter() - started
    if out.returncode != 0:
        raise RuntimeError(f"singleton {' '.join(args)} exited {out.returncode}:\n{out.stderr.decode()[-3000:]}")
    return {"seconds": seconds, "stdout_lines": out.stdout.count(b"\n")}


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The first round's figures, with the median, min and max of ``seconds`` (and ``first_seconds``)."""
    merged = dict(rounds[0])
    for field in ("seconds", "first_seconds"):
        values = [one[field] for one in rounds if one.get(field) is not None]
        if values:
            merged[field] = statistics.median(values)
            merged[f"{field}_min"], merged[f"{field}_max"] = min(values), max(values)
    return merged


def run(keys: int, locks: int, rare: int, real: int, slots: int, rounds: int, before: str = "") -> dict[str, Any]:
    """Fill a server, then measure the library of ``before`` (if given) and the current one on it,
    the versions taking turns in each round (the machine's load drifts)."""
    if locks > keys or rare > locks - real:
        raise ValueError("need keys >= locks and rare <= locks - real")
    server = Server()
    scratch = Path(tempfile.mkdtemp(prefix="csb-bench-admin-"))
    try:
        shutil.copy(APP_FILE, scratch / "admin_app.py")
        client = server.client(0)
        progress(f"admin: filling {keys:,} keys ({locks:,} locks, {slots:,} slot claims)")
        started = time.perf_counter()
        written = fill(client, keys, locks, rare, real, slots)
        fill_seconds = time.perf_counter() - started
        versions: dict[str, Path] = {}
        if before:
            versions[f"before ({before})"] = export_library(before, scratch / "before")
        versions["current"] = ROOT
        url, empty_url = f"{server.url}/0", f"{server.url}/1"
        api: dict[str, list[dict[str, Any]]] = {label: [] for label in versions}
        cli: dict[str, dict[str, list[dict[str, Any]]]] = {label: {} for label in versions}
        for round_ in range(rounds):
            for label, library in versions.items():
                progress(f"admin: round {round_ + 1}/{rounds}, {label}")
                api[label].append(measure_api(library, scratch, url))
                for name, args in cli_commands().items():
                    cli[label].setdefault(name, []).append(
                        measure_cli(library, scratch, empty_url if name == "empty" else url, args))
        measured = {label: {"api": {name: _median([one[name] for one in api[label]]) for name in OPERATIONS},
                            "cli": {name: _median(runs) for name, runs in cli[label].items()}}
                    for label in versions}
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return {"keys": keys, "locks": locks, "rare": rare, "slots": slots, "rounds": rounds, "written": written,
            "fill_seconds": round(fill_seconds, 1), "versions": measured}


# --------------------------------------------------------------------------- report


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(report: dict[str, Any]) -> str:
    headers = ["code", "operation", "found", "API s", "first lock s", "SCAN calls", "us per SCAN",
               "commands", "CLI s"]
    rows = []
    for label, measured in report["versions"].items():
        api, cli = measured["api"], measured["cli"]
        for name, (_, title) in OPERATIONS.items():
            one = api[name]
            rows.append([label, title, f"{one['found']:,}", _s(one["seconds"]), _s(one.get("first_seconds")),
                         f"{one['scan_calls']:,}", f"{one['scan_usec_per_call']:,}", f"{one['commands']:,}",
                         _s(cli[name]["seconds"])])
        rows.append([label, "CLI on an empty database (start-up)", "0", "-", "-", "-", "-", "-",
                     _s(cli["empty"]["seconds"])])
    written = report["written"]
    return (markdown_table(headers, rows)
            + f"\n\n{written['total']:,} keys: {written['locks'] + written['real']:,} locks "
              f"({written['claims']:,} claims, {written['real']:,} taken with acquire; {report['rare']:,} of "
              f"the task given to --task), {written['slots']:,} slot claims, {written['counters']:,} counter "
              f"hashes, {written['others']:,} other keys (filled in {report['fill_seconds']} s). Median of "
              f"{report['rounds']} round(s); CLI times include Python's and Celery's start-up (the empty "
              "database row).")


def main(argv: list[str] | None = None) -> int:
    return bench_cli(__doc__, run, table, argv, keys=1_000_000, locks=10_000, rare=10, real=200, slots=1_000,
                     rounds=3, before="")


if __name__ == "__main__":
    sys.exit(main())
