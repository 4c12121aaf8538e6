"""Memory: nothing the library writes outlives its TTL.

Takes and releases the lease of N distinct task keys (what N singleton runs
write: lock, fencing counter, counter hash) and claims M beat slots, then
reports Redis ``used_memory`` and the key count at the start, right after, and
once the TTLs have passed. Run leases use a short ``lock_ttl``; slot claims
live period + margin. What may stay is what docs/monitoring.md lists as
long-lived (:data:`LONG_LIVED`): the task's counter hash (30 days after its
last update) and ``<prefix>:server`` (one key, never expires); any other key
left once the count has come down fails the benchmark.

Usage: python -m benchmarks.bench_memory [--runs N] [--slots M]
"""

from __future__ import annotations

import sys
import time
from typing import Any

import redis

from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.records import server_key
from celery_singleton_beat.task.keys import task_stats_key

from .common import Server, bench_cli, markdown_table, progress, wait_until

PREFIX = "singleton"
LOCK_TTL = 2.0
#: The keys of a pass that outlive its TTLs by design (docs/monitoring.md, "Keys").
LONG_LIVED = frozenset({task_stats_key(PREFIX, "bench.job"), server_key(PREFIX)})


def snapshot(client: redis.Redis) -> dict[str, int]:
    return {"used_memory": int(client.info("memory")["used_memory"]), "keys": int(client.dbsize())}


def write_runs(client: redis.Redis, runs: int) -> None:
    spec = LockSpec(task="bench.job", ttl=LOCK_TTL, stats_key=task_stats_key(PREFIX, "bench.job"))
    pipe_every = 1000
    for i in range(runs):
        lease = acquire(client, f"{PREFIX}:{{bench.job:{i:064x}}}", spec, str(i)).lease
        assert lease is not None
        lease.release()
        if i and i % (pipe_every * 20) == 0:
            progress(f"  {i} runs")


def write_slots(client: redis.Redis, slots: int, ttl_ms: int) -> None:
    """Claim ``slots`` beat slots the way the scheduler does (SET NX PX)."""
    pipe = client.pipeline(transaction=False)
    for i in range(slots):
        pipe.set(f"{PREFIX}:{{beat:bench-entry-{i % 100}}}:{1_700_000_000 + i}", "bench", nx=True, px=ttl_ms)
        if len(pipe) >= 1000:
            pipe.execute()
    pipe.execute()


def one_pass(client: redis.Redis, runs: int, slots: int, slot_ttl: float, baseline_keys: int) -> dict[str, Any]:
    progress(f"memory: {runs} distinct runs, {slots} beat slots")
    write_runs(client, runs)
    write_slots(client, slots, int(slot_ttl * 1000))
    peak = snapshot(client)
    started = time.monotonic()
    # Everything but the long-lived keys must expire.
    wait_until(lambda: client.dbsize() <= baseline_keys + len(LONG_LIVED), 120, "keys to expire")
    left = {key.decode() for key in client.scan_iter(count=1000)} - LONG_LIVED
    if len(left) > baseline_keys:
        raise RuntimeError(f"keys left after their TTLs: {sorted(left)[:10]}")
    return {"peak": peak, "after_ttl": snapshot(client), "seconds_to_expire": round(time.monotonic() - started, 1)}


def run(runs: int, slots: int, slot_ttl: float) -> dict[str, Any]:
    """Two identical passes: the second must end where the first did (nothing accumulates)."""
    server = Server()
    client = server.client()
    try:
        baseline = snapshot(client)
        passes = [one_pass(client, runs, slots, slot_ttl, baseline["keys"]) for _ in range(2)]
    finally:
        server.stop()
    return {"runs": runs, "slots": slots, "baseline": baseline, "passes": passes,
            "growth_between_passes": passes[1]["after_ttl"]["used_memory"] - passes[0]["after_ttl"]["used_memory"]}


def table(report: dict[str, Any]) -> str:
    rows = [["baseline", report["baseline"]["keys"], f"{report['baseline']['used_memory'] / 1024:.0f}", ""]]
    for i, one in enumerate(report["passes"], 1):
        rows.append([f"pass {i} peak", one["peak"]["keys"], f"{one['peak']['used_memory'] / 1024:.0f}", ""])
        rows.append([f"pass {i} after TTLs", one["after_ttl"]["keys"],
                     f"{one['after_ttl']['used_memory'] / 1024:.0f}", one["seconds_to_expire"]])
    return (markdown_table(["moment", "keys", "used_memory KiB", "s to expire"], rows)
            + f"\n\nEach pass: {report['runs']} distinct runs and {report['slots']} beat slots. "
              f"used_memory growth from pass 1 to pass 2 after TTLs: {report['growth_between_passes'] / 1024:.0f} KiB.")


def main(argv: list[str] | None = None) -> int:
    return bench_cli(__doc__, run, table, argv, runs=100_000, slots=10_000, slot_ttl=5.0)


if __name__ == "__main__":
    sys.exit(main())
