"""Killed pool child: how long until its key runs again (one-process prefork pool).

Each round: a run of key ``k<i>`` holds its lock (300 s lease) on the only
pool process; a second message of the same key waits behind it in the worker;
the benchmark SIGKILLs the pool child and times, from the kill:

* ``noticed``: the main process reports the child's exit (billiard's
  ``Process ... exited with 'signal 9 (SIGKILL)'`` line);
* ``freed``: the main process freed the dead run's lock (``SingletonRequest``);
* ``child_ready``: the replacement pool process is ready (``worker_process_init``);
* ``runs_again``: the waiting message's body starts, holding the key.

A waiting message that still found the lock held would be skipped: the
benchmark then publishes again until one runs and counts the skips.

Celery notices a dead child through the child's sentinel pipe, which closes a
moment before the child can be reaped; when its check loses that race it looks
again at its periodic pool check (Celery: every 5 s; the singleton worker step:
every ``POOL_CHECK_INTERVAL``). Each round kills at a random moment, 0-5 s after
the waiting message arrived, so both paths are sampled: see the mean, the max
and the rounds over 1 s, not only the median.

Usage: python -m benchmarks.bench_child_kill [--rounds R]
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import Server, bench_cli, bench_env, markdown_table, progress, start_celery, summary, wait_until

STAGES = ("noticed", "freed", "child_ready", "runs_again")


def _log_time(log: Path, *parts: str) -> float | None:
    """``%(created)`` of the first worker log line containing every one of ``parts``."""
    for line in log.read_text(errors="replace").splitlines():
        if all(part in line for part in parts):
            match = re.match(r"(\d+\.\d+) ", line)
            if match:
                return float(match.group(1))
    return None


def one_round(i: int, pause: float, app: Any, server: Server, log: Path) -> dict[str, float]:
    records = server.client(3)
    key = f"k{i}"
    first = app.hold.delay(key, 300)
    wait_until(lambda: records.llen(f"start:{key}") == 1, 60, f"the first run of {key}")
    pid = json.loads(records.lindex(f"start:{key}", 0))["pid"]
    waiting = app.hold.delay(key, 0)
    wait_until(lambda: _log_time(log, f"[{waiting.id}] received"), 60, "the second message received")
    # Celery's own periodic pool check runs every 5 s: kill at a random phase of it.
    time.sleep(pause)
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    skips = 0
    while True:
        wait_until(lambda waiting=waiting: records.llen(f"start:{key}") >= 2
                   or _log_time(log, f"[{waiting.id}]", "skipped"),
                   60, f"{key} to run again")
        if records.llen(f"start:{key}") >= 2:
            break
        skips += 1
        waiting = app.hold.delay(key, 0)
    again = json.loads(records.lindex(f"start:{key}", 1))["t"]
    ready = [json.loads(x) for x in records.lrange("child_ready", 0, -1)]
    child_ready = min(e["t"] for e in ready if e["t"] >= killed_at)
    noticed = wait_until(lambda: _log_time(log, f"pid:{pid} exited"), 30, "the exit line")
    freed = wait_until(lambda: _log_time(log, f"[{first.id}]", "freed its lock"), 30, "the freed line")
    return {"noticed": noticed - killed_at, "freed": freed - killed_at,
            "child_ready": child_ready - killed_at, "runs_again": again - killed_at, "skips": skips}


def run(rounds: int) -> dict[str, Any]:
    server = Server()
    os.environ["BENCH_BROKER"] = server.url
    from . import child_kill_app

    log = Path(tempfile.mkstemp(prefix="csb-bench-child-kill-", suffix=".log")[1])
    worker = start_celery(["-A", "benchmarks.child_kill_app", "worker", "-P", "prefork", "-c", "1",
                           "-l", "info", "-n", "kill@%h", "--without-gossip", "--without-mingle",
                           "--without-heartbeat"],
                          bench_env(BENCH_BROKER=server.url), "ready.", log)
    rows: list[dict[str, float]] = []
    try:
        pauses = random.Random(rounds)
        for i in range(rounds):
            progress(f"child kill round {i + 1}/{rounds}")
            rows.append(one_round(i, pauses.uniform(0.0, 5.0), child_kill_app, server, log))
    finally:
        worker.stop(timeout=30)
        server.stop()
        log.unlink(missing_ok=True)
    report: dict[str, Any] = {"rounds": rounds, "skips": sum(row["skips"] for row in rows),
                              "rows": rows}
    for stage in STAGES:
        values = [row[stage] for row in rows]
        report[stage] = {**summary(values), "mean": statistics.mean(values),
                         "over_1s": sum(value > 1.0 for value in values)}
    return report


def table(report: dict[str, Any]) -> str:
    rows = [[stage, f"{report[stage]['median']:.3f}", f"{report[stage]['mean']:.3f}",
             f"{report[stage]['min']:.3f}", f"{report[stage]['max']:.3f}", report[stage]["over_1s"]]
            for stage in STAGES]
    return (markdown_table(["seconds after the SIGKILL", "median", "mean", "min", "max", "rounds over 1 s"], rows)
            + f"\n\n{report['rounds']} rounds; waiting messages skipped (lock still held): {report['skips']}")


def main(argv: list[str] | None = None) -> int:
    return bench_cli(__doc__, run, table, argv, rounds=5)


if __name__ == "__main__":
    sys.exit(main())
