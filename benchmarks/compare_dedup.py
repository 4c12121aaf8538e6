"""Runs per tick with 3 beats: plain Celery, celery-singleton, celery-once, and ours.

For each variant, on a private redis-server (127.0.0.1, free port): one
prefork worker (concurrency 4) and 3 ``celery beat`` processes of
``benchmarks/compare_apps/dedup_app.py``: one 1 s entry whose task sleeps
50 ms and records each execution. After a warm-up, the executions that start
within N seconds are counted: **runs per tick** = executions / ticks elapsed.

* ``plain``: ``celery.Task``, 3 x ``PersistentScheduler``.
* ``celery_singleton``: ``celery_singleton.Singleton``, 3 x ``PersistentScheduler``.
* ``celery_once``: ``celery_once.QueueOnce``, 3 x ``PersistentScheduler``.
* ``ours``: ``SingletonTask``, 3 x ``-S celery_singleton_beat.beat:SingletonScheduler``.
* not run by default: ``ours_task_only`` (``SingletonTask``, 3 x ``PersistentScheduler``),
  ``redbeat`` (``celery.Task``, 3 x ``redbeat.RedBeatScheduler``, its defaults),
  ``redbeat_loop1`` (the same with ``beat_max_loop_interval = 1``) and ``ours_redbeat``
  (``SingletonTask``, 3 x ``celery_singleton_beat.contrib.redbeat:SingletonRedBeatScheduler``:
  RedBeat's keys, no lock).

With Celery's interval schedule each beat fires one interval after its own
start, so what a publish-time lock sees depends on the beats' phases. Each
variant runs in two launch modes (``--modes``); the phase of each beat (its
sends modulo 1 s, from its log) is measured and reported:

* ``together``: the 3 beats are launched at once (phases as start-up makes them);
* ``staggered``: launches timed so that the beats start about 1/3 s apart
  (phases about 0, 333 and 667 ms if start-up takes as long each time), as
  beats started at unrelated times would be.

and, not run by default, ``failover``: launched together, then the beat that
sent last (RedBeat's lock holder) is SIGKILLed a quarter into the window;
``longest gap without a run`` shows how long the schedule stopped.

A publish-time lock is held from the publish to the end of the run (about
50 ms here), so what decides is the smallest gap between two beats' phases,
reported as ``min phase gap``.

celery-singleton, celery-once and celery-redbeat are ``pip install``-ed (versions
pinned, see ``--singleton``/``--once``/``--redbeat``) into a throw-away
virtualenv in a temp dir whose ``.pth`` adds this project's virtualenv (same
celery and redis-py for every variant); a package that cannot be installed
has its variants skipped with a message.
Every process runs in its own process group and is stopped at the end, even on
error or Ctrl-C.

Usage:
    python benchmarks/compare_dedup.py [--seconds 20] [--modes together,staggered]
        [--variants plain,celery_singleton,celery_once,ours] [--json] [--venv DIR] [--keep]
    python benchmarks/compare_dedup.py --key-probe   # runs compare_apps/key_probe.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import Server, bench_env, markdown_table, progress, wait_until  # noqa: E402
from harness.processes import ChildProcess, signal_group  # noqa: E402

APP = "benchmarks.compare_apps.dedup_app"
OURS_SCHEDULER = "celery_singleton_beat.beat:SingletonScheduler"
REDBEAT_SCHEDULER = "redbeat.RedBeatScheduler"
OURS_REDBEAT_SCHEDULER = "celery_singleton_beat.contrib.redbeat:SingletonRedBeatScheduler"
BEATS = 3
INTERVAL = 1.0
TASK_SLEEP = 0.05


@dataclass(frozen=True)
class Variant:
    label: str
    task: str  # CMP_VARIANT of the app
    scheduler: str | None = None  # None: Celery's PersistentScheduler
    package: str | None = None  # third-party package (option name): runs in the throw-away virtualenv
    max_loop: float | None = None  # beat_max_loop_interval


VARIANTS = {
    "plain": Variant("plain Celery Task", "plain"),
    "celery_singleton": Variant("celery-singleton Singleton", "celery_singleton", package="singleton"),
    "celery_once": Variant("celery-once QueueOnce", "celery_once", package="once"),
    "ours": Variant("SingletonTask + SingletonScheduler", "ours", OURS_SCHEDULER),
    "ours_task_only": Variant("SingletonTask + PersistentScheduler", "ours"),
    "redbeat": Variant("plain Task + RedBeatScheduler (defaults)", "redbeat", REDBEAT_SCHEDULER,
                       package="redbeat"),
    "redbeat_loop1": Variant("plain Task + RedBeatScheduler, beat_max_loop_interval=1", "redbeat",
                             REDBEAT_SCHEDULER, package="redbeat", max_loop=1.0),
    "ours_redbeat": Variant("SingletonTask + SingletonRedBeatScheduler", "ours_redbeat", OURS_REDBEAT_SCHEDULER,
                            package="redbeat"),
}
DEFAULT_VARIANTS = ("plain", "celery_singleton", "celery_once", "ours")
MODES = ("together", "staggered", "failover")
DEFAULT_MODES = ("together", "staggered")

# Celery's log lines start with "[<local time, ms>: INFO/<process>] ".
_LINE = r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): INFO/\w+\] "
STARTING = re.compile(_LINE + r"beat: Starting\.\.\.")
# A beat's attempt to send the entry: Celery's scheduler logs the first line
# before every send; ours logs one of the second ones per slot, won or not.
ATTEMPT_PLAIN = re.compile(_LINE + r"Scheduler: Sending due task tick")
ATTEMPT_OURS = re.compile(_LINE + r"beat: tick: slot \S+ (won by|already claimed)")


# ----------------------------------------------------------------- processes

class Processes:
    """Child processes (:class:`harness.processes.ChildProcess`: each the leader of its own
    process group, dying with this script); all stopped by ``stop_all``."""

    def __init__(self) -> None:
        self.running: list[ChildProcess] = []

    def start(self, name: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> ChildProcess:
        log.write_bytes(b"")
        process = ChildProcess(name, argv, env=env, cwd=cwd, log=log)
        process.error = RuntimeError
        self.running.append(process)  # before it starts: nothing can orphan it
        return process.start()

    def stop(self, process: ChildProcess, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL of its whole group (pool children of a prefork worker)."""
        process.stop(timeout=timeout)
        self.running = [p for p in self.running if p is not process]

    def stop_all(self) -> None:
        for process in reversed(list(self.running)):
            self.stop(process)


