"""Child processes that never outlive their parent.

Every child starts a new session, so its process group holds it and whatever
it forks (a Celery worker's pool processes): stopping a child ends by
SIGKILLing that group and waiting until it is empty. On Linux each child also
asks the kernel (``prctl(PR_SET_PDEATHSIG)``) for a signal when its parent
dies, even by SIGKILL, so nothing survives a killed test session or demo.

``PR_SET_PDEATHSIG`` fires when the *thread* that started the child ends:
start children from a thread that lives as long as they should (the main
thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path

from .waiting import wait_until

__all__ = ["ChildProcess", "ProcessError", "die_with_parent", "group_alive", "signal_group"]

#: ``prctl`` option asking the kernel to signal a process when its parent dies.
PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    # Looked up here, in the parent: the child only calls it between fork and exec.
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


class ProcessError(RuntimeError):
    """A child process exited early, or did not do what was waited for in time."""


def die_with_parent(signum: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get ``signum`` when this process dies.

    None where ``prctl`` does not exist (not Linux). Should this process die
    between the fork and the ``prctl`` call, the child exits at once.
    """
    if _prctl is None:
        return None
    prctl, parent, number = _prctl, os.getpid(), int(signum)

    def preexec() -> None:  # pragma: no cover - runs in the child, before exec
        prctl(PR_SET_PDEATHSIG, number)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def _preexec(first: Callable[[], None] | None, cpus: frozenset[int] | None) -> Callable[[], None] | None:
    """``first``, then (``cpus`` given) the child's CPU affinity: one ``preexec_fn``."""
    if cpus is None:
        return first

    def preexec() -> None:  # pragma: no cover - runs in the child, before exec
        if first is not None:
            first()
        os.sched_setaffinity(0, cpus)

    return preexec


def signal_group(pgid: int, signum: int) -> None:
    """Send ``signum`` to the process group ``pgid``, if it still exists."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _live_members(pgid: int) -> bool | None:
    """Whether a process of group ``pgid`` other than a zombie exists (None: no /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def group_alive(pgid: int) -> bool:
    """True while any process of the process group ``pgid`` runs.

    Zombies do not count: where nobody reaps orphans (PID 1 in some
    containers) they would otherwise keep a swept group "alive" for ever.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    live = _live_members(pgid)
    return True if live is None else live


class ChildProcess:
    """One child process, leader of its own process group, output in ``log``.

    ``error`` is the exception class raised when the process exits early or a
    wait times out (tests use AssertionError, the demo its DemoError).
    ``user`` runs it as another user (its uid and primary group, no other
    groups); that needs root. ``cpus`` confines it, and every thread it makes, to
    those CPUs (set in the child before it runs anything).
    """

    error: type[Exception] = ProcessError

    def __init__(self, name: str, argv: list[str], *, env: dict[str, str] | None = None,
                 cwd: Path | str | None = None, log: Path,
                 death_signal: int = signal.SIGKILL, user: str | None = None,
                 cpus: Collection[int] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.log = Path(log)
        self.death_signal = death_signal
        self.user = user
        self.cpus = frozenset(cpus) if cpus is not None else None
        self.process: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        state = "not started" if self.process is None else (
            "running" if self.running else f"exited {self.returncode}")
        return f"<{type(self).__name__} {self.name} pid={self.process and self.process.pid} {state}>"

    # ----------------------------------------------------------------- start

    def start(self) -> ChildProcess:
        """Start the process in a new session (its own process group)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        # Popen switches user before preexec_fn: the death signal survives the switch.
        as_user: dict[str, object] = {}
        if self.user is not None:
            import pwd

            entry = pwd.getpwnam(self.user)
            as_user = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(  # type: ignore[call-overload]
                self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_preexec(die_with_parent(self.death_signal), self.cpus), **as_user,
            )
        return self

    # ----------------------------------------------------------------- state

    @property
    def pid(self) -> int:
        if self.process is None:
            raise self.error(f"{self.name} was never started")
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
        """Raise ``error`` with the end of the log if the process has exited."""
        code = self.returncode
        if self.process is not None and code is not None:
            raise self.error(f"{self.name} (pid {self.process.pid}) exited with status {code}; "
                             f"end of {self.log}:\n{self.tail(40)}")

    def wait_for_output(self, text: str, timeout: float) -> None:
        """Wait until ``text`` is in the log; fail at once if the process exits first."""
        def seen() -> bool:
            if text in self.output():
                return True
            self.check_running()
            return False

        try:
            wait_until(seen, timeout, f"{self.name} to print {text!r}", interval=0.05, error=self.error)
        except self.error as exc:
            if "timed out" in str(exc):
                raise self.error(f"{exc}; end of {self.log}:\n{self.tail(40)}") from None
            raise

    def await_answer(self, answers: Callable[[], bool], where: str, timeout: float, *,
                     interval: float, tail_lines: int) -> bool:
        """After :meth:`start` of a server: wait until ``answers()`` or the process ends.

        True when it runs and answered. False when it exited first (reaped; most
        likely its port was taken meanwhile: the caller tries another). Timed out:
        killed, and ``self.error`` raised with the end of its log. Interrupted:
        killed, and the interruption goes on (the caller never gets to stop it).
        """
        try:
            wait_until(lambda: self.returncode is not None or answers(), timeout,
                       f"{self.name} (pid {self.pid}) on {where}", interval=interval, error=self.error)
        except self.error:
            tail = self.tail(tail_lines)
            self.kill()
            raise self.error(f"{self.name} did not answer on {where}; end of {self.log}:\n{tail}") from None
        except BaseException:
            self.kill()
            raise
        if self.running:
            return True
        self.kill()
        return False

    # ----------------------------------------------------------------- stop

    def send(self, signum: int) -> None:
        """Send ``signum`` to the process alone (not its group), if it runs."""
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        """SIGTERM the process alone: a clean shutdown begins (a worker ends its pool)."""
        self.send(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the process and its whole group at once, and reap it."""
        if self.process is None:
            return
        signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout: float = 15.0, hurry: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM the process, wait up to ``timeout`` s, then SIGKILL its group.

        Only the group leader gets SIGTERM: a Celery worker then shuts down
        warmly and ends its own pool processes. ``hurry`` returning True skips
        the wait. Whatever the path, the group is swept with SIGKILL and waited
        for (up to 5 s) until it is empty.
        """
        if self.process is None:
            return
        if self.process.poll() is None:
            self.terminate()
            deadline = time.monotonic() + timeout
            while self.process.poll() is None and time.monotonic() < deadline and not hurry():
                time.sleep(0.05)
        signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()
        # Orphans of the group are reparented and reaped elsewhere; give them a moment.
        deadline = time.monotonic() + 5.0
        while group_alive(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
