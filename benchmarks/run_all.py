"""Run every benchmark and write one Markdown report (stdout and benchmarks/results.md).

Each benchmark starts its own redis-server and compares variants in the same
run. Sizes default to the published ones; ``--quick`` shrinks them to seconds
(the smoke test uses it so the benchmarks keep working). The ``## Chaos``
section of the output file is not a benchmark's (``make chaos``, documented
by hand): it is kept as it was.

``--large`` adds the sizes that take minutes more (the beat at 100,000 due entries).

Usage: python -m benchmarks.run_all [--quick] [--large] [--only NAME ...] [--output PATH]
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import progress
from .targets import summary_table

HERE = Path(__file__).resolve().parent

#: name -> (module, title, published sizes, quick sizes)
BENCHMARKS: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "task": ("bench_task", "Task overhead: plain Task vs SingletonTask, one solo worker",
             {"tasks": 2000, "rounds": 3}, {"tasks": 30, "rounds": 1}),
    # Both on every server of benchmarks/servers.py (those not installed: skipped); quick: the
    # default server only (tests/test_benchmarks.py runs two servers side by side on its own).
    "peers": ("bench_peers", "Peers: plain Task, SingletonTask, celery-singleton, celery-once, one solo worker",
              {"tasks": 2000, "rounds": 3},
              {"tasks": 30, "rounds": 1, "servers": ("default",),
               "variants": ("plain", "ours", "ours_acks_late", "celery_singleton", "celery_once")}),
    "instructions": ("bench_instructions", "Instructions per task (callgrind): plain Task, SingletonTask and the peers",
                     {"small": 200, "large": 1000},
                     # quick: the lock Redis alone under callgrind (a worker takes minutes there)
                     {"small": 2, "large": 4, "variants": ("ours",), "servers": ("default",),
                      "counted": ("redis",)}),
    "contention": ("bench_contention", "Contention: 8 pool processes, 1,000 submissions over 10 keys",
                   {"submissions": 1000, "keys": 10, "rounds": 3}, {"submissions": 20, "keys": 4, "rounds": 1}),
    "beat": ("bench_beat", "Beat at scale: tick time and memory, PersistentScheduler vs SingletonScheduler",
             {"sizes": (1, 100, 10_000), "rounds": 3, "small_rounds": 10, "large_rounds": 1, "ticks": 50},
             {"quick": True}),
    "primitives": ("bench_primitives", "Lock primitives: acquire/release pairs per second",
                   {"pairs": 10000, "rounds": 3}, {"pairs": 200, "rounds": 1}),
    "child_kill": ("bench_child_kill", "Killed pool child: seconds until its key runs again, one-process pool",
                   {"rounds": 20}, {"rounds": 1}),
    "memory": ("bench_memory", "Memory: keys and used_memory return to baseline after TTLs",
               {"runs": 100_000, "slots": 10_000, "slot_ttl": 5.0}, {"runs": 200, "slots": 100, "slot_ttl": 1.0}),
    # One gevent worker per size and variant (three rounds each: plain, ours, ours with PTTLs sampled).
    "leases": ("bench_leases", "Leases: N runs at once in one gevent worker, plain Task vs SingletonTask",
               {"sizes": (100, 1000, 5000), "seconds": 20.0, "rounds": 1},
               {"sizes": (5,), "seconds": 1.0, "rounds": 1}),
    # The current code only (a before/after table: `python -m benchmarks.bench_admin --before REF`).
    "admin": ("bench_admin", "Admin tools on a large Redis: `singleton locks`, `stats` and `slots`",
              {"keys": 1_000_000, "locks": 10_000, "rare": 10, "real": 200, "slots": 1_000, "rounds": 3},
              {"keys": 2_000, "locks": 50, "rare": 5, "real": 10, "slots": 20, "rounds": 1}),
}


def machine() -> str:
    cpus = os.cpu_count()
    try:
        with open("/proc/meminfo") as meminfo:
            mem_kb = int(next(line for line in meminfo if line.startswith("MemTotal")).split()[1])
        memory = f"{mem_kb / 1024 / 1024:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        memory = "unknown memory"
    try:
        import hiredis  # noqa: F401  (redis-py uses it when installed: the `fast` extra)
        parser = "hiredis"
    except ImportError:
        parser = "no hiredis"
    return (f"{platform.system()} {platform.machine()}, {cpus} CPUs, {memory}, "
            f"Python {platform.python_version()}, redis-py with {parser}, redis-server on loopback")


#: What ``--large`` changes of the published sizes: sizes that take minutes more.
LARGE: dict[str, dict[str, Any]] = {
    "beat": {"sizes": (1, 100, 10_000, 100_000)},
}


def run_one(name: str, quick: bool, large: bool = False) -> tuple[str, float, dict[str, Any]]:
    """One benchmark: its section of the report, the seconds it took, its report."""
    module_name, title, sizes, quick_sizes = BENCHMARKS[name]
    module = importlib.import_module(f"benchmarks.{module_name}")
    run: Callable[..., dict[str, Any]] = module.run
    started = time.monotonic()
    report = run(**(quick_sizes if quick else {**sizes, **(LARGE.get(name, {}) if large else {})}))
    return f"### {title}\n\n{module.table(report)}\n", time.monotonic() - started, report


#: Sections of the output file written by hand, kept when the benchmarks rewrite it.
KEPT = "\n## Chaos"


def kept_sections(output: Path) -> str:
    """The part of ``output`` from :data:`KEPT` on (empty when there is none)."""
    try:
        text = output.read_text()
    except FileNotFoundError:
        return ""
    at = text.find(KEPT)
    return "" if at < 0 else "\n" + text[at:].lstrip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--large", action="store_true",
                        help="also the large sizes (beat: 100,000 due entries, about 10 minutes more)")
    parser.add_argument("--only", nargs="*", choices=sorted(BENCHMARKS), default=None)
    parser.add_argument("--output", type=Path, default=HERE / "results.md")
    args = parser.parse_args(argv)
    names = args.only or list(BENCHMARKS)
    sections = [f"## Benchmark results\n\nMachine: {machine()}.\n"]
    failed = []
    reports: dict[str, dict[str, Any]] = {}
    for name in names:
        progress(f"== {name}")
        try:
            section, seconds, reports[name] = run_one(name, args.quick, args.large)
        except Exception as exc:  # report it, keep the other benchmarks' results
            failed.append(name)
            progress(f"!! {name} failed: {exc!r}")
            sections.append(f"### {BENCHMARKS[name][1]}\n\nFAILED: {exc!r}\n")
            continue
        sections.append(section + f"\n_{name}: {seconds:.0f} s_\n")
    if "instructions" in reports or "peers" in reports:
        sections.insert(1, "### Targets: the lock's cost per server, ratio to plain\n\n"
                        + summary_table(reports.get("instructions"), reports.get("peers")) + "\n")
    text = "\n".join(sections)
    print(text)
    if not args.quick or args.output != HERE / "results.md":
        args.output.write_text(text + kept_sections(args.output))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
