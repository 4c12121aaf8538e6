"""Helpers shared by the benchmarks: servers, processes, statistics, tables.

Processes and redis-servers come from :mod:`harness` (shared with the tests
and the demo): every child is the leader of its own process group, dies with
the benchmark (``PR_SET_PDEATHSIG`` on Linux), and a redis-server is used only
once the server on its port reports the pid of the process we started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from celery_singleton_beat.recovery.window import mark_in_use
from harness.processes import ChildProcess
from harness.redis_server import RedisServerProcess, find_redis_server, free_port
from harness.waiting import wait_until as _wait_until

__all__ = ["ROOT", "Server", "bench_cli", "bench_env", "core_split", "cpu_layout", "cpu_layout_note", "free_port",
           "markdown_table", "process_cpu_seconds", "progress", "running_on", "start_celery", "summary", "wait_until"]

ROOT = Path(__file__).resolve().parent.parent
#: Databases the benchmark apps keep their locks in.
LOCK_DBS = range(4)


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` (every 10 ms) until truthy; RuntimeError after ``timeout`` s."""
    return _wait_until(condition, timeout, what, interval=0.01, error=RuntimeError)


class Server:
    """A private redis-server for one benchmark run (checked to be ours).

    ``binary``: the server to start (see :mod:`benchmarks.servers`); by default
    ``$REDIS_SERVER``, else ``redis-server`` on ``PATH``.
    """

    def __init__(self, binary: str | None = None) -> None:
        found = find_redis_server()
        self.dir = tempfile.mkdtemp(prefix="csb-bench-")
        self._process = RedisServerProcess(
            "redis", binary or (found[0] if found else "redis-server"),
            lambda port: ["--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", self.dir],
            workdir=Path(self.dir),
        )
        self._process.error = RuntimeError
        self._process.start()
        assert self._process.port is not None
        self.port: int = self._process.port
        self.in_use()

    def in_use(self) -> None:
        """Every database a benchmark keeps locks in has the library's record of the server
        serving them (``mark_in_use``): benchmarks measure a Redis in use, not the recovery
        window a new or emptied Redis costs its first locks."""
        for db in LOCK_DBS:
            with self.client(db) as client:
                mark_in_use(client)

    def flush(self, *dbs: int) -> None:
        """``FLUSHDB`` of ``dbs`` (``FLUSHALL`` without any), then :meth:`in_use`."""
        if not dbs:
            with self.client() as client:
                client.flushall()
        for db in dbs:
            with self.client(db) as client:
                client.flushdb()
        self.in_use()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db)

    def command_calls(self) -> tuple[int, int]:
        """(round trips, commands) so far from INFO commandstats, INFO itself excluded.

        Commands that Lua scripts run count as commands but not as round trips:
        a client's round trips are its EVALSHA calls plus its plain commands.
        """
        stats = self.client().info("commandstats")
        inner = {"cmdstat_get", "cmdstat_set", "cmdstat_del", "cmdstat_incr", "cmdstat_incrby",
                 "cmdstat_exists", "cmdstat_pexpire", "cmdstat_pttl", "cmdstat_time", "cmdstat_hincrby"}
        commands = sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info")
        trips = sum(v["calls"] for k, v in stats.items() if k not in inner and k != "cmdstat_info")
        return trips, commands

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        self._process.stop(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def start_celery(args: Sequence[str], env: dict[str, str], ready: str | None, log: Path,
                 cpus: Collection[int] | None = None) -> ChildProcess:
    """``python -m celery <args>``, output in ``log``; waits for ``ready`` in the log if given.
    ``cpus``: the only CPUs it may run on (every thread of it), else any.

    Stop it with ``.stop()`` (SIGTERM, then SIGKILL of its group) or ``.terminate()``.
    """
    process = ChildProcess(Path(log).stem, [sys.executable, "-m", "celery", *args], env=env, cwd=ROOT,
                           log=Path(log), cpus=cpus)
    process.error = RuntimeError
    process.log.write_bytes(b"")
    process.start()
    if ready:
        try:
            process.wait_for_output(ready, 120)
        except RuntimeError:
            process.stop(timeout=10)
            raise
    return process


def core_split() -> tuple[frozenset[int], frozenset[int]] | None:
    """This process's CPUs in two: the lowest for a measured worker, the rest for everything
    else (its servers, the harness), as if those ran on hosts of their own. None with fewer
    than two CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    return (frozenset(cpus[:1]), frozenset(cpus[1:])) if len(cpus) > 1 else None


def cpu_layout(split: tuple[frozenset[int], frozenset[int]] | None) -> dict[str, list[int]] | None:
    """``split`` (:func:`core_split`) as a report keeps it (JSON): None when every CPU was shared."""
    return None if split is None else {"worker": sorted(split[0]), "others": sorted(split[1])}


def cpu_layout_note(cpus: dict[str, list[int]] | None, others: str) -> str:
    """The report's line on where the worker and ``others`` ran (``cpus`` as the report keeps it)."""
    if not cpus:
        return f"CPUs: the worker, {others} share every CPU."
    return (f"CPUs: the worker alone on CPU {', '.join(map(str, cpus['worker']))}; {others} on "
            f"{', '.join(map(str, cpus['others']))} (as on hosts of their own).")


@contextlib.contextmanager
def running_on(cpus: Collection[int] | None) -> Iterator[None]:
    """This process (and every process it starts meanwhile) on ``cpus`` only; None: unchanged."""
    before = os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def bench_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` used so far, all its threads: ``utime + stime`` of
    ``/proc/<pid>/stat`` (Linux; clock ticks, 10 ms each on most kernels)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()  # after "pid (comm)": the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bench_cli(doc: str, run: Callable[..., dict[str, Any]], table: Callable[[dict[str, Any]], str],
              argv: list[str] | None, **defaults: Any) -> int:
    """The command line of a benchmark: one ``--option`` per keyword of ``run``, plus ``--json``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, (list, tuple)):
            parser.add_argument(flag, type=type(default[0]), nargs="+", default=list(default))
        else:
            parser.add_argument(flag, type=type(default), default=default)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    options = vars(parser.parse_args(argv))
    as_json = options.pop("json")
    report = run(**options)
    print(json.dumps(report, indent=2) if as_json else table(report))
    return 0
