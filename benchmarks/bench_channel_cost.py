"""What the lock channel's reply bookkeeping costs: instructions per lock cycle, this tree
against an earlier revision, counted by callgrind.

A cycle is a run's two lock requests on its thread's channel: an acquire (which
also reads the previous cycle's release reply) and a release written without
waiting (``Lease.release_soon``). Each variant runs ``--small`` and ``--large``
cycles under ``valgrind --tool=callgrind`` in a process of its own; the
difference divided by the difference in cycles is the cost of one cycle, free of
start-up. Timing-dependent paths are held still so that both variants do the
same work: no idle look at the connection (``IDLE_CHECK``), no background flush
(``FLUSH_AFTER``), the garbage collector off, one hash seed.

Not part of ``make bench`` (run it by hand; docs/performance.md gives its figures)::

    python -m benchmarks.bench_channel_cost --baseline 4eee3e3 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import Server

ROOT = Path(__file__).resolve().parent.parent

#: The measured program: ``python -c CYCLES <port> <cycles>``.
CYCLES = """
import gc, sys
import redis
import celery_singleton_beat.connection.channel as channel
import celery_singleton_beat.connection.flusher as flusher
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
channel.IDLE_CHECK = flusher.FLUSH_AFTER = 1e9
gc.disable()
port, cycles = int(sys.argv[1]), int(sys.argv[2])
client = redis.Redis(port=port)
spec = LockSpec(task="t", ttl=60)
released = []
for i in range(cycles):
    lease = acquire(client, "bench:{t:%d}" % (i % 50), spec, str(i)).lease
    lease.release_soon(lambda ok, error: released.append(ok))
acquire(client, "bench:{end}", spec, "end")
assert released.count(True) == cycles, released.count(True)
"""


def instructions(source: Path, port: int, cycles: int) -> int:
    """Instructions callgrind counted in one run of :data:`CYCLES` with ``source`` first on the path."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "callgrind.out"
        env = {**os.environ, "PYTHONPATH": str(source), "PYTHONHASHSEED": "0"}
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--log-file=/dev/null",
                        sys.executable, "-c", CYCLES, str(port), str(cycles)], env=env, check=True)
        for line in out.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError("callgrind wrote no total")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="4eee3e3", help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", type=int, default=1000)
    parser.add_argument("--large", type=int, default=7000)
    args = parser.parse_args()
    server = Server()
    try:
        with tempfile.TemporaryDirectory() as baseline:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline, "celery_singleton_beat"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", baseline], input=archive, check=True)
            per_cycle: dict[str, list[float]] = {args.baseline: [], "this tree": []}
            for _ in range(args.rounds):  # interleaved, so that both meet the same machine
                for name, source in ((args.baseline, Path(baseline)), ("this tree", ROOT)):
                    small = instructions(source, server.port, args.small)
                    large = instructions(source, server.port, args.large)
                    per_cycle[name].append((large - small) / (args.large - args.small))
                    print(f"{name}: {per_cycle[name][-1]:,.0f} instructions per cycle", flush=True)
    finally:
        server.stop()
    base, ours = per_cycle[args.baseline], per_cycle["this tree"]
    differences = [b - a for a, b in zip(base, ours, strict=True)]
    print(f"\n{args.baseline}: {statistics.mean(base):,.0f} per cycle; this tree: {statistics.mean(ours):,.0f}; "
          f"difference {statistics.mean(differences):+,.0f} per cycle (two requests), "
          f"paired differences {', '.join(f'{d:+,.0f}' for d in differences)}")


if __name__ == "__main__":
    main()
