"""The performance targets of the lock, judged from one run's reports.

``benchmarks.run_all`` puts this summary at the top of ``benchmarks/results.md``
when ``bench_instructions`` and/or ``bench_peers`` ran: one row per server,
each figure a ratio to plain Celery on the same server, measured side by side
in the same run, with its target and whether it is met.

The targets (set for Redis 7.0 and Valkey 9; the other Redis
versions are held to Redis 7.0's):

* Redis instructions per task (callgrind, no-op task, fresh keys):
  <= 1.6x plain on Redis, <= 1.4x on Valkey 9; ``acks_late`` tasks <= 1.8x / 1.5x;
* Redis server CPU per task (timed, INFO ``used_cpu_sys + used_cpu_user``): <= 1.35x plain;
* worker instructions per task: <= 1.07x plain, beside celery-singleton and celery-once.
"""

from __future__ import annotations

import re
from typing import Any

from .common import markdown_table

__all__ = ["CPU_TARGET", "WORKER_TARGET", "redis_targets", "summary_table"]

#: Redis server CPU per task, ours over plain (timed).
CPU_TARGET = 1.35
#: Worker instructions per task, ours over plain (callgrind).
WORKER_TARGET = 1.07


def redis_targets(label: str) -> tuple[float, float]:
    """Redis instructions per task over plain: (default mode, ``acks_late``) for server ``label``."""
    match = re.match(r"(\w+) (\d+)", label)
    if match and match.group(1) == "Valkey" and int(match.group(2)) >= 9:
        return 1.4, 1.5
    return 1.6, 1.8


def _judged(ratio: float | None, target: float | None) -> str:
    if ratio is None:
        return "-"
    if target is None:
        return f"{ratio:.2f}x"
    return f"{ratio:.2f}x (<= {target:.2f}x: {'met' if ratio <= target + 1e-9 else 'NOT met'})"


def _instructions(report: dict[str, Any] | None, server: str, variant: str, key: str) -> float | None:
    data = ((report or {}).get("servers", {}).get(server, {}).get("variants", {}).get(variant, {}))
    value = data.get(key)
    return float(value) if value is not None else None


def _cpu(report: dict[str, Any] | None, server: str, variant: str) -> float | None:
    data = ((report or {}).get("servers", {}).get(server, {}).get("variants", {}).get(variant, {}))
    value = data.get("redis_cpu_us_per_task_ratio_to_plain")
    return float(value) if value is not None else None


def summary_table(instructions: dict[str, Any] | None, peers: dict[str, Any] | None) -> str:
    """The targets' table for the servers of either report (skipped servers listed as such)."""
    servers: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for report in (instructions, peers):
        for name, data in (report or {}).get("servers", {}).items():
            if "label" in data:
                servers.setdefault(name, data["label"])
            else:
                skipped.setdefault(name, data.get("skipped", "not run"))
    rows = []
    for name, label in servers.items():
        redis_target, late_target = redis_targets(label)
        rows.append([
            label,
            _judged(_instructions(instructions, name, "ours", "redis_ratio"), redis_target),
            _judged(_instructions(instructions, name, "ours_acks_late", "redis_ratio"), late_target),
            _judged(_cpu(peers, name, "ours"), CPU_TARGET),
            _judged(_cpu(peers, name, "ours_acks_late"), None),
            _judged(_instructions(instructions, name, "ours", "worker_ratio"), WORKER_TARGET),
            _judged(_instructions(instructions, name, "ours_acks_late", "worker_ratio"), None),
            _judged(_instructions(instructions, name, "celery_singleton", "worker_ratio"), None),
            _judged(_instructions(instructions, name, "celery_once", "worker_ratio"), None),
        ])
    for name, why in skipped.items():
        if name not in servers:
            rows.append([name, f"skipped: {why}", *[""] * 7])
    headers = ["server", "Redis instructions/task, ours", "Redis instructions/task, ours acks_late",
               "Redis CPU/task, ours", "Redis CPU/task, ours acks_late", "worker instructions/task, ours",
               "worker, ours acks_late", "worker, celery-singleton", "worker, celery-once"]
    return "\n".join([
        "Each figure: ours (or a peer) over plain Celery on the same server, measured side by side in this "
        "run. Instructions: `bench_instructions` (callgrind, no-op tasks, fresh keys); Redis CPU: "
        "`bench_peers` (timed, INFO used_cpu_sys + used_cpu_user, medians). The project's targets: "
        "Redis instructions <= 1.6x plain on Redis (set for 7.0; 6.2 and 8.2 held "
        "to it) and <= 1.4x on Valkey 9, acks_late <= 1.8x / 1.5x; Redis CPU <= 1.35x; worker instructions "
        "<= 1.07x, at or below celery-singleton and celery-once.",
        "",
        markdown_table(headers, rows),
    ])
