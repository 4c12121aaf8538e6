"""Instructions per task: plain Task, SingletonTask and the peers, counted by callgrind.

The wall-clock benchmarks on a shared 2-core VM move by 20-40 % from one
minute to the next (``bench_peers`` reports min-max); a ratio of a few percent
drowns in that. This one counts what the work costs instead of timing it:
the worker or the measured redis-server runs under
``valgrind --tool=callgrind``, which counts the user-space instructions it
executes (one of them at a time: the other runs at full speed). The count
does not depend on the machine's load, so small changes show and variants
compare exactly.

On every server this machine has (:mod:`benchmarks.servers`: the default
``redis-server`` and those shipped in packages; one not installed is reported
as skipped), every variant: plain, ours (default mode), ours with
``acks_late``, celery-singleton and celery-once; ratios are to plain on the
same server.

For each variant the same run as ``bench_peers`` (one solo worker drains
no-op tasks with distinct arguments; broker, locks and results on one
redis-server) is done twice, with ``--small`` and ``--large`` tasks; the
difference of the totals divided by the difference of the task counts is the
cost of one task, start-up and shutdown cancelled out:

* **worker instructions/task**: the worker process, all its threads;
* **Redis instructions/task**: the measured server, publishing and draining
  (the peers claim their lock at publish time: that is counted too).

What callgrind does not see: time in the kernel (system calls: about 25 us
each on our VMs, three per SingletonTask run against none for plain's lock
path) and waiting. So these ratios are the floor of the CPU ratios; ``bench_peers``
measures CPU time with the system calls in it. A variant whose package cannot be
installed is skipped with a message. Needs ``valgrind`` (``apt-get install valgrind``).

``--counted redis`` counts the lock Redis alone (a worker under callgrind takes a
minute or more to start; the suite's smoke run of every benchmark counts Redis only).

Usage: python -m benchmarks.bench_instructions [--small 200] [--large 1000] [--variants ...]
       [--servers all|NAME ...] [--counted worker redis] [--venv DIR] [--json]
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.processes import ChildProcess
from harness.redis_server import RedisServerProcess, find_redis_server

from .bench_peers import APP, DEFAULT_VARIANTS, VARIANTS
from .common import ROOT, Server, bench_cli, bench_env, markdown_table, progress
from .compare_dedup import PACKAGES, prepare_third_party, versions
from .servers import select_servers

#: Seconds a step may take under callgrind (it runs programs ~50x slower).
TIMEOUT = 1800.0
_COLLECTED = re.compile(rb"Collected\s*:\s*([\d,]+)")


def _valgrind(out: Path) -> list[str]:
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.out", f"--log-file={out}.log"]


def _collected(out: Path) -> int:
    """The instruction total callgrind wrote when its program exited."""
    found = _COLLECTED.search(Path(f"{out}.log").read_bytes())
    if found is None:
        raise RuntimeError(f"callgrind wrote no total to {out}.log (did the program exit cleanly?)")
    return int(found.group(1).replace(b",", b""))


def _pop(control: Any, name: str, worker: ChildProcess) -> bool:
    """Wait for the control list ``name`` (short BLPOPs: redis-py's socket timeout is 5 s)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if control.blpop([name], timeout=1) is not None:
            return True
        worker.check_running()
    return False


def one_run(variant: str, tasks: int, python: str, work: Path, counted: str, binary: str | None = None) -> int:
    """Instructions of the ``counted`` process (``worker`` or ``redis``) for one drain of ``tasks`` tasks.

    Only that process runs under callgrind: the other runs at full speed, so the
    drain is not stretched for it. Redis runs with ``hz 1``: its timer work
    (``serverCron``) grows with the drain's wall time, not with the tasks.
    """
    tag = work / f"{variant}-{tasks}-{counted}"
    if binary is None:
        found = find_redis_server()
        binary = found[0] if found else "redis-server"
    wrap = _valgrind(tag) if counted == "redis" else []
    measured = RedisServerProcess(
        "measured", wrap[0] if wrap else binary,
        lambda port: [*wrap[1:], *([binary] if wrap else []), "--port", str(port), "--bind", "127.0.0.1",
                      "--save", "", "--appendonly", "no", "--hz", "1", "--dynamic-hz", "no", "--dir", str(work)],
        workdir=work)
    measured.error = RuntimeError
    ctl = Server()
    try:
        measured.start(timeout=120)
        env = bench_env(CMP_REDIS=f"redis://127.0.0.1:{measured.port}", CMP_CONTROL=ctl.url, CMP_VARIANT=variant,
                        PYTHONHASHSEED="0")
        publisher = ChildProcess("publisher", [python, "-m", APP, "publish", str(tasks)], env=env, cwd=ROOT,
                                 log=work / "publisher.log")
        publisher.error = RuntimeError
        publisher.start()
        assert publisher.process is not None
        if publisher.process.wait(TIMEOUT) != 0:
            raise RuntimeError(f"{variant}: publishing failed:\n{publisher.tail(30)}")
        worker = ChildProcess("worker", [*(_valgrind(tag) if counted == "worker" else []), python, "-m", "celery",
                                         "-A", APP, "worker", "-P", "solo", "-Q", "peers", "-l", "warning",
                                         "--without-gossip", "--without-mingle", "--without-heartbeat"],
                              env=env, cwd=ROOT, log=work / "worker.log")
        worker.error = RuntimeError
        control = ctl.client()
        try:
            worker.start()
            if not _pop(control, "ready", worker):
                raise RuntimeError(f"{variant}: the worker did not start the gate task:\n{worker.tail(30)}")
            control.rpush("go", "1")
            if not _pop(control, "done", worker):
                raise RuntimeError(f"{variant}: {tasks} tasks not done:\n{worker.tail(30)}")
        finally:
            worker.stop(timeout=300)  # a warm shutdown, then callgrind writes its total
        measured.stop(timeout=300)
        return _collected(tag)
    finally:
        measured.stop(timeout=300)
        ctl.stop()


def run(small: int, large: int, variants: tuple[str, ...] = DEFAULT_VARIANTS, servers: tuple[str, ...] = ("all",),
        singleton: str = "celery-singleton==0.3.1", once: str = "celery-once==3.0.1",
        venv: str = "", counted: tuple[str, ...] = ("worker", "redis")) -> dict[str, Any]:
    """Every variant on every server of ``servers`` (``all``: each of :mod:`benchmarks.servers`) at
    ``small`` and ``large`` tasks; instructions per task of each process in ``counted``
    (``worker``, ``redis``) and ratios to plain on the same server."""
    if shutil.which("valgrind") is None:
        return {"skipped": "valgrind not found (apt-get install valgrind)", "servers": {}}
    if not 0 < small < large:
        raise ValueError("need 0 < small < large")
    if not counted or set(counted) - {"worker", "redis"}:
        raise ValueError(f"counted must name worker and/or redis, not {counted}")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    found, skipped_servers = select_servers(servers)
    work = Path(tempfile.mkdtemp(prefix="csb-bench-instr-"))
    requirements = {"singleton": singleton, "once": once}
    needed = {VARIANTS[v][1] for v in variants} - {None}
    report: dict[str, Any] = {"small": small, "large": large, "servers": {}}
    try:
        third_python, third, skipped = prepare_third_party(
            Path(venv) if venv else work / "venv", {p: requirements[p] for p in PACKAGES if p in needed})
        python = third_python or sys.executable
        report["environment"] = {**versions(python, ["celery", "kombu", "redis"]), **third}
        for name, why in skipped_servers.items():
            report["servers"][name] = {"skipped": why}
        results: dict[str, dict[str, Any]] = {}
        for name, server in found.items():
            results[name] = {}
            report["servers"][name] = {"label": server.label, "binary": server.binary, "variants": results[name]}
        # Variant by variant across the servers: plain and ours everywhere first.
        for variant in variants:
            label, package = VARIANTS[variant]
            for name, server in found.items():
                if package in skipped:
                    results[name][variant] = {"label": label, "skipped": skipped[package]}
                    continue
                data: dict[str, Any] = {"label": label}
                for process in counted:
                    totals = []
                    for tasks in (small, large):
                        progress(f"instructions: {server.label}: {variant} x {tasks}, {process} under callgrind")
                        totals.append(one_run(variant, tasks, python, work, process, server.binary))
                    data[f"{process}_per_task"] = (totals[1] - totals[0]) / (large - small)
                results[name][variant] = data
                progress(f"instructions: {server.label}: {variant}: "
                         + ", ".join(f"{p} {data[f'{p}_per_task']:,.0f}/task" for p in counted))
        for by_variant in results.values():
            _ratios(by_variant)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _ratios(results: dict[str, Any]) -> None:
    """Each variant's counts over plain's on the same server (``worker_ratio``, ``redis_ratio``)."""
    plain = results.get("plain", {})
    for data in results.values():
        for process in ("worker", "redis"):
            if f"{process}_per_task" in data and f"{process}_per_task" in plain:
                data[f"{process}_ratio"] = data[f"{process}_per_task"] / plain[f"{process}_per_task"]


def _ratio(data: dict[str, Any], key: str) -> str:
    return f"{data[key]:.3f}" if key in data else "-"


def _count(data: dict[str, Any], key: str, digits: int) -> str:
    return f"{data[key] / 1000:,.{digits}f}k" if key in data else "not counted"


def table(report: dict[str, Any]) -> str:
    if "skipped" in report:
        return f"Skipped: {report['skipped']}."
    rows = []
    for name, server in report["servers"].items():
        if "skipped" in server:
            rows.append([name, f"skipped: {server['skipped']}", "", "", "", ""])
            continue
        for data in server["variants"].values():
            if "skipped" in data:
                rows.append([server["label"], data["label"], f"skipped: {data['skipped'].split(': ', 1)[0]}",
                             "", "", ""])
                continue
            rows.append([server["label"], data["label"], _count(data, "worker_per_task", 0),
                         _ratio(data, "worker_ratio"), _count(data, "redis_per_task", 1),
                         _ratio(data, "redis_ratio")])
    return "\n".join([
        f"User-space instructions per task counted by callgrind (worker: all threads; Redis: the measured "
        f"server, publish and drain), from runs of {report['small']:,} and {report['large']:,} no-op tasks "
        "(the difference, so start-up cancels out), on each server; ratios are to plain on the same server. "
        "Kernel time (system calls) is not in these counts.",
        "",
        markdown_table(["server", "variant", "worker instructions/task", "vs plain", "Redis instructions/task",
                        "vs plain"], rows),
    ])


def main(argv: list[str] | None = None) -> int:
    return bench_cli(__doc__, run, table, argv, small=200, large=1000, variants=DEFAULT_VARIANTS,
                     servers=("all",), singleton="celery-singleton==0.3.1", once="celery-once==3.0.1", venv="",
                     counted=("worker", "redis"))


if __name__ == "__main__":
    sys.exit(main())
