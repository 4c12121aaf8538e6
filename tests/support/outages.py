"""A Redis outage that starts just before a run's acquire (``tests.apps.outage_app``).

The run is held at a gate (files in a directory: the Redis a gate would use may be
the one about to go down) just before its ``__call__``; the test starts the
outage, opens the gate, and the run's acquire meets the outage.
:func:`hold_at_the_gate` and :func:`open_the_gate` do that in two steps, so a test
may start any outage in between (:class:`Outage`, or several).
"""

from __future__ import annotations

import itertools
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from .owners import register
from .paths import scratch_file
from .processes import CeleryProcess, start_worker
from .servers import RedisServer
from .waiting import wait_for

__all__ = ["APP", "DROPPED", "NOT_STARTED", "Held", "Outage", "Unanswered", "dropped", "hold_at_the_gate",
           "open_the_gate", "wait_for_output"]

APP = "tests.apps.outage_app"
#: What Celery logs when a run's message is dropped for good.
DROPPED = "reject requeue=False"
#: What a run logs when its first acquire meets the outage.
NOT_STARTED = "not started, Redis unavailable"

_workers = itertools.count()


@dataclass
class Outage:
    """One way a redis-server stops working, started and ended on purpose.

    ``restart``: SIGTERM (the AOF is written out, the port kept), started again from
    its AOF by :meth:`end`; connections are refused meanwhile. ``refused-writes``:
    ``maxmemory`` 1 byte with ``noeviction``: every write answers "OOM command not
    allowed", reads work (a broker's consumer keeps its connection).
    """

    kind: str
    server: RedisServer

    def begin(self) -> None:
        if self.kind == "restart":
            self.server.stop()
            assert not self.server.running
        else:
            with self.server.client() as admin:
                admin.config_set("maxmemory", 1)
                with pytest.raises(redis.exceptions.OutOfMemoryError):
                    admin.set("outage:probe", "1")  # the outage is real: writes are refused

    def end(self) -> None:
        if self.kind == "restart":
            self.server.start()  # same port, same directory: the AOF is loaded
        else:
            with self.server.client() as admin:
                admin.config_set("maxmemory", 0)


class Unanswered:
    """A loopback port where nothing answers: a connect to it times out (a host that is down
    or cut off, not one that refuses). It listens but never accepts, and its one-slot
    backlog is filled first, so the kernel drops every further SYN. Closed by its owner."""

    name = "unanswered"

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.fillers: list[socket.socket] = []
        self.log = scratch_file(self.name)  # nothing is written there: a failure report shows it empty

    def start(self) -> Unanswered:
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        for _ in range(2):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", self.port))
            self.fillers.append(filler)
        register(self)
        return self

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    @property
    def running(self) -> bool:
        return self.listener.fileno() != -1

    def tail(self, lines: int = 15) -> str:
        return ""

    def close(self) -> None:
        for sock in (*self.fillers, self.listener):
            sock.close()


def dropped(worker: CeleryProcess) -> bool:
    return DROPPED in worker.output()


def wait_for_output(workers: list[CeleryProcess], text: str, timeout: float) -> None:
    """Wait until one of ``workers`` logged ``text``, whether it still runs or not (Celery's
    consumer may exit on a broker restart while its pool child logs on)."""
    wait_for(lambda: any(text in worker.output() for worker in workers), timeout=timeout,
             message=f"{text!r} in the log of {', '.join(worker.name for worker in workers)}")


@dataclass
class Held:
    """A run held at the gate: its worker (and how to start another), its result, the servers."""

    worker: CeleryProcess
    result: AsyncResult
    lock_server: RedisServer | Unanswered
    broker: RedisServer
    pool: str
    env: dict[str, str]
    gate: Path
    standbys: list[CeleryProcess] = field(default_factory=list)

    @property
    def workers(self) -> list[CeleryProcess]:
        return [self.worker, *self.standbys]

    @property
    def runner(self) -> int:
        """The pid of the process the held run is in (a prefork pool child, or the worker)."""
        return int((self.gate / f"waiting-{self.result.id}").read_text())

    def log_of(self, text: str) -> bool:
        """Whether a worker of this run logged ``text``."""
        return any(text in worker.output() for worker in self.workers)

    def standby(self, redis_server: RedisServer, pool: str | None = None) -> CeleryProcess:
        """Start one more worker of the same app and servers, on the same pool unless told
        (for a message given back, or one whose first worker exited)."""
        worker = start_worker(redis_server, APP, f"standby{next(_workers)}", pool=pool or self.pool, env=self.env)
        self.standbys.append(worker)
        return worker


def hold_at_the_gate(
    task: str, pool: str, *, redis_server: RedisServer, lock_server: RedisServer | Unanswered, broker: RedisServer,
    client_apps: list[Celery], gate: Path, options: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> Held:
    """Start a worker, publish one run of ``task`` with ``options`` (``send_task``'s) and
    wait until it is held at the gate (and, for ``job``, acknowledged: Celery's early ack)."""
    base = f"redis://127.0.0.1:{broker.port}"
    worker_env = {"CSB_OUTAGE_BROKER": base, "CSB_LOCK_REDIS": lock_server.url(2), "CSB_GATE": str(gate),
                  "CSB_VISIBILITY_TIMEOUT": "10", **(env or {})}
    worker = start_worker(redis_server, APP, f"outage{next(_workers)}", pool=pool, concurrency=2, env=worker_env)
    worker.wait_for_line("concurrency:", f"2 ({'thread' if pool == 'threads' else pool}", timeout=5)
    # Published without a result backend (Celery's Redis backend would subscribe to the
    # result at once, on a server that may go down); read by polling.
    publisher = Celery("outage-publisher", broker=f"{base}/0")
    reader = Celery("outage-reader", broker=f"{base}/0", backend=f"{base}/1")
    client_apps.extend([publisher, reader])
    result = reader.AsyncResult(publisher.send_task(f"{APP}.{task}", ("k",), **(options or {})).id)
    wait_for(lambda: (gate / f"waiting-{result.id}").exists(), timeout=30,
             message="the run held at the gate, just before its acquire")
    if task == "job":  # acknowledged before the outage (threads and gevent ack later)
        with broker.client(0) as queue:
            wait_for(lambda: queue.hlen("unacked") == 0, timeout=10, message="Celery's early acknowledgement")
    return Held(worker, result, lock_server, broker, pool, worker_env, gate)


def open_the_gate(held: Held) -> None:
    """Let the run go to its acquire (the outage has begun); wait until it met the outage."""
    (held.gate / "open").touch()
    wait_for_output([held.worker], f"[{held.result.id}] {NOT_STARTED}", timeout=30)
