"""Instructions per start in one gevent worker taking in N runs at once, ours vs plain Celery.

What ``bench_leases`` measures as the start spread (first start to last start of N
runs queued before a gevent worker starts), counted instead of timed: wall-clock
and CPU time on a shared 2-core machine moved the ratio from 0.53x to 2.61x between
runs of the same code. Here the worker runs under ``valgrind --tool=callgrind``,
which counts the user-space instructions every thread of it executes (the main
thread, where the hub runs every greenlet, reported apart too); the first
body to start zeroes the counts (a callgrind client request, through a two-function
library built with ``gcc`` at the start), the N-th dumps them. The figure is that
count over N - 1: the instructions the worker spent per run taken in, everything
included (kombu's fetch and acknowledgement, the pool, the acquire, the keeper's
work meanwhile, the body's own record write, which plain's body makes too).

The app is ``benchmarks.leases_app`` (the same bodies for both variants), each
body sleeping far longer than the round: the worker is killed once the count is
dumped, so no run ends inside the window. Broker and records on one redis-server,
the locks on another.

The keeper's renewals go on by the wall clock, and callgrind runs the worker some
50 times slower: with the benchmark's ``lock_ttl = 3`` (renewed every second) the
window would hold some 50 times the renewals a real one does. So the lease and the
worker's liveness TTL are long here by default (``--lock-ttl 600 --liveness-ttl
600``: no renewal inside the window; the keeper's cost per renewal is measured
apart, see docs/performance.md); ``--lock-ttl 3 --liveness-ttl 10`` counts them, at
that exaggerated rate.

Which threads: ``--threads main`` (the default) counts the main thread alone, where
the hub runs every greenlet: the runs, the acquires, kombu's reads. Callgrind zeroes
and dumps the counts of the thread that asks, so that count is exact. ``--threads all``
counts every thread, but the other threads' counts run from their own start, not from
the first start (callgrind zeroes only the asking thread's): in our worker the lease
keeper's and the counters' threads, started by the first acquire, just before the
window; plain Celery's gevent worker has no other thread doing work.

What callgrind does not see: system calls (the kernel's share of each send and
receive) and waiting. Needs ``valgrind``, its ``callgrind.h`` and ``gcc``.

Usage: python -m benchmarks.bench_start_instructions [--n 200] [--rounds 2] [--lock-ttl 600]
       [--liveness-ttl 600] [--threads main|all] [--json]
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

from harness.processes import ChildProcess

from .common import ROOT, Server, bench_cli, bench_env, markdown_table, progress

#: Seconds a round may take under callgrind (start-up alone is a minute or two).
TIMEOUT = 1800.0
#: Seconds each body sleeps: longer than any round (the worker is killed once counted).
SLEEP = 7200.0
VARIANTS = {"plain": "plain", "ours": "singleton"}
_TOTALS = re.compile(rb"^(?:summary|totals):\s*(\d+)", re.M)
_MARKS_C = r"""
#include <valgrind/callgrind.h>
void csb_zero(void) { CALLGRIND_ZERO_STATS; }
void csb_dump(void) { CALLGRIND_DUMP_STATS_AT("last start"); }
"""


def build_marks(work: Path) -> Path:
    """The library of the two client requests the bodies call (no-ops outside valgrind)."""
    source, library = work / "marks.c", work / "libcsbmarks.so"
    source.write_text(_MARKS_C)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], check=True,
                   capture_output=True)
    return library


def _dumped(out: Path) -> int | None:
    """The instructions of the dump the N-th start asked for (None before it is written)."""
    for path in sorted(out.parent.glob(out.name + ".1*")):
        found = _TOTALS.search(path.read_bytes())
        if found is not None:
            return int(found.group(1))
    return None


def one_round(variant: str, n: int, broker: Server, locks: Server, work: Path, marks: Path,
              lock_ttl: int, liveness_ttl: float, threads: str = "main") -> dict[str, Any]:
    """One worker under callgrind taking in ``n`` queued runs of ``variant``: its count."""
    env = bench_env(BENCH_BROKER=broker.url, BENCH_LOCKS=locks.url, BENCH_CALLGRIND_LIB=str(marks),
                    BENCH_MARK_LAST=str(n), BENCH_LOCK_TTL=str(lock_ttl), BENCH_LIVENESS_TTL=str(liveness_ttl),
                    PYTHONHASHSEED="0")
    os.environ.update(BENCH_BROKER=broker.url, BENCH_LOCKS=locks.url, BENCH_LOCK_TTL=str(lock_ttl))
    from . import leases_app

    task = getattr(leases_app, VARIANTS[variant])
    broker.flush()
    locks.flush()
    queue = f"bench-start-instr-{variant}-{n}"
    with leases_app.app.producer_or_acquire() as producer:
        for i in range(n):  # queued before the worker starts, as in bench_leases
            task.apply_async((i, SLEEP), queue=queue, producer=producer)
    tag = work / f"{variant}-{n}-{time.monotonic_ns()}"
    out = Path(f"{tag}.out")
    worker = ChildProcess("worker", [
        "valgrind", "--tool=callgrind", f"--separate-threads={'yes' if threads == 'main' else 'no'}",
        f"--callgrind-out-file={out}",
        f"--log-file={tag}.log",
        sys.executable, "-m", "celery", "-A", "benchmarks.leases_app", "worker", "-P", "gevent", "-c", str(n),
        "--prefetch-multiplier", "1", "-Q", queue, "-l", "warning", "--without-gossip", "--without-mingle",
        "--without-heartbeat"], env=env, cwd=ROOT, log=Path(f"{tag}.worker.log"))
    worker.error = RuntimeError
    worker.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while (total := _dumped(out)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{variant}: no count dumped in {TIMEOUT:g} s:\n{worker.tail(30)}")
            worker.check_running()
            time.sleep(1.0)
        with broker.client(3) as records:  # the last body writes its start once it dumped
            while (started := records.zcard("starts")) < n and time.monotonic() < deadline:
                worker.check_running()
                time.sleep(0.5)
    finally:
        worker.kill()  # the bodies sleep on: no warm shutdown
    if started != n:
        raise RuntimeError(f"{variant}: {started} of {n} runs started")
    with locks.client(0) as client:
        lock_keys = sum(1 for key in client.scan_iter(match="singleton:{*", count=1000) if key.endswith(b"}"))
    return {"instructions": total, "per_start": total / (n - 1), "lock_keys": lock_keys}


def run(n: int = 200, rounds: int = 2, lock_ttl: int = 600, liveness_ttl: float = 600.0,
        threads: str = "main") -> dict[str, Any]:
    """``rounds`` rounds of each variant, interleaved; instructions per start and ours over plain."""
    if shutil.which("valgrind") is None or shutil.which("gcc") is None:
        return {"skipped": "needs valgrind and gcc (apt-get install valgrind gcc)"}
    if n < 2 or threads not in ("main", "all"):
        raise ValueError("need n >= 2 and --threads main or all")
    work = Path(tempfile.mkdtemp(prefix="csb-bench-start-instr-"))
    broker, locks = Server(), Server()
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    try:
        marks = build_marks(work)
        for r in range(rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
            for variant in order:
                progress(f"start instructions: N={n} round {r + 1}/{rounds}: {variant} under callgrind")
                result = one_round(variant, n, broker, locks, work, marks, lock_ttl, liveness_ttl, threads)
                progress(f"start instructions: {variant}: {result['per_start']:,.0f} per start")
                results[variant].append(result)
    finally:
        broker.stop()
        locks.stop()
        shutil.rmtree(work, ignore_errors=True)
    medians = {v: statistics.median(r["per_start"] for r in rs) for v, rs in results.items()}
    return {"date": date.today().isoformat(), "n": n, "rounds": rounds, "lock_ttl": lock_ttl,
            "liveness_ttl": liveness_ttl, "threads": threads, "per_start": medians,
            "ratio": medians["ours"] / medians["plain"], "results": results}


def table(report: dict[str, Any]) -> str:
    if "skipped" in report:
        return f"Skipped: {report['skipped']}."
    rows = [[variant, ", ".join(f"{r['per_start'] / 1000:,.1f}k" for r in report["results"][variant]),
             f"{report['per_start'][variant] / 1000:,.1f}k"] for variant in VARIANTS]
    return "\n".join([
        f"Measured {report['date']}: user-space instructions of one gevent worker (`-P gevent -c {report['n']}`, "
        f"{'its main thread, the hub' if report['threads'] == 'main' else 'every thread'}) from the first of "
        f"{report['n']:,} queued runs' start to the last, over "
        f"{report['n'] - 1:,}, counted by callgrind; `lock_ttl = {report['lock_ttl']}`, liveness TTL "
        f"{report['liveness_ttl']:g} s; {report['rounds']} round(s) per variant, interleaved.",
        "",
        markdown_table(["variant", "instructions per start, each round", "median"], rows),
        "",
        f"Ours over plain: **{report['ratio']:.3f}x**.",
    ])


def main(argv: list[str] | None = None) -> int:
    return bench_cli(__doc__, run, table, argv, n=200, rounds=2, lock_ttl=600, liveness_ttl=600.0, threads="main")


if __name__ == "__main__":
    sys.exit(main())
