"""Peers: plain Task, SingletonTask, celery-singleton and celery-once, one solo worker, same run.

On every server this machine has (:mod:`benchmarks.servers`: the default
``redis-server`` and those shipped in packages), each a process of its own
started for the run: every variant on the default server, ``--server-variants``
(plain, ours and ours with ``acks_late`` by default) on the others, ratios to
plain on the same server. A server that is not installed is reported as skipped.

For each variant, N no-op tasks with distinct arguments are queued, then one
solo worker drains them. Broker (db 0), the locks of every library (db 1) and
the result backend (db 2) share one private redis-server on loopback: the
*measured* server. Rounds are interleaved (the variants' order rotates from one
round to the next) and reported as medians with min-max.

What is measured, per variant, over the drain only (the worker first runs a
gate task that holds it until the benchmark has read the measured server's
counters; the benchmark's own signals go through a second redis-server):

* **tasks/s** inside the worker: N / (first task's start to last task's end),
  counted in the worker's memory (as ``bench_task``, without its Redis counter);
* **worker CPU us/task**: the worker process's CPU time (all threads) over the
  same span / N: what the library costs the worker, little moved by other
  load on the machine (wall-clock rates are);
* **Redis CPU us/task**: ``INFO cpu`` ``used_cpu_sys + used_cpu_user`` delta / N;
* **commands/task**: ``INFO commandstats`` calls delta / N. Redis counts every
  command a Lua script runs as a command (``total_commands_processed`` too):
  a script with 5 ``redis.call`` is 6 commands;
* **requests/task**: top-level commands that clients sent, without those run
  inside Lua. No counter of Redis tells them apart, so one extra round per
  variant, after the timed ones, runs with a ``MONITOR`` client that tags each
  command with its origin (a client address, or ``lua``); requests are the
  lines not from Lua. That round is not timed (MONITOR slows the server); the
  JSON report has its per-command split and ``monitor_gap``, its commandstats
  delta minus what MONITOR showed (a few commands per round);
* **reads/task**: ``INFO stats`` ``total_reads_processed`` delta / N: the
  server's socket reads, about one per client write (a pipeline is one, a
  command written without waiting for its reply is one too);
* **publish commands/task**: commandstats delta while the N tasks are queued
  (celery-singleton and celery-once claim their lock there, at publish time;
  the drain columns do not see it). Includes the publisher's start-up.

celery-singleton and celery-once are ``pip install``-ed (pinned, see
``--singleton``/``--once``) into a throw-away virtualenv by the helpers of
``benchmarks/compare_dedup.py`` (its ``.pth`` adds this project's virtualenv:
the same celery, kombu and redis-py for every variant); every variant then runs
with that interpreter. A package that cannot be installed has its variant
skipped with a message.

Usage: python -m benchmarks.bench_peers [--tasks 2000] [--rounds 3] [--variants ...] [--servers all|NAME ...]
       [--server-variants ...] [--venv DIR] [--json]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import redis

from harness.processes import ChildProcess

from .common import ROOT, Server, bench_cli, bench_env, markdown_table, progress, summary
from .compare_dedup import PACKAGES, prepare_third_party, versions
from .servers import DEFAULT, select_servers

APP = "benchmarks.compare_apps.peers_app"
#: name -> (label, third-party package option of compare_dedup, or None)
VARIANTS: dict[str, tuple[str, str | None]] = {
    "plain": ("plain Celery Task", None),
    "ours": ("SingletonTask (ours, default mode)", None),
    "celery_singleton": ("celery-singleton Singleton", "singleton"),
    "celery_once": ("celery-once QueueOnce", "once"),
    "ours_acks_late": ("SingletonTask (ours), acks_late", None),
    "plain_acks_late": ("plain Celery Task, acks_late", None),
    "ours_ignore_result": ("SingletonTask (ours), ignore_result", None),
    "plain_ignore_result": ("plain Celery Task, ignore_result", None),
}
#: What runs on the default server unless told otherwise (``plain_acks_late`` and the
#: ``_ignore_result`` variants only when asked).
DEFAULT_VARIANTS = ("plain", "ours", "ours_acks_late", "celery_singleton", "celery_once")
#: What runs on the other servers: the library's own cost on each server, ratio to plain there.
SERVER_VARIANTS = ("plain", "ours", "ours_acks_late")
#: Commands the benchmark itself runs on the measured server inside a drain
#: window: the first INFO (counted once it has run) and the two ECHO markers.
OWN_COMMANDS = 3
START, END = "csb-window-start", "csb-window-end"
TIMEOUT = 600.0


def counters(client: redis.Redis) -> dict[str, float]:
    """The measured server's counters, from one ``INFO all``."""
    info = client.info("all")
    return {
        "cpu_s": float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
        "commands": sum(v["calls"] for k, v in info.items() if k.startswith("cmdstat_")),
        "reads": info["total_reads_processed"],
    }


