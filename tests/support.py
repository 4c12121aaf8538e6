"""Test harness: a real redis-server, real worker processes, deadline waits.

Nothing here mocks Redis or Celery: tests talk to a ``redis-server`` started on
a free loopback port and to ``celery worker`` processes started from the
tests' own app modules (``tests/apps``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent

#: Databases of the test redis-server.
BROKER_DB, BACKEND_DB, LOCK_DB, RECORD_DB = 0, 1, 2, 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05,
              message: str = "condition") -> Any:
    """Poll ``condition`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


def redis_server_binary() -> str:
    binary = os.environ.get("REDIS_SERVER") or shutil.which("redis-server")
    if not binary:
        raise RuntimeError("redis-server not found: run `make test` (installs it) or set REDIS_SERVER")
    return binary


class RedisServer:
    """A throw-away redis-server on a free loopback port (no persistence)."""

    def __init__(self, *extra_args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.dir = tempfile.mkdtemp(prefix="csb-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, socket_timeout=10)

    def start(self) -> "RedisServer":
        self.process = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", self.dir, *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

        def up() -> bool:
            try:
                return bool(self.client().ping())
            except redis.RedisError:
                return False

        wait_for(up, timeout=20, message=f"redis-server on port {self.port}")
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """SIGKILL: every key is gone (no persistence), as in a crash."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def restart(self) -> None:
        self.kill()
        self.start()


def child_env(redis_server: RedisServer, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["CSB_TEST_REDIS"] = f"redis://127.0.0.1:{redis_server.port}"
    env.update(extra)
    return env


class CeleryProcess:
    """A ``celery`` sub-command (worker, beat, ...) run as a real process.

    Output goes to a log file; :meth:`wait_for_log` polls it.
    """

    def __init__(self, args: list[str], env: dict[str, str], name: str = "celery") -> None:
        self.args = args
        self.env = env
        self.log = Path(tempfile.mkstemp(prefix=f"csb-{name}-", suffix=".log")[1])
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "CeleryProcess":
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", *self.args], env=self.env, cwd=ROOT,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 60.0) -> None:
        def seen() -> bool:
            if self.process is not None and self.process.poll() is not None and text not in self.output():
                raise AssertionError(f"process exited ({self.process.returncode}) before {text!r}:\n{self.output()[-4000:]}")
            return text in self.output()

        wait_for(seen, timeout=timeout, message=f"{text!r} in {self.log}")

    def wait_for_line(self, *parts: str, timeout: float = 60.0) -> str:
        """Wait for one log line containing every one of ``parts``; return it."""
        def line() -> str | None:
            return next((ln for ln in self.output().splitlines() if all(p in ln for p in parts)), None)

        return wait_for(line, timeout=timeout, message=f"a line with {parts!r} in {self.log}")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signum)

    def kill_group(self) -> None:
        """SIGKILL the process and everything it started (pool children)."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL of the group if it lingers."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group()
        try:  # pool children left behind by a killed parent
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def start_worker(redis_server: RedisServer, app: str, name: str, *, pool: str = "prefork",
                 concurrency: int = 2, extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> CeleryProcess:
    """Start ``celery -A app worker`` and wait until it is ready."""
    worker = CeleryProcess(
        ["-A", app, "worker", "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h",
         "-l", "info", "-E", "--without-gossip", "--without-mingle", "--without-heartbeat",
         *(extra or [])],
        child_env(redis_server, **(env or {})), name=name,
    ).start()
    worker.wait_for_log("ready.", timeout=60)
    return worker
