"""What waiting for the release costs a run with followers (issue 21, point 2): figures, no assertions.

A real prefork worker of ``tests.apps.order_app`` on a redis-server of its own
(broker, results, locks), its locks either direct or through a
:class:`~tests.support.proxy.DelayProxy` (``--delay`` each way). Two figures:

* per-run latency, publish to result (``AsyncResult.get``), of a run without
  followers and of a run with a ``link=`` callback (a plain task), interleaved,
  median (p10-p90) over ``--runs`` runs each;
* a chain of ``--steps`` same-key steps, one worker: time per step, median over
  ``--rounds`` chains.

Through the proxy a blocking lock round trip costs 2 x delay, so (latency with
proxy - latency direct) / (2 x delay) is the number of blocking lock round trips
per run. Run it from a checkout's venv (``python -m tests.measure_release_wait``)
on two branches to compare; not part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from celery import chain

from tests.support import LOCK_DB, Owner, RedisServer, owning, start_worker
from tests.support.proxy import DelayProxy


def spread(values: list[float]) -> str:
    """Median (p10-p90) of seconds, in milliseconds."""
    ordered = sorted(values)
    p10, p90 = ordered[len(ordered) // 10], ordered[(len(ordered) * 9) // 10]
    return f"{statistics.median(ordered) * 1000:.2f} ({p10 * 1000:.2f}-{p90 * 1000:.2f})"


def per_run(order: Any, runs: int) -> dict[str, list[float]]:
    """Latency of a run without and with a ``link`` callback, interleaved."""
    timings: dict[str, list[float]] = {"no followers": [], "link callback": []}
    then = order.plain.si("after")
    for i in range(runs + 10):  # the first 10 of each warm up
        for variant, options in (("no followers", {}), ("link callback", {"link": then})):
            began = time.perf_counter()
            result = order.step.apply_async(("k",), {"note": str(i)}, **options)
            result.get(timeout=30)
            if i >= 10:
                timings[variant].append(time.perf_counter() - began)
    return timings


def per_chain(order: Any, steps: int, rounds: int) -> list[float]:
    """Seconds per step of a chain of ``steps`` same-key steps."""
    per_step = []
    for r in range(rounds + 1):  # the first warms up
        began = time.perf_counter()
        last = chain(*[order.step.si("c", note=str(n)) for n in range(steps)]).apply_async()
        last.get(timeout=120)
        if r:
            per_step.append((time.perf_counter() - began) / steps)
    return per_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.01, help="one way, seconds")
    args = parser.parse_args(argv)
    rows = []
    with owning(Owner("measure")) as owner:
        try:
            server = RedisServer(name="measure-redis").start()
            os.environ["CSB_TEST_REDIS"] = f"redis://127.0.0.1:{server.port}"
            from tests.apps import order_app as order

            for path in ("direct", "proxy"):
                server.flushall()
                lock_url = server.url(LOCK_DB)
                if path == "proxy":
                    lock_url = DelayProxy(server.port, args.delay, name="measure-proxy").start().url(LOCK_DB)
                worker = start_worker(server, "tests.apps.order_app", f"measure-{path}", concurrency=2,
                                      env={"CSB_LOCK_REDIS": lock_url})
                label = "direct" if path == "direct" else f"proxy {args.delay * 1000:g} ms each way"
                for variant, values in per_run(order, args.runs).items():
                    rows.append((label, f"one run, {variant}", spread(values)))
                rows.append((label, f"chain of {args.steps} same-key steps, per step",
                             spread(per_chain(order, args.steps, args.rounds))))
                worker.stop()
                print(f"{label}: done", file=sys.stderr)
        finally:
            owner.close()
    print("| lock path | what | ms, median (p10-p90) |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
