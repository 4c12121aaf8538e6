"""The app and the admin API timings of ``bench_admin``, run in a child process.

Imports only the library, Celery and redis-py (no ``benchmarks`` module):
``bench_admin`` copies this file into a scratch directory and runs it with the
library of the version it measures first on ``PYTHONPATH`` (the current tree,
or the code of a git commit for ``--before``). ``celery -A admin_app singleton
...`` uses the same ``app``.

As a script: ``python admin_app.py --task NAME --rounds R`` prints a JSON
report of the admin API calls, each timed ``R`` times, with the Redis commands
the first of each cost (``INFO commandstats``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

URL = os.environ.get("BENCH_ADMIN_REDIS", "redis://127.0.0.1:6379/0")

app = Celery("bench_admin", broker="memory://")
app.conf.update(singleton_redis_url=URL)


def commandstats(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """``command -> (calls, usec)`` from ``INFO commandstats``."""
    return {name[len("cmdstat_"):]: (int(v["calls"]), int(v["usec"]))
            for name, v in client.info("commandstats").items()}


def cost(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """What ran between two :func:`commandstats`: SCAN calls and their server time, every command."""
    delta = {name: (calls - before.get(name, (0, 0))[0], usec - before.get(name, (0, 0))[1])
             for name, (calls, usec) in after.items() if name != "info"}
    scans, scan_usec = delta.get("scan", (0, 0))
    return {"scan_calls": scans, "scan_usec_per_call": round(scan_usec / scans) if scans else 0,
            "keys_calls": delta.get("keys", (0, 0))[0], "commands": sum(calls for calls, _ in delta.values())}


def measure(call: Callable[[], Any], size: Callable[[Any], int], rounds: int,
            client: redis.Redis) -> dict[str, Any]:
    seconds: list[float] = []
    found = 0
    spent: dict[str, Any] = {}
    for round_ in range(rounds):
        before = commandstats(client) if round_ == 0 else {}
        started = time.perf_counter()
        result = call()
        seconds.append(time.perf_counter() - started)
        if round_ == 0:
            spent = cost(before, commandstats(client))
            found = size(result)
    return {"seconds": statistics.median(seconds), "found": found, **spent}


def first_of(make: Callable[[], Any]) -> Callable[[], float | None]:
    """Seconds until an iterator's first item (None when it has none)."""
    def call() -> float | None:
        started = time.perf_counter()
        walk = make()
        try:
            next(walk)
        except StopIteration:
            return None
        finally:
            close = getattr(walk, "close", None)
            if close is not None:
                close()
        return time.perf_counter() - started
    return call


def main(argv: list[str] | None = None) -> int:
    from celery_singleton_beat import admin

    parser = argparse.ArgumentParser()
    parser.add_argument("--task", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    client = redis.Redis.from_url(URL)
    admin.list_locks(app, task="bench.warm-up")  # the client made, the settings read
    report: dict[str, Any] = {"library": os.path.dirname(admin.__file__)}
    report["locks"] = measure(lambda: admin.list_locks(app), len, args.rounds, client)
    report["locks_task"] = measure(lambda: admin.list_locks(app, task=args.task), len, args.rounds, client)
    report["stats"] = measure(lambda: admin.read_counters(app), lambda c: len(c.tasks) + len(c.beat_entries),
                              args.rounds, client)
    report["slots"] = measure(lambda: admin.recent_slots(app, last=20), lambda h: len(h.claims), args.rounds,
                              client)
    streaming = getattr(admin, "iter_locks", None)
    if streaming is not None:  # the first lock, before the walk ends
        for name, kwargs in (("locks", {}), ("locks_task", {"task": args.task})):
            firsts = [first_of(lambda kw=kwargs: streaming(app, **kw))() for _ in range(args.rounds)]
            known = [s for s in firsts if s is not None]
            report[name]["first_seconds"] = statistics.median(known) if known else None
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
