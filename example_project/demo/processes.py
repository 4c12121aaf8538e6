"""The demo's child processes: each in a process group of its own, always stopped.

Built on :class:`harness.processes.ChildProcess` (shared with the tests and the
benchmarks): every child starts a new session, so its process group holds it
and whatever it forks (a worker's pool processes). Ctrl-C in a terminal then
reaches the demo alone, which stops the children in order, and stopping a
child ends by signalling its whole group: nothing it started survives it. On
Linux a child also gets SIGTERM should the demo itself be killed with SIGKILL
(a worker then shuts down warmly and ends its pool).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.processes import ChildProcess, group_alive
from harness.waiting import wait_until as _wait_until

__all__ = ["Child", "DemoError", "group_alive", "wait_until"]


class DemoError(RuntimeError):
    """The demo cannot go on (a process failed to start, no Redis, ...)."""


def wait_until(condition: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.1) -> Any:
    """Poll ``condition`` until it returns a truthy value; DemoError after ``timeout`` s."""
    return _wait_until(condition, timeout, what, interval=interval, error=DemoError)


class Child(ChildProcess):
    """One process of the demo cluster, with its output in ``log``."""

    error = DemoError

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path,
                 log: Path) -> None:
        super().__init__(name, argv, env=env, cwd=cwd, log=log, death_signal=signal.SIGTERM)
        #: Set when the demo killed it on purpose (failover).
        self.killed = False
        self._terminated = False

    def start(self) -> Child:
        super().start()
        return self

    def terminate(self) -> None:
        """Send SIGTERM to the process (once): a clean shutdown begins."""
        if not self._terminated and self.running:
            self._terminated = True
            super().terminate()
