"""Where a gevent worker's hub spends the start window of N runs, ours vs plain Celery, sampled.

``bench_leases`` times the start spread (first start to last start of N runs queued
before a gevent worker starts) and ``bench_start_instructions`` counts the hub's
user-space instructions in it. Neither sees what the kernel does for the hub (each
``send`` on a loopback TCP socket runs the receiver's side of the stack too, and a
page fault zeroes a page) nor how much of the Python is the cyclic garbage
collector's. Here one round of ``bench_leases`` per variant runs under
``perf record -a -e cpu-clock`` (a software clock, so it works on a virtual machine
without hardware counters), time-stamped with the wall clock so the window is the
bodies' own first and last start stamps, and the samples of the worker's main thread
(the hub, where every greenlet runs) in that window are sorted by what they were doing:

- ``collector``: the cyclic garbage collector (its collection and traversal functions);
- ``send`` / ``receive`` / ``epoll`` / ``mmap`` / ``other system calls``: the kernel
  inside a system call made by the hub, by call;
- ``page faults``: the kernel filling a page the hub touched first;
- ``kernel, other``: the kernel otherwise (interrupts, scheduling);
- ``Python and libraries``: everything else in user space.

Each category is given in microseconds of the hub's CPU per start (samples over the
sampling rate, over N), for both variants, and ours less plain. Needs ``perf`` allowed
to sample every CPU (root, or ``kernel.perf_event_paranoid`` <= 0).

Usage: python -m benchmarks.bench_start_profile [--sizes 1000 5000] [--rounds 1] [--json]
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from datetime import date
from pathlib import Path
from typing import Any

from .bench_leases import one_round
from .common import Server, bench_cli, core_split, cpu_layout, cpu_layout_note, markdown_table, progress, running_on

#: Samples per second and CPU.
FREQUENCY = 1999
#: Seconds each body sleeps: every run of the window holds its lease through it.
SLEEP = 20.0
VARIANTS = ("plain", "ours")
CATEGORIES = ("Python and libraries", "collector", "send", "receive", "epoll", "mmap", "other system calls",
              "page faults", "kernel, other")
#: Leaf functions of CPython's cyclic collector (``Modules/gcmodule.c`` and the types'
#: ``tp_traverse``, which only the collector calls on this path).
_COLLECTOR = ("gc_collect_main", "visit_reachable", "visit_decref", "move_unreachable", "update_refs",
              "subtract_refs", "deduce_unreachable", "move_legacy_finalizers", "handle_weakrefs",
              "gc_list_merge", "PyObject_IS_GC", "_PyObject_VisitInstanceAttributes", "_PyDict_MaybeUntrack",
              "_PyTuple_MaybeUntrack", "untrack_tuples", "untrack_dicts", "validate_list")
_SYSCALLS = {"sendto": "send", "sendmsg": "send", "recvfrom": "receive", "recvmsg": "receive",
             "epoll_wait": "epoll", "epoll_ctl": "epoll", "epoll_pwait": "epoll", "mmap": "mmap", "munmap": "mmap",
             "brk": "mmap", "mprotect": "mmap"}


def categorize(frames: list[str]) -> str:
    """The category of one sample, from its call chain (leaf first: ``symbol`` or
    ``symbol (dso)`` per frame, as ``perf script -F sym,dso`` prints them)."""
    names = [frame.split(" (", 1)[0].strip() for frame in frames]
    if not any("[kernel.kallsyms]" in frame for frame in frames):
        leaf = names[0] if names else ""  # a type's tp_traverse: dict_traverse, tupletraverse, ...
        return "collector" if leaf in _COLLECTOR or leaf.endswith("traverse") else "Python and libraries"
    if "asm_exc_page_fault" in names:
        return "page faults"
    for name in names:
        if name.startswith("__x64_sys_"):
            return _SYSCALLS.get(name.removeprefix("__x64_sys_"), "other system calls")
    if "entry_SYSCALL_64_after_hwframe" in names or "do_syscall_64" in names:
        return "other system calls"
    return "kernel, other"


def samples(script_output: str) -> Iterable[list[str]]:
    """The call chains of ``perf script -F ip,sym,dso`` output: one list of frames per sample."""
    for block in script_output.split("\n\n"):
        frames = []
        for line in block.strip().splitlines():
            parts = line.strip().split(None, 1)  # "<ip> <symbol> (<dso>)"
            if len(parts) == 2:
                frames.append(parts[1])
        if frames:
            yield frames


def hub_profile(data: Path, pid: int, first: float, last: float) -> dict[str, int]:
    """Samples of thread ``pid`` (a worker's main thread) between ``first`` and ``last``
    (wall clock), by category."""
    output = subprocess.run(["perf", "script", "-i", str(data), "--tid", str(pid), "--time", f"{first:.6f},{last:.6f}",
                             "-F", "ip,sym,dso"], capture_output=True, text=True, check=True).stdout
    counts: collections.Counter[str] = collections.Counter(categorize(frames) for frames in samples(output))
    return {category: counts.get(category, 0) for category in CATEGORIES}


def one_profile(variant: str, n: int, broker: Server, locks: Server, work: Path,
                cpus: frozenset[int] | None = None) -> dict[str, Any]:
    """One ``bench_leases`` round of ``variant`` under ``perf record``: the hub's samples in its window."""
    data = work / f"{variant}-{n}-{time.monotonic_ns()}.data"
    recorder = subprocess.Popen(["perf", "record", "-q", "-a", "-g", "-k", "CLOCK_REALTIME", "-e", "cpu-clock",
                                 "-F", str(FREQUENCY), "-o", str(data)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        result = one_round(variant, n, SLEEP, broker, locks, work / "worker.log", cpus=cpus)
    finally:
        recorder.send_signal(signal.SIGINT)
        _, error = recorder.communicate(timeout=120)
    if recorder.returncode not in (0, -signal.SIGINT):
        raise RuntimeError(f"perf record failed ({recorder.returncode}): {error.decode(errors='replace')[-500:]}")
    profile = hub_profile(data, result["worker_pid"], result["first_start"], result["last_start"])
    data.unlink()
    return {"spread_s": result["start_spread_s"], "refused": result["refused"], "lost": result["lost"],
            "samples": profile, "us_per_start": {k: v * 1e6 / FREQUENCY / n for k, v in profile.items()}}


def run(sizes: tuple[int, ...] = (1000, 5000), rounds: int = 1) -> dict[str, Any]:
    """``rounds`` profiled rounds per size and variant, interleaved."""
    if shutil.which("perf") is None:
        return {"skipped": "needs perf (apt-get install linux-perf)"}
    work = Path(tempfile.mkdtemp(prefix="csb-bench-start-profile-"))
    # As bench_leases: the worker alone on one CPU, the servers, perf and the harness on the others.
    split = core_split()
    worker_cpus, other_cpus = split if split is not None else (None, None)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with running_on(other_cpus):
        broker, locks = Server(), Server()
        try:
            for n in sizes:
                results[str(n)] = {v: [] for v in VARIANTS}
                for r in range(rounds):
                    for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                        progress(f"start profile: N={n} round {r + 1}/{rounds}: {variant} under perf")
                        results[str(n)][variant].append(one_profile(variant, n, broker, locks, work, worker_cpus))
        finally:
            broker.stop()
            locks.stop()
            shutil.rmtree(work, ignore_errors=True)
    return {"date": date.today().isoformat(), "rounds": rounds, "frequency": FREQUENCY, "results": results,
            "cpus": cpu_layout(split)}


def _mean(rounds: list[dict[str, Any]], category: str) -> float:
    return float(sum(r["us_per_start"][category] for r in rounds)) / len(rounds)


def table(report: dict[str, Any]) -> str:
    if "skipped" in report:
        return f"Skipped: {report['skipped']}."
    lines = [f"Measured {report['date']}: the hub's CPU per start in the start window, sampled by perf "
             f"({report['frequency']} Hz, cpu-clock), mean of {report['rounds']} round(s) per variant; "
             f"microseconds per start.",
             cpu_layout_note(report.get("cpus"), "the redis-servers, perf and the harness"), ""]
    for n, variants in report["results"].items():
        plain, ours = variants["plain"], variants["ours"]
        rows = []
        for category in (*CATEGORIES, "total"):
            names = CATEGORIES if category == "total" else (category,)
            a, b = (sum(_mean(rs, name) for name in names) for rs in (plain, ours))
            rows.append([category, f"{a:,.1f}", f"{b:,.1f}", f"{b - a:+,.1f}"])
        spreads = ", ".join(f"{o['spread_s']:.2f}/{p['spread_s']:.2f}" for p, o in zip(plain, ours, strict=True))
        lines += [f"N = {int(n):,} (start spread ours/plain, s: {spreads})", "",
                  markdown_table(["", "plain", "ours", "ours - plain"], rows), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_cli(__doc__, run, table, argv, sizes=(1000, 5000), rounds=1)


if __name__ == "__main__":
    sys.exit(main())
