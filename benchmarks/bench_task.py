"""Task overhead: plain Task vs SingletonTask through one solo worker, same run.

N no-op tasks with distinct arguments are queued, then one solo worker drains
them; throughput is measured inside the worker (first start to last end).
Variants run interleaved (A B C, B C A, ...: the order rotates from one round to
the next) and are reported as medians with min/max, plus the Redis commands each
task added on the lock server (INFO commandstats delta on a separate
redis-server that holds only the locks), and the time each task added to
plain's of the same round (1/rate - 1/plain's rate, median over the rounds).

* ``plain``, ``singleton``, ``singleton_until_executed``: results ignored (no
  one sees a run's end: the release's reply is read with the next acquire);
* ``plain_result``, ``singleton_result``: the result stored (the broker's
  server, db 2); the singleton run waits for its release's reply before
  Celery stores it. ``*_result`` variants compare to ``plain_result``.

Usage: python -m benchmarks.bench_task [--tasks N] [--rounds R] [--variants ...]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import Server, bench_cli, bench_env, markdown_table, progress, start_celery, summary, wait_until

VARIANTS = ("plain", "singleton", "singleton_until_executed", "plain_result", "singleton_result")


def baseline(variant: str) -> str:
    """The plain variant a variant is compared to: the same result handling."""
    return "plain_result" if variant.endswith("_result") else "plain"


def one_round(variant: str, tasks: int, broker: Server, locks: Server, log: Path) -> dict[str, float]:
    env = bench_env(BENCH_BROKER=broker.url, BENCH_LOCKS=locks.url)
    os.environ.update(BENCH_BROKER=broker.url, BENCH_LOCKS=locks.url)
    from . import task_app

    records = broker.client(3)
    records.flushdb()
    broker.client(2).flushdb()  # the stored results of the previous round
    task = getattr(task_app, variant)
    for i in range(tasks):  # queue everything first: the worker is not running yet
        task.apply_async((i, tasks), queue=f"bench-{variant}")
    calls_before = locks.command_calls()
    worker = start_celery(["-A", "benchmarks.task_app", "worker", "-P", "solo", "-Q", f"bench-{variant}",
                           "-l", "warning", "--without-gossip", "--without-mingle", "--without-heartbeat"],
                          env, None, log)
    try:
        wait_until(lambda: records.get("last"), 600, f"{tasks} {variant} tasks")
    finally:
        worker.stop(timeout=30)
    seconds = float(records.get("last")) - float(records.get("first"))
    # Publish-time claims (until_executed) happen before calls_before: this is the worker's side.
    trips_after, commands_after = locks.command_calls()
    return {"tasks_per_s": tasks / seconds,
            "lock_round_trips_per_task": (trips_after - calls_before[0]) / tasks,
            "lock_commands_per_task": (commands_after - calls_before[1]) / tasks}


def run(tasks: int, rounds: int, variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    variants = tuple(dict.fromkeys([*{baseline(v): None for v in variants}, *variants]))
    broker, locks = Server(), Server()
    log = Path(tempfile.mkstemp(prefix="csb-bench-worker-", suffix=".log")[1])
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    try:
        for r in range(rounds):
            for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
                progress(f"round {r + 1}/{rounds}: {variant} x {tasks}")
                results[variant].append(one_round(variant, tasks, broker, locks, log))
    finally:
        broker.stop()
        locks.stop()
        log.unlink(missing_ok=True)
    report: dict[str, Any] = {"tasks": tasks, "rounds": rounds, "variants": {}}
    for variant in variants:
        base = results[baseline(variant)]
        plain = summary([x["tasks_per_s"] for x in base])["median"]
        rates = summary([x["tasks_per_s"] for x in results[variant]])
        report["variants"][variant] = {
            "baseline": baseline(variant),
            "tasks_per_s": rates, "ratio_to_plain": rates["median"] / plain,
            # per round: this variant's time per task minus its plain's in the same round
            "added_us_per_task": summary([1e6 / x["tasks_per_s"] - 1e6 / b["tasks_per_s"]
                                          for x, b in zip(results[variant], base, strict=True)]),
            "lock_round_trips_per_task": summary([x["lock_round_trips_per_task"] for x in results[variant]]),
            "lock_commands_per_task": summary([x["lock_commands_per_task"] for x in results[variant]]),
        }
    return report


def table(report: dict[str, Any]) -> str:
    rows = []
    for variant, data in report["variants"].items():
        rate = data["tasks_per_s"]
        added = data["added_us_per_task"]
        rows.append([variant, f"{rate['median']:.0f} ({rate['min']:.0f}-{rate['max']:.0f})",
                     f"{data['ratio_to_plain']:.3f} ({data['baseline']})",
                     "-" if variant == data["baseline"] else
                     f"{added['median']:+.0f} ({added['min']:+.0f} to {added['max']:+.0f})",
                     f"{data['lock_round_trips_per_task']['median']:.2f}",
                     f"{data['lock_commands_per_task']['median']:.2f}"])
    return markdown_table(["task", "tasks/s median (min-max)", "ratio to plain",
                           "us/task added (same round, median, min to max)",
                           "lock requests/task", "Redis commands/task (incl. inside Lua)"], rows) + (
        "\n\nLock requests are the commands the worker sent to the lock server (acquire and release). "
        "A run whose end nobody sees (results ignored) waits only for the acquire on standalone Redis: "
        "the release is written at once and its reply read with the next acquire (one blocking round "
        "trip per run); a run whose result is stored (`*_result`) also waits for the release's reply "
        "before Celery stores the result (two).")


def main(argv: list[str] | None = None) -> int:
    return bench_cli(__doc__, run, table, argv, tasks=2000, rounds=3, variants=VARIANTS)


if __name__ == "__main__":
    sys.exit(main())