class Monitor(threading.Thread):
    """Counts the commands ``MONITOR`` shows between the two ECHO markers, by origin."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.client = server.client()
        self.ready = threading.Event()
        self.requests = self.inside_lua = 0
        self.by_command: dict[str, int] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.client.monitor() as monitor:
                self.ready.set()
                inside = False
                for line in monitor.listen():
                    command = line["command"]
                    if command == f"ECHO {START}":
                        inside = True
                    elif command == f"ECHO {END}":
                        return
                    elif inside:
                        lua = line["client_type"] == "lua"
                        name = ("lua " if lua else "") + command.split(" ", 1)[0].lower()
                        self.by_command[name] = self.by_command.get(name, 0) + 1
                        if lua:
                            self.inside_lua += 1
                        else:
                            self.requests += 1
        except BaseException as exc:  # reported by the caller
            self.error = exc
            self.ready.set()


def one_round(variant: str, tasks: int, python: str, measured: Server, ctl: Server, log: Path,
              monitored: bool = False) -> dict[str, Any]:
    """Queue ``tasks`` tasks, drain them with one solo worker; the measures of this round."""
    env = bench_env(CMP_REDIS=measured.url, CMP_CONTROL=ctl.url, CMP_VARIANT=variant)
    client, control = measured.client(), ctl.client()
    measured.flush()
    ctl.flush()
    # Keys the flush left (the library's server records): not locks or results of this round.
    left = {db: measured.client(db).dbsize() for db in (1, 2)}

    log.write_bytes(b"")
    before = counters(client)
    publisher = ChildProcess("publisher", [python, "-m", APP, "publish", str(tasks)], env=env, cwd=ROOT,
                             log=log)
    publisher.error = RuntimeError
    publisher.start()
    try:
        assert publisher.process is not None
        publisher.process.wait(TIMEOUT)
    finally:
        publisher.stop()  # sweeps its group; kills it only if it is still running
    if publisher.returncode != 0:
        raise RuntimeError(f"{variant}: publishing failed:\n{publisher.tail(30)}")
    published = counters(client)
    locks_after_publish = measured.client(1).dbsize() - left[1]

    worker = ChildProcess("worker", [python, "-m", "celery", "-A", APP, "worker", "-P", "solo", "-Q",
                                     "peers", "-l", "warning", "--without-gossip", "--without-mingle",
                                     "--without-heartbeat"], env=env, cwd=ROOT, log=log)
    worker.error = RuntimeError
    monitor = Monitor(measured) if monitored else None
    try:
        worker.start()
        if control.blpop(["ready"], timeout=120) is None:
            raise RuntimeError(f"{variant}: the worker did not start the gate task:\n{worker.tail(30)}")
        if monitor is not None:
            monitor.start()
            if not monitor.ready.wait(30) or monitor.error is not None:
                raise RuntimeError(f"MONITOR did not start: {monitor.error!r}")
        start = counters(client)
        client.echo(START)
        control.rpush("go", "1")
        done = control.blpop(["done"], timeout=TIMEOUT)
        client.echo(END)
        end = counters(client)
        if done is None:
            raise RuntimeError(f"{variant}: {tasks} tasks not done in {TIMEOUT:.0f} s:\n{worker.tail(30)}")
        if monitor is not None:
            monitor.join(TIMEOUT)
            if monitor.error is not None or monitor.is_alive():
                raise RuntimeError(f"MONITOR did not see the end marker: {monitor.error!r}")
    finally:
        worker.stop(timeout=30)
        if monitor is not None and monitor.is_alive():
            monitor.client.connection_pool.disconnect()
    outcome = json.loads(done[1])
    results = measured.client(2).dbsize() - left[2]
    if outcome["tasks"] != tasks or results != tasks:
        raise RuntimeError(f"{variant}: {outcome['tasks']} tasks ran, {results} results stored, not {tasks}")
    commands = end["commands"] - start["commands"] - OWN_COMMANDS
    measures: dict[str, Any] = {
        "tasks_per_s": tasks / outcome["seconds"],
        "worker_cpu_us_per_task": outcome["cpu_seconds"] * 1e6 / tasks,
        "redis_cpu_us_per_task": (end["cpu_s"] - start["cpu_s"]) * 1e6 / tasks,
        "commands_per_task": commands / tasks,
        "reads_per_task": (end["reads"] - start["reads"] - OWN_COMMANDS) / tasks,
        "publish_commands_per_task": (published["commands"] - before["commands"] - 1) / tasks,
        "locks_after_publish": locks_after_publish,
    }
    if monitor is not None:
        measures.update(requests_per_task=monitor.requests / tasks,
                        inside_lua_per_task=monitor.inside_lua / tasks,
                        monitor_gap=commands - (monitor.requests + monitor.inside_lua),
                        by_command={k: round(v / tasks, 3) for k, v in sorted(monitor.by_command.items())})
    return measures


def run(tasks: int, rounds: int, variants: tuple[str, ...] = DEFAULT_VARIANTS,
        servers: tuple[str, ...] = ("all",), server_variants: tuple[str, ...] = SERVER_VARIANTS,
        singleton: str = "celery-singleton==0.3.1", once: str = "celery-once==3.0.1",
        venv: str = "") -> dict[str, Any]:
    """``variants`` on the default server and ``server_variants`` on each other one of ``servers``,
    ``rounds`` times (interleaved), then once each under MONITOR; the report.

    ``servers``: names of :mod:`benchmarks.servers` (``all``: every one; those
    not installed are reported as skipped).
    """
    unknown = [v for v in (*variants, *server_variants) if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    found, skipped_servers = select_servers(servers)
    plan = {name: [v for v in variants if name == DEFAULT or v in server_variants] for name in found}
    work = Path(tempfile.mkdtemp(prefix="csb-bench-peers-"))
    venv_dir = Path(venv) if venv else work / "venv"
    requirements = {"singleton": singleton, "once": once}
    needed = {VARIANTS[v][1] for vs in plan.values() for v in vs} - {None}
    measured: dict[str, Server] = {}
    ctl: Server | None = None
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {}
    accounting: dict[str, dict[str, dict[str, Any]]] = {}
    load_at_start = _loadavg()
    try:
        third_python, third, skipped = prepare_third_party(
            venv_dir, {p: requirements[p] for p in PACKAGES if p in needed})
        python = third_python or sys.executable
        stack = versions(python, ["celery", "kombu", "redis"])
        if stack != versions(sys.executable, ["celery", "kombu", "redis"]):
            raise RuntimeError(f"the throw-away virtualenv sees {stack}, not this project's versions")
        runnable = {name: [v for v in vs if VARIANTS[v][1] not in skipped] for name, vs in plan.items()}
        samples = {name: {v: [] for v in vs} for name, vs in runnable.items()}
        ctl = Server()
        for name, server in found.items():
            measured[name] = Server(server.binary)
        log = work / "process.log"
        for r in range(rounds):
            for name, order in runnable.items():
                order = order[r % len(order):] + order[:r % len(order)] if order else []
                for variant in order:
                    progress(f"round {r + 1}/{rounds}: {found[name].label}: {variant} x {tasks}")
                    samples[name][variant].append(one_round(variant, tasks, python, measured[name], ctl, log))
        for name, order in runnable.items():
            accounting[name] = {}
            for variant in order:
                progress(f"MONITOR round: {found[name].label}: {variant} x {tasks}")
                accounting[name][variant] = one_round(variant, tasks, python, measured[name], ctl, log,
                                                      monitored=True)
    finally:
        for server_process in (*measured.values(), ctl):
            if server_process is not None:
                server_process.stop()
        shutil.rmtree(work, ignore_errors=True)
    report: dict[str, Any] = {
        "tasks": tasks, "rounds": rounds, "servers": {},
        "environment": {"interpreter": python, **stack, **third, "loadavg_1min_at_start": load_at_start,
                        "loadavg_1min_at_end": _loadavg()}}
    for name, why in skipped_servers.items():
        report["servers"][name] = {"skipped": why}
    for name, server in found.items():
        report["servers"][name] = {"label": server.label, "binary": server.binary,
                                   **report_of(tuple(plan[name]), samples[name], accounting[name], skipped)}
    return report


def _loadavg() -> str:
    """The 1-minute load average: other work on the machine moves wall-clock rates."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "unknown"


