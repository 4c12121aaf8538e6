"""One redis-server of the chaos cluster (the broker, a lock Redis, a Sentinel-managed
primary or replica, a Redis Cluster node): an append-only file, a port kept across
restarts, its starts and kills recorded in the history."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import redis

from ..redis_server import RedisServerProcess, find_redis_server, free_port
from .history import Recorder

__all__ = ["EMPTY", "Redis"]

#: An empty value in a redis.conf line (``save ""``).
EMPTY = '""'


class Redis:
    """A redis-server of the cluster with an append-only file, on a port it keeps across restarts.

    ``replica_of`` (a primary's port) starts it as a replica. ``with_file``: its
    options are in a configuration file that Sentinel rewrites as it moves the
    roles around, so a restart keeps the role Sentinel gave it last.
    ``cluster_bus``: a Redis Cluster node, with a bus port of its own (kept across
    restarts, as its port: the other nodes know both).
    """

    def __init__(self, name: str, workdir: Path, rec: Recorder, extra: dict[str, str] | None = None, *,
                 replica_of: int | None = None, with_file: bool = False, cluster_bus: bool = False) -> None:
        found = find_redis_server()
        if found is None:
            raise RuntimeError("redis-server not found: apt-get install redis-server (or set REDIS_SERVER)")
        self.name = name
        self.workdir = workdir
        self.rec = rec
        options = {"bind": "127.0.0.1", "save": "", "appendonly": "yes", "appendfsync": "always",
                   "dir": str(workdir), "maxmemory-policy": "noeviction", "repl-diskless-sync-delay": "0",
                   **(extra or {})}
        if replica_of is not None:
            options["replicaof"] = f"127.0.0.1 {replica_of}"

        #: The Cluster bus port (``cluster_bus``): a free one at each first start attempt, then kept.
        self.bus_port: int | None = None

        def args_for(port: int) -> list[str]:
            if cluster_bus and (self.bus_port is None or self.server.port is None):
                self.bus_port = free_port()
            bus = ["--cluster-port", str(self.bus_port)] if cluster_bus else []
            if not with_file:
                return ["--port", str(port), *bus,
                        *(a for k, v in options.items() for a in (f"--{k}", *v.split(" ")))]
            config = workdir / "redis.conf"
            if not config.exists():  # later starts read what Sentinel rewrote
                workdir.mkdir(parents=True, exist_ok=True)
                lines = [f"{k} {v or EMPTY}" for k, v in {"port": str(port), **options}.items()]
                config.write_text("\n".join(lines) + "\n")
            return [str(config)]

        self.server = RedisServerProcess(name, found[0], args_for, workdir=workdir)

    @property
    def port(self) -> int:
        assert self.server.port is not None, f"{self.name} was never started"
        return self.server.port

    @property
    def running(self) -> bool:
        return self.server.running

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0, timeout: float = 5.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, socket_timeout=timeout,
                           socket_connect_timeout=timeout)

    def start(self) -> None:
        self.server.start()
        self.rec("proc", name=self.name, action="start", pid=self.server.pid, port=self.port)

    def kill(self) -> None:
        self.server.kill()
        self.rec("proc", name=self.name, action="exit", pid=self.server.pid, code=-signal.SIGKILL)

    def follow(self, primary_port: int | None) -> None:
        """Before a start: make its configuration file say whom to replicate (None: nobody),
        as a start-up script that asks the sentinels does."""
        config = self.workdir / "redis.conf"
        lines = [line for line in config.read_text().splitlines()
                 if not line.startswith(("replicaof ", "slaveof "))]
        if primary_port is not None and primary_port != self.server.port:
            lines.append(f"replicaof 127.0.0.1 {primary_port}")
        config.write_text("\n".join(lines) + "\n")

    def wipe(self) -> None:
        """Remove the persisted data (the next start is empty, as a server without persistence)."""
        assert not self.running
        shutil.rmtree(self.workdir / "appendonlydir", ignore_errors=True)
        (self.workdir / "dump.rdb").unlink(missing_ok=True)
