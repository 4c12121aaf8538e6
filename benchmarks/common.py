"""Helpers shared by the benchmarks: servers, processes, statistics, tables."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise RuntimeError(f"timed out waiting for {what}")


class Server:
    """A private redis-server for one benchmark run."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="csb-bench-")
        binary = os.environ.get("REDIS_SERVER") or shutil.which("redis-server") or "redis-server"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_until(self._up, 20, "redis-server")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db)

    def _up(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

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
        self.process.terminate()
        self.process.wait(10)


def start_celery(args: Sequence[str], env: dict[str, str], ready: str | None, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "celery", *args], env=env, cwd=ROOT,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    if ready:
        wait_until(lambda: ready in log.read_text(errors="replace") or process.poll() is not None,
                   120, f"{ready!r} in {log}")
        if process.poll() is not None:
            raise RuntimeError(log.read_text(errors="replace")[-3000:])
    return process


def bench_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


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