def report_of(variants: tuple[str, ...], samples: dict[str, list[dict[str, Any]]],
              accounting: dict[str, dict[str, Any]], skipped: dict[str, str]) -> dict[str, Any]:
    """One server's part of the report: medians (min-max) per variant, ratios to plain, the MONITOR round."""
    report: dict[str, Any] = {"variants": {}}
    for variant in variants:
        label, package = VARIANTS[variant]
        if variant not in samples:
            report["variants"][variant] = {"label": label, "skipped": skipped.get(package or "", "not run")}
            continue
        data: dict[str, Any] = {"label": label}
        for measure in ("tasks_per_s", "worker_cpu_us_per_task", "redis_cpu_us_per_task", "commands_per_task",
                        "reads_per_task", "publish_commands_per_task"):
            data[measure] = summary([s[measure] for s in samples[variant]])
        data["locks_after_publish"] = samples[variant][0]["locks_after_publish"]
        data["monitor_round"] = accounting[variant]
        report["variants"][variant] = data
    plain = report["variants"].get("plain", {})
    for data in report["variants"].values():
        if "skipped" in data or "tasks_per_s" not in plain:
            continue
        data["ratio_to_plain"] = data["tasks_per_s"]["median"] / plain["tasks_per_s"]["median"]
        for measure in ("worker_cpu_us_per_task", "redis_cpu_us_per_task"):
            data[f"{measure}_ratio_to_plain"] = data[measure]["median"] / plain[measure]["median"]
    return report