def _signal_group(process: ChildProcess, signum: int) -> None:
    signal_group(process.pid, signum)


def wait_for_log(process: ChildProcess, log: Path, text: str, timeout: float) -> None:
    process.wait_for_output(text, timeout)


# ----------------------------------------------------------------- third-party virtualenv

#: Option name -> distribution name of the third-party packages.
PACKAGES = {"singleton": "celery-singleton", "once": "celery-once", "redbeat": "celery-redbeat"}


def third_party_python(venv: Path, requirements: list[str]) -> str:
    """A virtualenv with ``requirements`` installed; this project's packages through a .pth."""
    python = venv / "bin" / "python"
    if not python.exists():
        progress(f"creating throw-away virtualenv {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # Same celery / kombu / redis-py as the other variants: this virtualenv's site-packages.
    Path(site, "csb_main_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    progress(f"pip install {' '.join(requirements)} (throw-away virtualenv)")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    *requirements], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return str(python)


def prepare_third_party(venv: Path, requirements: dict[str, str]) -> tuple[str | None, dict[str, str],
                                                                            dict[str, str]]:
    """Install each needed package on its own: (python, versions, {package: why skipped})."""
    python: str | None = None
    installed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for package, requirement in requirements.items():
        try:
            python = third_party_python(venv, [requirement])
            installed.update(versions(python, [PACKAGES[package]]))
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = getattr(exc, "stderr", None) or b""
            detail = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
            skipped[package] = f"cannot install {requirement}: {exc}"
            progress(f"SKIPPING {PACKAGES[package]}: {skipped[package]}\n{detail[-1500:]}")
    return python, installed, skipped


def versions(python: str, names: list[str]) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys; "
            "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))")
    out = subprocess.run([python, "-c", code, *names], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


# ----------------------------------------------------------------- one run

def log_times(log: Path, pattern: re.Pattern[str]) -> list[float]:
    """Epoch times of the log lines matching ``pattern`` (Celery logs local time, ms)."""
    times = []
    for line in log.read_text(errors="replace").splitlines():
        match = pattern.match(line)
        if match:
            times.append(datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return times


def phase_ms(times: list[float]) -> float | None:
    """Circular mean of ``times`` modulo the interval, in ms (None without times)."""
    if not times:
        return None
    angles = [2 * math.pi * ((t % INTERVAL) / INTERVAL) for t in times]
    mean = math.atan2(sum(map(math.sin, angles)), sum(map(math.cos, angles)))
    return round((mean / (2 * math.pi) % 1.0) * INTERVAL * 1000, 1)


def start_beats(mode: str, celery: list[str], variant: Variant, env: dict[str, str], run_dir: Path,
                procs: Processes) -> list[tuple[ChildProcess, Path]]:
    """Start the beats; ``staggered`` aims their start-up (hence phases) 1/BEATS interval apart.

    A beat's interval entry fires one interval after the beat starts, so its
    phase is set by the instant it logs ``beat: Starting...``. Start-up takes
    a variable time, so each launch is timed from the start-up latencies seen
    so far; the phases actually reached are measured from the logs later.
    """
    beats: list[tuple[ChildProcess, Path]] = []
    latencies: list[float] = []
    first_phase = 0.0
    for i in range(1, BEATS + 1):
        if mode == "staggered" and i > 1:
            target = first_phase + (i - 1) * INTERVAL / BEATS
            time.sleep((target - (time.time() + statistics.median(latencies))) % INTERVAL)
        log = run_dir / f"beat{i}.log"
        argv = [*celery, "beat", "-l", "info", "-s", str(run_dir / f"beat{i}-schedule"),
                "--pidfile", str(run_dir / f"beat{i}.pid")]
        if variant.scheduler:
            argv += ["-S", variant.scheduler]
        launched = time.time()
        process = procs.start(f"beat{i}", argv, {**env, "CMP_BEAT_ID": str(i)}, log, run_dir)
        beats.append((process, log))
        if mode == "staggered":
            wait_for_log(process, log, "beat: Starting...", 120)
            started = log_times(log, STARTING)[0]
            latencies.append(started - launched)
            if i == 1:
                first_phase = started % INTERVAL
    for process, log in beats:
        wait_for_log(process, log, "beat: Starting...", 120)
    return beats


def phase_gaps(phases: list[float | None]) -> list[tuple[float, float]]:
    """(width, start) in ms of the gaps between consecutive beat phases, around the interval."""
    known = sorted(p for p in phases if p is not None)
    if not known:
        return []
    period = INTERVAL * 1000
    return [(b - a, a) for a, b in itertools.pairwise(known)] + [(known[0] + period - known[-1], known[-1])]


def min_gap_ms(phases: list[float | None]) -> float | None:
    """The smallest distance between two beats' phases (None with fewer than two)."""
    gaps = phase_gaps(phases)
    return round(min(gaps)[0], 1) if len(gaps) > 1 else None


def quiet_point_s(phases: list[float | None]) -> float:
    """An offset within the interval (s) far from every beat's phase: mid of the largest gap."""
    gaps = phase_gaps(phases)
    if not gaps:
        return 0.0
    width, start = max(gaps)
    return ((start + width / 2) % (INTERVAL * 1000)) / 1000


def run_variant(name: str, mode: str, seconds: float, python: str, server: Server, work: Path,
                procs: Processes) -> dict[str, Any]:
    variant = VARIANTS[name]
    server.flush()
    records = server.client(2)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-{mode}-", dir=work))
    env = bench_env(CMP_REDIS=server.url, CMP_VARIANT=variant.task, CMP_INTERVAL=str(INTERVAL),
                    CMP_SLEEP=str(TASK_SLEEP), CMP_MAX_LOOP=str(variant.max_loop or ""))
    env.pop("CMP_BEAT_ID", None)
    celery = [python, "-m", "celery", "-A", APP]

    worker_log = run_dir / "worker.log"
    worker = procs.start("worker", [*celery, "worker", "-P", "prefork", "-c", "4", "-l", "info",
                                    "-n", f"cmp-{name}@127.0.0.1", "--without-gossip",
                                    "--without-mingle", "--without-heartbeat"],
                         env, worker_log, run_dir)
    wait_for_log(worker, worker_log, " ready.", 120)

    beats = start_beats(mode, celery, variant, env, run_dir, procs)

    # Warm-up: every beat up, a few ticks run, start-up catch-up sends are over.
    wait_until(lambda: records.llen("runs") > 0, 60, "a first execution")
    time.sleep(3 * INTERVAL)
    t0 = time.time()
    killed: dict[str, Any] = {}
    if mode == "failover":
        # SIGKILL the beat that sent last (RedBeat: the lock holder), a quarter into the window.
        time.sleep(seconds / 4)
        last = json.loads(records.lindex("pubs", -1) or "{}")
        victim = int(last.get("beat", 1))
        _signal_group(beats[victim - 1][0], signal.SIGKILL)
        killed = {"killed_beat": str(victim), "killed_at_s": round(time.time() - t0, 3)}
    time.sleep(max(t0 + seconds - time.time(), 0))
    t1 = time.time()
    for process, _ in beats:
        procs.stop(process)
    time.sleep(1.0)  # let queued copies run: they were published in the window
    procs.stop(worker)

    runs = [json.loads(raw) for raw in records.lrange("runs", 0, -1)]
    pubs = [json.loads(raw) for raw in records.lrange("pubs", 0, -1)]
    in_window = [r for r in runs if t0 <= r["start"] < t1]
    pubs_window = [p for p in pubs if t0 <= p["t"] < t1]
    ticks = (t1 - t0) / INTERVAL
    pattern = ATTEMPT_OURS if variant.scheduler in (OURS_SCHEDULER, OURS_REDBEAT_SCHEDULER) else ATTEMPT_PLAIN
    edges = [t0, *sorted(r["start"] for r in in_window), t1]
    attempts = {str(i): [t for t in log_times(log, pattern) if t0 <= t < t1]
                for i, (_, log) in enumerate(beats, 1)}
    phases = {b: phase_ms(ts) for b, ts in attempts.items()}
    # Executions per tick: ticks cut where no beat fires (whole ticks in the window only).
    cut = quiet_point_s(list(phases.values()))
    per_tick = Counter(math.floor((r["start"] - cut) / INTERVAL) for r in in_window)
    first, last = math.ceil((t0 - cut) / INTERVAL), math.floor((t1 - cut) / INTERVAL)
    histogram = Counter(per_tick.get(k, 0) for k in range(first, last))
    errors = sum(log.read_text(errors="replace").count("Message Error") for _, log in beats)
    return {
        "variant": name,
        "label": variant.label,
        "mode": mode,
        "seconds": round(t1 - t0, 3),
        "ticks": round(ticks, 2),
        "executions": len(in_window),
        "runs_per_tick": round(len(in_window) / ticks, 3),
        "published": len(pubs_window),
        "published_per_tick": round(len(pubs_window) / ticks, 3),
        "published_by_beat": dict(sorted(Counter(p["beat"] for p in pubs_window).items())),
        "attempts_by_beat": {b: len(ts) for b, ts in attempts.items()},
        "beat_phase_ms": phases,
        "min_phase_gap_ms": min_gap_ms(list(phases.values())),
        "ticks_with_n_runs": {str(n): histogram[n] for n in sorted(histogram)},
        "beat_send_errors": errors,
        "longest_gap_without_run_s": round(max(b - a for a, b in itertools.pairwise(edges)), 3),
        **killed,
    }


# ----------------------------------------------------------------- report

def environment(server: Server, third: dict[str, str]) -> dict[str, Any]:
    redis_version = server.client().info("server")["redis_version"]
    ours = versions(sys.executable, ["celery", "kombu", "redis"])
    load = os.getloadavg()
    return {
        "python": platform.python_version(),
        **ours,
        **third,
        "redis_server": redis_version,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in load],
    }


def table(report: dict[str, Any]) -> str:
    rows = []
    for r in report["results"]:
        if "skipped" in r:
            rows.append([r["label"], r["mode"], "skipped", "", "", "", "", "", r["skipped"], ""])
            continue
        phases = "/".join("-" if v is None else f"{v:.0f}" for v in r["beat_phase_ms"].values())
        hist = " ".join(f"{n}:{c}" for n, c in r["ticks_with_n_runs"].items())
        gap = "-" if r["min_phase_gap_ms"] is None else f"{r['min_phase_gap_ms']:.0f}"
        mode = r["mode"]
        if "killed_beat" in r:
            mode += f" (beat {r['killed_beat']} SIGKILLed at +{r['killed_at_s']:.1f} s)"
        rows.append([r["label"], mode, f"**{r['runs_per_tick']:.2f}**", r["executions"],
                     f"{r['ticks']:.1f}", f"{r['published_per_tick']:.2f}", phases, gap, hist,
                     f"{r['longest_gap_without_run_s']:.1f}"])
    headers = ["variant", "beats launched", "runs per tick", "executions", "ticks",
               "published per tick", "beat phase (ms, beats 1/2/3)", "min phase gap (ms)",
               "ticks with n runs (n:count)", "longest gap without a run (s)"]
    env = report["environment"]
    lines = [
        f"3 beats, 1 worker (prefork, concurrency 4), 1 s entry, task sleeps {TASK_SLEEP * 1000:.0f} ms, "
        f"{report['seconds']:.0f} s measured per row.",
        "",
        markdown_table(headers, rows),
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()),
    ]
    if report["logs"]:
        lines.append(f"Logs: {report['logs']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per run (default 20)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--venv", help="virtualenv for the third-party packages (kept; default: a temp dir)")
    parser.add_argument("--key-probe", action="store_true",
                        help="only print which calls share a lock key in each library (no processes)")
    parser.add_argument("--keep", action="store_true", help="keep the logs (work directory)")
    parser.add_argument("--singleton", default="celery-singleton==0.3.1", help="pip requirement")
    parser.add_argument("--once", default="celery-once==3.0.1", help="pip requirement")
    parser.add_argument("--redbeat", default="celery-redbeat==2.4.2", help="pip requirement")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS] + [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown variant or mode: {', '.join(unknown)}")
    if not 1 <= args.seconds <= 600:
        parser.error("--seconds must be between 1 and 600")
    return args


def key_probe(venv: Path, requirements: list[str]) -> int:
    try:
        python = third_party_python(venv, requirements)
    except (subprocess.CalledProcessError, OSError) as exc:
        progress(f"SKIPPING the key probe: cannot install {' / '.join(requirements)}: {exc}")
        return 0
    probe = ROOT / "benchmarks" / "compare_apps" / "key_probe.py"
    return subprocess.run([python, str(probe)], env=bench_env(), cwd=ROOT).returncode


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    work = Path(tempfile.mkdtemp(prefix="csb-compare-"))
    venv = Path(args.venv) if args.venv else work / "venv"
    procs = Processes()
    server: Server | None = None
    results: list[dict[str, Any]] = []
    try:
        if args.key_probe:
            return key_probe(venv, [args.singleton, args.once])
        needed = {VARIANTS[v].package for v in args.variants} - {None}
        third_python, third, skipped = prepare_third_party(
            venv, {p: getattr(args, p) for p in PACKAGES if p in needed})
        server = Server()
        env_info = environment(server, third)
        for mode in args.modes:
            for name in args.variants:
                variant = VARIANTS[name]
                if variant.package in skipped:
                    results.append({"variant": name, "label": variant.label, "mode": mode,
                                    "skipped": skipped[variant.package]})
                    continue
                progress(f"{name} ({mode}): {args.seconds:.0f} s")
                result = run_variant(name, mode, args.seconds,
                                     third_python if variant.package and third_python else sys.executable,
                                     server, work, procs)
                progress(f"  -> {result['runs_per_tick']:.2f} runs per tick")
                results.append(result)
    finally:
        procs.stop_all()
        if server is not None:
            server.stop()
            shutil.rmtree(server.dir, ignore_errors=True)
        if not args.venv:
            shutil.rmtree(venv, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report = {"seconds": args.seconds, "beats": BEATS, "interval_s": INTERVAL,
              "task_sleep_s": TASK_SLEEP, "environment": env_info, "results": results,
              "logs": str(work) if args.keep else None}
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
