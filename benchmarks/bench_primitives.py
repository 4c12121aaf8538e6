"""Lock primitives: acquire/release pairs per second against the server's limits.

Three rates on one private redis-server, interleaved over rounds:

* ``redis-benchmark SET`` (one client, no pipelining): what one connection can do;
  an acquire/release pair costs two round trips, so half this rate is the ceiling;
* redis-py's ``Lock`` acquire/release pairs (token + Lua release), for reference;
* this library's ``acquire`` + ``Lease.release`` pairs (with counters).

Usage: python -m benchmarks.bench_primitives [--pairs N] [--rounds R]
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from typing import Any

from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec

from .common import Server, bench_cli, markdown_table, progress, summary


def redis_benchmark_set(server: Server, requests: int) -> float:
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return float("nan")
    out = subprocess.run(
        [binary, "-h", "127.0.0.1", "-p", str(server.port), "-c", "1", "-n", str(requests), "-t", "set", "-q"],
        capture_output=True, text=True, check=True,
    ).stdout
    # "SET: 12345.67 requests per second, p50=0.055 msec"
    match = re.search(r"SET: ([\d.]+) requests per second", out.replace("\r", "\n"))
    return float(match.group(1)) if match else float("nan")


def redis_py_lock_pairs(server: Server, pairs: int) -> float:
    client = server.client()
    started = time.perf_counter()
    for i in range(pairs):
        lock = client.lock(f"bench:pylock:{i}", timeout=60)
        lock.acquire(blocking=False)
        lock.release()
    return pairs / (time.perf_counter() - started)


def singleton_pairs(server: Server, pairs: int) -> float:
    client = server.client()
    spec = LockSpec(task="t", ttl=60, stats_key="bench:{stats}:task:t")
    started = time.perf_counter()
    for i in range(pairs):
        key = f"bench:{{t:{i}}}"
        lease = acquire(client, key, spec, str(i)).lease
        assert lease is not None
        lease.release()
    return pairs / (time.perf_counter() - started)


def run(pairs: int, rounds: int) -> dict[str, Any]:
    server = Server()
    rates: dict[str, list[float]] = {"redis-benchmark SET (ops/s)": [], "redis-py Lock pairs/s": [],
                                     "SingletonTask lease pairs/s": []}
    try:
        for r in range(rounds):
            progress(f"primitives round {r + 1}/{rounds}")
            rates["redis-benchmark SET (ops/s)"].append(redis_benchmark_set(server, pairs * 2))
            rates["redis-py Lock pairs/s"].append(redis_py_lock_pairs(server, pairs))
            rates["SingletonTask lease pairs/s"].append(singleton_pairs(server, pairs))
    finally:
        server.stop()
    result = {name: summary(values) for name, values in rates.items()}
    set_rate = result["redis-benchmark SET (ops/s)"]["median"]
    return {"pairs": pairs, "rounds": rounds, "rates": result,
            "pair_ceiling": set_rate / 2,
            "ratio_to_ceiling": result["SingletonTask lease pairs/s"]["median"] / (set_rate / 2),
            "ratio_to_redis_py_lock": (result["SingletonTask lease pairs/s"]["median"]
                                       / result["redis-py Lock pairs/s"]["median"])}


def table(report: dict[str, Any]) -> str:
    rows = [[name, f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f})"] for name, s in report["rates"].items()]
    rows.append(["ceiling for pairs (SET rate / 2)", f"{report['pair_ceiling']:.0f}"])
    rows.append(["lease pairs / ceiling", f"{report['ratio_to_ceiling']:.2f}"])
    rows.append(["lease pairs / redis-py Lock pairs", f"{report['ratio_to_redis_py_lock']:.2f}"])
    return markdown_table(["measure", "median (min-max)"], rows)


def main(argv: list[str] | None = None) -> int:
    return bench_cli(__doc__, run, table, argv, pairs=20000, rounds=3)


if __name__ == "__main__":
    sys.exit(main())