def _with_ratio(data: dict[str, Any], measure: str) -> str:
    """``median (ratio to plain x)`` of one measure, as a table cell."""
    ratio = data.get(f"{measure}_ratio_to_plain")
    return f"{data[measure]['median']:.0f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def _range(summary_: dict[str, float]) -> str:
    return f"{summary_['median']:.0f} ({summary_['min']:.0f}-{summary_['max']:.0f})"


def table(report: dict[str, Any]) -> str:
    """The report as a markdown table (one row per server and variant), what each column means, the versions."""
    rows = []
    blank = [""] * 8
    for name, server in report["servers"].items():
        if "skipped" in server:
            rows.append([name, f"skipped: {server['skipped']}", *blank])
            continue
        for data in server["variants"].values():
            if "skipped" in data:
                why = data["skipped"].split(": ", 1)[0]  # the pip error is in the JSON report and on stderr
                rows.append([server["label"], data["label"], f"skipped: {why}", *blank[1:]])
                continue
            ratio = f"{data['ratio_to_plain']:.2f}" if "ratio_to_plain" in data else "-"
            rows.append([server["label"], data["label"], _range(data["tasks_per_s"]), ratio,
                         _with_ratio(data, "worker_cpu_us_per_task"),
                         f"{_range(data['redis_cpu_us_per_task'])}"
                         + (f" ({data['redis_cpu_us_per_task_ratio_to_plain']:.2f}x)"
                            if "redis_cpu_us_per_task_ratio_to_plain" in data else ""),
                         f"{data['commands_per_task']['median']:.2f}",
                         f"{data['monitor_round']['requests_per_task']:.2f}",
                         f"{data['reads_per_task']['median']:.2f}",
                         f"{data['publish_commands_per_task']['median']:.2f}"])
    headers = ["server", "variant", "tasks/s median (min-max)", "ratio to plain", "worker CPU us/task (vs plain)",
               "Redis CPU us/task median (min-max) (vs plain)",
               "commands/task (incl. inside Lua)", "requests/task (top-level)", "server reads/task",
               "publish: commands/task"]
    env = report["environment"]
    return "\n".join([
        f"{report['tasks']:,} no-op tasks with distinct arguments, solo worker, broker + result backend + "
        f"locks on one loopback server, {report['rounds']} interleaved rounds (medians); every "
        "column but the last over the drain only. Each server is a separate process of its own, "
        "measured in the same run; ratios are to plain on the same server.",
        "",
        markdown_table(headers, rows),
        "",
        "Commands count those Redis runs inside Lua scripts; requests are the commands clients sent "
        "(counted by MONITOR in one extra, untimed round per variant); server reads are INFO "
        "total_reads_processed (about one per client write: a pipeline is one). celery-singleton and "
        "celery-once claim their lock when the task is published (last column), the drain sees their release.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in env.items()
                                 if k != "interpreter" and not k.startswith("loadavg")) + ". "
        f"Load average (1 min) at start {env['loadavg_1min_at_start']}, at end {env['loadavg_1min_at_end']}.",
    ])


def main(argv: list[str] | None = None) -> int:
    return bench_cli(__doc__, run, table, argv, tasks=2000, rounds=3, variants=DEFAULT_VARIANTS,
                     servers=("all",), server_variants=SERVER_VARIANTS, singleton="celery-singleton==0.3.1",
                     once="celery-once==3.0.1", venv="")


if __name__ == "__main__":
    sys.exit(main())
