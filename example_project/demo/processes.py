"""The demo's child processes: each in a process group of its own, always stopped.

Every child starts a new session, so its process group holds it and whatever
it forks (a worker's pool processes). Ctrl-C in a terminal then reaches the
demo alone, which stops the children in order, and stopping a child ends by
signalling its whole group: nothing it started survives it. On Linux a child
also gets SIGTERM should the demo itself be killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["Child", "DemoError", "group_alive", "wait_until"]

#: ``prctl`` option asking the kernel to signal a process when its parent dies.
_PR_SET_PDEATHSIG = 1


class DemoError(RuntimeError):
    """The demo cannot go on (a process failed to start, no Redis, ...)."""


def wait_until(condition: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.1) -> Any:
    """Poll ``condition`` until it returns a truthy value; DemoError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def group_alive(pgid: int) -> bool:
    """True while any process of the process group ``pgid`` exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    """Ask Linux for SIGTERM when the demo dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Child:
    """One process of the demo cluster, with its output in ``log``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path,
                 log: Path) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        #: Set when the demo killed it on purpose (failover).
        self.killed = False
        self._terminated = False

    def start(self) -> Child:
        """Start the process in a new session (its own process group)."""
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        return self

    @property
    def pid(self) -> int:
        if self.process is None:
            raise DemoError(f"{self.name} was never started")
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 15) -> str:
        """The last lines of the process's output, indented, for error messages."""
        return "\n".join("    " + line for line in self.output().splitlines()[-lines:])

    def check_running(self) -> None:
        """Raise DemoError with the end of its log if the process has exited."""
        code = self.returncode
        if self.process is not None and code is not None:
            raise DemoError(f"{self.name} (pid {self.pid}) exited with status {code}; "
                            f"end of {self.log}:\n{self.tail()}")

    def wait_for_output(self, text: str, timeout: float) -> None:
        """Wait until ``text`` appears in the log; DemoError if the process exits first."""
        def seen() -> bool:
            if text in self.output():
                return True
            self.check_running()
            return False

        try:
            wait_until(seen, timeout, f"{self.name} to print {text!r}", interval=0.1)
        except DemoError as exc:
            if "timed out" in str(exc):
                raise DemoError(f"{exc}; end of {self.log}:\n{self.tail()}") from None
            raise

    def terminate(self) -> None:
        """Send SIGTERM to the process (once): a clean shutdown begins."""
        if self.running and not self._terminated:
            self._terminated = True
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()  # type: ignore[union-attr]

    def kill(self) -> None:
        """SIGKILL the process and its group at once (no clean-up on its side)."""
        if self.process is None:
            return
        _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout: float, hurry: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM the process, wait up to ``timeout`` s, then SIGKILL its group.

        Only the group leader gets SIGTERM: a Celery worker then shuts down
        warmly and ends its own pool processes. ``hurry`` returning True (the
        user pressed Ctrl-C again) skips the wait. Whatever the path, the
        group is swept with SIGKILL and waited for until it is empty.
        """
        if self.process is None:
            return
        if self.process.poll() is None:
            self.terminate()
            deadline = time.monotonic() + timeout
            while self.process.poll() is None and time.monotonic() < deadline and not hurry():
                time.sleep(0.05)
        _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()
        # Orphans of the group are reaped by init; give them a moment to go.
        deadline = time.monotonic() + 5.0
        while group_alive(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
