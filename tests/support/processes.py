"""Real processes the tests start: ``celery`` sub-commands and other programs.

Each is a :class:`harness.processes.ChildProcess` (own process group, dies
with the test session, output in a log file in the scratch directory) and
registers itself with the current owner when it starts (see :mod:`.owners`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from harness.processes import ChildProcess, die_with_parent

from .owners import Owner, owning, register
from .paths import ROOT, scratch_file
from .servers import RedisServer
from .waiting import wait_for

__all__ = ["CeleryProcess", "TestProcess", "child_env", "process_state", "run_command", "start_worker",
           "wait_until_stopped"]


def child_env(redis_server: RedisServer, **extra: str) -> dict[str, str]:
    """This process's environment, plus the repository on PYTHONPATH and the
    test server's address in ``CSB_TEST_REDIS`` (what ``tests/apps`` read)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["CSB_TEST_REDIS"] = f"redis://127.0.0.1:{redis_server.port}"
    env.update(extra)
    return env


class TestProcess(ChildProcess):
    """A child process of the tests: registered when started; failures are AssertionErrors."""

    __test__ = False  # not a test class, whatever pytest thinks of the name
    error = AssertionError

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None,
                 cwd: Path | str | None = ROOT, log: Path | None = None, cpus: Collection[int] | None = None) -> None:
        super().__init__(name, argv, env=env, cwd=cwd, log=log or scratch_file(name), cpus=cpus)

    def start(self) -> TestProcess:
        register(self)  # before anything can fail
        super().start()
        return self

    def close(self) -> None:
        self.stop()

    def wait_for_log(self, text: str, timeout: float = 60.0) -> None:
        """Wait until ``text`` is in the output; fail at once if the process exits first."""
        self.wait_for_output(text, timeout)

    def wait_for_line(self, *parts: str, timeout: float = 60.0) -> str:
        """Wait for one output line containing every one of ``parts``; return it."""
        def line() -> str | None:
            found = next((ln for ln in self.output().splitlines() if all(p in ln for p in parts)), None)
            if found is None:
                self.check_running()
            return found

        try:
            return wait_for(line, timeout=timeout, message=f"a line with {parts!r} in {self.log}")  # type: ignore[no-any-return]
        except AssertionError as exc:
            if "timed out" in str(exc):
                raise AssertionError(f"{exc}; end of {self.log}:\n{self.tail(40)}") from None
            raise

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the process alone."""
        self.send(signum)

    def kill_group(self) -> None:
        """SIGKILL the process and everything it started (pool children), at once."""
        self.kill()


class CeleryProcess(TestProcess):
    """``python -m celery <args>`` (worker, beat, flower, ...) run from the repository root."""

    def __init__(self, args: list[str], env: dict[str, str], name: str = "celery") -> None:
        self.args = args
        super().__init__(name, [sys.executable, "-m", "celery", *args], env)


def start_worker(redis_server: RedisServer, app: str, name: str, *, pool: str = "prefork",
                 concurrency: int = 2, extra: list[str] | None = None,
                 env: dict[str, str] | None = None, events: bool = True) -> CeleryProcess:
    """Start ``celery -A app worker`` (task events on unless ``events`` is False, node
    ``name@host``) and wait until it is ready.

    It is registered with the current owner before the wait, so a worker that
    never gets ready is stopped as well.
    """
    worker = CeleryProcess(
        ["-A", app, "worker", "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h",
         "-l", "info", *(["-E"] if events else []), "--without-gossip", "--without-mingle", "--without-heartbeat",
         *(extra or [])],
        child_env(redis_server, **(env or {})), name=name,
    ).start()
    worker.wait_for_log("ready.", timeout=60)
    return worker


def module_worker(redis_server: RedisServer, app: str, name: str, **options: Any) -> Iterator[CeleryProcess]:
    """Body of a module-scoped fixture (``yield from``): one worker of ``app``
    (:func:`start_worker`'s ``options``), owned by the module and stopped after it."""
    with owning(Owner(f"{name} worker")) as owner:
        process = start_worker(redis_server, app, name, **options)
    yield process
    owner.close()


def run_command(argv: list[str], *, timeout: float, **options: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` for short commands, from the repository root; the command
    dies with the test session (it is never left running)."""
    options.setdefault("cwd", ROOT)
    return subprocess.run(argv, timeout=timeout, preexec_fn=die_with_parent(signal.SIGKILL), **options)


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` in ``/proc`` (``R``, ``S``, ``T`` stopped, ``Z``
    zombie...), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]  # after "pid (comm)": the name may hold spaces
    except (FileNotFoundError, ProcessLookupError):
        return None


def wait_until_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until the process ``pid`` is stopped (state ``T`` after a SIGSTOP: it runs no
    more from then on, which ``os.kill`` returning does not promise)."""
    wait_for(lambda: process_state(pid) == "T", timeout=timeout, message=f"process {pid} to stop")
