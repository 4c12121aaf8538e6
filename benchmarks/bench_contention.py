"""Contention: 8 pool processes, many submissions over few keys, plain vs singleton.

Counts runs, skips and overlaps (must be 0 for the singleton task) and reports
the time spent around the body per run (p50/p99), singleton minus plain being
the latency the lock adds.

Usage: python -m benchmarks.bench_contention [--submissions N] [--keys K] [--rounds R]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import Server, bench_cli, bench_env, markdown_table, progress, start_celery, summary, wait_until


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_round(variant: str, submissions: int, keys: int, server: Server, log: Path) -> dict[str, Any]:
    os.environ["BENCH_BROKER"] = server.url
    from . import contention_app

    records = server.client(3)
    server.flush(3, 2)
    task = getattr(contention_app, variant)
    worker = start_celery(["-A", "benchmarks.contention_app", "worker", "-P", "prefork", "-c", "8",
                           "-Q", f"contention-{variant}", "-l", "warning", "-n", f"{variant}@%h",
                           "--without-gossip", "--without-mingle", "--without-heartbeat"],
                          bench_env(BENCH_BROKER=server.url), None, log)
    try:
        order = random.Random(submissions)  # the same key sequence for every variant and round
        for _ in range(submissions):
            task.apply_async((f"key-{order.randrange(keys)}",), queue=f"contention-{variant}")
        wait_until(lambda: int(records.get(f"done:{task.name}") or 0) >= submissions, 600,
                   f"{submissions} {variant} tasks")
    finally:
        worker.stop(timeout=60)
    around = [json.loads(x) * 1000 for x in records.lrange(f"around:{task.name}", 0, -1)]
    runs = int(records.get(f"runs:{task.name}") or 0)
    return {"runs": runs, "skips": submissions - runs, "overlaps": int(records.get(f"overlap:{task.name}") or 0),
            "around_p50_ms": percentile(around, 0.5), "around_p99_ms": percentile(around, 0.99)}


def run(submissions: int, keys: int, rounds: int) -> dict[str, Any]:
    server = Server()
    log = Path(tempfile.mkstemp(prefix="csb-bench-contention-", suffix=".log")[1])
    results: dict[str, list[dict[str, Any]]] = {"plain": [], "singleton": []}
    try:
        for r in range(rounds):
            for variant in results:
                progress(f"contention round {r + 1}/{rounds}: {variant} x {submissions} over {keys} keys")
                results[variant].append(one_round(variant, submissions, keys, server, log))
    finally:
        server.stop()
        log.unlink(missing_ok=True)
    report: dict[str, Any] = {"submissions": submissions, "keys": keys, "rounds": rounds, "variants": {}}
    for variant, rows in results.items():
        report["variants"][variant] = {
            "runs": summary([row["runs"] for row in rows]),
            "skips": summary([row["skips"] for row in rows]),
            "overlaps_total": sum(row["overlaps"] for row in rows),
            "around_p50_ms": statistics.median(row["around_p50_ms"] for row in rows),
            "around_p99_ms": statistics.median(row["around_p99_ms"] for row in rows),
        }
    plain, single = report["variants"]["plain"], report["variants"]["singleton"]
    report["added_p50_ms"] = single["around_p50_ms"] - plain["around_p50_ms"]
    report["added_p99_ms"] = single["around_p99_ms"] - plain["around_p99_ms"]
    return report


def table(report: dict[str, Any]) -> str:
    rows = []
    for variant, data in report["variants"].items():
        rows.append([variant, f"{data['runs']['median']:.0f}", f"{data['skips']['median']:.0f}",
                     data["overlaps_total"], f"{data['around_p50_ms']:.2f}", f"{data['around_p99_ms']:.2f}"])
    text = markdown_table(["task", "runs (median)", "skips (median)", "overlaps (all rounds)",
                           "around body p50 ms", "around body p99 ms"], rows)
    return text + (f"\n\nAdded by the lock: p50 {report['added_p50_ms']:.2f} ms, "
                   f"p99 {report['added_p99_ms']:.2f} ms ({report['submissions']} submissions over "
                   f"{report['keys']} keys, 8 pool processes, {report['rounds']} rounds).")


def main(argv: list[str] | None = None) -> int:
    return bench_cli(__doc__, run, table, argv, submissions=1000, keys=10, rounds=3)


if __name__ == "__main__":
    sys.exit(main())
